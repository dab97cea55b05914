"""scripts/bench.py's report: the median round per load level, the ratios between peers, and the tables."""

from __future__ import annotations

from typing import Any

from bench_metrics import percentile, ratio


def median_rows(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per load level, the round with the median output throughput (the lower one of an even count),
    carrying every round's throughput."""
    out = []
    for level_rows in zip(*rounds, strict=True):
        ranked = sorted(level_rows, key=lambda r: r["output_throughput"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["output_throughput_rounds"] = [r["output_throughput"] for r in level_rows]
        out.append(row)
    return out


def _cell(stats: dict[str, float]) -> str:
    return "/".join(f"{stats[k]:.0f}" for k in ("mean", "p50", "p90", "p99"))


HEADER = ("| peer | load | ok/fail | req/s | out tok/s | total tok/s | TTFT ms | TPOT ms | ITL ms | E2EL ms "
          "| client CPU s |\n|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip


def format_row(row: dict[str, Any]) -> str:
    flag = f" ({row['output_len_mismatch']} off-length)" if row.get("output_len_mismatch") else ""
    return (f"| {row['peer']} | {row['load']} | {row['completed']}/{row['failed']}{flag} | "
            f"{row['request_throughput']:.2f} | {row['output_throughput']:.1f} | {row['total_token_throughput']:.1f} | "
            f"{_cell(row['ttft_ms'])} | {_cell(row['tpot_ms'])} | {_cell(row['itl_ms'])} | {_cell(row['e2el_ms'])} | "
            f"{_cpu_cell(row.get('client_cpu_s'))} |")  # fmt: skip


def _cpu_cell(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f}"


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per load level: the first measured peer's output tok/s, p50 TPOT and p50 TTFT relative to each other
    peer's. With rounds, each ratio is taken within a round and the median of those is reported."""
    measured = [r for r in runs if r.get("rows")]
    if len(measured) < 2:
        return []
    base, out = measured[0], []
    for other in measured[1:]:
        for level, (mine, theirs) in enumerate(zip(_rounds(base), _rounds(other), strict=False)):
            per_round = {key: [ratio(_get(a, key), _get(b, key)) for a, b in zip(mine, theirs, strict=False)]
                         for key in _RATIO_KEYS}  # fmt: skip
            entry = {"load": base["rows"][level]["load"], "base": base["peer"], "peer": other["peer"]}
            entry |= {f"{key}_ratio": _median(values) for key, values in per_round.items()}
            if len(mine) > 1:
                entry["output_throughput_ratio_rounds"] = per_round["output_throughput"]
            out.append(entry)
    return out


_RATIO_KEYS = {"output_throughput": ("output_throughput",), "tpot_p50": ("tpot_ms", "p50"),
               "ttft_p50": ("ttft_ms", "p50")}  # fmt: skip


def _get(row: dict[str, Any], key: str) -> float:
    value: Any = row
    for part in _RATIO_KEYS[key]:
        value = value[part]
    return value


def _rounds(run: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Per load level, that level's row in every round."""
    return [list(level) for level in zip(*run.get("rounds", [run["rows"]]), strict=True)]


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return percentile(known, 50) if known else None


def print_report(runs: list[dict[str, Any]], rel: list[dict[str, Any]]) -> None:
    print("\nLatency cells: mean/p50/p90/p99 in ms. Throughput over each level's whole run.\n")
    print(HEADER)
    for run in runs:
        for row in run.get("rows", []):
            print(format_row(row))
    for run in runs:
        if "skipped" in run:
            print(f"\nskipped {run['peer']}: {run['skipped']}")
        for row in run.get("rows", []):
            for err in row["errors"]:
                print(f"\n{run['peer']} {row['load']} error: {err}")
    if rel:
        print(
            f"\n| load | {rel[0]['base']} vs | out tok/s ratio | TPOT p50 ratio | TTFT p50 ratio |\n|---|---|---|---|---|"
        )
        for r in rel:
            cells = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in
                     ("output_throughput_ratio", "tpot_p50_ratio", "ttft_p50_ratio")]  # fmt: skip
            rounds = r.get("output_throughput_ratio_rounds")
            each = (
                f" (rounds: {', '.join('-' if v is None else f'{v:.2f}' for v in rounds)})" if rounds else ""
            )
            print(f"| {r['load']} | {r['peer']} | {' | '.join(cells)} |{each}")


# the flags that pick Peregrine's (and llama.cpp's) kernels
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                "amx_tile", "amx_int8", "amx_bf16", "asimd", "asimddp")


def machine(bandwidth_gb_s: float | None = None) -> dict[str, Any]:
    """The header every table is read with: the CPU's model, the flags that pick kernels, Peregrine's ISA level on
    it, the cores, and the measured read bandwidth when given (scripts/bandwidth.py)."""
    import os
    import platform
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.backends import cpu_features

    flags = cpu_features.cpu_flags()
    return {"cpu": cpu_features.cpu_model_name() or platform.processor(), "flags": [f for f in KERNEL_FLAGS if f in flags],
            "peregrine_level": cpu_features.detected_level(flags), "cpus": os.cpu_count(),
            "platform": platform.platform(), "read_gb_s": bandwidth_gb_s}


def print_machine(info: dict[str, Any]) -> None:
    bandwidth = f", read {info['read_gb_s']:.1f} GB/s" if info.get("read_gb_s") else ""
    print(f"CPU: {info['cpu']} ({info['cpus']} CPUs), flags {' '.join(info['flags']) or '-'}, Peregrine level "
          f"{info['peregrine_level']}{bandwidth}")

