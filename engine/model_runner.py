"""Turns a scheduled step into one forward pass and returns the logits of the sequences that sample.

Works with any Hugging Face causal LM whose attention goes through transformers' `AttentionInterface`
(Llama, Mistral, Qwen, Phi, Gemma, ...): the model is switched to the `peregrine_paged` implementation and
called on one packed row of tokens with explicit positions, `use_cache=False` (the paged cache is ours), and
`logits_to_keep` set to the rows that sample, so the LM head only runs where a token is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import attention
from engine.attention import AttentionMetadata, PrefillChunk
from engine.kv_cache import KVCache
from engine.scheduler import ScheduledSeq, SchedulerOutput


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [1, total_tokens]
    positions: torch.Tensor  # [1, total_tokens]
    logits_indices: torch.Tensor  # [num_sampling] rows of the packed batch, in SchedulerOutput.sampling order
    meta: AttentionMetadata


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device) -> None:
        attention.register()
        model.set_attn_implementation(attention.ATTN_IMPL)
        self.model = model.eval()
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Returns logits [num_sampling, vocab] (float32) for `out.sampling`, in that order."""
        inputs = self.prepare(out)
        result = self.model(
            input_ids=inputs.input_ids,
            position_ids=inputs.positions,
            use_cache=False,
            logits_to_keep=inputs.logits_indices,
            peregrine=inputs.meta,
        )
        return result.logits[0].float()

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        items = [s for s in out.scheduled if s.num_tokens == 1] + [s for s in out.scheduled if s.num_tokens > 1]
        offsets, ids, positions, slots = {}, [], [], []
        for item in items:
            offsets[id(item)] = len(ids)
            ids += item.seq.tokens_in(item.start, item.start + item.num_tokens)
            positions += range(item.start, item.start + item.num_tokens)
            slots += self._slots(item.seq.block_table, item.start, item.start + item.num_tokens)
        decodes = [s for s in items if s.num_tokens == 1]
        prefills = tuple(self._chunk(s, offsets[id(s)]) for s in items if s.num_tokens > 1)
        logits_rows = [offsets[id(s)] + s.num_tokens - 1 for s in out.sampling]
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=self._tensor(slots),
            num_decodes=len(decodes),
            decode_slots=self._decode_slots(decodes) if decodes else None,
            decode_mask=self._decode_mask(decodes) if decodes else None,
            prefills=prefills,
        )
        return StepInputs(self._tensor(ids)[None], self._tensor(positions)[None], self._tensor(logits_rows), meta)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _chunk(self, item: ScheduledSeq, offset: int) -> PrefillChunk:
        end = item.start + item.num_tokens
        context = self._tensor(self._slots(item.seq.block_table, 0, end)) if item.start else None
        return PrefillChunk(offset, item.num_tokens, item.start, context)

    def _decode_slots(self, decodes: list[ScheduledSeq]) -> torch.Tensor:
        """[batch, max_ctx] slots of each decoding sequence's context, padded with the null slot."""
        width = max(s.start + 1 for s in decodes)
        rows = [self._slots(s.seq.block_table, 0, s.start + 1) for s in decodes]
        null = self.kv_cache.null_slot
        return self._tensor([row + [null] * (width - len(row)) for row in rows])

    def _decode_mask(self, decodes: list[ScheduledSeq]) -> torch.Tensor:
        lengths = self._tensor([s.start + 1 for s in decodes])
        width = int(max(s.start + 1 for s in decodes))
        mask = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
        return mask[:, None, None, :]  # [batch, 1, 1, max_ctx]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
