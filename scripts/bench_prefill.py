"""Where a prefill step of a GGUF file kept quantized spends its time, in process (no server): the whole step of one
prompt (the one-call decoder: every layer, attention and the LM head), then each matmul of one layer and the LM head
alone through `qlinear` on the file's own weights, at the same number of rows, times the layer count. Compare with
llama.cpp's `llama-bench -m FILE -t THREADS -p TOKENS -n 0` (prompt tokens a second). Prints a table, then one JSON
object. Not a test: numbers depend on the machine and its load.

    python scripts/bench_prefill.py --gguf .cache/bench-families/llama-3.2-1b-Q4_K_M.gguf --tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import tool_cache_dir  # noqa: E402
from engine.backends import cpu_kernels  # noqa: E402
from engine.model.quant import QuantLinear  # noqa: E402
from engine.types import EngineConfig, SamplingParams  # noqa: E402
from models.loader import load_model  # noqa: E402

TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
              20: "IQ4_NL", 23: "IQ4_XS"}


def step_times(loaded, tokens: int, repeats: int, cpu_isa: str = "auto") -> list[float]:
    """Seconds of the engine step that prefills a whole `tokens`-token prompt (one chunk), once per repeat."""
    from engine.llm_engine import LLMEngine

    cfg = EngineConfig(model_path="in-memory", model_name="bench", device="cpu", kv_cache_bytes=64 << 20,
                       max_num_seqs=1, max_num_batched_tokens=tokens, prefix_caching=False,
                       cache_dir=str(tool_cache_dir()), cpu_isa=cpu_isa)
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, torch.device("cpu"), loaded.dtype, 4096)
    vocab = loaded.model.config.vocab_size
    times = []
    for r in range(repeats + 1):  # the first builds the decoder
        prompt = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(r)).tolist()
        engine.add_request(f"r{r}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        while engine.has_work:
            engine.step()
    return times[1:]


def linear_times(model, kernels, tokens: int, repeats: int) -> list[dict]:
    """Each quantized matmul of layer 0 and the LM head through `qlinear` at `tokens` rows: median seconds."""
    layers = model.model.layers
    named = [(n, m) for n, m in layers[0].named_modules() if isinstance(m, QuantLinear)]
    named.append(("lm_head", model.lm_head))
    rows = []
    for name, mod in named:
        w = mod.qweight
        n, k = w.shape
        x = torch.randn(tokens, k)
        runs = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            kernels.qlinear(x, w.blocks, w.qtype, None)
            runs.append(time.perf_counter() - start)
        count = 1 if name == "lm_head" else len(layers)
        med = statistics.median(runs[1:])
        rows.append({"name": name, "format": TYPE_NAMES.get(w.qtype, str(w.qtype)), "N": n, "K": k,
                     "ms": med * 1e3, "ms_all_layers": med * 1e3 * count,
                     "gmacs": tokens * n * k / med / 1e9})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--skip-step", action="store_true", help="only the matmuls")
    p.add_argument("--cpu-isa", default="auto", help="the kernels' ISA level (auto: this CPU's; avx2, avx512, ...)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = EngineConfig(model_path=str(args.gguf.parent), gguf_file=args.gguf.name, model_name="bench", device="cpu",
                       dtype="auto", weight_format="quantized", cache_dir=str(tool_cache_dir()), cpu_isa=args.cpu_isa)
    loaded = load_model(cfg)
    kernels = cpu_kernels.load(tool_cache_dir(), cap=args.cpu_isa)
    out = {"gguf": str(args.gguf), "tokens": args.tokens, "threads": torch.get_num_threads(), "isa": kernels.isa()}
    if not args.skip_step:
        times = step_times(loaded, args.tokens, args.repeats, args.cpu_isa)
        out["step_s"] = times
        med = statistics.median(times)
        print(f"prefill step of {args.tokens} tokens: median {med * 1e3:.0f} ms "
              f"({args.tokens / med:.1f} tok/s); runs {[round(t * 1e3) for t in times]}")
    rows = linear_times(loaded.model, kernels, args.tokens, args.repeats)
    out["linears"] = rows
    total = sum(r["ms_all_layers"] for r in rows)
    print(f"{'matmul':<24} {'fmt':<5} {'N':>7} {'K':>6} {'ms':>8} {'x layers':>9} {'GMAC/s':>7}")
    for r in rows:
        print(f"{r['name']:<24} {r['format']:<5} {r['N']:>7} {r['K']:>6} {r['ms']:>8.2f} {r['ms_all_layers']:>9.1f}"
              f" {r['gmacs']:>7.1f}")
    print(f"matmuls in all: {total:.0f} ms")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
