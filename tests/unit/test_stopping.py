"""Stop strings (held back, never streamed) and token-level stop checks (pure Python)."""

from __future__ import annotations

from engine.core.sequence import Sequence
from engine.core.stopping import StopStringMatcher, check_token_stop, partial_stop_len
from engine.types import SamplingParams


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None]:
    emitted = []
    for piece in pieces:
        text, stop = matcher.feed(piece)
        emitted.append(text)
        if stop is not None:
            return emitted, stop
    emitted.append(matcher.flush())
    return emitted, None


def test_stop_string_split_across_tokens_is_never_emitted() -> None:
    emitted, stop = feed_all(StopStringMatcher(["STOP"]), ["Hello S", "T", "O", "P tail"])
    assert stop == "STOP"
    assert "".join(emitted) == "Hello "
    assert all("S" not in e for e in emitted)


def test_held_back_prefix_is_released_when_it_does_not_complete() -> None:
    emitted, stop = feed_all(StopStringMatcher(["STOP"]), ["a S", "T", "x"])
    assert stop is None and emitted == ["a ", "", "STx", ""]


def test_include_stop_string_and_earliest_of_several() -> None:
    emitted, stop = feed_all(StopStringMatcher(["world", "lo"], include_stop_str=True), ["hello world"])
    assert stop == "lo" and "".join(emitted) == "hello"


def test_partial_stop_len() -> None:
    assert partial_stop_len("abc", ["cde"]) == 1
    assert partial_stop_len("abcd", ["bcdx", "d"]) == 3
    assert partial_stop_len("abc", ["xyz"]) == 0
    assert partial_stop_len("", ["x"]) == 0


def test_no_stops_passes_text_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", None)


def make(params: SamplingParams, outputs: list[int], max_tokens: int = 10, prompt_len: int = 2) -> Sequence:
    s = Sequence("r", 0, [5] * prompt_len, params, max_tokens)
    s.output_token_ids = outputs
    return s


def test_token_stops() -> None:
    eos = {2}
    assert check_token_stop(make(SamplingParams(), [7, 2]), eos, 100).reason == "stop"
    assert check_token_stop(make(SamplingParams(ignore_eos=True), [7, 2]), eos, 100) is None
    hit = check_token_stop(make(SamplingParams(stop_token_ids=(7,)), [7]), eos, 100)
    assert (hit.reason, hit.stop_reason) == ("stop", 7)
    assert check_token_stop(make(SamplingParams(min_tokens=3), [1, 2]), eos, 100) is None
    assert check_token_stop(make(SamplingParams(), [1, 1, 1], max_tokens=3), eos, 100).reason == "length"
    assert check_token_stop(make(SamplingParams(), [1, 1]), eos, max_model_len=4).reason == "length"
    assert check_token_stop(make(SamplingParams(), [1]), eos, 100) is None
