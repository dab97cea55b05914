"""Build `chat_prompts.jsonl`: a fixed, seeded set of realistic chat requests for `scripts/bench.py`.

The text is the Python language reference that ships with CPython itself (`pydoc_data.topics`, the help
topics behind `help("assert")`; PSF licence), so nothing is downloaded. Each request asks one of a few
everyday things (summarise, explain, quiz, compare, rewrite) about a passage of 40-320 words, some with a
system prompt and some as a second turn after an earlier answer, and carries a suggested output length
drawn from a log-normal (median ~110 tokens, 16-384), as chat traffic is skewed.

    python scripts/bench_data/build_chat_prompts.py     # rewrites scripts/bench_data/chat_prompts.jsonl

The committed file is what the benchmark reads; rebuilding it on another Python version may change it.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from pydoc_data.topics import topics

SEED = 20240611
COUNT = 200
OUT = Path(__file__).with_name("chat_prompts.jsonl")
SYSTEMS = (
    "You are a concise assistant for Python developers.",
    "You are a patient teacher. Explain things step by step.",
    "Answer in plain English, without code unless asked.",
)
ASKS = (
    "Summarize the following passage in a few sentences:\n\n{p}",
    "Explain this part of the Python reference to a beginner:\n\n{p}",
    "Write three quiz questions, with answers, about this text:\n\n{p}",
    "What is the single most important rule described here? Quote the sentence that states it.\n\n{p}",
    "Rewrite this documentation so it reads like a friendly blog post:\n\n{p}",
    "{p}\n\nGive a short code example that illustrates the passage above.",
    "I don't understand this. Can you help?\n\n{p}",
)
FOLLOW_UPS = (
    "Thanks. Can you give an example?",
    "How does this differ from other languages you know?",
    "Can you make that shorter?",
    "What mistakes do people usually make with this?",
)


def passages(text: str) -> list[str]:
    """Paragraph-sized chunks of a topic, headings and grammar blocks dropped."""
    paras = [re.sub(r"\s+", " ", p).strip() for p in text.split("\n\n")]
    return [p for p in paras if len(p.split()) >= 12 and not set(p) <= set("*=-~ ")]


def take_words(rng: random.Random, paras: list[str], low: int, high: int) -> str:
    target = rng.randint(low, high)
    start = rng.randrange(len(paras))
    chosen, words = [], 0
    for para in paras[start:] + paras[:start]:
        chosen.append(para)
        words += len(para.split())
        if words >= target:
            break
    return " ".join(" ".join(chosen).split()[:target])


def output_len(rng: random.Random) -> int:
    return max(16, min(384, round(rng.lognormvariate(4.7, 0.6))))


def one(rng: random.Random, index: int, pool: dict[str, list[str]]) -> dict:
    topic = rng.choice(sorted(pool))
    passage = take_words(rng, pool[topic], 40, 320)
    messages = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    messages.append({"role": "user", "content": rng.choice(ASKS).format(p=passage)})
    if rng.random() < 0.25:
        earlier = take_words(rng, pool[topic], 30, 90)
        messages += [
            {"role": "assistant", "content": earlier},
            {"role": "user", "content": rng.choice(FOLLOW_UPS)},
        ]
    return {"id": f"chat-{index:03d}", "topic": topic, "messages": messages, "output_len": output_len(rng)}


def main() -> int:
    rng = random.Random(SEED)
    pool = {name: ps for name, text in topics.items() if len(ps := passages(text)) >= 2}
    rows = [one(rng, i, pool) for i in range(COUNT)]
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {OUT} (Python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
