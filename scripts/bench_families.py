"""Speed on real shapes (issue 36): random-weight GGUFs of real models' shapes, served by Peregrine and llama-server.

`make` writes each shape as an F16 GGUF with random weights (the values do not change the speed) and the family's
real tokenizer (copied from llama.cpp's vocab-only GGUFs, `models/ggml-vocab-*.gguf` in the vendored source; Gemma
3's 262k-token one is not there, so Llama 2's SentencePiece vocabulary padded to as many rows stands in), then
quantizes it with llama.cpp's own `llama-quantize` (built by `scripts/bench_peers.py setup`) to Q4_K_M and Q8_0 (or
the --formats given: any llama-quantize type, e.g. Q5_K_M).
`run` serves each file with both servers through `scripts/bench.py` (one stream and 16, same file, same threads,
random prompts, fixed-length answers) and prints one table with the ratios; at one stream also each server's share of
the memory roofline (the decode rate, 1 / TPOT p50, times the weight bytes a token reads, over the read bandwidth
bench.py measured just before that server's run: a shared host's bandwidth moves by 1.5x from minute to minute).
`table` prints the table again from the results `run` saved.

    python scripts/bench_families.py make --shapes qwen3-0.6b,llama-3.2-1b
    python scripts/bench_families.py run --shapes qwen3-0.6b --formats Q4_K_M,Q8_0
    python scripts/bench_families.py make --shapes llama-3.2-1b --formats Q5_K_M
    python scripts/bench_families.py table --formats Q4_K_M,Q8_0

Files go to `.cache/bench-families/` (gigabytes: F16 sources are removed after quantizing unless --keep-f16).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers as peers  # noqa: E402

sys.path.insert(0, str(peers.REPO))
from models.gguf_weights import open_reader  # noqa: E402  (reads a 150k-token vocabulary in a second)

OUT = peers.CACHE / "bench-families"
QUANTIZE = peers.LLAMA_BUILD / "bin" / "llama-quantize"


@dataclass(frozen=True)
class Shape:
    """A model's shape as its GGUF states it (llama.cpp's tensor names for `arch`)."""

    arch: str
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: str  # llama.cpp's ggml-vocab-<vocab>.gguf
    rope_base: float
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head RMSNorm of q and k
    qkv_bias: bool = False  # Qwen2: biases on q, k, v
    fused: bool = False  # Phi-3: q, k, v in one tensor (attn_qkv), gate and up in one (ffn_up)
    sandwich: bool = False  # Gemma 3: norms on o's and down's outputs too
    window: int = 0  # Gemma 3: the sliding window of 5 layers in 6
    vocab_rows: int = 0  # the embedding's rows, where the real model has more tokens than the vocab file
    context: int = 8192
    original_context: int = 0  # Phi-3.5: longrope's factors and attention factor over this original context
    softcaps: tuple[float, float] = (0.0, 0.0)  # Gemma 2: the attention scores' and the logits' soft caps


SHAPES = {
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 3072, 16, 8, 128, "qwen2", 1e6, qk_norm=True),
    "llama-3.2-1b": Shape("llama", 2048, 16, 8192, 32, 8, 64, "llama-bpe", 5e5),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 8960, 12, 2, 128, "qwen2", 1e6, qkv_bias=True),
    # Gemma 3's 262,144-token vocabulary (a quarter of the 1B's weights): llama.cpp's SentencePiece vocab (Gemma's
    # kind of tokenizer) padded with unused tokens to that many rows
    "gemma-3-1b": Shape("gemma3", 1152, 26, 6912, 4, 1, 256, "llama-spm", 1e6, qk_norm=True, sandwich=True,
                        window=512, vocab_rows=262144, context=32768),
    # Gemma 2's window on every other layer (llama.cpp's default pattern, no key written), 256,000 tokens, soft caps
    "gemma-2-2b": Shape("gemma2", 2304, 26, 9216, 8, 4, 256, "llama-spm", 1e4, sandwich=True, window=4096,
                        vocab_rows=256000, softcaps=(50.0, 30.0)),
    "phi-3.5-mini": Shape("phi3", 3072, 32, 8192, 32, 32, 96, "phi-3", 1e4, fused=True, context=131072,
                          original_context=4096),
}


def vocab_gguf(name: str) -> Path:
    found = sorted(peers.CACHE.glob(f"peers-sdist/*/vendor/llama.cpp/models/ggml-vocab-{name}.gguf"))
    if not found:
        sys.exit(f"ggml-vocab-{name}.gguf not found: run `python scripts/bench_peers.py setup` first")
    return found[0]


def write_f16(name: str, shape: Shape, path: Path, vocab: Path, seed: int = 0) -> None:
    """The shape as an F16 GGUF (F32 norms and biases), tied embeddings, and the tokenizer and chat template of the
    GGUF `vocab` (its `tokenizer.*` keys; the embedding has a row per token)."""
    import gguf

    reader = gguf.GGUFReader(vocab)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    pad = max(0, shape.vocab_rows - len(tokens))
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"random {name}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if shape.window:
        writer.add_sliding_window(shape.window)
    if shape.softcaps[0]:
        writer.add_attn_logit_softcapping(shape.softcaps[0])
        writer.add_final_logit_softcapping(shape.softcaps[1])
    if shape.original_context:  # as llama.cpp's converter writes Phi-3.5's longrope
        writer.add_rope_scaling_orig_ctx_len(shape.original_context)
        scale = shape.context / shape.original_context
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(shape.original_context))))
    # normal tokens: llama-server renders an UNUSED one as no text, and random weights pick them often, so its
    # stream carried no text and the load generator counted its requests as failed
    padded = {"tokenizer.ggml.tokens": [f"pad{i}" for i in range(pad)],
              "tokenizer.ggml.token_type": [int(gguf.TokenType.NORMAL)] * pad, "tokenizer.ggml.scores": [0.0] * pad}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            writer.add_key_value(key, list(value) + padded[key] if key in padded else value, field.types[0], sub_type=sub)
    rng = np.random.default_rng(seed)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    writer.add_tensor("token_embd.weight", matrix(len(tokens) + pad, shape.hidden))
    writer.add_tensor("output_norm.weight", ones(shape.hidden))
    if shape.original_context:
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", 1.0 + rng.random(shape.head_dim // 2, dtype=np.float32))
    if shape.fused:
        matmuls = {"attn_qkv": (q + 2 * kv, shape.hidden), "ffn_up": (2 * shape.ffn, shape.hidden)}
    else:
        matmuls = {"attn_q": (q, shape.hidden), "attn_k": (kv, shape.hidden), "attn_v": (kv, shape.hidden),
                   "ffn_gate": (shape.ffn, shape.hidden), "ffn_up": (shape.ffn, shape.hidden)}
    matmuls |= {"attn_output": (shape.hidden, q), "ffn_down": (shape.hidden, shape.ffn)}
    norms = ["attn_norm", "ffn_norm", *(["post_attention_norm", "post_ffw_norm"] if shape.sandwich else [])]
    for i in range(shape.layers):
        b = f"blk.{i}."
        for t, (rows, cols) in matmuls.items():
            writer.add_tensor(b + t + ".weight", matrix(rows, cols))
        for t in norms:
            writer.add_tensor(b + t + ".weight", ones(shape.hidden))
        if shape.qk_norm:
            writer.add_tensor(b + "attn_q_norm.weight", ones(shape.head_dim))
            writer.add_tensor(b + "attn_k_norm.weight", ones(shape.head_dim))
        if shape.qkv_bias:
            for t, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                writer.add_tensor(b + t + ".bias", np.zeros(n, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make(names: list[str], formats: list[str], keep_f16: bool) -> None:
    if not QUANTIZE.is_file():
        sys.exit(f"{QUANTIZE} missing: `python scripts/bench_peers.py setup` builds llama-server; then "
                 f"`cmake --build {peers.LLAMA_BUILD} --target llama-quantize`")
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names:
        f16 = OUT / f"{name}-F16.gguf"
        targets = {fmt: OUT / f"{name}-{fmt}.gguf" for fmt in formats}
        if all(p.is_file() for p in targets.values()):
            continue
        if not f16.is_file():
            print(f"writing {f16.name}", flush=True)
            write_f16(name, SHAPES[name], f16, vocab_gguf(SHAPES[name].vocab))
        for fmt, path in targets.items():
            if not path.is_file():
                print(f"quantizing {path.name}", flush=True)
                subprocess.run([str(QUANTIZE), str(f16), str(path), fmt, "2"], check=True,
                               stdout=subprocess.DEVNULL)
        if not keep_f16:
            f16.unlink()


def run(names: list[str], formats: list[str], args: argparse.Namespace) -> None:
    for name in names:
        for fmt in formats:
            gguf, out = OUT / f"{name}-{fmt}.gguf", result_path(name, fmt)
            cmd = [sys.executable, str(Path(__file__).with_name("bench.py")), "--peers", "peregrine,llamacpp",
                   "--gguf", str(gguf), "--concurrency", args.concurrency, "--input-len", str(args.input_len),
                   "--output-len", str(args.output_len), "--threads", str(args.threads), "--out", str(out),
                   "--dtype", args.dtype, "--peregrine-args", args.peregrine_args]  # fmt: skip
            subprocess.run(cmd, check=True)
    table(names, formats)


def result_path(name: str, fmt: str) -> Path:
    return OUT / f"bench-{name}-{fmt}.json"


def table(names: list[str], formats: list[str]) -> None:
    """The rows of every saved result among names x formats (as `run` left them), as JSON and one table."""
    rows, machines = [], []
    for name in names:
        for fmt in formats:
            if result_path(name, fmt).is_file():
                result = json.loads(result_path(name, fmt).read_text())
                rows += summarize(name, fmt, OUT / f"{name}-{fmt}.gguf", result)
                machines.append(result.get("meta", {}).get("machine", {}))
    print(json.dumps(rows))
    if machines:
        m = machines[0]
        reads = [x for r in rows for x in (r["read_gb_s"], r["read_gb_s_llamacpp"]) if x]
        print(f"\n{m.get('cpu')}, {m.get('cpus')} CPUs, flags {' '.join(m.get('flags', []))}, Peregrine level "
              f"{m.get('peregrine_level')}; read bandwidth {min(reads, default=0):.1f}-{max(reads, default=0):.1f} "
              "GB/s (each server's sample, taken just before its run, is the one its roofline share is of)")
    print("\n| shape | format | streams | Peregrine tok/s | llama-server tok/s | ratio | TTFT p50 P / L (s) "
          "| TPOT p50 P / L (ms) | of roofline P / L (at GB/s) | RSS peak, after P / L (MB); P's after over the file |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mem = [r["rss_peregrine"], r["rss_now_peregrine"], r["rss_llamacpp"], r["rss_now_llamacpp"]]
        rss = (f"{mem[0]:.0f}, {mem[1]:.0f} / {mem[2]:.0f}, {mem[3]:.0f}; {mem[1] / r['file_mb']:.2f}x"
               if all(mem) else "n/a")
        roof = " / ".join(f"{share:.0%} ({gb_s:.0f})" if share is not None else "n/a" for share, gb_s in (
            (r["roofline_peregrine"], r["read_gb_s"]), (r["roofline_llamacpp"], r["read_gb_s_llamacpp"])))
        roof = "" if r["concurrency"] != 1 else roof
        print(f"| {r['shape']} | {r['format']} | {r['concurrency']} | {r['peregrine']:.1f} | {r['llamacpp']:.1f} "
              f"| {r['ratio']:.2f}x | {r['ttft_peregrine']:.2f} / {r['ttft_llamacpp']:.2f} "
              f"| {r['tpot_peregrine']:.1f} / {r['tpot_llamacpp']:.1f} | {roof} | {rss} |")


def weight_bytes_a_token(gguf: Path) -> int:
    """The bytes of weights one decode step reads: every tensor but the embedding table, which a step reads one row
    of, unless it is also the LM head (no `output.weight`: tied, as Llama 3.2, Qwen3-0.6B and Gemma 3)."""
    reader = open_reader(gguf)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    tied = "output.weight" not in sizes
    return sum(n for name, n in sizes.items() if tied or name != "token_embd.weight")


def summarize(name: str, fmt: str, gguf: Path, result: dict) -> list[dict]:
    """One row per concurrency level: each server's output tok/s, TTFT and TPOT p50, the ratio, and at one stream
    each server's decode rate (1 / TPOT p50) as a share of the roofline (read bandwidth / weight bytes a token)."""
    by_peer = {run["peer"]: {row["concurrency"]: row for row in run["rows"]} for run in result["runs"]}
    rss = {run["peer"]: run.get("peak_rss_mb") for run in result["runs"]}  # the server's whole run, every level
    now = {run["peer"]: run.get("rss_mb") for run in result["runs"]}  # after it
    at_start = result.get("meta", {}).get("machine", {}).get("read_gb_s")
    # each peer's own sample, taken just before its run (bench.py), else the one at the file's start
    reads = {run["peer"]: run.get("read_gb_s") or at_start for run in result["runs"]}
    step_bytes = weight_bytes_a_token(gguf) if any(reads.values()) else 0

    def roofline(row: dict, peer: str) -> float | None:
        if not step_bytes or not reads.get(peer) or row["concurrency"] != 1 or not row["tpot_ms"]["p50"]:
            return None
        return step_bytes / (row["tpot_ms"]["p50"] / 1e3) / (reads[peer] * 1e9)

    rows = []
    for conc, ours in sorted(by_peer.get("peregrine", {}).items()):
        theirs = by_peer.get("llamacpp", {}).get(conc)
        if theirs is None:
            continue
        rows.append({"shape": name, "format": fmt, "file_mb": gguf.stat().st_size / 1e6, "concurrency": conc,
                     "peregrine": ours["output_throughput"], "llamacpp": theirs["output_throughput"],
                     "ratio": ours["output_throughput"] / theirs["output_throughput"],
                     "ttft_peregrine": ours["ttft_ms"]["p50"] / 1e3, "ttft_llamacpp": theirs["ttft_ms"]["p50"] / 1e3,
                     "tpot_peregrine": ours["tpot_ms"]["p50"], "tpot_llamacpp": theirs["tpot_ms"]["p50"],
                     "read_gb_s": reads.get("peregrine"), "read_gb_s_llamacpp": reads.get("llamacpp"),
                     "step_mb": step_bytes / 1e6 if step_bytes else None,
                     "roofline_peregrine": roofline(ours, "peregrine"),
                     "roofline_llamacpp": roofline(theirs, "llamacpp"),
                     "rss_peregrine": rss.get("peregrine"), "rss_llamacpp": rss.get("llamacpp"),
                     "rss_now_peregrine": now.get("peregrine"), "rss_now_llamacpp": now.get("llamacpp")})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=("make", "run", "table"))
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--formats", default="Q4_K_M,Q8_0", help="llama-quantize types, comma-separated")
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 source files")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto", help="Peregrine's --dtype (auto: what a user gets)")
    p.add_argument("--peregrine-args", default="--max-model-len 2048")
    args = p.parse_args(argv)
    names, formats = args.shapes.split(","), args.formats.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}")
    if args.step == "make":
        make(names, formats, args.keep_f16)
    elif args.step == "run":
        run(names, formats, args)
    else:
        table(names, formats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
