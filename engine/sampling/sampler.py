"""Batched sampling on the device: one row per sequence, each with its own parameters.

Order: min_tokens suppression, penalties (repetition, presence, frequency), logit bias, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> draw. Only the rows that sample are computed past the argmax. A draw
takes one uniform number per row (from the sequence's own generator when it has a seed, so a seeded sequence gets
the same tokens whatever else is in the batch) and inverts the row's cumulative distribution (racing a vocabulary
of Exp(1) noise instead cost ~0.7 ms a row on a CPU, more than a small model's decode step). Top-k, top-p and min-p
keep what is at or above a floor per row, found without sorting the vocabulary where it can be (`filter_probs`).
The results cross to the host in one copy per step. Logprobs are those of the model's raw distribution (before
penalties and temperature), like vLLM's default; for a row constrained by a grammar (engine/sampling/grammar.py), of the
masked distribution: its mask is applied first, to that row only.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from engine.backends.kernels import Argmax, argmax_torch
from engine.core.sequence import DraftRow, SampledToken, SampleRow, Sequence
from engine.sampling.grammar import apply_mask
from engine.types import SamplingParams

SeqKey = tuple[str, int]
MIN_LOGPROB = -9999.0  # a token a grammar forbids has logprob -inf; reported as this (JSON has no -inf), as vLLM


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: Collection[int],
                 argmax: Argmax | None = None) -> None:
        """`argmax`: row-wise argmax with torch.argmax's answers (the engine's `Kernels.argmax`)."""
        self._device = device
        self._argmax = argmax or argmax_torch
        self._eos = sorted(eos_token_ids)
        self._global = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[SeqKey, SeededStream] = {}

    def release(self, seq: Sequence) -> None:
        self._seeded.pop(seq.seq_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[SampleRow],
               masks: tuple[list[int], torch.Tensor] | None = None) -> list[SampledToken]:
        """logits: [batch, vocab] float32, one row per sequence in `seqs`.

        masks: (rows, forbidden) for constrained rows: bool [len(rows), vocab], the tokens their grammars forbid.
        They apply to those rows only (in place), first, so everything after (penalties, temperature, top-p,
        logprobs) sees the masked distribution; the other rows are untouched."""
        if not seqs:
            return []
        if masks is not None:
            logits = apply_mask(logits, *masks)
        raw = logits
        logits = self._process(logits, seqs)
        if masks is not None and logits is not raw:
            logits = _keep_allowed(logits, raw, masks[0])
        ids = self._choose(logits, seqs)  # [batch]
        return self._to_host(ids, raw, seqs)

    def _process(self, logits: torch.Tensor, seqs: list[SampleRow]) -> torch.Tensor:
        if any(len(s.output_token_ids) < s.params.min_tokens for s in seqs):
            logits = suppress_stops(logits, seqs, self._eos)
        if any(_has_penalty(s) for s in seqs):
            logits = apply_penalties(logits, seqs)
        if any(s.params.logit_bias for s in seqs):
            logits = apply_logit_bias(logits, seqs)
        return logits

    def _choose(self, logits: torch.Tensor, seqs: list[SampleRow]) -> torch.Tensor:
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not rows:
            return self._argmax(logits)
        drawing = [seqs[i] for i in rows]
        at = None if len(rows) == len(seqs) else torch.tensor(rows, device=logits.device)
        sub = logits if at is None else logits[at]
        temps = torch.tensor([s.params.temperature for s in drawing], device=logits.device, dtype=logits.dtype)
        probs = filter_probs(torch.softmax(sub / temps[:, None], dim=-1), [s.params for s in drawing])
        drawn = draw(probs, self._uniforms(drawing, probs.device))
        if at is None:
            return drawn
        return self._argmax(logits).index_copy_(0, at, drawn)

    def _uniforms(self, seqs: list[SampleRow], device: torch.device) -> torch.Tensor:
        """One U[0, 1) number per row: a seeded sequence's from its own generator, the others' from the global one
        (one call for all of them, in row order)."""
        free = [s for s in seqs if s.params.seed is None]
        if len(free) == len(seqs):
            return torch.rand(len(seqs), device=device, generator=self._global)
        shared = iter(torch.rand(len(free), device=device, generator=self._global).split(1)) if free else iter(())
        return torch.cat([next(shared) if s.params.seed is None else self._seeded_uniform(s) for s in seqs])

    def _seeded_uniform(self, row: SampleRow) -> torch.Tensor:
        """The number of the row's output position; positions before the sequence's own output length are done."""
        done = len(row.seq.output_token_ids) if isinstance(row, DraftRow) else len(row.output_token_ids)
        return self._stream(row).at(len(row.output_token_ids), done)

    def _stream(self, seq: SampleRow) -> SeededStream:
        stream = self._seeded.get(seq.seq_id)
        if stream is None:
            assert seq.params.seed is not None
            gen = torch.Generator(device=self._device).manual_seed(seq.params.seed + seq.index)
            stream = self._seeded[seq.seq_id] = SeededStream(gen)
        return stream

    def _to_host(self, ids: torch.Tensor, raw: torch.Tensor, seqs: list[SampleRow]) -> list[SampledToken]:
        wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        if not wanted:
            return [SampledToken(t) for t in ids.tolist()]  # the one device-to-host copy
        k = max(wanted)
        logprobs = torch.log_softmax(raw.float(), dim=-1)
        chosen = logprobs.gather(1, ids[:, None]).clamp(min=MIN_LOGPROB)
        top = logprobs.topk(k, dim=-1) if k > 0 else None
        parts = [ids[:, None].double(), chosen.double()]
        if top is not None:
            parts += [top.indices.double(), top.values.clamp(min=MIN_LOGPROB).double()]
        rows = torch.cat(parts, dim=1).tolist()  # the one device-to-host copy
        return [_unpack(row, seq.params.logprobs, k) for row, seq in zip(rows, seqs, strict=True)]


def _keep_allowed(logits: torch.Tensor, masked: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A constrained row that min_tokens left with no token at all gets its grammar's choices back."""
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    dead = torch.isneginf(logits.index_select(0, idx)).all(dim=1)
    if bool(dead.any()):
        dead_rows = idx[dead]
        logits = logits.clone()
        logits[dead_rows] = masked[dead_rows]
    return logits


