"""`scripts/bench.py --workload`: what bench.py measures besides its load sweep (issue 38), each result one table with
ratios and the targets it is read against, under bench.py's header (CPU model, kernel flags, read bandwidth).

- long: the sweep itself at 1k / 4k / 8k-token prompts (`--input-len` takes several lengths), one stream, Peregrine
  against llama-server; per length, TTFT and prefill tokens/s, and the time a token deep in that context.
- speculative: scripts/bench_speculative.py (Peregrine in-process, speculation off and on, greedy answers checked
  identical) and scripts/bench_speculative_llama.py (llama-server plain and with its speculative types) on the same
  prompts, merged: per workload and stream count, each one's best against its own plain decoding and against the
  other's best, and Peregrine's best against the memory roofline (read bandwidth over the weights a step reads).
- isa: scripts/bench_isa.py, every ISA level this CPU runs side by side, the batch-1 decode's share of the roofline.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

# Per workload, what an option left unset means.
DEFAULTS: dict[str, dict[str, Any]] = {
    "serve": {"input_len": "128", "output_len": 128, "concurrency": "1,4,16,64", "num_prompts": 0, "rounds": 1},
    "long": {"input_len": "1024,4096,8000", "output_len": 32, "concurrency": "1", "num_prompts": 3, "rounds": 1},
    "speculative": {"input_len": "128", "output_len": 256, "concurrency": "1,16", "num_prompts": 16, "rounds": 3},
    "isa": {"input_len": "128", "output_len": 128, "concurrency": "1,16", "num_prompts": 0, "rounds": 1},
}
# llama-server's speculative configurations run by default: those that ever paid on this work (docs/speculative.md:
# its draft-simple pair with the bundled model ran at 0.44-0.48x its plain decoding, and is left to
# bench_speculative_llama.py's own --configs)
LLAMA_CONFIGS = "plain,ngram-simple,ngram-simple (n 3 m 8),ngram-mod,ngram-cache"
TTFT_TARGET, DECODE_TARGET = 1.0, 1.0  # long prompts: TTFT at most llama-server's, decode deep in context at least 1.0x
SPEC_TARGETS = {"plain": 2.0, "peer": 1.5, "open": 1.0}  # grounded work: x plain, x llama-server's best; open: x plain


def apply_defaults(args: argparse.Namespace) -> None:
    for name, value in DEFAULTS[args.workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.workload == "long":
        if not args.peers and not args.base_url:
            args.peers = "peregrine,llamacpp"
        if "--max-model-len" not in args.peregrine_args:  # room for the longest prompt and its answer
            longest = max(int(n) for n in str(args.input_len).split(","))
            need = longest + args.output_len + 64
            if getattr(args, "gguf", None):  # lengths are the bundled tokenizer's: the file's own may count more
                need = min(gguf_context(args.gguf) or need, 2 * need)
            args.peregrine_args += f" --max-model-len {need}"


def gguf_context(path: Path) -> int | None:
    """The context length a GGUF file's metadata gives (`<architecture>.context_length`), None without one. The long
    workload's prompts are drawn with the bundled tokenizer; another model's tokenizer makes them longer (Llama 3's
    about 1.19x), so a --gguf gets its own context rather than the asked lengths."""
    root = str(Path(__file__).resolve().parents[1])  # the repository, for models.preflight
    if root not in sys.path:
        sys.path.insert(0, root)
    from models.preflight import read_gguf_layout

    meta = read_gguf_layout(path).meta
    value = meta.get(f"{meta.get('general.architecture')}.context_length")
    return int(value) if value else None


def read_bandwidth(args: argparse.Namespace) -> float | None:
    """GB/s for the header: --bandwidth when given (0: none), else the best of scripts/bandwidth.py's torch reads
    (ordinary and huge pages) with the peers' threads, measured now, before anything else runs. The isa workload
    measures its own (scripts/bench_isa.py, with the hand-written reads too)."""
    if args.bandwidth is not None:
        return args.bandwidth or None
    if args.workload == "isa":
        return None
    import bandwidth

    print(f"-- measuring read bandwidth ({args.threads} threads)", flush=True)
    gbs = bandwidth.measure(256, 3, args.threads or None, simd=False)
    return round(max(v for k, v in gbs.items() if k.startswith("read")), 2)


def write(out: Path, args: argparse.Namespace, host: dict[str, Any], result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": shlex.join([sys.executable, *sys.argv]), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "workload": args.workload, "machine": host, "args": vars(args) | {"out": str(out)}}  # fmt: skip
    out.write_text(json.dumps({"meta": meta, **result}, indent=2, default=str))
    print(f"\nwrote {out}")


# -- long prompts -----------------------------------------------------------------------------------------------


def long_table(runs: list[dict[str, Any]], rel: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prompt length and peer compared: TTFT and prefill tokens/s of the first peer and that peer, the time a
    token deep in the context (p50 TPOT) of each, and the ratios the targets read (TTFT ratio: first / other, at
    most 1.0; decode: other's TPOT / first's, at least 1.0)."""
    measured = [r for r in runs if r.get("rows")]
    rows = []
    for r in rel:
        base, other = measured[0], next(m for m in measured if m["peer"] == r["peer"])
        mine = next(x for x in base["rows"] if x["load"] == r["load"])
        theirs = next(x for x in other["rows"] if x["load"] == r["load"])
        tpot = r["tpot_p50_ratio"]
        rows.append({"load": r["load"], "input_len": mine.get("input_len"), "base": r["base"], "peer": r["peer"],
                     "prompt_tokens": [_mean_prompt(mine), _mean_prompt(theirs)],
                     "ttft_s": [mine["ttft_ms"]["p50"] / 1e3, theirs["ttft_ms"]["p50"] / 1e3],
                     "prefill_tok_s": [_prefill(mine), _prefill(theirs)],
                     "tpot_ms": [mine["tpot_ms"]["p50"], theirs["tpot_ms"]["p50"]],
                     "ttft_ratio": r["ttft_p50_ratio"], "decode_speedup": 1 / tpot if tpot else None})
    return rows


