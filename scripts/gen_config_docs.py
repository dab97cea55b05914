"""Write docs/configuration.md from `config.Settings`: every setting's flag, environment variable, default,
accepted values and help text, grouped as config/settings.py groups them (its `# --- name ---` lines).

The page is generated so that it cannot drift from the code: tests/unit/test_config_docs.py fails when the file
differs from what this script renders. After changing a setting, run

    .venv/bin/python scripts/gen_config_docs.py           # rewrite docs/configuration.md
    .venv/bin/python scripts/gen_config_docs.py --check   # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import enum
import inspect
import re
import sys
import typing
from pathlib import Path

import annotated_types
from pydantic.fields import FieldInfo

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import config.settings  # noqa: E402
from config import CONVENTIONAL_ENV, ENV_PREFIX, Settings  # noqa: E402

OUTPUT = REPO / "docs" / "configuration.md"
COMMAND = ".venv/bin/python scripts/gen_config_docs.py"
_SECTION = re.compile(r"^\s*# --- (?P<name>.+?) -+\s*$")
_FIELD = re.compile(r"^    (?P<name>[a-z_][a-z0-9_]*)\s*:")

HEADER = f"""# Configuration reference

<!-- Generated from config.Settings by scripts/gen_config_docs.py: do not edit by hand; run `{COMMAND}`. -->

Every setting is a command-line flag, an environment variable `{ENV_PREFIX}<NAME>`, or a `NAME=value` line in a
`.env` file in the working directory. Flags win over the environment, which wins over `.env`, which wins over the
defaults below. `python main.py --help` (or `bash scripts/serve.sh --help`) prints the same list.

A bad value stops the start with one line naming the flag and the variable, and exit status 2:

```
main.py: error: --port (PEREGRINE_PORT): Input should be less than or equal to 65535, got '70000'
```

- A boolean flag has a `--no-` form (`--no-prefix-caching`); in the environment it is `true` or `false`.
- Sizes take units: `512MB`, `2GiB`.
- `--model` may be given more than once: the first is the default model, the others fill `--extra-models`
  ([several models](serving.md#several-models-in-one-server)).
- {", ".join(f"`{var}`" for var in CONVENTIONAL_ENV.values())} are read too (from the environment or `.env`),
  below `{ENV_PREFIX}<NAME>` in priority, for {", ".join(f"`--{n.replace('_', '-')}`" for n in CONVENTIONAL_ENV)}.
"""


def sections() -> dict[str, str]:
    """Field name -> the section comment above it in config/settings.py."""
    found: dict[str, str] = {}
    current = "general"
    for line in inspect.getsource(config.settings).splitlines():
        if match := _SECTION.match(line):
            # "several models (README: ...)" -> "several models"
            current = re.sub(r"\s*\(.*\)$", "", match["name"])
        elif (match := _FIELD.match(line)) and match["name"] in Settings.model_fields:
            found.setdefault(match["name"], current)
    return found


def flag(name: str, field: FieldInfo) -> str:
    kebab = name.replace("_", "-")
    return f"`--{kebab}` / `--no-{kebab}`" if field.annotation is bool else f"`--{kebab}`"


def default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "empty" if not value else f"`{value}`"
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value == "":
        return "empty"
    return f"`{value.value if isinstance(value, enum.Enum) else value}`"


def values(field: FieldInfo) -> str:
    """The accepted values: a Literal's choices, else the type with its bounds."""
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return ", ".join(f"`{choice}`" for choice in typing.get_args(annotation))
    if len(args) == 1 and typing.get_origin(args[0]) is typing.Literal:
        return ", ".join(f"`{choice}`" for choice in typing.get_args(args[0]))
    base = args[0] if len(args) == 1 else annotation
    name = getattr(base, "__name__", None) or str(base)
    text = {"str": "text", "int": "integer", "float": "number", "bool": "boolean", "Path": "path",
            "Secret": "secret", "Size": "size", "list": "list"}.get(name, name)  # fmt: skip
    return ", ".join([text, *bounds(field)])


def bounds(field: FieldInfo) -> list[str]:
    marks = {annotated_types.Ge: ("ge", "at least"), annotated_types.Gt: ("gt", "above"),
             annotated_types.Le: ("le", "at most"), annotated_types.Lt: ("lt", "below")}  # fmt: skip
    return [f"{sign} {getattr(item, attr)}" for item in field.metadata for kind, (attr, sign) in marks.items()
            if isinstance(item, kind)]  # fmt: skip


def cell(text: str) -> str:
    """Markdown table cell: a pipe would end the cell, and `<think>` would read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def row(name: str, field: FieldInfo) -> str:
    env = f"`{ENV_PREFIX}{name.upper()}`"
    if name in CONVENTIONAL_ENV:
        env += f", `{CONVENTIONAL_ENV[name]}`"
    described = cell(field.description or "")
    return f"| {flag(name, field)} | {env} | {default(field)} | {cell(values(field))} | {described} |"


def render() -> str:
    """The whole page, from Settings as it is now."""
    grouped: dict[str, list[str]] = {}
    where = sections()
    for name, field in Settings.model_fields.items():
        grouped.setdefault(where.get(name, "general"), []).append(row(name, field))
    parts = [HEADER]
    for section, rows in grouped.items():
        parts.append(
            f"## {section[0].upper()}{section[1:]}\n\n| flag | environment | default | values | what |"
        )
        parts.append("|---|---|---|---|---|")
        parts.extend([*rows, ""])
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs; write nothing")
    parser.add_argument(
        "--output", type=Path, default=OUTPUT, help="the page (default: docs/configuration.md)"
    )
    args = parser.parse_args(argv)
    text = render()
    current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
    if args.check:
        if current != text:
            print(f"{args.output} is out of date with config.Settings: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if current != text:
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
