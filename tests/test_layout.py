"""The layout's rules, checked on the source (no imports executed):

- nothing under `lightning_middleware/` imports `trainer_backend`, not even lazily in a function;
- no import cycles between the modules of the three packages, nor between their sub-packages
  (arrows between folders run one way: `gateway` uses `capture` and `rewards`, never the reverse);
- no `from our_module import _private` anywhere (packages, tests, benchmarks);
- no two modules share a basename unless they play the same role in their folders (`SAME_ROLE`);
- no source module over 1,000 lines (size follows role: a cohesive module that reads top to bottom
  may be long; this catches a module that has become two), and every sub-package says what lives in it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("lightning_middleware", "adapters", "trainer_backend")
MAX_LINES = 1000


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources(*tops: str) -> dict[str, Path]:
    out = {}
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _sources(*PACKAGES)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, *, include_type_checking: bool) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every import, at any depth."""
    package = module if _is_package(module) else module.rpartition(".")[0]

    def walk(node: ast.AST) -> Iterator[tuple[str, list[str], int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not include_type_checking:
                for other in child.orelse:
                    yield from walk(other)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, [], child.lineno
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                yield base, [a.name for a in child.names], child.lineno
            yield from walk(child)

    yield from walk(tree)


def _is_package(module: str) -> bool:
    path = MODULES.get(module)
    return path is not None and path.name == "__init__.py"


def _edges(module: str, path: Path) -> set[str]:
    """Our modules `module` imports at run time: `from pkg import sub` points at pkg.sub."""
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for target, names, _line in _imports(tree, module, include_type_checking=False):
        if target.split(".")[0] not in PACKAGES:
            continue
        subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
        if subs and len(subs) == len(names):
            out.update(subs)
            continue
        out.update(subs)
        while target and target not in MODULES:  # `import a.b.c` of a module we don't have as a file
            target = target.rpartition(".")[0]
        if target and target != module:
            out.add(target)
    return out


def test_core_never_imports_the_trainer() -> None:
    bad = []
    for module, path in MODULES.items():
        if not module.startswith("lightning_middleware"):
            continue
        tree = ast.parse(path.read_text(), str(path))
        for target, _names, line in _imports(tree, module, include_type_checking=True):
            if target.split(".")[0] == "trainer_backend":
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    graph = {m: _edges(m, p) for m, p in MODULES.items()}
    assert _cycles(graph) == []


def _folder(module: str) -> str:
    """The sub-package a module lives in (`lightning_middleware.gateway`), or the module itself
    when it sits at a package's top (`lightning_middleware.records`)."""
    head = ".".join(module.split(".")[:2])
    return head if head != module and _is_package(head) else module


def folder_graph() -> dict[str, set[str]]:
    """Imports between folders, at run time; a package's `__init__` (its public surface,
    re-exporting from its folders) is no folder of its own."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        if module in PACKAGES:
            continue
        here = _folder(module)
        graph.setdefault(here, set()).update(
            _folder(t) for t in _edges(module, path) if t not in PACKAGES and _folder(t) != here)
    return graph


def test_arrows_between_folders_run_one_way() -> None:
    graph = folder_graph()
    assert {"lightning_middleware.capture", "lightning_middleware.asgi"} <= graph["lightning_middleware.gateway"]
    assert _cycles(graph) == []


# Basenames several folders use for the same role: a package's CLI and configuration, its protocols,
# and the two sides (the gateway's, the in-process transport's) of format translation.
SAME_ROLE = {"__init__", "cli", "config", "base", "translation"}


def test_a_basename_names_one_role() -> None:
    """A newcomer guesses the file from its name: `labelling.py` was both a web app and advantage
    labelling, `responses.py` both the Responses API and raw ASGI replies."""
    seen: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        seen.setdefault(path.stem, []).append(module)
    shared = {name: mods for name, mods in seen.items() if len(mods) > 1 and name not in SAME_ROLE}
    assert not shared, shared


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_private_names_imported_across_modules() -> None:
    ours = {*PACKAGES, "tests", "bench"}
    bad = []
    for module, path in _sources(*PACKAGES, "tests", "bench").items():
        tree = ast.parse(path.read_text(), str(path))
        for target, names, line in _imports(tree, module, include_type_checking=True):
            if target.split(".")[0] not in ours:
                continue
            private = [n for n in [*target.split(".")[1:], *names] if n.startswith("_") and not n.startswith("__")]
            if private:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {', '.join(private)} from {target}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module: str) -> None:
    lines = MODULES[module].read_text().count("\n")
    assert lines <= MAX_LINES, f"{module} has {lines} lines (limit {MAX_LINES}): split it by role"


def test_every_package_says_what_lives_in_it() -> None:
    missing = [m for m, p in MODULES.items()
               if p.name == "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing
