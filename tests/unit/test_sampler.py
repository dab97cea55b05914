"""Batched sampler on hand-made logits (torch, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.core.sequence import Sequence
from engine.sampling.sampler import FIRST_RANKS, Sampler, apply_penalties, draw, filter_probs
from engine.types import SamplingParams

CPU = torch.device("cpu")
EOS = 0
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="needs a CUDA device"))]


def seq(params: SamplingParams, outputs: list[int] | None = None, prompt: list[int] | None = None,
        rid: str = "r", index: int = 0) -> Sequence:
    s = Sequence(rid, index, prompt or [1], params, max_tokens=100)
    s.output_token_ids = list(outputs or [])
    return s


def sampler(device: str = "cpu") -> Sampler:
    return Sampler(torch.device(device), seed=0, eos_token_ids=[EOS])


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2, 0.0], [5.0, 1.0, 0.0, 0.0]])
    seqs = [seq(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert [t.token_id for t in sampler().sample(logits, seqs)] == [1, 0]


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0]] * 3)
    seqs = [seq(SamplingParams(temperature=0.0)), seq(SamplingParams(temperature=5.0)),
            seq(SamplingParams(temperature=0.0))]
    for _ in range(20):
        got = [t.token_id for t in sampler().sample(logits, seqs)]
        assert got[0] == 2 and got[2] == 2


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.clamp_min(1e-12).log().repeat(4000, 1)
    seqs = [seq(SamplingParams(temperature=1.0)) for _ in range(4000)]
    ids = torch.tensor([t.token_id for t in sampler().sample(logits, seqs)])
    freq = torch.bincount(ids, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.04), freq


def kept_ids(probs: torch.Tensor, params: list[SamplingParams]) -> list[list[int]]:
    """The token ids `filter_probs` leaves each row (probability > 0), sorted."""
    return [row.nonzero()[:, 0].tolist() for row in filter_probs(probs, params)]


def sorted_reference(probs: torch.Tensor, x: SamplingParams) -> list[int]:
    """One row's kept ids by the definition: a full sort, then top-k, top-p (mass ranked above < top_p), min-p."""
    order = probs.argsort(descending=True).tolist()
    kept, before = [], 0.0
    for rank, token in enumerate(order):
        p = float(probs[token])
        if rank == 0 or ((x.top_k <= 0 or rank < x.top_k) and (x.top_p >= 1.0 or before < x.top_p)
                         and p >= x.min_p * float(probs[order[0]])):
            kept.append(token)
        before += p
    return sorted(kept)


def test_top_k_top_p_min_p_filter_per_row() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 4)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(min_p=0.6), SamplingParams()]
    assert kept_ids(probs, params) == [
        [0, 1],  # top-k 2
        [0, 1],  # 0.4 < 0.6, 0.4 + 0.3 reaches it
        [0, 1],  # >= 0.6 * 0.4
        [0, 1, 2, 3],  # no filter
    ]
    assert kept_ids(probs[2:], params[2:]) == [[0, 1], [0, 1, 2, 3]]  # min-p alone: nothing ranked


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0])
def test_filters_match_a_full_sort_when_the_nucleus_is_wider_than_the_first_ranks(scale: float, device: str) -> None:
    """Flat rows (scale 0.5) need far more than FIRST_RANKS tokens for top-p: their whole row is sorted (numpy on
    a CPU, torch.sort elsewhere)."""
    gen = torch.Generator().manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(6, 5000, generator=gen) * scale, dim=-1).to(device)
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.99, min_p=0.001), SamplingParams(top_k=300),
              SamplingParams(top_k=10, top_p=0.5), SamplingParams(top_p=0.3), SamplingParams(top_k=5000, top_p=0.95)]
    got = kept_ids(probs, params)
    assert got == [sorted_reference(row, x) for row, x in zip(probs.cpu(), params, strict=True)]
    if scale == 0.5:
        assert len(got[0]) > FIRST_RANKS and len(got[1]) > 8 * FIRST_RANKS


@pytest.mark.parametrize("device", DEVICES)
def test_a_draw_follows_the_values_and_never_picks_a_zero(device: str) -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]], device=device).repeat(3, 1)
    edges = draw(probs, torch.tensor([0.0, 0.999999, 0.5], device=device))
    assert edges.tolist() == [1, 4, 3]  # u = 0: the first nonzero; u -> 1: the last nonzero
    u = torch.rand(20000, generator=torch.Generator().manual_seed(3)).to(device)
    picked = draw(probs[:1].expand(20000, -1), u)
    freq = torch.bincount(picked, minlength=6).float() / 20000
    assert torch.allclose(freq, probs[0], atol=0.02), freq


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_sampling_draws_from_the_renormalized_nucleus(device: str) -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1).to(device)
    seqs = [seq(SamplingParams(temperature=1.0, top_p=0.7)) for _ in range(4000)]
    ids = torch.tensor([t.token_id for t in sampler(device).sample(logits, seqs)])
    freq = torch.bincount(ids, minlength=4).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.04), freq


