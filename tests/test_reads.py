"""One door for every foreign byte, read from the source with ``ast`` (nothing is imported).

Every read of a file goes through the safe-file layer, ``data/files.py`` (`data.files.open_read` and the readers
built on it: a regular file only, no link followed below the folder fastmt owns, a size cap per kind of file,
every parse failure one line). This test fails on any other ``open`` (for reading), ``Path.open`` /
``.read_text`` / ``.read_bytes``, ``json.load``, ``np.load``, ``torch.load``, ``pickle.load`` or read-only
``os.open`` in the packages and the benchmark scripts. The exemptions below are listed one by one with their reason,
and each must still match a call (a stale exemption fails too).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("train", "models", "data", "kernels", "bench")
SAFE_LAYER = "data/files.py"

# (file, function or "*", call) -> why it may read by itself
EXEMPT = {
    ("train/runs/checkpoint.py", "_torch_load", "torch.load"):
        "loads the file object (or its /proc/self/fd name) that data.files.open_read opened and checked",
    ("bench/aot.py", "*", "read_bytes"): "the lead's AOT build hashes the repository's own kernel sources",
    ("bench/aot.py", "*", "read_text"): "the lead's AOT build reads back the manifest it wrote",
    ("bench/harness.py", "*", "read_text"): "reads back the log its own child process wrote",
    ("bench/eole_peer.py", "*", "read_text"): "reads back the logs and translations its own eole child wrote",
    ("bench/race.py", "*", "read_text"): "reads back the logs and records its own children wrote, and /proc/loadavg",
    ("bench/race.py", "*", "torch.load"): "loads (weights_only) the HF weights its own child saved",
    ("train/compile_cache.py", "load", "os.open"): "opens the mega-cache with O_NOFOLLOW and checks its owner and "
                                                  "mode on the descriptor before torch reads it",
    ("bench/harness.py", "*", "Path.open"): "reads back the benchmark CSV it appends to",
    ("bench/report.py", "*", "read_text"): "edits the repository's own README.md",
    ("bench/data_scale.py", "*", "open"): "reads /proc of its own children and the corpus it measures",
    ("bench/data_scale.py", "*", "Path.open"): "reads the stand-in corpus and the CSV it writes",
    ("bench/data_scale.py", "*", "read_text"): "prints back the report it just wrote",
    ("bench/profile.py", "*", "Path.open"): "compresses the trace the profiler just wrote",
    ("bench/profile.py", "*", "read_text"): "prints back the report it just wrote",
    ("bench/runner.py", "*", "read_text"): "reads back the spec and events files it wrote for its own child",
    ("train/cpu_threads.py", "*", "read_text"): "reads the kernel's /proc counters (CPU ticks), never a user's file",
}

_READ_METHODS = {"read_text", "read_bytes"}
_LOADERS = {("json", "load"), ("np", "load"), ("numpy", "load"), ("torch", "load"), ("pickle", "load")}


def _mode(call: ast.Call, position: int) -> str | None:
    """The mode argument of an open call when it is a literal string (None: absent or computed)."""
    args = call.args[position:position + 1] or [k.value for k in call.keywords if k.arg == "mode"]
    if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
        return args[0].value
    return None if not args else "?"


def _writes(mode: str | None) -> bool:
    return mode is not None and mode != "?" and any(c in mode for c in "wax")


def _os_open_reads(call: ast.Call) -> bool:
    """``os.open(path, flags)`` whose flags name no write access (O_WRONLY / O_RDWR) nor a folder (O_DIRECTORY)."""
    names = {n.attr for a in call.args[1:2] for n in ast.walk(a) if isinstance(n, ast.Attribute)}
    return not names & {"O_WRONLY", "O_RDWR", "O_DIRECTORY"}


def reads(path: Path) -> list[tuple[str, str, int]]:
    """``(function, call, line)`` of every file read in ``path`` that does not go through the safe layer."""
    tree = ast.parse(path.read_text(), str(path))  # (the test reads the repository's own sources)
    found = []
    layer = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)  # `from data import files as F`
             and (n.module in ("data", None) or n.module == "data.files") for a in n.names if a.name == "files"}

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call):
                f = child.func
                call = None
                if isinstance(f, ast.Name) and f.id == "open" and not _writes(_mode(child, 1)):
                    call = "open"
                elif isinstance(f, ast.Attribute):
                    base = f.value.id if isinstance(f.value, ast.Name) else None
                    if base in layer:
                        call = None  # the safe layer's own readers (F.read_bytes, files.read_json, ...)
                    elif (base, f.attr) in _LOADERS:
                        call = f"{base if base != 'numpy' else 'np'}.{f.attr}"
                    elif f.attr in _READ_METHODS:
                        call = f.attr
                    elif base == "os" and f.attr == "open":
                        call = "os.open" if _os_open_reads(child) else None
                    elif base == "io" and f.attr == "open" and not _writes(_mode(child, 1)):
                        call = "open"
                    elif f.attr == "open" and base not in ("os", "io", "gzip", "tarfile", "zipfile") \
                            and not _writes(_mode(child, 0)):
                        call = "Path.open"
                    elif f.attr == "open" and base == "gzip" and not _writes(_mode(child, 1)):
                        call = "Path.open"
                if call:
                    found.append((inner, call, child.lineno))
            visit(child, inner)

    visit(tree, "*")
    return found


def all_reads() -> dict[tuple[str, str, str], list[int]]:
    out: dict[tuple[str, str, str], list[int]] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == SAFE_LAYER:
                continue
            for func, call, line in reads(path):
                out.setdefault((rel, func, call), []).append(line)
    return out


def _exempt(key: tuple[str, str, str]) -> tuple[str, str, str] | None:
    rel, func, call = key
    for k in ((rel, func, call), (rel, "*", call)):
        if k in EXEMPT:
            return k
    return None


def test_the_reader_finds_reads():
    """The scanner finds what it must (a scanner that found nothing would pass every rule)."""
    src = ("import json, numpy as np, torch, os\nfrom pathlib import Path\n"
           "def f(p):\n    open(p)\n    open(p, 'w')\n    Path(p).read_text()\n    json.load(open(p, 'rb'))\n"
           "    np.load(p)\n    torch.load(p)\n    Path(p).open()\n    Path(p).open('a')\n    os.open(p, os.O_RDONLY)\n"
           "    os.open(p, os.O_WRONLY | os.O_CREAT)\n")
    probe = ROOT / "tests" / ".reads_probe.py"
    probe.write_text(src)
    try:
        got = sorted((c, n) for _, c, n in reads(probe))
    finally:
        probe.unlink()
    assert got == sorted([("open", 4), ("read_text", 6), ("json.load", 7), ("open", 7), ("np.load", 8),
                          ("torch.load", 9), ("Path.open", 10), ("os.open", 12)])


def test_every_read_goes_through_the_safe_layer():
    bad = {k: v for k, v in all_reads().items() if _exempt(k) is None}
    assert not bad, ("reads outside data/files.py (use data.files.open_read / read_bytes / read_json / load_npy): "
                     + "; ".join(f"{rel}:{lines} {func}() {call}" for (rel, func, call), lines in sorted(bad.items())))


def test_every_exemption_is_still_used():
    used = {_exempt(k) for k in all_reads()}
    stale = sorted(set(EXEMPT) - used)
    assert not stale, f"exemptions that match no read any more (remove them): {stale}"
