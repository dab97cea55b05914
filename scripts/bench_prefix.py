"""Prefix-caching benchmark: a multi-turn chat load with and without Peregrine's automatic prefix caching.

    python scripts/bench_prefix.py                       # starts Peregrine twice: caching on, then off
    python scripts/bench_prefix.py --peers peregrine,peregrine-nocache,llamacpp   # + llama-server if built
    python scripts/bench_prefix.py --base-url http://127.0.0.1:8000              # a server you started

The load: `--conversations` chats (8) of `--turns` turns (5) each, run concurrently, every chat's turns one
after another. All chats share one system prompt of about `--system-tokens` tokens (1,000); each turn adds a
short user message and `--output-len` generated tokens (32, EOS ignored) to the chat's history, so turn t
resends the system prompt and the whole conversation so far, as chat clients and agents do. Each request is
streamed; TTFT is measured at the first content chunk.

Reported per server: TTFT p50 of turn 1 and of turns 2-5, output tokens/s over the whole load (all output
tokens / wall time from the first request to the last completion), and for Peregrine the prefix cache hits
read from `GET /metrics` (`peregrine_prefix_cache_hits_total` / `..._queries_total`). The peers are started
here one after another on free loopback ports (`scripts/bench_peers.py`), each warmed up with one unrelated
request; llama-server (which keeps each slot's prefix through `cache_prompt`) runs only where
`python scripts/bench_peers.py setup` built it. JSON goes to stdout's end and to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import bench_peers as peers
import httpx
from bench_client import Target, send
from bench_datasets import BenchRequest, load_tokenizer, special_ids
from bench_metrics import percentile

WORDS = ["falcon", "river", "stone", "cloud", "engine", "ledger", "harbor", "lantern", "meadow", "signal", "orbit", "copper", "window", "garden", "station", "thunder", "pepper", "canvas", "marble", "violet", "anchor", "basket", "candle", "desert", "forest", "glacier", "island", "jungle", "kettle", "ladder", "mirror", "needle", "ocean", "pillow", "quartz", "ribbon", "saddle", "tunnel", "valley", "wagon", "yellow"]
QUESTIONS = ("Summarise the rules above in one line.", "Which rule matters most, and why?",
             "Give an example that follows rule three.", "What would break rule seven?",
             "Name two rules that work together.", "Rewrite rule one more simply.")  # fmt: skip
PEER_FLAGS = {"peregrine": (), "peregrine-nocache": ("--no-prefix-caching",)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="measure one running server (root URL, no /v1) instead of starting peers")
    p.add_argument("--peers", default="peregrine,peregrine-nocache",
                   help="servers to start: peregrine, peregrine-nocache (--no-prefix-caching), llamacpp")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--dtype", default="auto", help="Peregrine's --dtype (auto: what a user gets; it times decode steps at start)")
    p.add_argument("--threads", type=int, default=2, help="llama-server threads")
    p.add_argument("--peregrine-args", default="--kv-cache-bytes 1GiB --max-model-len 4096",
                   help="extra flags for both Peregrine servers")
    p.add_argument("--llama-server", type=Path, help="llama-server binary (default: .cache/llama-build)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json or a folder (default: the bundled model's)")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON file (default: bench-results/prefix-<time>.json)")
    return p.parse_args(argv)


def system_prompt(tokenizer: Any, tokens: int, seed: int) -> str:
    """Numbered rules of seeded random words, cut to about `tokens` tokens."""
    rng = random.Random(seed)
    lines, text = [], ""
    while len(tokenizer.encode(text).ids) < tokens:
        words = " ".join(rng.choice(WORDS) for _ in range(12))
        lines.append(f"Rule {len(lines) + 1}: always {words}.")
        text = "You are the club's assistant. Follow these rules.\n" + "\n".join(lines)
    return text


async def conversation(session: aiohttp.ClientSession, target: Target, system: str, index: int,
                       args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    """One chat, turn after turn; each reply is appended to the history the next turn resends. A failed turn
    ends the chat: it is recorded with its error, and the turns before it count."""
    messages = [{"role": "system", "content": system}]
    turns: list[dict[str, Any]] = []
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": f"(chat {index}) {QUESTIONS[(index + turn) % len(QUESTIONS)]}"})
        req = BenchRequest("chat", None, tuple(messages), 0, args.output_len)
        result = await send(session, target, req, tokenizer)
        if not result.success:
            turns.append({"turn": turn, "error": f"chat {index} turn {turn} failed: {result.error}"})
            break
        messages.append({"role": "assistant", "content": result.text})
        turns.append({"turn": turn, "ttft_s": result.ttft, "latency_s": result.latency,
                      "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens})
    return turns


async def run_load(target: Target, system: str, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=3600, connect=30)
    # A new connection per request, for every server alike: llama-server closes idle keep-alive connections
    # under this load, and a request written into a closed pooled connection fails ("Can not write request body").
    connector = aiohttp.TCPConnector(force_close=True, limit=args.conversations + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=2**20) as session:
        start = time.perf_counter()
        chats = await asyncio.gather(*(conversation(session, target, system, i, args, tokenizer)
                                       for i in range(args.conversations)))
        duration = time.perf_counter() - start
    errors = [t["error"] for chat in chats for t in chat if "error" in t]
    turns = [t for chat in chats for t in chat if "error" not in t]
    if not turns:
        return {"failed": errors[0] if errors else "no turns", "errors": errors, "turns": []}
    later = [t["ttft_s"] for t in turns if t["turn"] > 1] or [float("nan")]
    first = [t["ttft_s"] for t in turns if t["turn"] == 1]
    output = sum(t["output_tokens"] for t in turns)
    return {"requests": len(turns), "duration_s": duration, "output_tokens": output,
            "output_tok_s": output / duration, "ttft_turn1_p50_ms": 1000 * percentile(first, 50),
            "ttft_turns2plus_p50_ms": 1000 * percentile(later, 50),
            "ttft_turns2plus_p90_ms": 1000 * percentile(later, 90),
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns), "errors": errors, "turns": turns}  # fmt: skip


async def warm_up(target: Target, tokenizer: Any) -> None:
    """One unrelated request, so first-request costs (kernel builds, lazy caches) stay out of the figures."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await send(session, target, BenchRequest("chat", None, ({"role": "user", "content": "Say hello."},), 0, 4),
                   tokenizer)


