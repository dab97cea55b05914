"""scripts/bench_speculative.py's choice of prompts at one stream, without running an engine: distinct prompts,
spread over the tasks and passages (sixteen: every one once; an earlier spread repeated eight of them twice)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_speculative  # noqa: E402

SETS = {"grounded": bench_speculative.grounded_texts(), "open": bench_speculative.OPEN,
        "copy": bench_speculative.copy_texts(), "json": bench_speculative.json_texts()}


@pytest.mark.parametrize("name", sorted(SETS))
@pytest.mark.parametrize("count", [1, 2, 4, 8, 16, 40])
def test_one_stream_picks_distinct_prompts(name: str, count: int) -> None:
    prompts = SETS[name]
    chosen = bench_speculative.one_stream(prompts, count)
    assert len(chosen) == min(count, len(prompts))
    positions = [prompts.index(p) for p in chosen]
    assert len(set(positions)) == len(positions), positions


def test_four_prompts_are_four_tasks_on_four_passages() -> None:
    prompts = bench_speculative.grounded_texts()
    width = len(bench_speculative.TASKS)
    positions = [prompts.index(p) for p in bench_speculative.one_stream(prompts, 4)]
    assert sorted(j // width for j in positions) == list(range(width))  # tasks (task-major order)
    assert sorted(j % width for j in positions) == list(range(width))  # passages
    assert sorted(prompts.index(p) for p in bench_speculative.one_stream(prompts, 16)) == list(range(16))


def test_step_fit_recovers_fixed_and_per_row() -> None:
    steps = [(rows, rows, 0.005 + 0.001 * rows) for rows in (1, 1, 3, 5, 9, 9)]
    fixed, per_row = bench_speculative.step_fit(steps)
    assert fixed == pytest.approx(0.005)
    assert per_row == pytest.approx(0.001)
    assert bench_speculative.step_fit([(1, 1, 0.005), (1, 1, 0.006)]) is None  # rows never vary: nothing to fit


def test_first_difference_names_the_answer_and_position() -> None:
    assert bench_speculative.first_difference([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == (1, 1)
    assert bench_speculative.first_difference([[1, 2, 3]], [[1, 2]]) == (0, 2)  # one stopped sooner


class _Engine:
    """An engine stand-in: each request emits one token a step and ends after as many tokens as its prompt's
    first number; records how many requests were in flight at every step."""

    def __init__(self) -> None:
        self.left: dict[str, int] = {}
        self.counters = type("Counters", (), {"spec_proposed_tokens": 0})()
        self.in_flight: list[int] = []

    @property
    def has_work(self) -> bool:
        return bool(self.left)

    def add_request(self, rid: str, prompt: list[int], params: object) -> None:
        self.left[rid] = prompt[0]

    def step(self) -> list:
        self.in_flight.append(len(self.left))
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            if done:
                del self.left[rid]
            outs.append(type("Out", (), {"request_id": rid, "token_ids": [1], "finish_reason": "length" if done
                                         else None})())
        return outs


@pytest.mark.parametrize("steady", [False, True])
def test_run_serves_in_waves_or_keeps_every_stream_busy(steady: bool) -> None:
    """Four streams, eight requests of 2 to 9 tokens: in waves the second four start when the longest of the first
    ends, the batch shrinking meanwhile; under steady load a finished request's slot takes the next at once, so
    four stay in flight until the prompts run out."""
    lengths = [2, 9, 3, 4, 5, 2, 6, 3]
    engine = _Engine()
    _, _, answers, _ = bench_speculative.run(engine, [[n] for n in lengths], 4, 16, steady=steady)
    assert [len(a) for a in answers] == lengths
    if steady:
        assert engine.in_flight == [4] * 7 + [3, 2, 1]  # ten steps: the last admitted (6 tokens at step 5) ends last
    else:
        assert engine.in_flight == [4, 4, 3, 2, 1, 1, 1, 1, 1] + [4, 4, 3, 2, 2, 1]  # 9 + 6 steps