def _unpack(row: list[float], asked: int | None, k: int) -> SampledToken:
    token_id = int(row[0])
    if asked is None:
        return SampledToken(token_id)
    top = tuple((int(row[2 + j]), row[2 + k + j]) for j in range(asked))
    return SampledToken(token_id, row[1], top)


def _has_penalty(seq: SampleRow) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def suppress_stops(logits: torch.Tensor, seqs: list[SampleRow], eos: list[int]) -> torch.Tensor:
    """Forbid EOS and stop token ids for sequences that have not reached min_tokens yet."""
    logits = logits.clone()
    for i, seq in enumerate(seqs):
        if len(seq.output_token_ids) < seq.params.min_tokens:
            banned = [t for t in (*eos, *seq.params.stop_token_ids) if t < logits.shape[1]]
            logits[i, banned] = float("-inf")
    return logits


def token_counts(seqs: list[SampleRow], vocab: int, device: torch.device, prompt: bool) -> torch.Tensor:
    """[batch, vocab] counts of the output tokens (plus prompt tokens when `prompt`) of each sequence."""
    lists = [(s.prompt_token_ids if prompt else []) + s.output_token_ids for s in seqs]
    width = max(1, max(len(t) for t in lists))
    padded = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for i, toks in enumerate(lists):
        padded[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    counts = torch.zeros((len(seqs), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, seqs: list[SampleRow]) -> torch.Tensor:
    """Repetition (HF: divide positive / multiply negative logits of seen tokens, prompt included), then
    OpenAI presence and frequency penalties over the generated tokens."""
    vocab, device = logits.shape[1], logits.device
    rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=device)[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in seqs], device=device)[:, None]
    frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=device)[:, None]
    out_counts = token_counts(seqs, vocab, device, prompt=False)
    seen = token_counts(seqs, vocab, device, prompt=True) > 0
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency * out_counts - presence * (out_counts > 0).float()


def apply_logit_bias(logits: torch.Tensor, seqs: list[SampleRow]) -> torch.Tensor:
    logits = logits.clone()
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            ids = torch.tensor([t for t in bias if 0 <= t < logits.shape[1]], dtype=torch.long)
            vals = torch.tensor([bias[t] for t in bias if 0 <= t < logits.shape[1]], dtype=logits.dtype)
            logits[i, ids.to(logits.device)] += vals.to(logits.device)
    return logits


FIRST_RANKS = 64  # top-p looks for its cut among a row's best 64 first, then sorts the row


