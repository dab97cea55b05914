"""What structured output costs: constrained vs free decoding on a real server, and grammar compile times.

    # start Peregrine here (bundled SmolLM2), measure, stop it
    python scripts/bench_structured.py
    # or a server you started yourself
    python scripts/bench_structured.py --base-url http://127.0.0.1:8000

Measures, and prints as JSON (also `--out`) and as a table:
1. Throughput: `--concurrency` (16) concurrent streamed chat requests with a `json_schema` response_format
   against the same number of free requests on the same prompts, `--output-len` (128) tokens each. The schema
   (an array of at least 200 small objects) cannot end before that length and the free requests ignore EOS,
   so both runs generate exactly the same number of tokens and the output tok/s ratio is the cost of the
   masks. `--rounds` (3) alternating rounds (free/json, json/free, ...); the ratio is the median of the
   per-round ratios. The constrained answers are checked to be valid JSON prefixes of that schema.
2. Compile time of a 50-property schema, here in this process with the model's tokenizer (llguidance, as the
   server does it: compile plus the first mask), median of `--compile-repeats` fresh schemas.
3. TTFT of a request with a schema the server has not seen against the same schema again (cached), medians
   over `--ttft-repeats` fresh 50-property schemas, one request at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import bench_peers as peers
import httpx
from bench_client import _read_stream
from bench_datasets import chat_requests
from bench_metrics import RequestResult, ratio, summarize

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                         "city": {"type": "string", "maxLength": 24}},
        "required": ["name", "age", "city"], "additionalProperties": False}
LONG_SCHEMA = {"type": "array", "items": ITEM, "minItems": 200}
INSTRUCTION = "Answer as a JSON array of people, each with a name, an age and a city."


def schema_50(tag: str) -> dict[str, Any]:
    """A 50-property object schema; `tag` makes it new to every cache."""
    kinds = [{"type": "string", "maxLength": 32}, {"type": "integer", "minimum": 0, "maximum": 10_000},
             {"type": "boolean"}, {"enum": ["low", "medium", "high"]}, {"type": "number"}]
    props = {f"field_{i}_{tag}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="a running server's root URL (no /v1); default: start Peregrine here")
    p.add_argument("--model", help="model id to send (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile-repeats", type=int, default=5)
    p.add_argument("--ttft-repeats", type=int, default=5)
    p.add_argument("--peregrine-args", default="", help="extra flags for python main.py (one string)")
    p.add_argument("--out", type=Path, help="write the JSON here too")
    return p.parse_args(argv)


def body_for(req: Any, model: str, output_len: int, structured: bool) -> dict[str, Any]:
    messages = [{"role": "system", "content": INSTRUCTION}, *req.messages]
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": LONG_SCHEMA}}
    else:
        body["ignore_eos"] = True
    return body


async def send(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read()).decode(errors='replace')[:200]}"
                return result
            usage = await _read_stream(response.content, result, start)
    except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    return result


async def run_level(url: str, bodies: list[dict[str, Any]]) -> tuple[list[RequestResult], float]:
    """All bodies at once (one concurrent stream each); results and the duration (first send to last end)."""
    timeout = aiohttp.ClientTimeout(total=1800, connect=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(bodies) + 4), timeout=timeout,
                                     read_bufsize=2**20) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(send(session, url, b) for b in bodies))
    return list(results), time.perf_counter() - start


def valid_prefix(text: str) -> bool:
    """True if `text` is a prefix of some JSON array of ITEM-shaped objects (checked by llguidance)."""
    import llguidance

    from engine.sampling import grammar

    tok = _tokenizer()
    matcher = llguidance.LLMatcher(grammar.ll_tokenizer(tok), grammar.grammar_text(
        grammar.Constraint("json_schema", json.dumps(LONG_SCHEMA))), log_level=0)
    ids = grammar.ll_tokenizer(tok).tokenize_str(text)
    return matcher.try_consume_tokens(ids) == len(ids)


_TOK: list[Any] = []


def _tokenizer() -> Any:
    if not _TOK:
        from transformers import AutoTokenizer

        gguf = peers.bundled_gguf()
        _TOK.append(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    return _TOK[0]


def throughput(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    reqs = chat_requests(_NullTok(), args.concurrency, args.output_len, seed=0)
    bodies = {kind: [body_for(r, model, args.output_len, kind == "json") for r in reqs] for kind in ("free", "json")}
    # warm up, and put every prompt in the prefix cache: otherwise the first level measured pays the prefills
    asyncio.run(run_level(url, [b | {"max_tokens": 1} for b in bodies["free"]]))
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = ("free", "json") if i % 2 == 0 else ("json", "free")
        row: dict[str, Any] = {}
        for kind in order:
            results, duration = asyncio.run(run_level(url, bodies[kind]))
            summary = summarize(results, duration)
            row[kind] = summary.to_json()
            if kind == "json":
                row["json_valid_prefixes"] = sum(valid_prefix(r.text) for r in results if r.success)
        row["ratio"] = ratio(row["json"]["output_throughput"], row["free"]["output_throughput"])
        print(f"round {i + 1}: free {row['free']['output_throughput']:.1f} tok/s, json "
              f"{row['json']['output_throughput']:.1f} tok/s, ratio {row['ratio']:.3f}", flush=True)
        rounds.append(row)
    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]
    return {"rounds": rounds, "median_ratio": statistics.median(ratios) if ratios else None,
            "median_free_tok_s": statistics.median(r["free"]["output_throughput"] for r in rounds),
            "median_json_tok_s": statistics.median(r["json"]["output_throughput"] for r in rounds)}


class _NullTok:
    """chat_requests wants a tokenizer for prompt-length estimates; the server's usage gives the real counts."""

    def encode(self, text: str, add_special_tokens: bool = False) -> Any:
        return type("E", (), {"ids": text.split()})()


