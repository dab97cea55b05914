"""Turns a scheduled step into one forward pass and returns the logits of the sequences that sample.

The forward passes, same inputs and outputs, and why there is more than one:
- llama: `engine.model.forward.LlamaFastForward`, the Llama family's forward on the model's own weights; picked by
  "auto" wherever it applies. Its decode-only steps run as one call of the C++ decoder (the same module's
  whole-step form, `Kernels.decoder`) where the backend has one (the CPU with Peregrine's kernels); prefill, mixed
  steps and devices without the kernels run the same module op by op. One forward, two granularities.
- generic: any Hugging Face causal LM whose attention goes through transformers' `AttentionInterface`
  (Llama, Mistral, Qwen, Phi, Gemma, ...). It must stay beside the fast one: the families and features the fast
  forward does not take (sliding windows, other blocks: `forward.supports`), and devices that compile the model as a
  whole (the TT backend's `forward_impl` says "generic": torch-ttnn compiles the Hugging Face module). The model is
  switched to the `peregrine_paged` attention and called on one packed row of tokens with explicit positions,
  `use_cache=False` (the paged cache is ours), and `logits_to_keep` set to the rows that sample, so the LM head
  only runs where a token is drawn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.backends.kernels import TORCH, Kernels
from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.model import attention
from engine.model import forward as llama_fast
from engine.model.attention import AttentionMetadata, PrefillChunk
from engine.model.kv_cache import KVCache
from engine.sampling import prompt_logprobs

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [1, total_tokens]
    positions: torch.Tensor  # [1, total_tokens]
    # [num_sampling + prompt rows] rows of the packed batch: SchedulerOutput.sampling order, then the rows of
    # engine.sampling.prompt_logprobs.spans(out) (only sequences that asked for prompt logprobs have any)
    logits_indices: torch.Tensor
    meta: AttentionMetadata


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, device: torch.device,
                 impl: str = "auto", kernels: Kernels = TORCH) -> None:
        attention.register()
        attention.check_supported(model)
        model.set_attn_implementation(attention.ATTN_IMPL)
        self.model = model.eval()
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.kernels = kernels
        self.decode_attention = kernels.decode_attention
        # decodes the kernel does not take (an int8 cache) attend by masked SDPA over gathered blocks
        self._masked = self.decode_attention is None or kv_cache.quantized
        self.impl = choose_impl(model, impl)
        self._forward: Forward = (
            llama_fast.LlamaFastForward(model, kernels) if self.impl == "llama" else self._generic
        )
        log.info("forward pass: %s", self.impl)

    @property
    def forward(self) -> Forward:
        """The forward pass `run` calls: LlamaFastForward for the Llama family, else the model's own."""
        return self._forward

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Returns logits [sum of num_rows, vocab] (float32) for `out.sampling`, in that order (an item with
        speculative proposals has 1 + len(draft) rows: its last token's, then each proposal's), followed by the rows
        of `prompt_logprobs.spans(out)` when a sequence asked for prompt logprobs."""
        inputs = self.prepare(out)
        logits = self._forward(inputs.input_ids[0], inputs.positions[0], inputs.meta, inputs.logits_indices)
        return logits.float()

    def _generic(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_indices: torch.Tensor) -> torch.Tensor:
        result = self.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=logits_indices,
            peregrine=meta,
        )
        return result.logits[0]

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        if all(s.num_tokens == 1 and s.seq.params.prompt_logprobs is None for s in out.scheduled):
            return self.prepare_decodes(out.scheduled)
        return self.prepare_mixed(out)

    def prepare_mixed(self, out: SchedulerOutput) -> StepInputs:
        """Any step: decodes first, then prefill chunks, then the prompt-logprob rows."""
        items = [s for s in out.scheduled if s.num_tokens == 1] + [s for s in out.scheduled if s.num_tokens > 1]
        self.kv_cache.ensure_zeroed(1 + max(max(s.seq.block_table) for s in items))
        offsets, ids, positions, slots = {}, [], [], []
        for item in items:
            offsets[id(item)] = len(ids)
            ids += _tokens(item)
            positions += range(item.start, item.start + item.num_tokens)
            slots += self._slots(item.seq.block_table, item.start, item.start + item.num_tokens)
        decodes = [s for s in items if s.num_tokens == 1]
        prefills = tuple(self._chunk(s, offsets[id(s)]) for s in items if s.num_tokens > 1)
        logits_rows = [r for s in out.sampling for r in range(offsets[id(s)] + s.num_tokens - s.num_rows,
                                                                offsets[id(s)] + s.num_tokens)]
        for span in prompt_logprobs.spans(out):
            first = offsets[id(span.item)] + span.offset
            logits_rows += range(first, first + span.count)
        tables = self._decode_block_tables(decodes) if decodes else None
        lengths = self._tensor([s.start + 1 for s in decodes]) if decodes else None
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=self._tensor(slots),
            num_decodes=len(decodes),
            decode_block_tables=tables,
            decode_mask=self._decode_mask(lengths, tables) if decodes and self._masked else None,
            prefills=prefills,
            decode_lengths=lengths,
            decode_kernel=self.decode_attention,
        )
        return StepInputs(self._tensor(ids)[None], self._tensor(positions)[None], self._tensor(logits_rows), meta)

    def prepare_decodes(self, items: list[ScheduledSeq]) -> StepInputs:
        """`prepare_mixed` for a step of one token per sequence (every decode step): the same inputs, built as views
        of one tensor (token ids, positions, slots, lengths, logits rows, block tables) instead of six (~10 us less
        Python a step, more when the weight stream has left the caches cold)."""
        n = len(items)
        self.kv_cache.ensure_zeroed(1 + max(max(s.seq.block_table) for s in items))
        tables = [self._decode_table(s) for s in items]
        width = max(len(t) for t in tables)
        null = self.kv_cache.null_block
        rows = [i for i, s in enumerate(items) if s.samples]
        flat = [s.seq.tokens_in(s.start, s.start + 1)[0] for s in items]
        flat += [s.start for s in items]
        flat += [self._slots(t, s.start, s.start + 1)[0] for s, t in zip(items, tables, strict=True)]
        flat += [s.start + 1 for s in items]
        flat += rows
        for t in tables:
            flat += t + [null] * (width - len(t))
        ids, positions, slots, lengths, logits_rows, tables_flat = self._tensor(flat).split(
            (n, n, n, n, len(rows), n * width))
        block_tables = tables_flat.view(n, width)
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=slots,
            num_decodes=n,
            decode_block_tables=block_tables,
            decode_mask=self._decode_mask(lengths, block_tables) if self._masked else None,
            prefills=(),
            decode_lengths=lengths,
            decode_kernel=self.decode_attention,
        )
        return StepInputs(ids[None], positions[None], logits_rows, meta)

    def _slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _chunk(self, item: ScheduledSeq, offset: int) -> PrefillChunk:
        end = item.start + item.num_tokens
        return PrefillChunk(offset, item.num_tokens, item.start,
                            self._tensor(item.seq.block_table[: -(-end // self.block_size)]), bool(item.draft))

    def _decode_block_tables(self, decodes: list[ScheduledSeq]) -> torch.Tensor:
        """[batch, max_blocks] block tables of the decoding sequences, padded with the null block."""
        rows = [self._decode_table(s) for s in decodes]
        width = max(len(row) for row in rows)
        null = self.kv_cache.null_block
        return self._tensor([row + [null] * (width - len(row)) for row in rows])

    def _decode_table(self, item: ScheduledSeq) -> list[int]:
        """The blocks a decoding sequence's context (its `start + 1` tokens) fills."""
        return item.seq.block_table[: item.start // self.block_size + 1]

    def _decode_mask(self, lengths: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        width = tables.shape[1] * self.block_size  # the gathered context: every table's blocks, padded
        mask = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
        return mask[:, None, None, :]  # [batch, 1, 1, max_blocks * block_size]

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)


def _tokens(item: ScheduledSeq) -> list[int]:
    """The token ids of an item's positions: the sequence's own, then its speculative proposals, if any."""
    own = item.seq.tokens_in(item.start, item.start + item.num_tokens - len(item.draft))
    return own + list(item.draft) if item.draft else own


def choose_impl(model: torch.nn.Module, impl: str) -> str:
    if impl not in ("auto", "generic", "llama"):
        raise ValueError(f"unknown model_impl {impl!r}: use auto, generic or llama")
    if impl == "llama" and not llama_fast.supports(model):
        raise ValueError(f"model_impl 'llama' does not support {type(model).__name__}; use generic or auto")
    if impl == "auto":
        return "llama" if llama_fast.supports(model) else "generic"
    return impl
