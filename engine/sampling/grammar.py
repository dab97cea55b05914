"""Constrained decoding with llguidance: compile a `Constraint` once, then one matcher per sequence.

- `engine/sampling/grammar_text.py` turns a constraint into llguidance grammar text (bounded in size and nesting).
- `validate(constraint, tokenizer)` compiles (bounded in size and time) and caches the compiled grammar; the
  app calls it before queueing a request, so a slow or hostile compile never runs on the engine loop, and a
  grammar llguidance rejects raises `GrammarError` (the app answers 400).
- `compiled(constraint, tokenizer)` returns the cached compiled grammar (a fresh `LLMatcher` used as a template;
  each sequence gets a `deep_copy`, which shares the compiled grammar and lexer).
- `GrammarState` is one sequence's matcher. It follows the sequence's output tokens (`sync`), so preemption with
  recompute, n > 1 and a lazy `trigger` need nothing special: the state is a function of the tokens so far.
- `BitmaskFiller` fills the masks of all constrained rows of a step in one `LLExecutor` call (it drops the GIL,
  so the engine runs it beside the forward pass), speculative verification rows included: row i of a sequence's
  proposals gets the mask of its state after the first i proposals (`mask_work`; the proposals were cut to what the
  grammar accepts, `GrammarState.valid_prefix`).

Why llguidance rather than xgrammar: see the README's "Structured output and tools" section.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import llguidance
import numpy as np
import torch

from engine.sampling.grammar_text import GrammarError, grammar_text
from engine.types import Constraint

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0  # wall time a compile may take (also bounded by llguidance's fuel limits below)
CACHE_SIZE = 256  # compiled grammars kept, least recently used evicted

LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
    max_lexer_states=100_000, max_grammar_size=200_000, verbose_errors=False,
)


# --- tokenizers ----------------------------------------------------------------------------------------

_tokenizers: dict[int, tuple[Any, llguidance.LLTokenizer]] = {}
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of a HF tokenizer, built once per tokenizer object (about a second)."""
    key = id(tokenizer)
    with _tokenizers_lock:
        hit = _tokenizers.get(key)
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        import llguidance.hf

        try:
            lltok = llguidance.hf.from_tokenizer(tokenizer)
        except Exception as exc:  # a slow (non-Rust) tokenizer, or one llguidance cannot read
            raise GrammarError(f"structured output is not available for this model's tokenizer: {exc}") from exc
        _tokenizers[key] = (tokenizer, lltok)
        return lltok


# --- compiling -----------------------------------------------------------------------------------------


def _compile(constraint: Constraint, lltok: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    grammar = grammar_text(constraint)
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=LIMITS)
    if matcher.is_error():
        raise GrammarError(f"invalid {constraint.kind}: {_short(matcher.get_error())}")
    probe = matcher.deep_copy()  # the first mask: builds the lexer now, and finds grammars that admit no text
    probe.compute_bitmask()
    if probe.is_error():
        raise GrammarError(f"the {constraint.kind} admits no text (it is unsatisfiable or endlessly recursive)")
    return matcher


def _short(message: str, limit: int = 500) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + "..."


