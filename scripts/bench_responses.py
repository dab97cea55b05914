"""Turn-5 TTFT of a five-turn conversation (issue 37): Peregrine's Responses API continuing each turn with
`previous_response_id`, against the same conversation resent whole through the chat route, on Peregrine and on
llama-server (which keeps a slot's prompt, `cache_prompt`).

    python scripts/bench_responses.py                 # Peregrine, then llama-server if built, 3 rounds each
    python scripts/bench_responses.py --rounds 5 --system-tokens 1000

Each round is a new conversation (its own questions) after a shared system prompt of about `--system-tokens`
tokens; every turn is greedy, `--output-len` tokens, streamed, one request at a time; TTFT is the time to the first
text delta. The servers run one after another on free loopback ports with the same GGUF and threads. Prints one
JSON line and a table of medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers as peers  # noqa: E402
from bench_datasets import load_tokenizer  # noqa: E402
from bench_prefix import system_prompt  # noqa: E402
from bench_report import machine, print_machine  # noqa: E402

QUESTIONS = ["What should a new member read first?", "And after that?", "Which rule matters most at night?",
             "Summarize the rules about guests.", "What did you say first, in one line?"]  # fmt: skip


def first_delta(client: httpx.Client, path: str, body: dict[str, Any], kind: str) -> tuple[float, str, dict]:
    """(seconds to the first text delta, the whole text, the final event) of one streamed request."""
    start, ttft, text, final = time.perf_counter(), None, "", {}
    with client.stream("POST", path, json=body | {"stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            delta = (event.get("delta") if kind == "responses" and event.get("type") == "response.output_text.delta"
                     else (event.get("choices") or [{}])[0].get("delta", {}).get("content") if kind == "chat" else None)
            if delta:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text += delta
            if kind == "responses" and event.get("type") in ("response.completed", "response.incomplete"):
                final = event["response"]
    return (ttft if ttft is not None else float("nan")), text, final


def conversation(client: httpx.Client, kind: str, system: str, round_no: int, args: argparse.Namespace) -> float:
    """One five-turn conversation; returns the last turn's TTFT."""
    messages, previous, ttft = [{"role": "system", "content": system}], None, float("nan")
    model = client.get("/v1/models").json()["data"][0]["id"]
    for question in QUESTIONS[: args.turns]:
        user = f"(round {round_no}) {question}"
        if kind == "responses":
            body = {"model": model, "instructions": system, "input": user, "max_output_tokens": args.output_len,
                    "temperature": 0} | ({"previous_response_id": previous} if previous else {})  # fmt: skip
            ttft, _, final = first_delta(client, "/v1/responses", body, kind)
            previous = final["id"]
        else:
            messages.append({"role": "user", "content": user})
            body = {"model": model, "messages": messages, "max_tokens": args.output_len, "temperature": 0}
            ttft, text, _ = first_delta(client, "/v1/chat/completions", body, kind)
            messages.append({"role": "assistant", "content": text})
    return ttft


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gguf", type=Path, help="default: the bundled SmolLM2 Q4_1")
    p.add_argument("--peregrine-args", default="--max-model-len 4096")
    args = p.parse_args(argv)
    gguf = args.gguf or peers.bundled_gguf()
    tokenizer = load_tokenizer(peers.ensure_dense_model(peers.bundled_gguf()))
    system = system_prompt(tokenizer, args.system_tokens, 0)
    opts = peers.PeerOptions(gguf=gguf, dense_dir=Path(), dtype="auto", threads=args.threads, max_concurrency=4,
                             context_per_request=4096, peregrine_args=tuple(args.peregrine_args.split()))  # fmt: skip
    plan = [("peregrine", "responses"), ("peregrine", "chat"), ("llamacpp", "chat")]
    results: dict[str, list[float]] = {}
    for name in dict.fromkeys(n for n, _ in plan):
        peer = peers.make_peer(name, opts)
        if peer.skip_reason:
            print(f"skipped {name}: {peer.skip_reason}", file=sys.stderr)
            continue
        peers.start(peer, Path("bench-results") / "responses-logs")
        try:
            if why := peers.wait_ready(peer, 900):
                sys.exit(f"{name}: {why}")
            with httpx.Client(base_url=peer.base_url, timeout=600) as client:
                kinds = [k for n, k in plan if n == name]
                conversation(client, kinds[0], system, -1, args)  # warm-up: the system prompt cached alike
                for round_no in range(args.rounds):
                    for kind in kinds:  # alternating, each round a new conversation per kind
                        results.setdefault(f"{name} {kind}", []).append(
                            conversation(client, kind, system, round_no * 10 + len(kind), args))
        finally:
            peers.stop(peer)
    host = machine()
    print(json.dumps({"machine": host, "turn5_ttft_s": results, "args": vars(args) | {"gguf": str(gguf)}}))
    print_machine(host)
    print(f"\n| server, route | turn-{args.turns} TTFT, median of {args.rounds} (s) | runs (s) |\n|---|---|---|")
    for key, values in results.items():
        print(f"| {key} | {statistics.median(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
