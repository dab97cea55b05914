"""scripts/bench_prefix.py: the shared system prompt, the multi-turn load against a scripted SSE server (each
turn resends the history with the previous reply), and the figures it reports."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from aiohttp import web

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_client  # noqa: E402
import bench_peers  # noqa: E402
import bench_prefix  # noqa: E402

SEEN = web.AppKey("seen", list)


def test_system_prompt_is_seeded_and_about_the_asked_length(tokenizer) -> None:
    text = bench_prefix.system_prompt(tokenizer, 300, seed=1)
    assert text == bench_prefix.system_prompt(tokenizer, 300, seed=1) != bench_prefix.system_prompt(tokenizer, 300, 2)
    assert 300 <= len(tokenizer.encode(text).ids) < 360


async def chat_stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    request.app[SEEN].append(body["messages"])
    if "(fail)" in body["messages"][0]["content"] and len(body["messages"]) > 2:
        return web.json_response({"error": {"message": "boom"}}, status=500)
    reply = f"reply{len(body['messages'])}"
    events = [{"choices": [{"delta": {"content": reply}}]},
              {"choices": [], "usage": {"prompt_tokens": 10 * len(body["messages"]), "completion_tokens": 3}}]
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def load(tokenizer, args: argparse.Namespace, system: str = "SYSTEM") -> tuple[dict, list]:
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/v1/chat/completions", chat_stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", bench_peers.free_port())
    await site.start()
    try:
        target = bench_client.Target(site.name.rstrip("/"), "m")
        return await bench_prefix.run_load(target, system, args, tokenizer), app[SEEN]
    finally:
        await runner.cleanup()


def test_each_turn_resends_the_history_with_the_previous_reply(tokenizer) -> None:
    args = argparse.Namespace(conversations=2, turns=3, output_len=3)
    row, seen = asyncio.run(load(tokenizer, args))
    assert row["requests"] == 6 and row["output_tokens"] == 18 and row["output_tok_s"] > 0
    assert sorted(len(m) for m in seen) == [2, 2, 4, 4, 6, 6]
    for messages in seen:
        assert messages[0] == {"role": "system", "content": "SYSTEM"}
        for i in range(2, len(messages), 2):  # every earlier turn's reply is in the history
            assert messages[i] == {"role": "assistant", "content": f"reply{i}"}
    assert [t["turn"] for t in row["turns"]] == [1, 2, 3, 1, 2, 3]
    assert row["ttft_turns2plus_p50_ms"] > 0 and row["prompt_tokens"] == 10 * (2 + 4 + 6) * 2


def test_a_failed_turn_ends_its_chat_and_the_finished_turns_still_count(tokenizer) -> None:
    row, seen = asyncio.run(load(tokenizer, argparse.Namespace(conversations=2, turns=3, output_len=3), "(fail)"))
    assert row["requests"] == 2 and [t["turn"] for t in row["turns"]] == [1, 1]  # turn 2 failed in both chats
    assert len(row["errors"]) == 2 and all("turn 2 failed" in e and "500" in e for e in row["errors"])
    assert sorted(len(m) for m in seen) == [2, 2, 4, 4]  # nothing sent after a chat's failed turn
    assert row["ttft_turns2plus_p50_ms"] != row["ttft_turns2plus_p50_ms"]  # NaN: no later turn finished


def test_ratios_compare_caching_on_with_off_and_with_llama_server() -> None:
    rows = [{"peer": "peregrine", "ttft_turns2plus_p50_ms": 50.0, "output_tok_s": 30.0},
            {"peer": "peregrine-nocache", "ttft_turns2plus_p50_ms": 200.0, "output_tok_s": 20.0},
            {"peer": "llamacpp", "skipped": "not built"}]
    assert bench_prefix.ratios(rows) == {"ttft_turns2plus_p50_on_over_off": 0.25, "output_tok_s_on_over_off": 1.5}
    assert bench_prefix.ratios(rows[:1]) == {}
    rows[1] = {"peer": "peregrine-nocache", "failed": "chat 0 turn 1 failed"}
    rows[2] = {"peer": "llamacpp", "ttft_turns2plus_p50_ms": 100.0, "output_tok_s": 60.0}
    assert bench_prefix.ratios(rows) == {"ttft_turns2plus_p50_peregrine_over_llamacpp": 0.5,
                                         "output_tok_s_peregrine_over_llamacpp": 0.5}