def compile_times(args: argparse.Namespace) -> dict[str, Any]:
    from engine.sampling import grammar
    from engine.types import Constraint

    tok = _tokenizer()
    grammar.ll_tokenizer(tok)
    times = []
    for _ in range(args.compile_repeats):
        c = Constraint("json_schema", json.dumps(schema_50(uuid.uuid4().hex[:8])))
        started = time.perf_counter()
        grammar.validate(c, tok)
        times.append(time.perf_counter() - started)
    cached = []
    for _ in range(args.compile_repeats):
        started = time.perf_counter()
        grammar.validate(c, tok)
        cached.append(time.perf_counter() - started)
    return {"compile_ms_median": statistics.median(times) * 1e3, "compile_ms_all": [t * 1e3 for t in times],
            "cached_lookup_ms_median": statistics.median(cached) * 1e3,
            "schema_chars": len(json.dumps(schema_50("x")))}


def ttft(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    def one(schema: dict[str, Any]) -> float:
        body = {"model": model, "messages": [{"role": "user", "content": "Fill in the record as JSON."}],
                "max_tokens": 4, "temperature": 0.0, "stream": True,
                "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}}
        results, _ = asyncio.run(run_level(url, [body]))
        if not results[0].success:
            raise RuntimeError(results[0].error)
        return results[0].ttft

    new, cached = [], []
    for _ in range(args.ttft_repeats):
        schema = schema_50(uuid.uuid4().hex[:8])
        new.append(one(schema))
        cached.append(one(schema))
    return {"ttft_new_schema_ms_median": statistics.median(new) * 1e3,
            "ttft_cached_schema_ms_median": statistics.median(cached) * 1e3,
            "ttft_new_ms_all": [t * 1e3 for t in new], "ttft_cached_ms_all": [t * 1e3 for t in cached]}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # stop the server we started
    peer = None
    url = args.base_url
    try:
        if url is None:
            opts = peers.PeerOptions(gguf=peers.bundled_gguf(), dense_dir=peers.DENSE_DIR,
                                     max_concurrency=max(16, args.concurrency),
                                     peregrine_args=tuple(args.peregrine_args.split()))
            peer = peers.make_peer("peregrine", opts)
            peers.start(peer, Path(tempfile.mkdtemp(prefix="bench-structured-")))
            why = peers.wait_ready(peer, 900)
            if why:
                print(f"Peregrine did not start: {why}", file=sys.stderr)
                return 1
            url = peer.base_url
        model = args.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        report = {"cpu": cpu_model(), "cores": _cores(), "base_url": url, "model": model,
                  "concurrency": args.concurrency, "output_len": args.output_len,
                  "compile": compile_times(args), "throughput": throughput(url, model, args),
                  "ttft": ttft(url, model, args)}
    finally:
        if peer is not None:
            peers.stop(peer)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    print_table(report)
    return 0


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def print_table(r: dict[str, Any]) -> None:
    t, c, f = r["throughput"], r["compile"], r["ttft"]
    rows = [
        ("CPU", f"{r['cpu']} ({r['cores']} cores)"),
        (f"free, {r['concurrency']} streams x {r['output_len']} tok", f"{t['median_free_tok_s']:.1f} output tok/s"),
        (f"json_schema, {r['concurrency']} streams x {r['output_len']} tok", f"{t['median_json_tok_s']:.1f} output tok/s"),
        ("ratio json / free (median of rounds)", f"{t['median_ratio']:.3f}" if t["median_ratio"] else "-"),
        ("compile, 50-property schema", f"{c['compile_ms_median']:.1f} ms (cached: {c['cached_lookup_ms_median']:.3f} ms)"),
        ("TTFT, new schema", f"{f['ttft_new_schema_ms_median']:.0f} ms"),
        ("TTFT, cached schema", f"{f['ttft_cached_schema_ms_median']:.0f} ms"),
    ]
    width = max(len(a) for a, _ in rows)
    print()
    for a, b in rows:
        print(f"{a:<{width}}  {b}")


if __name__ == "__main__":
    sys.exit(main())
