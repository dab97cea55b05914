"""Prompt logprobs on the device: `score` turns the kept logits rows of a step's spans (engine/core/prompt_logprobs.py:
which rows, and the per-sequence record) into (token logprob, rank, top-k) with one device-to-host copy."""

from __future__ import annotations

import torch

from engine.core.prompt_logprobs import PromptLogprobs, Scored, Span, spans

__all__ = ["PromptLogprobs", "Scored", "Span", "score", "spans"]


@torch.inference_mode()
def score(logits: torch.Tensor, step_spans: list[Span]) -> list[list[Scored]]:
    """logits: [sum(span.count), vocab], the spans' rows in order. Returns the scored tokens per span."""
    targets = [t for s in step_spans for t in s.item.seq.prompt_token_ids[s.first + 1 : s.first + 1 + s.count]]
    k = max(s.item.seq.params.prompt_logprobs or 0 for s in step_spans)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    ids = torch.tensor(targets, dtype=torch.long, device=logits.device)[:, None]
    chosen = logprobs.gather(1, ids)  # [rows, 1]
    rank = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    parts = [chosen.double(), rank.double()]
    if k > 0:
        top = logprobs.topk(k, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    rows = iter(torch.cat(parts, dim=1).tolist())  # the one device-to-host copy
    out = []
    for s in step_spans:
        asked = s.item.seq.params.prompt_logprobs or 0
        tokens = s.item.seq.prompt_token_ids[s.first + 1 : s.first + 1 + s.count]
        out.append([_unpack(t, next(rows), asked, k) for t in tokens])
    return out


def _unpack(token_id: int, row: list[float], asked: int, k: int) -> Scored:
    top = tuple((int(row[2 + j]), row[2 + k + j]) for j in range(asked))
    return Scored(token_id, row[0], int(row[1]), top)
