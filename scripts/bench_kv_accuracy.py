"""What a narrow KV cache costs in accuracy: a prompt's keys and values stored in each format, then the next tokens
computed over them, against the same over the float32 cache.

    python scripts/bench_kv_accuracy.py                        # the bundled SmolLM2-135M, a 1,000-token prompt
    python scripts/bench_kv_accuracy.py --gguf path/to/model.gguf --prompt-tokens 2000 --json out.json

The model runs through transformers (the GGUF's weights dequantized to float32), so only the cache's format differs
between rows. The prompt (this repository's docs, offline) is computed once; each format rounds its cache (keys and
values of every layer: `float16`, `bfloat16`, `int8` as Peregrine's `--kv-cache-dtype int8` keeps it, one scale a
head row, `engine.model.kv_cache.quantize_kv`; `int8/32` and `int8/16` with a scale per 32 or 16 values, llama.cpp's
q8_0 granularity and finer; `int8 K` / `int8 V` one of the two), then `--continue-tokens` positions of the text that
follows are computed over it (teacher-forced). Printed per format: the mean and largest KL divergence of the next-token
distribution from the float32 cache's, the share of positions whose most likely token is the same, the largest logit
difference. A JSON copy goes to --json.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def grouped_int8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded through int8 with one scale (max |x| / 127) per `group` values of its last dim: what
    quantize_kv does with group = head_dim."""
    from engine.model.kv_cache import dequantize_kv, quantize_kv

    shape = x.shape
    q, scale = quantize_kv(x.reshape(*shape[:-1], shape[-1] // group, group))
    return dequantize_kv(q, scale).reshape(shape).to(x.dtype)


def formats(head_dim: int) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], ...]]:
    """name -> (what the keys become, what the values become)."""
    same = lambda x: x  # noqa: E731
    half = lambda x: x.half().to(x.dtype)  # noqa: E731
    bf16 = lambda x: x.bfloat16().to(x.dtype)  # noqa: E731
    row = lambda x: grouped_int8(x, head_dim)  # noqa: E731
    found = {"float32": (same, same), "float16": (half, half), "bfloat16": (bf16, bf16), "int8": (row, row)}
    for group in (32, 16):
        if head_dim % group == 0 and group < head_dim:
            found[f"int8/{group}"] = (lambda x, g=group: grouped_int8(x, g),) * 2
    found["int8 K"] = (row, same)
    found["int8 V"] = (same, row)
    return found


@torch.inference_mode()
def measure(model: Any, ids: torch.Tensor, prompt: int, head_dim: int) -> dict[str, dict[str, float]]:
    """Per format: KL mean / max, top-1 agreement, largest logit difference over ids[prompt:], each position
    computed over the prompt's cache in that format (and the continuation's own keys and values, kept float)."""
    def over(keys: Callable, values: Callable) -> torch.Tensor:
        cache = model(ids[:, :prompt], use_cache=True).cache
        for layer in cache.layers:
            layer.keys.copy_(keys(layer.keys))
            layer.values.copy_(values(layer.values))
        return model(ids[:, prompt:], cache=cache, use_cache=False).logits[0].float()

    reference = over(lambda x: x, lambda x: x)
    want = reference.log_softmax(-1)
    results = {}
    for name, (keys, values) in formats(head_dim).items():
        logits = over(keys, values)
        got = logits.log_softmax(-1)
        kl = (want.exp() * (want - got)).sum(-1).clamp_min(0)
        results[name] = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                         "top1_same": float((want.argmax(-1) == got.argmax(-1)).float().mean()),
                         "logit_diff_max": float((logits - reference).abs().max())}
    return results


def prompt_text() -> str:
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", help="a GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--continue-tokens", type=int, default=200)
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.hub import bundled_path

    path = Path(args.gguf).resolve() if args.gguf else bundled_path("smollm2")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok(prompt_text(), return_tensors="pt").input_ids[:, : args.prompt_tokens + args.continue_tokens]
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    results = measure(model, ids, args.prompt_tokens, head_dim)
    print(f"# {path.name}: {args.prompt_tokens} prompt tokens cached in each format, the next {args.continue_tokens} "
          f"computed over them (teacher-forced), against the float32 cache")
    print("| cache | KL mean | KL max | top-1 same | largest logit difference |\n|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['kl_mean']:.2e} | {r['kl_max']:.2e} | {r['top1_same']:.1%} | {r['logit_diff_max']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": path.name, "prompt_tokens": args.prompt_tokens,
                                               "continue_tokens": args.continue_tokens, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
