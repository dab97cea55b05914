"""The C++ kernels' argument checks give TORCH_CHECK one message string, never a list to format (`TORCH_CHECK(c,
"text ", n)`): on an Intel Xeon with torch 2.11.0+cu130 and GCC 13.3 the process died (SIGSEGV) at the first check
that formatted a number, where the checks with one string raised their RuntimeError (docs/benchmarks.md, "ISA levels
side by side"). A number goes in through std::to_string."""

from __future__ import annotations

from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "engine" / "backends" / "csrc"


def check_arguments(source: str) -> list[tuple[int, list[str]]]:
    """(line, the arguments after the condition) of every TORCH_CHECK call in `source`, split at its top-level commas
    (not those inside brackets or string literals)."""
    found = []
    start = source.find("TORCH_CHECK(")
    while start >= 0:
        i, depth, quoted, args, current = start + len("TORCH_CHECK("), 1, False, [], ""
        while depth:
            c = source[i]
            if c == '"' and source[i - 1] != "\\":
                quoted = not quoted
            if not quoted and c in "([{":
                depth += 1
            elif not quoted and c in ")]}":
                depth -= 1
            if not quoted and c == "," and depth == 1:
                args.append(current.strip())
                current = ""
            elif depth:
                current += c
            i += 1
        args.append(current.strip())
        found.append((source[:start].count("\n") + 1, args[1:]))
        start = source.find("TORCH_CHECK(", i)
    return found


def test_the_parser_finds_a_formatted_message_and_passes_one_string() -> None:
    text = 'TORCH_CHECK(a(b, c), "x, y");\nTORCH_CHECK(d, "n = ", n);\nTORCH_CHECK(e, "k" + std::to_string(k));'
    assert check_arguments(text) == [(1, ['"x, y"']), (2, ['"n = "', "n"]), (3, ['"k" + std::to_string(k)'])]


def test_every_kernel_check_has_one_message_string() -> None:
    sources = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))
    checks = [(path.name, line, args) for path in sources for line, args in check_arguments(path.read_text())]
    assert len(checks) > 40  # the parser saw the checks
    assert [c for c in checks if len(c[2]) != 1] == []
