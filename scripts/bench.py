"""Serving benchmark against any OpenAI-compatible server, or against peers it starts itself.

    # one server you started yourself (any OpenAI-compatible base URL, without /v1)
    python scripts/bench.py --base-url http://127.0.0.1:8000 --concurrency 1,4,16,64
    # Peregrine and its peers, started here one after another on the same model and prompts
    python scripts/bench.py --peers peregrine,transformers,transformers-cb,llamacpp,llamacpp-python
    # server overhead: HTTP+SSE vs the engine in-process at 16 concurrent streams, nine alternating rounds
    python scripts/bench.py --peers peregrine,engine --concurrency 16 --num-prompts 16 --rounds 9
    # a smoke run (seconds per peer, after loading)
    python scripts/bench.py --peers peregrine --quick

Prompts are fixed and seeded (`--dataset random`: random-token prompts of `--input-len` tokens;
`--dataset chat`: the shipped chat set). Output length is fixed with `--output-len` wherever the server
can be told to ignore EOS. Load is a concurrency sweep (`--concurrency`) or Poisson arrivals
(`--request-rate`, capped by `--max-concurrency`). Metrics follow vLLM's serving benchmark
(`bench_metrics.py`). A table goes to stdout and everything to a JSON file (`--out`).

With `--rounds N` (N > 1) all the peers are started at once and measured in turns, N rounds in an
A B, B A order, so that a shared machine's slow spells fall on every peer alike. A peer's row is then its
median round, and each ratio is the median of the per-round ratios (each round's peers ran side by side).

`--workload` picks what is measured (scripts/bench_workloads.py), each printed as one table with ratios under a header
naming the CPU, its kernel flags and the read bandwidth measured at the start (`--bandwidth` to give it instead):

    python scripts/bench.py --workload long          # 1k / 4k / 8k-token prompts: TTFT, prefill, decode deep in context
    python scripts/bench.py --workload speculative   # speculative decoding on grounded work and open chat
    python scripts/bench.py --workload isa           # every ISA level this CPU runs, side by side, roofline share
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bench_peers as peers
import bench_workloads as workloads
import httpx
import psutil
from bench_client import FIXED_LENGTH, Target, run_load
from bench_datasets import BenchRequest, chat_requests, load_tokenizer, random_requests, special_ids
from bench_metrics import RequestResult, summarize
from bench_report import format_row, machine, median_rows, print_machine, print_report, ratios

PEER_CHOICES = ("engine", *peers.PEER_NAMES)
WORKLOADS = ("serve", "long", "speculative", "isa")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="serve", choices=WORKLOADS,
                   help="serve: the load sweep below; long: long prompts against llama-server; speculative: "
                        "speculative decoding against plain and llama-server's; isa: the ISA levels side by side")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--base-url", help="a running server's root URL (no /v1)")
    where.add_argument("--peers", help=f"comma-separated servers to start here: {', '.join(PEER_CHOICES)}")
    p.add_argument("--model", help="model id to send with --base-url (default: the first of GET /v1/models)")
    p.add_argument("--backend", default="ignore_eos", choices=sorted(FIXED_LENGTH),
                   help="how --base-url is asked for a fixed output length")  # fmt: skip
    p.add_argument("--api-key", help="bearer token for --base-url")
    p.add_argument("--dataset", default="random", choices=("random", "chat"))
    p.add_argument("--input-len", help="prompt tokens (random dataset), comma-separated for several (default 128; "
                                       "long: 1024,4096,8000)")
    p.add_argument("--output-len", type=int, help="output tokens (chat: 0 = each prompt's own; default 128, long 32, "
                                                  "speculative 256 at most)")
    p.add_argument("--num-prompts", type=int, help="requests per load level (default max(8, 2 x conc); long: 3; "
                                                   "speculative: prompts of a workload at one stream, 16: all)")
    p.add_argument("--concurrency", help="comma-separated concurrency levels (default 1,4,16,64; long: 1; "
                                         "speculative and isa: 1,16)")
    p.add_argument("--request-rate", help="comma-separated Poisson request rates (req/s) instead of a sweep")
    p.add_argument("--max-concurrency", type=int, default=64, help="in-flight cap with --request-rate")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each peer's runs")
    p.add_argument(
        "--rounds",
        type=int,
        help="measure the peers in N alternating rounds, all started at once (median reported; default 1, "
             "speculative 3)",
    )
    p.add_argument("--speculative-workloads", default="grounded,copy,open",
                   help="speculative: grounded, copy, open, json, tools (scripts/bench_speculative.py's prompt sets)")
    p.add_argument("--speculative-modes", default="off,ngram", help="speculative: Peregrine's modes (off always runs)")
    p.add_argument("--levels", help="isa: comma-separated ISA levels (default: every one this CPU runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="sent with every request (0: greedy)")
    p.add_argument("--top-p", type=float, help="sent when given (as --top-k and --min-p): what sampling costs")
    p.add_argument("--top-k", type=int, help="sent when given; llama-server samples top-k 40 unless told")
    p.add_argument("--min-p", type=float, help="sent when given; llama-server's default is 0.05")
    p.add_argument("--tokenizer", help="tokenizer.json or its folder (default: the bundled SmolLM2's)")
    p.add_argument("--gguf", type=Path, help="GGUF for the peers (default: the bundled SmolLM2 Q4_1)")
    p.add_argument("--dtype", default="bfloat16", help="dtype for Peregrine and transformers peers")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for the llama.cpp peers")
    p.add_argument("--peregrine-args", default="", help="extra flags for python main.py (one string)")
    p.add_argument("--llama-server", type=Path,
                   help="llama-server binary (default: .cache/llama-build, else the suite's static build in "
                   "~/.cache/peregrine; a binary given here runs with llama.cpp's defaults, without the --no-repack "
                   "the native build needs on AMX CPUs)")
    p.add_argument(
        "--peers-python", type=Path, help="python with llama-cpp-python (default: .cache/peers-venv)"
    )
    p.add_argument("--bandwidth", type=float, metavar="GB/S",
                   help="read bandwidth for the header and the rooflines (default: measured at the start with "
                        "scripts/bandwidth.py's reads; 0: not measured)")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a peer to load")
    p.add_argument("--out", type=Path, help="JSON results (default: bench-results/bench-<time>.json)")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 4 prompts of 32 tokens, 16 out, concurrency 4"
    )
    args = p.parse_args(argv)
    workloads.apply_defaults(args)
    if not args.base_url and not args.peers and args.workload in ("serve", "long"):
        p.error("give --base-url URL or --peers NAMES")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.quick:
        args.input_len, args.output_len, args.num_prompts, args.concurrency, args.warmup = "32", 16, 4, "4", 1
        args.bandwidth = 0.0 if args.bandwidth is None else args.bandwidth
    return args


def input_lens(args: argparse.Namespace) -> list[int]:
    return [int(n) for n in str(args.input_len).split(",")]


def load_levels(args: argparse.Namespace) -> list[dict[str, Any]]:
    """[{"concurrency": c, "rate": r}, ...]: the sweep's load levels; with several --input-len, each length at
    each of them (`input_len` in the level)."""
    if args.request_rate:
        loads = [{"concurrency": args.max_concurrency, "rate": float(r)} for r in args.request_rate.split(",")]
    else:
        loads = [{"concurrency": int(c), "rate": None} for c in args.concurrency.split(",")]
    lengths = input_lens(args)
    if len(lengths) == 1:
        return loads
    return [load | {"input_len": n} for n in lengths for load in loads]


def level_name(level: dict[str, Any]) -> str:
    name = f"rate {level['rate']:g}/s" if level["rate"] else f"conc {level['concurrency']}"
    return f"{name}, in {level['input_len']}" if "input_len" in level else name


ROUND_SEED_STRIDE = 1000


def build_requests(
    args: argparse.Namespace, tokenizer: Any, count: int, round_no: int | None = None, input_len: int | None = None
) -> list[BenchRequest]:
    """The level's prompts. Every round draws its own (the same for every peer in it): a server with a prompt
    cache (llama-server's) would otherwise answer later rounds from the KV of the first."""
    seed = args.seed + ROUND_SEED_STRIDE * ((round_no or 1) - 1)
    if args.dataset == "chat":
        return chat_requests(tokenizer, count, args.output_len or None, seed=seed)
    return random_requests(tokenizer, count, input_len or input_lens(args)[0], args.output_len, seed=seed)


def prompts_per_level(args: argparse.Namespace, level: dict[str, Any]) -> int:
    return args.num_prompts or max(8, 2 * level["concurrency"])


def mismatched_lengths(requests: list[BenchRequest], results: list[RequestResult]) -> int:
    """Successful requests whose output length differs from the one asked for (EOS not ignored)."""
    return sum(
        1 for q, r in zip(requests, results, strict=True) if r.success and r.output_tokens != q.output_len
    )


async def measure(target: Target | None, engine: Any, reqs: list[BenchRequest], tokenizer: Any,
                  level: dict[str, Any], args: argparse.Namespace) -> tuple[list[RequestResult], float]:  # fmt: skip
    if engine is not None:
        from bench_overhead import run_engine_load

        return await run_engine_load(engine, reqs, level["concurrency"], sampling(args))
    assert target is not None
    return await run_load(
        target, reqs, tokenizer, level["concurrency"], level["rate"], args.burstiness, args.seed
    )


def run_levels(
    name: str,
    target: Target | None,
    engine: Any,
    tokenizer: Any,
    args: argparse.Namespace,
    *,
    warmup: bool = True,
    round_no: int | None = None,
) -> list[dict]:
    """Warm up (unless told not to), then run every load level; one JSON-able row per level."""
    if warmup and args.warmup:
        warm = random_requests(tokenizer, args.warmup, 16, 8, seed=args.seed + 1)
        asyncio.run(
            measure(target, engine, warm, tokenizer, {"concurrency": args.warmup, "rate": None}, args)
        )
    rows = []
    for level in load_levels(args):
        reqs = build_requests(args, tokenizer, prompts_per_level(args, level), round_no, level.get("input_len"))
        cpu_start = time.process_time()
        results, duration = asyncio.run(measure(target, engine, reqs, tokenizer, level, args))
        # the load generator's own CPU, taken from the cores the server under test runs on (None in-process:
        # there this process is the engine too)
        client_cpu = time.process_time() - cpu_start if target is not None else None
        summary = summarize(results, duration)
        row = {"peer": name, "load": level_name(level), **level, "num_prompts": len(reqs),
               "output_len_mismatch": mismatched_lengths(reqs, results), **summary.to_json(),
               "client_cpu_s": client_cpu} | ({"round": round_no} if round_no is not None else {})  # fmt: skip
        print(format_row(row) + (f" round {round_no}" if round_no is not None else ""), flush=True)
        rows.append(row)
    return rows


@dataclass
class OpenPeer:
    """A started peer (server or in-process engine), ready to measure."""

    name: str
    info: dict[str, Any]
    target: Target | None = None
    engine: Any = None
    pid: int | None = None  # a server's process (None in-process)
    rounds: list[list[dict[str, Any]]] = field(default_factory=list)
    idle_cpu_s: float = 0.0  # CPU its process used while the other peers were measured
    reads_gb_s: list[float] = field(default_factory=list)  # read bandwidth measured just before each round

    def measure(self, tokenizer: Any, args: argparse.Namespace, round_no: int | None = None) -> None:
        """One round of every load level (warmed up in the first), after a read bandwidth sample of its own
        (unless --bandwidth was given): a shared host's bandwidth moves by more than a peer's lead from minute to
        minute, so each peer's roofline share is taken against the bandwidth of its own minutes."""
        if args.bandwidth is None and (gb_s := workloads.read_bandwidth(args)):
            self.reads_gb_s.append(gb_s)
        warmup = not self.rounds
        self.rounds.append(run_levels(self.name, self.target, self.engine, tokenizer, args, warmup=warmup,
                                      round_no=round_no))  # fmt: skip

    def _tree(self, measure: Callable[[psutil.Process], float]) -> float | None:
        """`measure` summed over the server's process tree; None in-process, or when it is gone or cannot say."""
        if self.pid is None:
            return None
        try:
            proc = psutil.Process(self.pid)
            return sum(measure(p) for p in (proc, *proc.children(recursive=True)))
        except (psutil.Error, OSError, StopIteration):
            return None

    def cpu_s(self) -> float:
        """CPU seconds of the server's process tree so far (0 in-process, or when it is gone)."""
        return self._tree(lambda p: sum(p.cpu_times()[:2])) or 0.0

    def peak_rss_mb(self) -> float | None:
        """The most resident memory the server's process tree has held (Linux's VmHWM of each process, summed;
        weights, KV cache and buffers alike), or None in-process or where /proc does not say."""

        def peak_kb(p: psutil.Process) -> float:
            lines = Path(f"/proc/{p.pid}/status").read_text().splitlines()
            return float(next(line.split()[1] for line in lines if line.startswith("VmHWM:")))

        kb = self._tree(peak_kb)
        return None if kb is None else kb / 1024

    def rss_mb(self) -> float | None:
        """The server's process tree's resident memory now (after the run: weights, the KV cache pages written so
        far, buffers), or None in-process."""
        rss = self._tree(lambda p: p.memory_info().rss)
        return None if rss is None else rss / 2**20

    def result(self) -> dict[str, Any]:
        extra = {"peak_rss_mb": mb} if (mb := self.peak_rss_mb()) is not None else {}
        extra |= {"rss_mb": mb} if (mb := self.rss_mb()) is not None else {}
        if self.reads_gb_s:
            extra |= {"read_gb_s": statistics.median(self.reads_gb_s), "reads_gb_s": self.reads_gb_s}
        if len(self.rounds) == 1:
            return self.info | {"rows": self.rounds[0]} | extra
        rounds = {"rows": median_rows(self.rounds), "rounds": self.rounds}
        return self.info | rounds | extra | ({"idle_cpu_s": self.idle_cpu_s} if self.pid is not None else {})


def open_peer(
    name: str, opts: peers.PeerOptions, tokenizer: Any, args: argparse.Namespace, stack: ExitStack
) -> OpenPeer | dict[str, Any]:
    """Start one peer (stopped when `stack` closes). Returns it ready, or {"peer", ..., "skipped"}."""
    if name == "engine":
        return open_engine(opts, args, stack)
    peer = peers.make_peer(name, opts)
    info: dict[str, Any] = {
        "peer": name,
        "description": peer.description,
        "command": shlex.join(peer.command),
    }
    if peer.skip_reason:
        print(f"-- skipping {name}: {peer.skip_reason}", flush=True)
        return info | {"skipped": peer.skip_reason}
    log_dir = (args.out.parent if args.out else Path("bench-results")) / "logs"
    print(f"-- starting {name}: {info['command']}", flush=True)
    peers.start(peer, log_dir.resolve())
    stack.callback(_stop, peer)
    why = peers.wait_ready(peer, args.ready_timeout)
    if why:
        print(f"-- skipping {name}: {why}", flush=True)
        return info | {"skipped": why}
    target = Target(peer.base_url, peer.model, peer.fixed_length, peer.stream_options,
                    special_token_ids=special_ids(tokenizer), sampling=sampling(args))  # fmt: skip
    return OpenPeer(name, info | {"pid": peer.process.pid}, target=target, pid=peer.process.pid)


def _stop(peer: peers.Peer) -> None:
    peers.stop(peer)
    print(f"-- stopped {peer.name} (pid {peer.process.pid if peer.process else '-'})", flush=True)


def open_engine(opts: peers.PeerOptions, args: argparse.Namespace, stack: ExitStack) -> OpenPeer:
    """The in-process engine, no HTTP: the baseline of the server-overhead comparison."""
    from bench_overhead import load_engine

    flags = peers.make_peer("peregrine", opts).command[2:]  # the very flags the peregrine peer gets
    print(f"-- loading the engine in-process: main.py {shlex.join(flags)}", flush=True)
    engine = load_engine(flags)
    stack.callback(lambda: asyncio.run(engine.shutdown()))
    return OpenPeer("engine", {"peer": "engine", "description": "Peregrine's AsyncEngine in-process, no HTTP"},
                    engine=engine)  # fmt: skip


def run_peers(
    names: list[str], opts: peers.PeerOptions, tokenizer: Any, args: argparse.Namespace
) -> list[dict]:
    """One round: each peer started, measured and stopped in turn. More rounds: all started, then measured
    round after round, the order reversed every other round (A B, B A, ...), then all stopped."""
    if args.rounds == 1:
        runs = []
        for name in names:
            with ExitStack() as stack:
                peer = open_peer(name, opts, tokenizer, args, stack)
                if isinstance(peer, OpenPeer):
                    peer.measure(tokenizer, args)
                    peer = peer.result()
                runs.append(peer)
        return runs
    with ExitStack() as stack:
        opened = [open_peer(name, opts, tokenizer, args, stack) for name in names]
        ready = [p for p in opened if isinstance(p, OpenPeer)]
        for round_no in range(1, args.rounds + 1):
            for peer in ready if round_no % 2 else ready[::-1]:
                others = [p for p in ready if p is not peer]
                before = [p.cpu_s() for p in others]
                peer.measure(tokenizer, args, round_no)
                for other, cpu in zip(others, before, strict=True):
                    other.idle_cpu_s += other.cpu_s() - cpu
        for peer in ready:  # an idle peer that burns CPU takes it from the one being measured
            if peer.idle_cpu_s > 1.0:
                print(f"-- warning: {peer.name} used {peer.idle_cpu_s:.1f} s of CPU while idle", flush=True)
        return [p.result() if isinstance(p, OpenPeer) else p for p in opened]


def sampling(args: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """The sampling fields every request carries: temperature always, top_p / top_k / min_p when given."""
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    return tuple((name, value) for name, value in given.items() if value is not None)


def run_base_url(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    base = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or httpx.get(f"{base}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    target = Target(base, model, args.backend, api_key=args.api_key, special_token_ids=special_ids(tokenizer),
                    sampling=sampling(args))
    return {
        "peer": base,
        "description": f"{base} model {model}",
        "rows": run_levels(base, target, None, tokenizer, args),
    }


def peer_options(args: argparse.Namespace, gguf: Path, dense: Path | None, levels: list[dict]) -> peers.PeerOptions:
    """What each peer of this run is started with: the file, the threads, slots for the highest level, a context
    that holds the longest prompt twice over, and a --llama-server binary run with llama.cpp's defaults."""
    return peers.PeerOptions(gguf=gguf, dense_dir=dense or Path(), dtype=args.dtype, threads=args.threads,
                             max_concurrency=max(lv["concurrency"] for lv in levels),
                             # the prompts are built with the bundled tokenizer: another model's (Gemma's, Phi's
                             # SentencePiece) can take twice the tokens for the same text, past a slot's context
                             context_per_request=2 * (max(input_lens(args)) if args.dataset == "random" else 1536) + (args.output_len or 384) + 64,
                             peregrine_args=tuple(shlex.split(args.peregrine_args)),
                             llama_server=args.llama_server, llama_defaults=args.llama_server is not None,
                             peers_python=args.peers_python)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so `finally` still stops the peers it started
    host = machine(workloads.read_bandwidth(args))  # before any peer starts: the machine's own figure
    print_machine(host)
    out = args.out or Path("bench-results") / f"bench-{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    args.out = out
    if args.workload in ("speculative", "isa"):
        result = workloads.run_speculative(args, host) if args.workload == "speculative" else workloads.run_isa(args)
        host["read_gb_s"] = host["read_gb_s"] or result.get("best_read_gb_s")  # isa measures its own
        print()
        print_machine(host)
        workloads.print_result(args.workload, result)
        workloads.write(out, args, host, result)
        return 0
    gguf = args.gguf or peers.bundled_gguf()
    # The transformers peers serve a dense copy of the file; the prompts are built with --tokenizer, else the
    # bundled model's (a --gguf of another model is converted only for a transformers peer).
    wants_dense = any(n.strip().startswith("transformers") for n in (args.peers or "").split(","))
    dense = peers.ensure_dense_model(gguf) if wants_dense else None
    tokenizer = load_tokenizer(args.tokenizer or dense or peers.ensure_dense_model(peers.bundled_gguf()))
    levels = load_levels(args)
    opts = peer_options(args, gguf, dense, levels)
    if args.base_url:
        runs = [run_base_url(tokenizer, args)]
    else:
        names = [n.strip() for n in args.peers.split(",") if n.strip()]
        unknown = [n for n in names if n not in PEER_CHOICES]
        if unknown:
            sys.exit(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEER_CHOICES)}")
        runs = run_peers(names, opts, tokenizer, args)
    rel = ratios(runs)
    print()
    print_machine(host)
    print_report(runs, rel)
    result: dict[str, Any] = {"runs": runs, "ratios": rel}
    if args.workload == "long":
        result["long"] = workloads.long_table(runs, rel)
        workloads.print_result("long", result["long"])
    workloads.write(out, args, host, result)
    return 0 if any(r.get("rows") for r in runs) else 1


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    raise SystemExit(main())
