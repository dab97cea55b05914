"""The benchmark's prompts: fixed and seeded, built locally (nothing is downloaded).

- `random`: vLLM's "random" dataset. Uniformly drawn token ids (special tokens excluded), decoded to text
  and re-encoded until the text is exactly `input_len` tokens for the model's tokenizer; sent to
  `/v1/completions`.
- `chat`: `bench_data/chat_prompts.jsonl` (built from the Python reference text that ships with CPython,
  see `bench_data/build_chat_prompts.py`); sent to `/v1/chat/completions`, so each server applies its own
  chat template.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CHAT_FILE = Path(__file__).parent / "bench_data" / "chat_prompts.jsonl"
ROUND_TRIPS = 64
PER_MESSAGE_TOKENS = 5  # chat-template tokens around each message, when only a local estimate is possible


@dataclass(frozen=True, slots=True)
class BenchRequest:
    kind: Literal["completion", "chat"]
    prompt: str | None  # completion requests
    messages: tuple[dict[str, str], ...] | None  # chat requests
    prompt_tokens: int  # exact for `random`; an estimate for `chat` (used only if the server omits usage)
    output_len: int


def load_tokenizer(path: str | Path) -> Any:
    """A `tokenizers.Tokenizer` from a `tokenizer.json` file or a model folder holding one."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path} (pass --tokenizer FOLDER_OR_FILE)")
    return Tokenizer.from_file(str(file))


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def special_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's special (added) token ids: EOS and every other end-of-generation marker among them."""
    return tuple(sorted(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special))


def _normal_ids(tokenizer: Any) -> list[int]:
    """Token ids that are not special and survive a decode/encode round trip on their own (a byte-level
    token holding half a UTF-8 character does not, and would keep the prompt length from settling)."""
    special = set(tokenizer.get_added_tokens_decoder())
    ids = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
    texts = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=True)
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    return [i for i, enc in zip(ids, encoded, strict=True) if enc.ids == [i]]


def exact_length_text(tokenizer: Any, rng: random.Random, pool: list[int], length: int) -> str:
    """Text that encodes to exactly `length` tokens (decode/re-encode round trips can merge or split
    tokens, so trim and top up until it holds; after ROUND_TRIPS tries the last text is kept as it is)."""
    ids = [rng.choice(pool) for _ in range(length)]
    text = ""
    for _ in range(ROUND_TRIPS):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) == length:
            return text
        ids = ids[:length] + [rng.choice(pool) for _ in range(max(0, length - len(ids)))]
    return text


def random_requests(
    tokenizer: Any, count: int, input_len: int, output_len: int, seed: int = 0
) -> list[BenchRequest]:
    """`count` completion requests of `input_len` random tokens each, each asking for `output_len`."""
    rng = random.Random(seed)
    pool = _normal_ids(tokenizer)
    out = []
    for _ in range(count):
        text = exact_length_text(tokenizer, rng, pool, input_len)
        out.append(BenchRequest("completion", text, None, count_tokens(tokenizer, text), output_len))
    return out


def chat_requests(
    tokenizer: Any, count: int, output_len: int | None, seed: int = 0, path: Path = CHAT_FILE
) -> list[BenchRequest]:
    """`count` chat requests from the shipped set, shuffled with `seed` (cycled if `count` is larger).
    `output_len` None keeps each prompt's own suggested length."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    random.Random(seed).shuffle(rows)
    out = []
    for i in range(count):
        row = rows[i % len(rows)]
        messages = tuple({"role": m["role"], "content": m["content"]} for m in row["messages"])
        estimate = sum(count_tokens(tokenizer, m["content"]) + PER_MESSAGE_TOKENS for m in messages)
        out.append(BenchRequest("chat", None, messages, estimate, output_len or int(row["output_len"])))
    return out
