"""The import graph of our packages: no cycles, and imports flow `main -> app / serving -> models -> engine`.

Read from the source with `ast` (nothing is imported): every `import` and `from ... import` counts, at module
level, inside functions and under `TYPE_CHECKING` alike, since each is a dependency a reader has to follow.
`from pkg import name` is an edge to `pkg.name` when that is a module of ours, else to `pkg`. Package `__init__`
files count as modules (`app/__init__.py` is `app`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "serving", "engine", "models", "config")
TOP_MODULES = ("main",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def our_modules() -> dict[str, Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    files += [ROOT / f"{name}.py" for name in TOP_MODULES if (ROOT / f"{name}.py").exists()]
    return {module_name(p): p for p in files}


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """`name` itself when it is one of our modules, else the nearest enclosing one of ours (or None)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, modules: dict[str, Path]) -> Iterator[str]:
    path = modules[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            owner = _owner(target, modules)
            if owner is not None and owner != module:
                yield owner


def import_graph() -> dict[str, set[str]]:
    modules = our_modules()
    return {m: set(imports_of(m, modules)) for m in modules}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def edges_between(graph: dict[str, set[str]], source: str, targets: tuple[str, ...]) -> list[str]:
    """`a -> b` for every import from package `source` into one of `targets`."""
    def top(name: str) -> str:
        return name.split(".")[0]

    return sorted(f"{a} -> {b}" for a, deps in graph.items() if top(a) == source for b in deps if top(b) in targets)


# ---------------------------------------------------------------- the checker itself


def test_find_cycles_sees_a_cycle_and_only_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_relative_and_from_imports_resolve_to_our_modules(tmp_path):
    modules = our_modules()
    assert "app.deps" in modules and "serving.registry" in modules and "app" in modules
    graph = import_graph()
    assert "app.errors" in graph["app.deps"]  # `from app.errors import ...`
    assert "app.server" in graph["app"]  # app/__init__.py: `from app.server import create_app`


# ---------------------------------------------------------------- the rules


def test_no_import_cycle_among_our_modules():
    cycles = find_cycles(import_graph())
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_app_and_serving_have_no_cycle_between_them():
    graph = import_graph()
    sub = {m: {d for d in deps if d.split(".")[0] in ("app", "serving")} for m, deps in graph.items()
           if m.split(".")[0] in ("app", "serving")}
    assert find_cycles(sub) == []
    assert edges_between(graph, "app", ("serving",)) == [], "app/ reaches the registry through app.deps.ModelRouter"


def test_engine_imports_neither_models_nor_config():
    assert edges_between(import_graph(), "engine", ("models", "config")) == []


def test_config_imports_nothing_of_ours():
    assert edges_between(import_graph(), "config", ("app", "serving", "engine", "models", "main")) == []


def test_nothing_below_imports_the_http_edge():
    graph = import_graph()
    for package in ("engine", "models", "config"):
        assert edges_between(graph, package, ("app", "serving", "main", "main_models")) == []
