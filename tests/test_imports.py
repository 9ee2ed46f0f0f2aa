"""The house plan's arrows, read from the source with ``ast`` (nothing is imported).

Every import of the first-party packages ``train/ models/ data/ kernels/`` is collected, at module level and
inside functions alike, and three rules are checked:

- no circle between modules (a function-level import closes a circle as surely as a top-level one: it is
  only later);
- ``models/``, ``data/`` and ``kernels/`` import nothing from ``train/`` (the arrows run down);
- the commands wing (``train.cli``, and the thin ``python -m`` entry modules that hand over to it) sits on
  top: nothing in the engine (``train/`` top level) or the run wing (``train.runs``) imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("train", "models", "data", "kernels")
# the documented `python -m` entry points of the commands, kept at their old paths: each only hands over to
# train.cli (checked below), so they belong to the commands wing
ENTRY_SHIMS = ("train.__main__", "train.translate", "train.evaluate", "train.stats", "train.commands",
               "train.export.__main__")
COMMANDS_WING = "train.cli"


def module_files() -> dict[str, Path]:
    """Every first-party module name -> its file (a package is its ``__init__``)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The first-party modules ``name`` imports anywhere in its file (``from a.b import c`` counts as
    ``a.b.c`` when that is a module, else as ``a.b``; relative imports are resolved)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.add(full if full in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imported_modules(name, path, known) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def in_commands_wing(module: str) -> bool:
    return module == COMMANDS_WING or module.startswith(COMMANDS_WING + ".") or module in ENTRY_SHIMS


def test_the_graph_is_read():
    """The reader finds the arrows it must find (a reader that found none would pass every rule)."""
    graph = import_graph()
    assert "models.decoding.state" in graph["models.transformer"]
    assert "models.decoding.decoder" in graph["models.decoding"]
    assert "kernels" in graph["models.layers"]
    assert any(m.startswith("train.") for m in graph["train.loop"])
    # a function-level import is read too (the train command imports the loop inside main())
    assert "train.loop" in graph["train.cli.train"]
    assert "train.cli.train" in graph["train.__main__"]


def test_no_circle_between_modules():
    found = circles(import_graph())
    assert not found, "import circles (module-level or inside functions): " + "; ".join(
        " -> ".join(c) for c in found)


def test_models_data_kernels_import_nothing_from_train():
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items() if not m.startswith("train")
                 for t in targets if t == "train" or t.startswith("train."))
    assert not bad, f"imports that run up into train/: {bad}"


def test_the_engine_and_the_run_wing_do_not_import_the_commands():
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, targets in graph.items()
                 if (m == "train" or m.startswith("train.")) and not in_commands_wing(m)
                 for t in targets if in_commands_wing(t))
    assert not bad, f"the engine or the run wing imports the commands wing: {bad}"


def test_entry_shims_only_hand_over_to_the_commands():
    """A ``python -m`` entry kept at its documented path is a shim: its first-party imports are the
    commands wing's, so it adds no arrow of its own."""
    graph = import_graph()
    for shim in ENTRY_SHIMS:
        if shim not in graph:
            continue
        others = {t for t in graph[shim] if not in_commands_wing(t)}
        assert not others, f"{shim} imports {sorted(others)}: an entry shim imports only train.cli"
