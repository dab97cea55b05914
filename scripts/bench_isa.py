"""The same engine on each ISA level this CPU runs, side by side: which kernels pay on this machine.

For each level (default: every build of the CPU kernels this CPU can run, from avx2 up) it runs
scripts/bench_engine.py in its own process with `--cpu-isa LEVEL`, on the same GGUF (default the bundled
SmolLM2-135M Q4_1; any file, or one rebuilt with random weights by scripts/gguf_random.py), with the same threads,
and prints one table: output tok/s at 1 and 16 streams, the batch-1 decode rate and its share of the memory
roofline (the best read bandwidth scripts/bandwidth.py measures with those threads, over the bytes a step reads),
each level against the first. The header names the CPU, its relevant flags and the bandwidth. Then one JSON object.
Not a test: the figures depend on the machine and its load.

    python scripts/bench_isa.py                                    # every level here, all cores
    python scripts/bench_isa.py --threads 2 --levels avx2,avx512   # AVX-512 without BF16 against AVX2, 2 cores
    python scripts/bench_isa.py --gguf random-Q4_K_M.gguf --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.backends import cpu_features  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent
FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "amx_tile", "amx_int8", "amx_bf16")  # the flags the levels are made of


def kernel_levels(flags: frozenset[str] | None = None) -> list[str]:
    """Each level this CPU (or one of `flags`) runs whose CPU kernels are a build of their own (amx is avx512_bf16's
    build), ascending."""
    builds: dict[str, str] = {}
    for level in cpu_features.available_levels(flags):
        build = cpu_features.kernel_build(level, flags)
        if level != "none" and build is not None and build not in builds.values():
            builds[level] = build
    return list(builds)


def compared_levels(flags: frozenset[str] | None = None) -> list[str]:
    """The levels compared by default: each build of its own (`kernel_levels`), and `amx` where the CPU has AMX-INT8:
    the same build as avx512_bf16, whose decode steps of 9 rows and more then multiply on the AMX int8 tiles."""
    have = cpu_features.cpu_flags() if flags is None else flags
    levels = kernel_levels(have)
    return levels + ["amx"] if "amx" in cpu_features.available_levels(have) and "amx_int8" in have else levels


def environment(threads: int) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment that hold a child to `threads` cores (all of them when 0)."""
    env = dict(os.environ)
    if not threads:
        return [], env
    env["OMP_NUM_THREADS"] = str(threads)
    cores = spread(sorted(os.sched_getaffinity(0)))[:threads]
    return ["taskset", "-c", ",".join(map(str, cores))], env


def spread(cpus: list[int]) -> list[int]:
    """`cpus` with one logical CPU of each physical core first, then their SMT siblings (Linux's topology files;
    as given where there are none), so that two threads get two cores, not one core's two hyperthreads."""
    def core(cpu: int) -> tuple[str, str]:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            return ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            return (str(cpu), "")
    first: dict[tuple[str, str], int] = {}
    for cpu in cpus:
        first.setdefault(core(cpu), cpu)
    return [*first.values(), *(cpu for cpu in cpus if cpu not in first.values())]


