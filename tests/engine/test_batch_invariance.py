"""Same request, same bits (issue 35), in the engine, on the default path: the bundled SmolLM2 Q4_1 kept quantized,
the one-call step of Peregrine's CPU kernels for every step (prompt tokens and decodes alike), on each ISA level
this CPU can run (at `none`, where the kernels do not build, the op-by-op pass: quantized matmuls 16 rows at a
time, attention token by token). A prompt's logits, at its last prompt token and at every greedy step after it (which read the KV
the prompt left), are bitwise the same computed whole, in chunks (chunked prefill), partly from cached blocks,
among batch mates with other prompts, or as a decode-size step of one token after cached blocks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.backends import cpu_features, cpu_kernels
from engine.types import SamplingParams
from tests.support import Loaded, chat_ids, make_engine, run_all

# the op-by-op pass of the none level attends token by token: minutes on a loaded 2-core machine
pytestmark = pytest.mark.timeout(3 * 900)
LEVELS = cpu_features.available_levels()  # amx: the avx512_bf16 build with steps of 8 rows on AMX int8 tiles
STEPS = 6
QUESTION = ("You help a bird-watching club on the northern coast. On the cliffs this morning I watched a falcon dive "
            "very fast at a flock of pigeons over the harbour. What bird was it likely to be, and how fast can it "
            "fly? Answer in two sentences.")
MATES = ["Write a short poem about the sea at night.", "List three uses of copper in houses, with reasons.",
         "Why do cats purr? Explain briefly to a child who asked at dinner.", "Describe a train station at 8 am."]


@pytest.fixture(params=LEVELS)
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    from config import DEFAULT_CACHE_DIR

    if request.param != "none" and cpu_kernels.load(DEFAULT_CACHE_DIR.expanduser(), cap=request.param) is None:
        pytest.skip(f"no CPU kernels at {request.param}: {cpu_kernels.unsupported_reason()}")
    yield request.param


def mates_at(level: str) -> list[str]:
    """Batch mates: two at the none level (its op-by-op pass took 5-8 minutes of the suite with four), else four."""
    return MATES[:2] if level == "none" else MATES


def recorded(engine: Any) -> dict[str, list[torch.Tensor]]:
    """Every sampling row's logits, per request, in step order (the runner's own output, before sampling)."""
    logits: dict[str, list[torch.Tensor]] = defaultdict(list)
    run = engine.runner.run

    def keep(out: Any) -> torch.Tensor:
        rows = run(out)
        for i, item in enumerate(out.sampling):
            logits[item.seq.request_id].append(rows[i].clone())
        return rows

    engine.runner.run = keep
    return logits


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


def assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want) == STEPS, what
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{what}: step {step} differs by up to {(a - b).abs().max().item():.3g}"


def test_prompt_logits_are_the_same_whole_chunked_cached_and_batched(smollm2_q4_1: Loaded, level: str) -> None:
    tok = smollm2_q4_1.tokenizer
    prompt = chat_ids(tok, QUESTION)
    assert len(prompt) > 4 * 16  # several KV blocks, and chunks of 32 split it
    whole = make_engine(smollm2_q4_1, max_num_batched_tokens=512, kv_cache_bytes=32 << 20, cpu_isa=level)
    # the one-call step where the kernels build (every ISA level but none); the op-by-op pass at none
    one_call = whole.runner._forward.decoder(whole.runner.kv_cache) is not None
    assert one_call is (level != "none")
    logits = recorded(whole)
    run_all(whole, {"whole": (prompt, greedy())})
    run_all(whole, {"cached": (prompt, greedy())})  # every whole block but the last from the cache
    mates = {f"mate{i}": (chat_ids(tok, text), greedy()) for i, text in enumerate(mates_at(level))}
    run_all(whole, {**mates, "batched": (prompt, greedy())})
    one = (len(prompt) - 1) // 16 * 16 + 1  # whole cached blocks and one token: a decode-size step
    run_all(whole, {"one-short": (prompt[:one], greedy())})
    chunked = make_engine(smollm2_q4_1, max_num_batched_tokens=32, kv_cache_bytes=32 << 20, prefix_caching=False, cpu_isa=level)
    logits_chunked = recorded(chunked)
    run_all(chunked, {"chunked": (prompt, greedy())})
    run_all(chunked, {"one-short": (prompt[:one], greedy())})
    assert whole.stats().prefix_cache_hits_total >= 2 * (len(prompt) // 16 * 16 - 16)
    for name in ("cached", "batched"):
        assert_same_bits(logits[name], logits["whole"], name)
    assert_same_bits(logits_chunked["chunked"], logits["whole"], "chunked")
    assert_same_bits(logits["one-short"], logits_chunked["one-short"], "one token after cached blocks")


def test_mates_do_not_change_each_other(smollm2_q4_1: Loaded, level: str) -> None:
    """Each of several different prompts gets the same bits alone and sharing its steps with the others (mixed
    prefill and decode steps, rows at different places)."""
    tok = smollm2_q4_1.tokenizer
    prompts = {f"p{i}": chat_ids(tok, text) for i, text in enumerate([QUESTION, *mates_at(level)])}
    alone: dict[str, list[torch.Tensor]] = {}
    for rid, prompt in prompts.items():
        engine = make_engine(smollm2_q4_1, max_num_batched_tokens=512, kv_cache_bytes=64 << 20, prefix_caching=False, cpu_isa=level)
        logits = recorded(engine)
        run_all(engine, {rid: (prompt, greedy())})
        alone[rid] = logits[rid]
    engine = make_engine(smollm2_q4_1, max_num_batched_tokens=64, kv_cache_bytes=64 << 20, prefix_caching=False, cpu_isa=level)
    logits = recorded(engine)
    run_all(engine, {rid: (prompt, greedy()) for rid, prompt in prompts.items()})
    for rid in prompts:
        assert_same_bits(logits[rid], alone[rid], rid)


@pytest.mark.parametrize("formats", [{"*": "Q5_K", "attn_v": "Q6_K", "token_embd": "Q6_K"},
                                     {"*": "IQ4_XS", "attn_v": "IQ4_NL", "ffn_up": "IQ4_NL", "token_embd": "IQ4_NL"}],
                         ids=["q5_k_m-like", "iq4"])
def test_k_quant_files_same_bits_whole_chunked_and_batched(level: str, formats: dict[str, str], tmp_path: Path,
                                                           byte_level_tokenizer: Any) -> None:
    """A tiny Q5_K_M-like GGUF (Q5_K matmuls, Q6_K attn_v, a Q6_K embedding and tied head; rows of 256 and 512), and
    an IQ4 one (IQ4_XS, IQ4_NL v, up and embedding), kept quantized: a 100-token prompt's logits are bitwise the same
    computed whole (many-row steps: the super-block tiles of qdot_kquant.h take 64 activation rows at a time at K =
    512, ffn_down), in chunks of 16, and among three batch mates, on the one-call step (the op-by-op pass at none)."""
    from models import gguf_weights
    from tests.quant_blocks import write_tiny_gguf

    vocab = len(byte_level_tokenizer)
    write_tiny_gguf(tmp_path, formats, vocab=vocab + (-vocab) % 32)
    model = gguf_weights.load(tmp_path / "tiny.gguf", tmp_path, torch.float32)
    assert model.model.layers[0].self_attn.q_proj.qweight.type_name == formats["*"]
    loaded = Loaded(model, byte_level_tokenizer, 256)
    prompt = [(7 * i + 3) % 250 + 5 for i in range(100)]
    mates = {f"mate{i}": ([(11 * j + i) % 250 + 5 for j in range(20 + 30 * i)], greedy()) for i in range(3)}
    whole = make_engine(loaded, max_num_batched_tokens=512, kv_cache_bytes=16 << 20, prefix_caching=False,
                        model_impl="llama", cpu_isa=level)
    assert (whole.runner._forward.decoder(whole.runner.kv_cache) is not None) is (level != "none")
    logits = recorded(whole)
    run_all(whole, {"whole": (prompt, greedy())})
    run_all(whole, {**mates, "batched": (prompt, greedy())})
    chunked = make_engine(loaded, max_num_batched_tokens=16, kv_cache_bytes=16 << 20, prefix_caching=False,
                          model_impl="llama", cpu_isa=level)
    logits_chunked = recorded(chunked)
    run_all(chunked, {"chunked": (prompt, greedy())})
    assert_same_bits(logits["batched"], logits["whole"], "batched")
    assert_same_bits(logits_chunked["chunked"], logits["whole"], "chunked")