def test_top_k_one_is_greedy_even_at_high_temperature() -> None:
    logits = torch.randn(64, 50)
    seqs = [seq(SamplingParams(temperature=3.0, top_k=1)) for _ in range(64)]
    got = [t.token_id for t in sampler().sample(logits, seqs)]
    assert got == logits.argmax(-1).tolist()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("own", "mates_params"), [
    ({}, {}), ({"top_p": 0.9}, {}), ({}, {"top_p": 0.8}), ({"top_p": 0.9, "top_k": 50}, {"top_k": 20}),
    ({"min_p": 0.05}, {"temperature": 0.0}),
])
def test_seeded_rows_do_not_depend_on_batch_mates(own: dict, mates_params: dict, device: str) -> None:
    """Whatever the mates ask for (drawn from the whole vocabulary, ranked, greedy), a seeded row draws the same."""
    torch.manual_seed(0)
    row = torch.randn(1, 100)
    params = SamplingParams(temperature=1.0, seed=42, **own)

    def draws(batch_mates: int) -> list[int]:
        s, target = sampler(device), seq(params, rid="seeded")
        mates = [seq(SamplingParams(**{"temperature": 1.0, **mates_params}), rid=f"m{i}") for i in range(batch_mates)]
        out = []
        for _ in range(10):
            logits = torch.cat([torch.randn(batch_mates, 100), row]).to(device)
            out.append(s.sample(logits, [*mates, target])[-1].token_id)
            target.output_token_ids.append(out[-1])  # as the engine does: the next draw is the next position's
        return out

    assert draws(0) == draws(3) == draws(7)
    assert len(set(draws(0))) > 1  # it does sample


def test_n_sequences_with_a_seed_differ_by_index() -> None:
    logits = torch.zeros(2, 1000)
    params = SamplingParams(temperature=1.0, seed=7)
    a, b = sampler().sample(logits, [seq(params, index=0), seq(params, index=1)])
    assert a.token_id != b.token_id


def test_penalties() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    rep = apply_penalties(logits, [seq(SamplingParams(repetition_penalty=2.0), outputs=[0], prompt=[1])])
    assert rep.tolist() == [[1.0, -4.0, 1.0, 1.0]]
    freq = apply_penalties(logits, [seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
                                        outputs=[2, 2, 3], prompt=[1])])
    assert freq.tolist() == [[2.0, -2.0, 1.0 - 1.0 - 0.25, 1.0 - 0.5 - 0.25]]


def test_logit_bias_and_min_tokens() -> None:
    logits = torch.tensor([[9.0, 1.0, 0.0]])
    biased = sampler().sample(logits, [seq(SamplingParams(temperature=0.0, logit_bias={2: 100.0}))])
    assert biased[0].token_id == 2
    held = sampler().sample(logits, [seq(SamplingParams(temperature=0.0, min_tokens=2), outputs=[1])])
    assert held[0].token_id == 1  # EOS (id 0) is forbidden before min_tokens
    free = sampler().sample(logits, [seq(SamplingParams(temperature=0.0, min_tokens=2), outputs=[1, 1])])
    assert free[0].token_id == EOS


def test_logprobs_are_the_raw_log_softmax_with_top_k() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    seqs = [seq(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=1.5), outputs=[1]),
            seq(SamplingParams(temperature=0.0))]
    first, second = sampler().sample(logits, seqs)
    ref = torch.log_softmax(logits[0], -1)
    assert first.logprob == pytest.approx(float(ref[first.token_id]), abs=1e-6)
    assert [t for t, _ in first.top] == [1, 2]
    assert [lp for _, lp in first.top] == pytest.approx(ref[[1, 2]].tolist(), abs=1e-6)
    assert second.logprob is None and second.top == ()
    assert math.isclose(sum(math.exp(v) for v in ref.tolist()), 1.0, rel_tol=1e-6)


def test_seeded_numbers_follow_the_output_position_through_verification_rows() -> None:
    """Speculative decoding samples rows for positions it may then discard: a seeded sequence's token at output
    position p is drawn with its generator's p-th number however many rows asked for p, so verification keeps
    exactly the tokens plain decoding draws."""
    from engine.core.sequence import DraftRow

    torch.manual_seed(0)
    logits = torch.randn(12, 50) * 2  # position p's logits: row p
    params = SamplingParams(temperature=1.0, seed=9)
    plain_seq, plain = seq(params), sampler()
    want = []
    for p in range(12):
        want.append(plain.sample(logits[p : p + 1], [plain_seq])[0].token_id)
        plain_seq.output_token_ids.append(want[-1])
    spec_seq, spec = seq(params), sampler()
    while len(spec_seq.output_token_ids) < 12:
        n = len(spec_seq.output_token_ids)
        depth = min(4, 12 - n)
        draft = [want[n + i] if i % 3 != 2 else -1 for i in range(depth - 1)]  # some proposals wrong
        rows = [spec_seq] + [DraftRow(spec_seq, spec_seq.output_token_ids + draft[:i]) for i in range(1, depth)]
        got = [t.token_id for t in spec.sample(logits[n : n + depth], rows)]
        keep = 1
        while keep < depth and got[keep - 1] == draft[keep - 1]:
            keep += 1
        spec_seq.output_token_ids += got[:keep]
    assert spec_seq.output_token_ids == want
    assert len(set(want)) > 3  # it does sample
