"""Batched sampling on the device: one row per sequence, each with its own parameters.

Order: min_tokens suppression, penalties (repetition, presence, frequency), logit bias, then greedy argmax or
temperature -> top-k -> top-p -> min-p -> draw. Draws use the exponential race (argmax of p / q, q ~ Exp(1)), with
noise from the sequence's own generator when it has a seed, so a seeded sequence gets the same tokens whatever
else is in the batch. The results cross to the host in one copy per step. Logprobs are those of the model's raw
distribution (before penalties and temperature), like vLLM's default; for a row constrained by a grammar
(engine/grammar.py), of the masked distribution: its mask is applied first, to that row only.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine.grammar import apply_mask
from engine.kernels import Argmax, argmax_torch
from engine.sequence import Sequence

SeqKey = tuple[str, int]
MIN_LOGPROB = -9999.0  # a token a grammar forbids has logprob -inf; reported as this (JSON has no -inf), as vLLM


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # set when the sequence asked for logprobs
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: Collection[int],
                 argmax: Argmax | None = None) -> None:
        """`argmax`: row-wise argmax with torch.argmax's answers (the engine's `Kernels.argmax`)."""
        self._device = device
        self._argmax = argmax or argmax_torch
        self._eos = sorted(eos_token_ids)
        self._global = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[SeqKey, torch.Generator] = {}

    def release(self, seq: Sequence) -> None:
        self._seeded.pop(seq.seq_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
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

    def _process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        if any(len(s.output_token_ids) < s.params.min_tokens for s in seqs):
            logits = suppress_stops(logits, seqs, self._eos)
        if any(_has_penalty(s) for s in seqs):
            logits = apply_penalties(logits, seqs)
        if any(s.params.logit_bias for s in seqs):
            logits = apply_logit_bias(logits, seqs)
        return logits

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        greedy = self._argmax(logits)
        if all(s.params.greedy for s in seqs):
            return greedy
        temps = torch.tensor([s.params.temperature if not s.params.greedy else 1.0 for s in seqs],
                             device=logits.device, dtype=logits.dtype)
        probs = filter_probs(torch.softmax(logits / temps[:, None], dim=-1), seqs)
        drawn = self._argmax(probs / self._noise(probs, seqs))
        is_greedy = torch.tensor([s.params.greedy for s in seqs], device=logits.device)
        return torch.where(is_greedy, greedy, drawn)

    def _noise(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Exp(1) noise, [batch, vocab]: a seeded sequence's row comes from its own generator."""
        noise = torch.ones_like(probs)
        free_rows = [i for i, s in enumerate(seqs) if not s.params.greedy and s.params.seed is None]
        if free_rows:
            rows = torch.empty((len(free_rows), probs.shape[1]), device=probs.device, dtype=probs.dtype)
            noise[free_rows] = rows.exponential_(generator=self._global)
        for i, seq in enumerate(seqs):
            if not seq.params.greedy and seq.params.seed is not None:
                noise[i].exponential_(generator=self._generator(seq))
        return noise

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._seeded.get(seq.seq_id)
        if gen is None:
            gen = torch.Generator(device=self._device).manual_seed(seq.params.seed + seq.index)
            self._seeded[seq.seq_id] = gen
        return gen

    def _to_host(self, ids: torch.Tensor, raw: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
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


def _has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def suppress_stops(logits: torch.Tensor, seqs: list[Sequence], eos: list[int]) -> torch.Tensor:
    """Forbid EOS and stop token ids for sequences that have not reached min_tokens yet."""
    logits = logits.clone()
    for i, seq in enumerate(seqs):
        if len(seq.output_token_ids) < seq.params.min_tokens:
            banned = [t for t in (*eos, *seq.params.stop_token_ids) if t < logits.shape[1]]
            logits[i, banned] = float("-inf")
    return logits


def token_counts(seqs: list[Sequence], vocab: int, device: torch.device, prompt: bool) -> torch.Tensor:
    """[batch, vocab] counts of the output tokens (plus prompt tokens when `prompt`) of each sequence."""
    lists = [(s.prompt_token_ids if prompt else []) + s.output_token_ids for s in seqs]
    width = max(1, max(len(t) for t in lists))
    padded = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for i, toks in enumerate(lists):
        padded[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    counts = torch.zeros((len(seqs), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
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


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    logits = logits.clone()
    for i, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            ids = torch.tensor([t for t in bias if 0 <= t < logits.shape[1]], dtype=torch.long)
            vals = torch.tensor([bias[t] for t in bias if 0 <= t < logits.shape[1]], dtype=logits.dtype)
            logits[i, ids.to(logits.device)] += vals.to(logits.device)
    return logits


def filter_probs(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Zero out what top-k, top-p and min-p exclude, per row. [batch, vocab] -> [batch, vocab]."""
    p = [s.params for s in seqs]
    if all(x.top_k <= 0 and x.top_p >= 1.0 and x.min_p <= 0.0 for x in p):
        return probs
    device, vocab = probs.device, probs.shape[1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    top_k = torch.tensor([x.top_k if x.top_k > 0 else vocab for x in p], device=device)[:, None]
    top_p = torch.tensor([x.top_p if x.top_p < 1.0 else 2.0 for x in p], device=device, dtype=probs.dtype)[:, None]
    min_p = torch.tensor([x.min_p for x in p], device=device, dtype=probs.dtype)[:, None]
    rank = torch.arange(vocab, device=device)[None, :]
    before = sorted_p.cumsum(dim=-1) - sorted_p  # probability mass ranked above each token
    drop = (rank >= top_k) | (before >= top_p) | (sorted_p < min_p * sorted_p[:, :1])
    drop[:, 0] = False  # the best token always survives
    kept = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, kept)