def filter_probs(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p drop, per row: [rows, vocab] -> [rows, vocab]. Each filter keeps the
    tokens at or above a floor, so a row keeps what is at or above the highest of its floors (the best token
    always survives; a tie at a floor is kept whole, as in vLLM):
    - top-k: the k-th best probability;
    - top-p: the smallest probability of the shortest run of best tokens whose mass reaches top_p (a token is
      kept while the mass ranked above it is below top_p);
    - min-p: min_p x the best probability.
    Nothing is sorted whole unless top-p needs more than the best FIRST_RANKS tokens: `torch.topk` of a few
    dozen is ~50 us a row on a CPU, `torch.sort` of 49k probabilities ~3 ms (numpy's sort, used there, ~0.1 ms).
    A row's floors depend on that row alone."""
    vocab, device, dtype = probs.shape[1], probs.device, probs.dtype
    floors = []
    if any(x.min_p > 0.0 for x in params):
        floors.append(torch.tensor([x.min_p for x in params], device=device, dtype=dtype) * probs.amax(dim=-1))
    has_k = [0 < x.top_k < vocab for x in params]
    top_p = [x.top_p for x in params]
    if any(has_k) or min(top_p) < 1.0:
        best = probs.topk(min(vocab, max([FIRST_RANKS] + [x.top_k for x in params])), dim=-1).values
        if any(has_k):
            kth = torch.tensor([x.top_k - 1 if k else 0 for x, k in zip(params, has_k, strict=True)], device=device)
            no_k = torch.tensor([not k for k in has_k], device=device)
            floors.append(best.gather(1, kth[:, None])[:, 0].masked_fill_(no_k, 0.0))
        if min(top_p) < 1.0:
            floors.append(_nucleus_floors(probs, best, top_p))
    if not floors:
        return probs
    floor = floors[0] if len(floors) == 1 else torch.stack(floors).amax(dim=0)
    return probs.masked_fill(probs < floor[:, None], 0.0)


def _nucleus_floors(probs: torch.Tensor, best: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Per row, the smallest probability top-p keeps (0 where top_p is 1): the first value, best first, at which the
    running mass reaches top_p. Found among the row's best values (`best`, [rows, width], descending) when it falls
    there, else in the whole row, sorted."""
    cut = torch.tensor(top_p, device=probs.device, dtype=probs.dtype)
    floors, found = _first_reaching(best, cut)
    for i in (~found).nonzero()[:, 0].tolist() if best.shape[1] < probs.shape[1] else []:
        if top_p[i] < 1.0:
            floors[i] = _first_reaching(_sorted_descending(probs[i])[None], cut[i : i + 1])[0][0]
    return floors.masked_fill(cut >= 1.0, 0.0)


def _first_reaching(values: torch.Tensor, cut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [rows, width] descending, cut [rows] -> (each row's first value at which the running mass reaches its
    cut, the last value where none does; whether one did)."""
    at = torch.searchsorted(values.cumsum(dim=-1), cut[:, None])[:, 0]
    return values.gather(1, at.clamp(max=values.shape[1] - 1)[:, None])[:, 0], at < values.shape[1]


def _sorted_descending(row: torch.Tensor) -> torch.Tensor:
    if row.device.type == "cpu":  # torch.sort of a 49k row takes ~3 ms on a CPU, numpy's sort ~0.1 ms
        return torch.from_numpy(np.sort(row.numpy())).flip(0)
    return row.sort(descending=True).values


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column of each row where its cumulative sum first passes u x its total: a draw in proportion to the row's
    (unnormalized, non-negative) values. A value of 0 is never drawn: only a strict rise of the cumulative sum is.
    probs [rows, width], u [rows] in [0, 1) -> [rows] long."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)  # NaN rows: in range


class SeededStream:
    """A seeded sequence's random numbers, indexed by output position: the token at position p is drawn with the
    generator's p-th number, however many rows asked for it (speculative decoding samples rows for positions it
    then discards; their numbers are kept for when those positions are sampled again). Plain decoding asks for
    each position once, in order: one draw each, as before."""

    def __init__(self, gen: torch.Generator) -> None:
        self._gen = gen
        self._base = 0  # the output position of ahead[0]
        self._ahead: list[torch.Tensor] = []  # drawn, for positions base, base + 1, ...

    def at(self, position: int, done: int) -> torch.Tensor:
        """The [1] uniform number of output `position`; the numbers of positions before `done` are forgotten (no
        row asks for them again: a sequence's output only grows)."""
        drop = min(max(0, done - self._base), len(self._ahead))
        del self._ahead[:drop]
        self._base += drop
        while self._base + len(self._ahead) <= position:
            self._ahead.append(torch.rand(1, device=self._gen.device, generator=self._gen))
        return self._ahead[position - self._base]