class _Cache:
    """Compiled grammars per (tokenizer, kind, value), least recently used evicted; one compile per key."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple[int, str, str], llguidance.LLMatcher] = OrderedDict()
        self._failures: OrderedDict[tuple[int, str, str], str] = OrderedDict()  # a refused grammar stays refused
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[int, str, str]) -> llguidance.LLMatcher | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                self.hits += 1
            return hit

    def put(self, key: tuple[int, str, str], matcher: llguidance.LLMatcher) -> None:
        with self._lock:
            _bounded_put(self._items, key, matcher, self.size)

    def failure(self, key: tuple[int, str, str]) -> str | None:
        with self._lock:
            return self._failures.get(key)

    def put_failure(self, key: tuple[int, str, str], message: str) -> None:
        with self._lock:
            _bounded_put(self._failures, key, message, self.size)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


def _bounded_put(items: OrderedDict, key: Any, value: Any, size: int) -> None:
    items[key] = value
    items.move_to_end(key)
    while len(items) > size:
        items.popitem(last=False)


CACHE = _Cache(CACHE_SIZE)
_compiler = ThreadPoolExecutor(max_workers=2, thread_name_prefix="peregrine-grammar")
_pending: dict[tuple[int, str, str], Any] = {}
_pending_lock = threading.Lock()


def _key(constraint: Constraint, lltok: llguidance.LLTokenizer) -> tuple[int, str, str]:
    return (id(lltok), constraint.kind, constraint.value)


def compiled(constraint: Constraint, tokenizer: Any, timeout: float | None = COMPILE_TIMEOUT_S) -> llguidance.LLMatcher:
    """The compiled grammar of `constraint` (a fresh matcher: deep_copy it), from the cache or compiled now.

    Raises GrammarError if it is invalid or does not compile within `timeout` seconds (the compile goes on in
    the background, bounded by llguidance's fuel limits, and is cached if it succeeds)."""
    lltok = ll_tokenizer(tokenizer)
    key = _key(constraint, lltok)
    hit = CACHE.get(key)
    if hit is not None:
        return hit
    failed = CACHE.failure(key)
    if failed is not None:  # the same hostile schema sent again costs nothing
        raise GrammarError(failed)
    with _pending_lock:
        future = _pending.get(key)
        if future is None:
            CACHE.misses += 1
            future = _compiler.submit(_compile_and_cache, key, constraint, lltok)
            _pending[key] = future
    try:
        return future.result(timeout=timeout)
    except FutureTimeout as exc:
        raise GrammarError(f"the {constraint.kind} took more than {timeout:.0f}s to compile") from exc


def _compile_and_cache(key: tuple[int, str, str], constraint: Constraint,
                       lltok: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    try:
        started = time.perf_counter()
        try:
            matcher = _compile(constraint, lltok)
        except GrammarError as exc:
            CACHE.put_failure(key, exc.message)
            raise
        CACHE.put(key, matcher)
        log.debug("compiled a %s grammar in %.3fs", constraint.kind, time.perf_counter() - started)
        return matcher
    finally:
        with _pending_lock:
            _pending.pop(key, None)


def validate(constraint: Constraint, tokenizer: Any) -> None:
    """Compile `constraint` for `tokenizer` (cached) or raise GrammarError. Blocking: call it off the event loop."""
    if constraint.trigger is not None and not constraint.trigger:
        raise GrammarError("a constraint's trigger must not be empty")
    compiled(constraint, tokenizer)


# --- per sequence ---------------------------------------------------------------------------------------


class GrammarState:
    """One sequence's matcher, kept in step with its output tokens.

    Without a trigger the matcher starts at the first output token. With one, the row is free until the
    trigger string appears in the decoded output; then the matcher is created and fed the text after the
    trigger, and constrains every later token."""

    def __init__(self, constraint: Constraint, tokenizer: Any) -> None:
        self.constraint = constraint
        self._tokenizer = tokenizer
        self._lltok = ll_tokenizer(tokenizer)
        self._template = compiled(constraint, tokenizer, timeout=None)
        self.matcher: llguidance.LLMatcher | None = None if constraint.trigger else self._template.deep_copy()
        self._seen = 0  # output tokens taken into account
        self._text = ""  # decoded output so far (lazy constraints, before the trigger)

    @property
    def active(self) -> bool:
        """True when the next token is constrained."""
        return self.matcher is not None and not self.matcher.is_stopped()

    @property
    def done(self) -> bool:
        """True when the grammar is complete and admits nothing more (the sequence should stop)."""
        return self.matcher is not None and self.matcher.is_stopped()

    @property
    def failed(self) -> bool:
        return self.matcher is not None and self.matcher.is_error()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher is not None else ""

    def valid_prefix(self, draft: list[int], eos_token_ids: Collection[int], output: list[int]) -> list[int]:
        """The speculative proposals `draft` (after the sequence's `output` tokens) up to the first the grammar
        refuses (and before any EOS: the grammar ends a constrained sequence itself), so each verification row has
        the mask of its state after the ones before it; [] once the grammar is done. Before a lazy constraint's
        trigger the rows are free: the proposals up to the one that would complete the trigger (the rows after
        it would need the matcher that only the trigger starts)."""
        if self.matcher is None:
            return self._before_trigger(draft, output)
        if self.matcher.is_stopped():
            return []
        cut = next((i for i, t in enumerate(draft) if t in eos_token_ids), len(draft))
        return draft[: self.matcher.validate_tokens(draft[:cut])]  # checks without consuming

    def _before_trigger(self, draft: list[int], output: list[int]) -> list[int]:
        """`draft` cut before the proposal whose text completes the trigger (searched where `sync` searches: in
        the decoded output, from just before the text seen so far)."""
        trigger = self.constraint.trigger or ""
        start = max(0, len(self._text) - len(trigger))
        decode = self._tokenizer.decode
        if decode(output + draft, skip_special_tokens=False).find(trigger, start) < 0:
            return draft
        n = next(n for n in range(1, len(draft) + 1)
                 if decode(output + draft[:n], skip_special_tokens=False).find(trigger, start) >= 0)
        return draft[: n - 1]

    def sync(self, output_token_ids: list[int], eos_token_ids: frozenset[int] = frozenset()) -> None:
        """Take the output tokens not seen yet into account (EOS is never fed: it ends the sequence)."""
        new = [t for t in output_token_ids[self._seen:] if t not in eos_token_ids]
        self._seen = len(output_token_ids)
        if not new:
            return
        if self.matcher is not None:
            if not self.matcher.is_stopped():
                self.matcher.consume_tokens(new)
            return
        trigger = self.constraint.trigger or ""
        before = len(self._text)
        self._text = self._tokenizer.decode(output_token_ids, skip_special_tokens=False)
        at = self._text.find(trigger, max(0, before - len(trigger)))
        if at < 0:
            return
        self.matcher = self._template.deep_copy()
        rest = self._text[at + len(trigger):]
        if rest:
            tokens = self._lltok.tokenize_str(rest)
            done = self.matcher.try_consume_tokens(tokens)
            if done < len(tokens):
                log.debug("lazy grammar: %d of %d tokens after the trigger fit", done, len(tokens))


def mask_work(items: list[Any], states: dict[tuple[str, int], GrammarState]) -> tuple[list[int], list]:
    """The constrained rows of a step's sampling items (the indices of their logits rows: an item's sequence row,
    then one row per proposal it verifies, `item.draft`) and the `BitmaskFiller.fill` work that masks them."""
    indices: list[int] = []
    work: list[tuple[GrammarState, list[int]]] = []
    at = 0
    for item in items:
        state = states.get(item.seq.seq_id)
        if state is not None and state.active:
            work.append((state, list(item.draft)))
            indices.extend(range(at, at + 1 + len(item.draft)))
        at += 1 + len(item.draft)
    return indices, work


def _bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, ceil(vocab_size / 32)], all bits set (llguidance.torch's allocate_token_bitmask, on the CPU)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class BitmaskFiller:
    """Fills the token bitmasks of the constrained rows of a step, all in one llguidance call, and unpacks them
    (numpy, single-threaded, in the caller's thread: the engine runs both beside the forward pass)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.lltok = ll_tokenizer(tokenizer)
        self.vocab_size = vocab_size
        self._eos = sorted(t for t in eos_token_ids if t < vocab_size)
        self._ll_eos = self.lltok.eos_token
        self._executor = llguidance.LLExecutor(num_threads=2)
        self._buffer = _bitmask(8, self.lltok.vocab_size)

    def fill(self, work: list[tuple[GrammarState, list[int]]]) -> torch.Tensor:
        """int32 bitmask, for each (state, proposals) in turn (each state `active`, its proposals all valid) one
        row for the state as it is, then one after each proposal: 1 + len(proposals) rows."""
        plain, drafted, rows = [], [], 0  # each state's first row is `rows` as it stands when it comes
        for state, draft in work:
            if draft:
                drafted.append((state.matcher, rows, draft))
            else:
                plain.append((state.matcher, rows))
            rows += 1 + len(draft)
        if self._buffer.shape[0] < rows:
            self._buffer = _bitmask(max(rows, 2 * self._buffer.shape[0]), self.lltok.vocab_size)
        mask = self._buffer[:rows]  # rows of a contiguous buffer: contiguous
        mask.fill_(-1)  # a row past where a grammar stops is left as it is: every token allowed (the row is dropped)
        # llguidance.torch's fill_next_token_bitmask_par (and its _with_draft_tokens form, which takes no empty
        # list), without importing that module: its torch.compile decorator imports torch's dynamo and inductor
        # (about 8 s and 150 MB at start). llguidance consumes a row's proposals in turn, then rolls them back
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, mask.data_ptr(), mask.shape[1] * 4, rows)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, mask.data_ptr(), mask.shape[1] * 4, rows)
        return mask

    def forbidden(self, mask: torch.Tensor) -> torch.Tensor:
        """bool [rows, vocab_size]: True where the grammar forbids the token. Ids past the tokenizer's vocabulary
        are forbidden; every EOS id of the model is allowed where the tokenizer's own EOS is."""
        bits = np.unpackbits((~mask.numpy()).view(np.uint8), axis=1, bitorder="little")  # [rows, words * 32]
        if bits.shape[1] >= self.vocab_size:
            out = np.ascontiguousarray(bits[:, : self.vocab_size])
        else:
            out = np.ones((bits.shape[0], self.vocab_size), dtype=np.uint8)
            out[:, : bits.shape[1]] = bits
        if self._eos and 0 <= self._ll_eos < bits.shape[1]:
            eos_banned = bits[:, self._ll_eos]
            for t in self._eos:
                out[:, t] = eos_banned
        return torch.from_numpy(out).view(torch.bool)

    def allowed(self, mask: torch.Tensor) -> torch.Tensor:
        """bool [rows, vocab_size]: True where the grammar allows the token."""
        return ~self.forbidden(mask)


def apply_mask(logits: torch.Tensor, rows: list[int], forbidden: torch.Tensor) -> torch.Tensor:
    """Set the forbidden tokens of `rows` to -inf, in place (the engine's logits are the step's fresh output);
    `forbidden`: bool [len(rows), vocab]. Returns `logits`."""
    forbidden = forbidden.to(logits.device)
    if len(rows) == logits.shape[0]:
        return logits.masked_fill_(forbidden, float("-inf"))
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill_(forbidden, float("-inf")))
    return logits