def run(command: list[str], env: dict[str, str], log: Path) -> str:
    """`command`'s standard output; all it prints is appended to `log`; SystemExit with its last lines if it fails."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n" + "\n".join(tail))
    return done.stdout


def run_json(command: list[str], env: dict[str, str], log: Path) -> dict:
    """The last JSON line `command` prints."""
    lines = [line for line in run(command, env, log).splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"{' '.join(command)} printed no JSON (its output: {log})")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", help=f"comma-separated levels (default: {','.join(compared_levels())} on this CPU)")
    p.add_argument("--threads", type=int, default=0, help="cores and threads for every run (0: all)")
    p.add_argument("--gguf", type=Path, help="the GGUF file (default: the bundled SmolLM2-135M Q4_1)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--batch1-repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the result here")
    p.add_argument("--log", type=Path, help="every run's whole output (default: a temporary file)")
    args = p.parse_args(argv)
    levels = args.levels.split(",") if args.levels else compared_levels()
    missing = [level for level in levels if level not in cpu_features.available_levels()]
    if missing:
        raise SystemExit(f"this CPU cannot run {', '.join(missing)} (it runs {cpu_features.available_levels()})")
    prefix, env = environment(args.threads)
    log = args.log or Path(tempfile.mkstemp(prefix="bench-isa-", suffix=".log")[1])
    with tempfile.TemporaryDirectory() as tmp:
        run([*prefix, sys.executable, str(SCRIPTS / "bandwidth.py"), "--threads", str(args.threads), "--json",
             f"{tmp}/bw.json"], env, log)
        bw = json.loads(Path(f"{tmp}/bw.json").read_text())
    read = max(v for k, v in bw["gb_per_s"].items() if k.startswith("read"))
    concurrency = [int(c) for c in args.concurrency.split(",")]
    runs = {}
    for level in levels:
        command = [*prefix, sys.executable, str(SCRIPTS / "bench_engine.py"), "--cpu-isa", level, "--dtype",
                   "float32", "--hf-requests", "0", "--concurrency", *map(str, concurrency), "--prompt-len",
                   str(args.prompt_len), "--output-len", str(args.output_len), "--batch1-repeats",
                   str(args.batch1_repeats), "--bandwidth", f"{read:.2f}",
                   *(["--gguf", str(args.gguf)] if args.gguf else [])]
        runs[level] = run_json(command, env, log)
        if runs[level]["cpu_isa"] != cpu_features.kernel_build(level):
            raise SystemExit(f"asked for {level}, the engine ran {runs[level]['cpu_isa']}")
    report(levels, runs, concurrency, bw, read, args)
    print(f"(every run's output: {log})")
    return 0


def report(levels: list[str], runs: dict[str, dict], concurrency: list[int], bw: dict, read: float,
           args: argparse.Namespace) -> None:
    flags = sorted(set(FLAGS) & cpu_features.cpu_flags())
    first = runs[levels[0]]
    model = first["model"]
    print(f"\n{model}, {first['prompt_len']} prompt / {first['output_len']} output tokens, greedy, float32 "
          f"activations, {bw['threads']} threads")
    print(f"CPU: {cpu_features.cpu_model_name() or 'unknown'}; flags: {' '.join(flags)}; best read {read:.1f} GB/s "
          f"({bw['threads']} threads); a batch-1 step reads {first['batch1_bytes_per_token']['weights'] / 1e6:.1f} "
          "MB of weights")
    heads = [f"{c} stream{'s' if c > 1 else ''} tok/s" for c in concurrency]
    print("| level | " + " | ".join(heads) + " | batch-1 decode tok/s | % of roofline (weights) | vs "
          f"{levels[0]} (" + ", ".join(f"{c}" for c in concurrency) + ", batch-1) |")
    print("|---" * (len(heads) + 4) + "|")
    rows = []
    for level in levels:
        r = runs[level]
        ratios = [r["output_tok_s"][str(c)] / first["output_tok_s"][str(c)] for c in concurrency]
        ratios.append(r["batch1_decode_tok_s"] / first["batch1_decode_tok_s"])
        roof = r["batch1_roofline"]["weights"]["percent"] if r["batch1_roofline"] else None
        print(f"| {level} | " + " | ".join(f"{r['output_tok_s'][str(c)]:.1f}" for c in concurrency)
              + f" | {r['batch1_decode_tok_s']:.1f} | {roof}% | " + ", ".join(f"{x:.2f}x" for x in ratios) + " |")
        rows.append({"level": level, "output_tok_s": r["output_tok_s"], "batch1_decode_tok_s": r["batch1_decode_tok_s"],
                     "roofline_percent": roof, "ratios": [round(x, 3) for x in ratios]})
    result = {"cpu": cpu_features.cpu_model_name(), "flags": flags, "bandwidth": bw, "best_read_gb_s": round(read, 2),
              "model": model, "rows": rows, "runs": runs}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    raise SystemExit(main())
