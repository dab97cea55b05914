"""Each family's tiny GGUF (tests/family_gguf.py: random weights, Q8_0 matmuls, the metadata and tensor layout
llama.cpp's converter writes) served by Peregrine on the fast path and by llama.cpp's own `llama-server`
(tests/llama_cpp.py) from the same file: greedy continuations of the same prompts, token ids in and out, agree.

Both multiply int8-quantized activations (blocks of 32) by the Q8_0 weights, but llama.cpp keeps its KV cache in
float16 and sums in its own order, so two greedy runs may part where the top two candidates are nearly tied: they
must agree token for token until they part, and may part only where Peregrine's own top two log-probabilities are
within TIE of each other (the stated bound); the chosen tokens' log-probabilities on the shared prefix agree within
LOGPROB. Gemma 3's file says its sliding-window pattern (first layer windowed, second global) and its window (4)
as llama.cpp reads them, so the window matters within the test's positions; Gemma 2's the same, and its soft caps
(attention 0.5, logits 50: both bind) under the keys llama.cpp reads."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from engine.types import SamplingParams
from models import gguf_weights
from tests.engine.test_families import vocab_of
from tests.family_gguf import SPECS, write_family
from tests.llama_cpp import llama_server, server_flags
from tests.support import Loaded, free_port, make_engine, run_all, stop_process, wait_http_ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # the first run builds llama-server
PROMPTS = [[5, 60, 61, 62, 63, 64, 200, 17], [9, 8, 7, 6, 5, 4, 3, 2, 1, 300, 301], [40, 41, 42]]
STEPS = 16
TIE = 0.5  # log-probability gap of Peregrine's top two where the runs may part (tests/support.part_at_near_ties')
LOGPROB = 0.1  # chosen tokens' log-probabilities on the shared prefix


@pytest.fixture(scope="module")
def server_binary() -> Path:
    return llama_server()


def llama_cpp_greedy(binary: Path, gguf: Path, workdir: Path, banned: list[int]) -> list[list[tuple[int, float | None]]]:
    """(token id, log-probability or None) of llama-server's greedy continuation of each prompt."""
    port, log = free_port(), workdir / "llama-server.log"
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "256",
           "-np", "1", "--no-warmup", *server_flags()]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", proc, log, timeout=120, what="llama-server")
        runs = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "n_predict": STEPS, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "n_probs": 2, "cache_prompt": False, "return_tokens": True,
                    "logit_bias": [[token, False] for token in banned]}  # fmt: skip
            reply = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=120, trust_env=False)
            assert reply.status_code == 200, reply.text
            done = reply.json()
            # log-probabilities come a piece of text each: a token that ends inside a UTF-8 character joins the next
            probs = done["completion_probabilities"]
            logprobs = [p["logprob"] for p in probs] if len(probs) == len(done["tokens"]) else [None] * len(probs)
            runs.append(list(zip(done["tokens"], logprobs + [None] * (len(done["tokens"]) - len(probs)), strict=True)))
        return runs
    finally:
        stop_process(proc)


@pytest.mark.parametrize("family", list(SPECS))
def test_greedy_agrees_with_llama_server(family: str, tmp_path: Path, byte_level_tokenizer: object,
                                         server_binary: Path) -> None:  # fmt: skip
    files = tmp_path / "file"
    files.mkdir()
    write_family(files, family, vocab_of(byte_level_tokenizer), tokenizer=byte_level_tokenizer)
    (files / "config.json").unlink()  # the bare file, as a user has it
    gguf = files / "tiny.gguf"
    folder = gguf_weights.metadata_folder(gguf, tmp_path / "cache")
    model = gguf_weights.load(gguf, folder, torch.float32)
    engine = make_engine(Loaded(model, byte_level_tokenizer, 256))
    assert engine.runner.impl == "llama"  # the fast path
    # llama.cpp's ignore_eos bans the end-of-generation tokens it recognises (<|im_end|> among them): both sides
    # ban the tokenizer's added tokens (<s>, </s>, <|im_start|>, <|im_end|>, ...)
    banned = sorted(byte_level_tokenizer.added_tokens_decoder)
    greedy = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=2,
                            logit_bias={token: -100.0 for token in banned})  # fmt: skip
    ours = run_all(engine, {str(i): (p, greedy) for i, p in enumerate(PROMPTS)})
    theirs = llama_cpp_greedy(server_binary, gguf, tmp_path, banned)
    report = []
    for i, run in enumerate(theirs):
        mine = [lp for o in ours[str(i)] for lp in o.logprobs]
        assert len(mine) == len(run) == STEPS
        shared = next((j for j, (a, (b, _)) in enumerate(zip(mine, run, strict=True)) if a.token_id != b), STEPS)
        if shared < STEPS:
            first, second = mine[shared].top[:2]
            assert first.logprob - second.logprob <= TIE, (family, i, shared, first, second, run[shared])
        drift = max([0.0, *(abs(a.logprob - b) for a, (_, b) in zip(mine[:shared], run[:shared], strict=True)
                            if b is not None)])
        assert drift <= LOGPROB, (family, i, drift)
        report.append(shared)
    print(f"{family}: shared greedy prefix per prompt {report} of {STEPS}")
    assert sum(report) >= STEPS, (family, report)  # they agree on more than near-ties at the first token
