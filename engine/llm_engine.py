"""The synchronous engine: one `step()` serves every running request by one token (or one prefill chunk; or, with
speculative decoding, by the proposed tokens it confirms plus one: engine/core/speculative.py).

`AsyncEngine` (engine/async_engine.py) runs `step()` in its own thread; tests and benchmarks may drive it
directly. The engine is built from a loaded model (models/engine_factory.py loads one from an `EngineConfig`: the
engine imports neither models/ nor config/).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from engine.backends import devices
from engine.core.block_manager import BlockManager
from engine.core.outputs import SequenceOutput
from engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.core.sequence import DraftRow, SampledToken, SampleRow, Sequence
from engine.core.speculative import (
    Acceptance,
    NgramProposer,
    Proposer,
    accepted_prefix,
    plan_lengths,
    until_stop,
)
from engine.core.step_cost import StepCost
from engine.draft import DraftModel, DraftProposer, check_same_vocabulary, kv_share
from engine.model.kv_cache import KVCache, KVCacheSpec, kv_cache_dtype, plan_num_blocks
from engine.model.quant import is_quantized
from engine.model.runner import ModelRunner
from engine.sampling import grammar, prompt_logprobs
from engine.sampling.sampler import Sampler
from engine.types import (
    MAX_LOGPROBS,
    EngineConfig,
    EngineStats,
    InvalidRequestError,
    PromptTooLongError,
    RequestOutput,
    SamplingParams,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Counters:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    spec_proposed_tokens: int = 0  # speculative proposals verified
    spec_accepted_tokens: int = 0  # of those, confirmed by the target model's own choice


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: Any, cfg: EngineConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, draft: DraftModel | None = None) -> None:
        """`draft`: the loaded draft model of `--speculative draft` (engine/draft.py); it must share `tokenizer`."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.backend = backend = devices.backend_for(cfg, device)  # every device decision: engine/backends/
        free = backend.free_memory_bytes()
        spec = _kv_spec(model, cfg, dtype)
        draft_spec = _kv_spec(draft.model, cfg, dtype) if draft is not None and cfg.speculative == "draft" else None
        part = 1.0 - kv_share(spec, draft_spec) if draft_spec is not None else 1.0
        self.kv_cache = _allocate_kv(spec, cfg, free, device, max_model_len, part)
        self.max_model_len = min(max_model_len, self.kv_cache.num_slots)
        self.blocks = BlockManager(self.kv_cache.num_blocks, cfg.block_size, cfg.prefix_caching,
                                   window=self.kv_cache.release_window)  # windowed layers' dead blocks given back
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.kernels = backend.kernels(dtype)  # chosen once, passed once
        self.runner = ModelRunner(backend.prepare(model, self.kernels), self.kv_cache, device,
                                  backend.forward_impl(cfg.model_impl), self.kernels)
        head = model.get_output_embeddings()
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])  # quantized: no .weight
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.sampler = Sampler(device, cfg.seed, self.eos_token_ids, self.kernels.argmax)
        self.counters = Counters()
        log.info("prefix caching %s", f"on: up to {self.kv_cache.num_slots} tokens of KV kept for reuse in "
                 f"blocks of {cfg.block_size}, evicted least recently used" if cfg.prefix_caching else "off")
        self._outputs: dict[tuple[str, int], SequenceOutput] = {}
        # structured output: one grammar state per constrained sequence; masks filled beside the forward pass
        self._grammars: dict[tuple[str, int], grammar.GrammarState] = {}
        self._filler: grammar.BitmaskFiller | None = None
        self._mask_thread: ThreadPoolExecutor | None = None
        # speculative decoding (engine/core/speculative.py, docs/speculative.md): None when off
        drafter = None
        if draft_spec is not None:
            assert draft is not None
            drafter = self._draft_proposer(draft, draft_spec, free, 1.0 - part)
        self.proposer: Proposer | None = make_proposer(cfg, drafter)
        self._adaptive = Acceptance()  # the adaptive rule's acceptance rates
        self.step_cost = StepCost()  # what a row costs: how many proposals pay

    def _draft_proposer(self, draft: DraftModel, spec: KVCacheSpec, free: int, share: float) -> DraftProposer:
        """The draft model's proposer: its own runner and paged KV cache (`share` of the KV budget)."""
        check_same_vocabulary(self.tokenizer, draft.tokenizer)
        cfg = self.cfg
        max_len = min(self.max_model_len, draft.max_model_len)
        cache = _allocate_kv(spec, cfg, free, self.device, max_len, share)
        runner = ModelRunner(self.backend.prepare(draft.model, self.kernels), cache, self.device,
                             self.backend.forward_impl(cfg.model_impl), self.kernels)
        log.info("speculative draft model %s: KV cache of %d tokens, %.1f MiB (%.0f%% of the KV budget; the "
                 "model's: %d tokens, %.1f MiB)", draft.name, cache.num_slots, cache.nbytes / 2**20, 100 * share,
                 self.kv_cache.num_slots, self.kv_cache.nbytes / 2**20)  # fmt: skip
        blocks = BlockManager(cache.num_blocks, cfg.block_size, prefix_caching=cfg.prefix_caching)
        return DraftProposer(runner, blocks, self.vocab_size, min(max_len, cache.num_slots),
                             cfg.max_num_batched_tokens)

    def step(self) -> list[RequestOutput]:
        """Propose, schedule, run the model, sample, update and emit."""
        drafted = self._propose()
        batch = self.scheduler.schedule()
        for seq in drafted:
            seq.draft = []  # the scheduler took what fit (ScheduledSeq.draft)
        if self.proposer is not None:
            for seq in batch.preempted:  # recomputed later: the proposer's state for it goes (draft KV blocks)
                self.proposer.release(seq)
        if batch.is_empty:
            return []
        sampling = batch.sampling  # before `update` grows the sequences
        rows = sample_rows(sampling)
        masks = self._start_masks(sampling)
        started = time.perf_counter()
        logits = self.runner.run(batch)
        self._score_prompt(batch, logits[len(rows):])
        sampled = iter(self.sampler.sample(logits[: len(rows)], rows, masks.result() if masks is not None else None))
        per_item = [[next(sampled) for _ in range(item.num_rows)] for item in sampling]
        if self.proposer is not None and all(item.num_tokens == 1 + len(item.draft) for item in batch.scheduled):
            # decodes and verifications only: a prompt chunk's rows run another path (and would dominate the fit)
            self.step_cost.observe(batch.num_batched_tokens, time.perf_counter() - started, len(batch.scheduled))
        grown = self.scheduler.update(batch, [tokens[0].token_id for tokens in per_item])
        self.kv_cache.release(self.blocks.take_released())
        self.counters.steps += 1
        outputs = []
        for item, seq, tokens in zip(sampling, grown, per_item, strict=True):
            outputs.append(self._emit(seq, tokens[0]))
            if item.draft:
                outputs += self._accept(item.draft, seq, tokens)
        self.counters.generated_tokens += len(outputs)
        return outputs

    def _propose(self) -> list[Sequence]:
        """Set the proposals of the decoding sequences that speculate this step; returns those sequences. A
        constrained sequence's are cut to what its grammar accepts (a lazy one's before its trigger: up to it); none
        past max_tokens or the context; as many as pay (`plan_lengths`). The proposer gets every sequence in one
        call (a draft model batches them)."""
        if self.proposer is None:
            return []
        k = self.cfg.speculative_tokens
        decoding = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
        candidates: list[tuple[Sequence, int]] = []
        for seq in decoding:
            if seq.seq_id in self._grammars and self._grammars[seq.seq_id].done:
                continue
            room = min(k, seq.max_tokens - len(seq.output_token_ids) - 1, self.max_model_len - seq.num_tokens - 1)
            if room > 0:
                candidates.append((seq, room))
        adaptive = self.cfg.speculative_adaptive
        lengths = (plan_lengths(candidates, len(decoding), self.proposer, self.step_cost, self._adaptive, k,
                               self.max_model_len) if adaptive else [room for _, room in candidates])
        wants = [(seq, n) for (seq, _), n in zip(candidates, lengths, strict=True) if n > 0]
        drafted = []
        for (seq, _), draft in zip(wants, self.proposer.propose_batch(wants) if wants else [], strict=True):
            if seq.seq_id in self._grammars:
                draft = self._grammars[seq.seq_id].valid_prefix(draft, self.eos_token_ids, seq.output_token_ids)
            seq.draft = draft = until_stop(draft, seq, self.eos_token_ids)  # no rows past where it would end
            if draft:
                drafted.append(seq)
        return drafted

    def _accept(self, draft: tuple[int, ...], seq: Sequence, tokens: list[SampledToken]) -> list[RequestOutput]:
        """After a verification's first token (emitted): keep the sampled tokens while the one before each matched
        its proposal, emitting them one by one (a stop ends the sequence there: the rest is dropped)."""
        accepted = accepted_prefix(draft, [t.token_id for t in tokens])
        self.counters.spec_proposed_tokens += len(draft)
        self.counters.spec_accepted_tokens += accepted
        self._adaptive.record(seq.seq_id, len(draft), accepted)
        outputs = []
        for token in tokens[1 : accepted + 1]:
            if seq.finished:
                break
            self.scheduler.accept(seq, token.token_id)
            outputs.append(self._emit(seq, token))
        return outputs

    def _start_masks(self, items: list[ScheduledSeq]) -> Future[tuple[list[int], torch.Tensor]] | None:
        """Start filling the token masks of this step's constrained rows (verification rows included; one
        llguidance call, GIL released) in a helper thread, so it runs beside the forward pass. None when no row is
        constrained now."""
        if not self._grammars:
            return None
        rows, work = grammar.mask_work(items, self._grammars)
        if not rows:
            return None
        filler = self._filler
        assert filler is not None and self._mask_thread is not None
        return self._mask_thread.submit(lambda: (rows, filler.forbidden(filler.fill(work))))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.validate(prompt_token_ids, params)
        self.admit(request_id, prompt_token_ids, params)

    def admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """`add_request` for a request `validate` accepted already (the async front validates on the caller's side)."""
        max_tokens = self.resolve_max_tokens(len(prompt_token_ids), params.max_tokens)
        states = self._grammar_states(params)
        for index in range(params.n):
            seq = Sequence(request_id, index, list(prompt_token_ids), params, max_tokens)
            self._outputs[seq.seq_id] = SequenceOutput(seq, self.tokenizer)
            if states:
                self._grammars[seq.seq_id] = states[index]
            self.scheduler.add(seq)
        self.counters.prompt_tokens += len(prompt_token_ids)

    def _grammar_states(self, params: SamplingParams) -> list[grammar.GrammarState]:
        """One grammar state per sequence of a constrained request (compiled grammars come from the cache that
        the app's `grammar.validate` filled before queueing)."""
        if params.constraint is None:
            return []
        try:
            states = [grammar.GrammarState(params.constraint, self.tokenizer) for _ in range(params.n)]
        except grammar.GrammarError as exc:
            raise InvalidRequestError(exc.message, param="constraint") from exc
        if self._filler is None:
            self._filler = grammar.BitmaskFiller(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peregrine-masks")
        return states

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Ends the request's sequences now; their KV blocks are free when this returns."""
        return [self._release(seq).aborted() for seq in self.scheduler.abort(request_id)]

    def abort_all(self) -> list[RequestOutput]:
        return [self._release(seq).aborted() for seq in self.scheduler.abort_all()]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def check_prompt(self, prompt_len: int, max_tokens: int | None) -> None:
        if prompt_len >= self.max_model_len:
            raise PromptTooLongError(
                f"The prompt has {prompt_len} tokens; this model's context is {self.max_model_len} tokens, "
                "which must also leave room for at least one generated token.",
                prompt_tokens=prompt_len, max_model_len=self.max_model_len, param="prompt_token_ids",
            )
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"The prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds this model's "
                f"context of {self.max_model_len} tokens.",
                prompt_tokens=prompt_len, max_model_len=self.max_model_len, param="max_tokens",
            )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt must contain at least one token", param="prompt_token_ids")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be in [0, {self.vocab_size})", param="prompt_token_ids")
        _validate_params(params)
        self.check_prompt(len(prompt_token_ids), params.max_tokens)

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        room = self.max_model_len - prompt_len
        return room if max_tokens is None else min(max_tokens, room)

    def stats(self, last_step_age_s: float = 0.0, alive: bool = True) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_used_blocks=self.blocks.num_used_blocks,
            kv_total_blocks=self.blocks.num_blocks,
            block_size=self.blocks.block_size,
            preemptions_total=self.scheduler.preemptions_total,
            prompt_tokens_total=self.counters.prompt_tokens,
            generated_tokens_total=self.counters.generated_tokens,
            steps_total=self.counters.steps,
            last_step_age_s=last_step_age_s,
            alive=alive,
            computed_tokens_total=self.scheduler.computed_tokens_total,
            prefix_cache_queries_total=self.scheduler.prefix_cache_queries_total,
            prefix_cache_hits_total=self.scheduler.prefix_cache_hits_total,
            kv_cached_blocks=self.blocks.num_cached_blocks,
            spec_proposed_tokens_total=self.counters.spec_proposed_tokens,
            spec_accepted_tokens_total=self.counters.spec_accepted_tokens,
        )

    def _score_prompt(self, batch: SchedulerOutput, rows: torch.Tensor) -> None:
        """Record the prompt logprobs of this step's chunks (rows: their logits, after the sampling rows)."""
        spans = prompt_logprobs.spans(batch)
        if spans:
            for span, scored in zip(spans, prompt_logprobs.score(rows, spans), strict=True):
                self._outputs[span.item.seq.seq_id].add_prompt_logprobs(span.first, scored)

    def _emit(self, seq: Sequence, sampled: Any) -> RequestOutput:
        state = self._grammars.get(seq.seq_id)
        done = False
        if state is not None:
            state.sync(seq.output_token_ids, self.eos_token_ids)
            done = state.done
            if state.failed:
                log.warning("request %s: the grammar matcher failed: %s", seq.request_id, state.error)
        out = self._outputs[seq.seq_id].on_token(sampled, self.eos_token_ids, self.max_model_len, done)
        if out.finish_reason is not None:
            self.scheduler.finish(seq, out.finish_reason, out.stop_reason)
            self._release(seq)
        return out

    def _release(self, seq: Sequence) -> SequenceOutput:
        self.sampler.release(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
            self._adaptive.release(seq.seq_id)
        self._grammars.pop(seq.seq_id, None)
        return self._outputs.pop(seq.seq_id)


def make_proposer(cfg: EngineConfig, draft: DraftProposer | None = None) -> Proposer | None:
    """The speculative proposer `cfg.speculative` names; None when off. `draft`: the draft model's proposer, built
    by the engine from the loaded draft model it was given (`--speculative draft`)."""
    if cfg.speculative == "off":
        return None
    if cfg.speculative == "ngram":
        return NgramProposer(cfg.speculative_ngram_max, cfg.speculative_ngram_min)
    if cfg.speculative == "draft":
        if draft is None:
            raise ValueError("--speculative draft needs a draft model (--speculative-model)")
        return draft
    raise ValueError(f"unknown speculative kind {cfg.speculative!r}: use off, ngram or draft")


def sample_rows(items: list[ScheduledSeq]) -> list[SampleRow]:
    """The sampler's rows of a step, aligned with the runner's logits: a sequence per sampling item, and after it
    one row per proposal it verifies (row i sees the first i proposals as its output)."""
    rows: list[SampleRow] = []
    for item in items:
        rows.append(item.seq)
        for i in range(1, len(item.draft) + 1):
            rows.append(DraftRow(item.seq, item.seq.output_token_ids + list(item.draft[:i])))
    return rows


def _validate_params(p: SamplingParams) -> None:
    checks = [
        (p.n >= 1, "n", "n must be at least 1"),
        (p.temperature >= 0.0, "temperature", "temperature must be >= 0"),
        (0.0 < p.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
        (0.0 <= p.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
        (p.repetition_penalty > 0.0, "repetition_penalty", "repetition_penalty must be > 0"),
        (p.max_tokens is None or p.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
        (p.min_tokens >= 0, "min_tokens", "min_tokens must be >= 0"),
        (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, "logprobs",
         f"logprobs must be between 0 and {MAX_LOGPROBS}"),
        (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
         f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}"),
    ]
    for ok, param, message in checks:
        if not ok:
            raise InvalidRequestError(message, param=param)


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _kv_spec(model: torch.nn.Module, cfg: EngineConfig, dtype: torch.dtype) -> KVCacheSpec:
    return KVCacheSpec.from_hf_config(model.config, kv_cache_dtype(cfg.kv_cache_dtype, dtype, is_quantized(model)))


def _allocate_kv(spec: KVCacheSpec, cfg: EngineConfig, free_bytes: int, device: torch.device, max_model_len: int,
                 part: float = 1.0) -> KVCache:
    """A KV cache of `part` of the budget (the rest: a draft model's, engine/draft.py)."""
    started = time.perf_counter()
    num_blocks = plan_num_blocks(
        spec, cfg.block_size, free_bytes, cfg.kv_cache_memory_fraction * part,
        None if cfg.kv_cache_bytes is None else int(cfg.kv_cache_bytes * part),
        max_useful_tokens=cfg.max_num_seqs * max_model_len,
    )
    cache = KVCache(spec, num_blocks, cfg.block_size, device, release=cfg.kv_window_release)
    log.info("KV cache sized from %s (free after load: %.0f MiB), allocated in %.2fs",
             "kv_cache_bytes" if cfg.kv_cache_bytes is not None else f"{cfg.kv_cache_memory_fraction:.0%} of free",
             free_bytes / 2**20, time.perf_counter() - started)
    return cache