def _mean_prompt(row: dict[str, Any]) -> float:
    return row["total_input_tokens"] / row["completed"] if row["completed"] else 0.0


def _prefill(row: dict[str, Any]) -> float | None:
    ttft = row["ttft_ms"]["p50"] / 1e3
    return _mean_prompt(row) / ttft if ttft else None


def _print_long(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("\n(long prompts: one peer measured, nothing to compare)")
        return
    print(f"\nLong prompts, {rows[0]['base']} against each peer (targets: TTFT ratio at most {TTFT_TARGET:.1f}, "
          f"decode at least {DECODE_TARGET:.1f}x)")
    print("| prompt tokens (asked; served) | peer | TTFT p50 s | TTFT ratio | prefill tok/s | decode ms a token p50 "
          "| decode speed-up | targets |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        ttft, decode = r["ttft_ratio"], r["decode_speedup"]
        met = [_mark(ttft is not None and ttft <= TTFT_TARGET, "TTFT"),
               _mark(decode is not None and decode >= DECODE_TARGET, "decode")]
        served = "/".join(f"{n:.0f}" for n in r["prompt_tokens"])
        print(f"| {r['input_len'] or r['load']}; {served} | {r['peer']} | {_pair(r['ttft_s'], '.2f')} | {_x(ttft)} | "
              f"{_pair(r['prefill_tok_s'], '.0f')} | {_pair(r['tpot_ms'], '.0f')} | {_x(decode)} | {', '.join(met)} |")


# -- speculative decoding ---------------------------------------------------------------------------------------


def run_speculative(args: argparse.Namespace, host: dict[str, Any]) -> dict[str, Any]:
    """bench_speculative.py, then (when llamacpp is among --peers, as by default) bench_speculative_llama.py on the
    same prompts, then the merged table."""
    import bench_speculative
    import bench_speculative_llama

    names = [n.strip() for n in (args.peers or "peregrine,llamacpp").split(",") if n.strip()]
    common = ["--streams", args.concurrency, "--one-stream-prompts", str(args.num_prompts), "--workloads",
              args.speculative_workloads, "--max-tokens", str(args.output_len)]
    ours_out = args.out.with_name(args.out.stem + "-peregrine.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    code = bench_speculative.main([*common, "--rounds", str(args.rounds), "--modes", args.speculative_modes,
                                   "--out", str(ours_out)])
    if code:
        raise SystemExit(f"scripts/bench_speculative.py failed ({code})")
    ours = json.loads(ours_out.read_text())
    theirs: dict[str, Any] = {"rows": []}
    if "llamacpp" in names:
        theirs_out = args.out.with_name(args.out.stem + "-llama-server.json")
        bench_speculative_llama.main([*common, "--configs", LLAMA_CONFIGS, "--threads", str(args.threads),
                                      "--out", str(theirs_out),
                                      *(["--llama-server", str(args.llama_server)] if args.llama_server else [])])
        theirs = json.loads(theirs_out.read_text())
    rows = speculative_table(ours["rows"], theirs["rows"], host.get("read_gb_s"), ours.get("weight_bytes"))
    return {"rows": rows, "peregrine": ours, "llama_server": theirs, "weight_bytes": ours.get("weight_bytes")}


def speculative_table(ours: list[dict[str, Any]], theirs: list[dict[str, Any]], read_gb_s: float | None,
                      weight_bytes: int | None) -> list[dict[str, Any]]:
    """Per (workload, streams) Peregrine measured: its plain rate, its best speculative mode (speed-up over plain:
    the median of per-round ratios), llama-server's plain and best configuration when measured, best against best,
    and Peregrine's best as a share of the roofline (read bandwidth / weight bytes a step, tokens/s)."""
    roofline = read_gb_s * 1e9 / weight_bytes if read_gb_s and weight_bytes else None
    out = []
    for workload, streams in dict.fromkeys((r["workload"], r["streams"]) for r in ours):
        mine = [r for r in ours if (r["workload"], r["streams"]) == (workload, streams)]
        plain = next(r for r in mine if r["mode"] == "off")
        best = max((r for r in mine if r["mode"] != "off"), key=lambda r: r["speedup"], default=plain)
        peer = [r for r in theirs if (r["workload"], r["streams"]) == (workload, streams)]
        peer_plain = next((r for r in peer if r["config"] == "plain"), None)
        peer_best = max((r for r in peer if r["config"] != "plain"), key=lambda r: r["tok_s"], default=peer_plain)
        row = {"workload": workload, "streams": streams, "plain_tok_s": plain["tok_s"], "mode": best["mode"],
               "tok_s": best["tok_s"], "speedup": best["speedup"] if best is not plain else 1.0,
               "decode_speedup": best.get("decode_speedup") if best is not plain else None,
               "accepted_share": best.get("accepted_share"), "proposed": best.get("proposed"),
               "peer_plain_tok_s": peer_plain["tok_s"] if peer_plain else None,
               "peer_config": peer_best["config"] if peer_best else None,
               "peer_tok_s": peer_best["tok_s"] if peer_best else None,
               "peer_speedup": peer_best["speedup"] if peer_best else None,
               "vs_peer": best["tok_s"] / peer_best["tok_s"] if peer_best else None,
               "roofline_tok_s": roofline, "roofline_share": best["tok_s"] / roofline if roofline else None}
        row["targets"] = _spec_targets(row)
        out.append(row)
    return out


def _spec_targets(row: dict[str, Any]) -> dict[str, bool]:
    """Issue 38's targets for a row: one stream on input-grounded work (grounded, copy) at least 2x plain, 1.5x
    llama-server's best and past the roofline; open chat never slower than plain."""
    if row["workload"] == "open":
        return {"open_not_slower": row["speedup"] >= SPEC_TARGETS["open"]}
    if row["streams"] != 1:
        return {}
    targets = {"2x_plain": row["speedup"] >= SPEC_TARGETS["plain"]}
    if row["vs_peer"] is not None:
        targets["1.5x_llama_best"] = row["vs_peer"] >= SPEC_TARGETS["peer"]
    if row["roofline_share"] is not None:
        targets["past_roofline"] = row["roofline_share"] > 1.0
    return targets


def _print_speculative(result: dict[str, Any]) -> None:
    rows = result["rows"]
    weights = result.get("weight_bytes")
    roof = rows[0]["roofline_tok_s"] if rows else None
    sizes = [f"a step reads {weights / 1e6:.1f} MB of weights"] if weights else []
    sizes += [f"roofline {roof:.0f} tok/s"] if roof else []
    about = "; ".join([result["peregrine"].get("target", "bundled model"), *([", ".join(sizes)] if sizes else [])])
    print(f"\nSpeculative decoding ({about})")
    print("| workload | streams | Peregrine plain tok/s | Peregrine best (mode; x plain[, decoding alone]; kept) | "
          "llama-server plain "
          "tok/s | llama-server best (config; x plain) | best / best | of roofline | targets |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        kept = f"; {r['accepted_share']:.0%} of {r['proposed']}" if r.get("proposed") else ""
        decoding = f", decoding {_x(r['decode_speedup'])}" if r.get("decode_speedup") else ""
        peer = f"{r['peer_tok_s']:.1f} ({r['peer_config']}; {_x(r['peer_speedup'])})" if r["peer_tok_s"] else "-"
        marks = ", ".join(_mark(ok, name.replace("_", " ")) for name, ok in r["targets"].items()) or "-"
        share = f"{r['roofline_share']:.0%}" if r["roofline_share"] is not None else "-"
        peer_plain = f"{r['peer_plain_tok_s']:.1f}" if r["peer_plain_tok_s"] else "-"
        print(f"| {r['workload']} | {r['streams']} | {r['plain_tok_s']:.1f} | {r['tok_s']:.1f} ({r['mode']}; "
              f"{_x(r['speedup'])}{decoding}{kept}) | {peer_plain} | {peer} | {_x(r['vs_peer'])} | {share} | {marks} |")


# -- ISA levels ---------------------------------------------------------------------------------------------------


def run_isa(args: argparse.Namespace) -> dict[str, Any]:
    """scripts/bench_isa.py with bench.py's threads, file, output length and concurrency."""
    import bench_isa

    out = args.out.with_name(args.out.stem + "-isa.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bench_isa.main(["--threads", str(args.threads), "--output-len", str(args.output_len), "--concurrency",
                    args.concurrency, "--json", str(out), *(["--gguf", str(args.gguf)] if args.gguf else []),
                    *(["--levels", args.levels] if args.levels else [])])
    return json.loads(out.read_text())


ROOFLINE_TARGET = 70.0  # percent: the batch-1 decode's goal


def _print_isa(result: dict[str, Any]) -> None:
    print(f"\nISA levels, {result['model']}, best read {result['best_read_gb_s']} GB/s (target: batch-1 decode at "
          f"least {ROOFLINE_TARGET:.0f}% of the roofline)")
    print("| level | output tok/s by streams | batch-1 decode tok/s | % of roofline | vs the first level | target |\n"
          "|---|---|---|---|---|---|")
    for r in result["rows"]:
        share = r["roofline_percent"]
        tok_s = ", ".join(f"{c}: {v:.1f}" for c, v in r["output_tok_s"].items())
        print(f"| {r['level']} | {tok_s} | {r['batch1_decode_tok_s']:.1f} | {share}% | "
              f"{', '.join(f'{x:.2f}x' for x in r['ratios'])} | "
              f"{_mark(share is not None and share >= ROOFLINE_TARGET, 'roofline')} |")


# -- shared -------------------------------------------------------------------------------------------------------


def print_result(workload: str, result: Any) -> None:
    {"long": _print_long, "speculative": _print_speculative, "isa": _print_isa}[workload](result)


def _mark(ok: bool, name: str) -> str:
    return f"{name} {'met' if ok else 'NOT met'}"


def _x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def _pair(values: list[float | None], spec: str) -> str:
    return " / ".join("-" if v is None else format(v, spec) for v in values)
