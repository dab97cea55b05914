"""Same request, same bits over long contexts (issue 38, item 3): a prompt of several hundred to 1,500 tokens gives
bitwise the same logits at its last prompt token and at the greedy steps after it prefilled whole, in chunks of an
odd size, and token by token. The one-call step's prefill attention shares each 64-position chunk of keys and
values among up to kRowsPerItem (32) of a prompt's rows; these prompts span many chunks and many such row groups,
so a row's attention must not depend on which rows it was grouped with. The bundled SmolLM2 Q4_1 on each ISA level
the kernels build for here, and at `none` (the op-by-op pass) on a shorter prompt in shorter chunks: that pass has no
64-position chunks or 32-row groups (it attends token by token), so what it must show is that chunks continuing from
earlier ones' KV, and single tokens, give the whole prompt's bits. 400 tokens in chunks of 133 cross three chunk
edges (700 in chunks of 333 crossed two) in 400 token-by-token steps, not 700."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.backends import cpu_features, cpu_kernels
from engine.types import SamplingParams
from tests.engine.test_batch_invariance import recorded
from tests.support import Loaded, make_engine, run_all

pytestmark = pytest.mark.timeout(3 * 900)
LEVELS = cpu_features.available_levels()
STEPS = 2
NONE_PROMPT, NONE_CHUNK = 400, 133  # `none`: scalar steps, so fewer of them; still odd chunks, three edges
CASES = [(lv, n) for lv in LEVELS for n in ((NONE_PROMPT,) if lv == "none" else (700, 1500))]


@pytest.fixture
def level(request: pytest.FixtureRequest) -> Iterator[str]:
    from config import DEFAULT_CACHE_DIR

    if request.param != "none" and cpu_kernels.load(DEFAULT_CACHE_DIR.expanduser(), cap=request.param) is None:
        pytest.skip(f"no CPU kernels at {request.param}: {cpu_kernels.unsupported_reason()}")
    yield request.param


def long_prompt(vocab: int, n: int) -> list[int]:
    """n ordinary token ids, fixed by a seed (the model's answer does not matter, only its bits)."""
    g = torch.Generator().manual_seed(n)
    return torch.randint(1000, vocab - 1000, (n,), generator=g).tolist()


def logits_of(loaded: Loaded, prompt: list[int], level: str, budget: int) -> list[torch.Tensor]:
    """The prompt's sampling rows' logits with at most `budget` prompt tokens a step (chunked prefill)."""
    engine = make_engine(loaded, max_num_batched_tokens=budget, max_num_seqs=1, kv_cache_bytes=160 << 20,
                         prefix_caching=False, cpu_isa=level)
    logits = recorded(engine)
    run_all(engine, {"r": (prompt, SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))},
            max_steps=len(prompt) + 10 * STEPS)
    assert len(logits["r"]) == STEPS
    return logits["r"]


@pytest.mark.parametrize(("level", "n"), CASES, indirect=["level"])
def test_long_prompt_same_bits_whole_chunked_and_token_by_token(smollm2_q4_1: Loaded, level: str, n: int) -> None:
    prompt = long_prompt(smollm2_q4_1.model.config.vocab_size, n)
    whole = logits_of(smollm2_q4_1, prompt, level, 2048)
    assert all(torch.isfinite(t).all() for t in whole)
    chunk = NONE_CHUNK if level == "none" else 333
    for budget in (chunk, 1):  # odd chunks (their rows straddle 64-position chunks and 32-row groups); one at a time
        got = logits_of(smollm2_q4_1, prompt, level, budget)
        for step, (a, b) in enumerate(zip(got, whole, strict=True)):
            assert torch.equal(a, b), f"{n} tokens, {budget} a step: step {step} differs by {(a - b).abs().max()}"