def prefix_counters(base_url: str) -> dict[str, float]:
    """Peregrine's prefix cache counters from /metrics ({} for servers without them)."""
    try:
        text = httpx.get(base_url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("peregrine_prefix_cache_hits_total", "peregrine_prefix_cache_queries_total"):
            values[name.removeprefix("peregrine_prefix_cache_").removesuffix("_total")] = float(value)
    return values


def measure(name: str, target: Target, system: str, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    print(f"-- measuring {name}: {args.conversations} chats x {args.turns} turns", flush=True)
    asyncio.run(warm_up(target, tokenizer))
    before = prefix_counters(target.base_url)
    row = {"peer": name} | asyncio.run(run_load(target, system, args, tokenizer))
    after = prefix_counters(target.base_url)
    if after:
        row["prefix_cache_hit_tokens"] = after.get("hits", 0) - before.get("hits", 0)
        row["prefix_cache_query_tokens"] = after.get("queries", 0) - before.get("queries", 0)
    return row


def run_peers(names: list[str], system: str, args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    gguf = peers.bundled_gguf()
    rows = []
    for name in names:
        flags = (*shlex.split(args.peregrine_args), *PEER_FLAGS[name]) if name in PEER_FLAGS else ()
        opts = peers.PeerOptions(gguf=gguf, dense_dir=Path(), dtype=args.dtype, threads=args.threads,
                                 max_concurrency=args.conversations, context_per_request=4096,
                                 peregrine_args=flags, llama_server=args.llama_server)  # fmt: skip
        peer = peers.make_peer("peregrine" if name in PEER_FLAGS else name, opts)
        if peer.skip_reason:
            print(f"-- skipping {name}: {peer.skip_reason}", flush=True)
            rows.append({"peer": name, "skipped": peer.skip_reason})
            continue
        with ExitStack() as stack:
            print(f"-- starting {name}: {shlex.join(peer.command)}", flush=True)
            peers.start(peer, (args.out.parent / "logs").resolve())
            stack.callback(peers.stop, peer)
            why = peers.wait_ready(peer, args.ready_timeout)
            if why:
                rows.append({"peer": name, "skipped": why})
                continue
            target = Target(peer.base_url, peer.model, peer.fixed_length, peer.stream_options,
                            special_token_ids=special_ids(tokenizer))  # fmt: skip
            rows.append(measure(name, target, system, args, tokenizer) | {"command": shlex.join(peer.command)})
    return rows


def base_url_row(args: argparse.Namespace, system: str, tokenizer: Any) -> list[dict[str, Any]]:
    url = args.base_url.rstrip("/")
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return [measure(url, Target(url, model), system, args, tokenizer)]


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {r["peer"]: r for r in rows if has_figures(r)}
    on = by.get("peregrine")
    rel = {}
    for other, suffix in (("peregrine-nocache", "on_over_off"), ("llamacpp", "peregrine_over_llamacpp")):
        if on and other in by:
            rel[f"ttft_turns2plus_p50_{suffix}"] = on["ttft_turns2plus_p50_ms"] / by[other]["ttft_turns2plus_p50_ms"]
            rel[f"output_tok_s_{suffix}"] = on["output_tok_s"] / by[other]["output_tok_s"]
    return rel


def print_table(rows: list[dict[str, Any]], rel: dict[str, float]) -> None:
    print(f"\n{'server':<20} {'TTFT p50 turn 1':>16} {'TTFT p50 turns 2+':>18} {'output tok/s':>13} "
          f"{'cached / prompt tokens':>23}")  # fmt: skip
    for r in rows:
        if not has_figures(r):
            print(f"{r['peer']:<20} {'skipped' if 'skipped' in r else 'failed'}: {r.get('skipped') or r['failed']}")
            continue
        cached = (f"{r['prefix_cache_hit_tokens']:.0f} / {r['prompt_tokens']}"
                  if "prefix_cache_hit_tokens" in r else "-")
        print(f"{r['peer']:<20} {r['ttft_turn1_p50_ms']:>13.0f} ms {r['ttft_turns2plus_p50_ms']:>15.0f} ms "
              f"{r['output_tok_s']:>13.1f} {cached:>23}")  # fmt: skip
        if r.get("errors"):
            print(f"{'':<20} {len(r['errors'])} failed turn(s), first: {r['errors'][0]}")
    for key, value in rel.items():
        print(f"{key}: {value:.3f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out or Path("bench-results") / f"prefix-{time.strftime('%Y%m%d-%H%M%S')}.json"
    tokenizer = load_tokenizer(args.tokenizer or default_tokenizer())
    system = system_prompt(tokenizer, args.system_tokens, args.seed)
    if args.base_url:
        rows = base_url_row(args, system, tokenizer)
    else:
        names = [n.strip() for n in args.peers.split(",") if n.strip()]
        rows = run_peers(names, system, args, tokenizer)
    rel = ratios(rows)
    print_table(rows, rel)
    report = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": shlex.join([sys.executable, *sys.argv]),
              "system_prompt_tokens": len(tokenizer.encode(system).ids), "args": vars(args) | {"out": str(args.out)},
              "rows": [{k: v for k, v in r.items() if k != "turns"} for r in rows], "ratios": rel}  # fmt: skip
    summary = json.dumps(report, indent=2, default=str)
    print(summary)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report | {"turns": {r["peer"]: r.get("turns") for r in rows}}, indent=2,
                                   default=str))
    print(f"wrote {args.out}")
    return 0 if any(has_figures(r) for r in rows) else 1


def has_figures(row: dict[str, Any]) -> bool:
    return "skipped" not in row and "failed" not in row


def default_tokenizer() -> Path:
    """The bundled model's tokenizer: Peregrine's converted GGUF folder when present, else a dense copy."""
    from config import tool_cache_dir

    found = sorted((tool_cache_dir() / "gguf").glob("SmolLM2-135M-Instruct*/tokenizer.json"))
    return found[0] if found else peers.ensure_dense_model(peers.bundled_gguf())


if __name__ == "__main__":
    raise SystemExit(main())
