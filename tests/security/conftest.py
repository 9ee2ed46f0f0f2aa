"""Fixtures of the security tests: real small file systems (tmpfs, read-only or tiny) where the machine lets
the tests mount them (root in a container: yes; else the test is skipped), and the legacy run fixture."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


class Tmpfs:
    """A mounted tmpfs at ``path``; ``read_only()`` remounts it read-only."""

    def __init__(self, path: Path, size: str):
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]})")

    def read_only(self) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)`` -> a mounted `Tmpfs` under tmp_path, unmounted after the test."""
    mounted: list[Tmpfs] = []

    def make(size: str = "300k", name: str = "fs") -> Tmpfs:
        if not shutil.which("mount"):
            pytest.skip("no mount command")
        m = Tmpfs(tmp_path / name, size)
        mounted.append(m)
        return m

    yield make
    for m in mounted:
        m.unmount()


@pytest.fixture
def shared_tmp():
    """A scratch folder another uid can traverse (mode 0755 up to /tmp): pytest keeps its own base folder 0700
    and re-applies that whenever a pytest starts on the machine, so tests run as another uid cannot use it."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="fastmt-security-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def run_as_nobody(scratch: Path, code: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``python -c code args`` as uid/gid 65534 (``setpriv``; root only) on a copy of the packages in ``scratch``
    (mode 0755): the checkout itself may sit in a folder other users cannot enter (a 0700 home), so the code runs
    from a copy that uid can read. Skips when this is not root, there is no setpriv, or that uid cannot reach the
    interpreter's own packages (a virtual environment inside such a folder)."""
    import os
    import sys

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to run code as another uid")
    code_dir = scratch / "code"
    if not code_dir.exists():
        for pkg in ("data", "train", "models", "kernels"):
            shutil.copytree(REPO / pkg, code_dir / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        for p in [code_dir, *code_dir.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code_dir), *site]), "HOME": str(scratch),
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", os.path.realpath(sys.executable)]
    probe = subprocess.run([*cmd, "-c", "import numpy, torch, sentencepiece"], cwd=scratch, env=env,
                           capture_output=True, text=True, timeout=timeout)
    if probe.returncode != 0:
        pytest.skip(f"uid {NOBODY} cannot import the interpreter's packages here: {probe.stderr.strip()[-200:]}")
    return subprocess.run([*cmd, "-c", code, *args], cwd=scratch, env=env, capture_output=True, text=True,
                          timeout=timeout)


MEMORY_CAP = 4 * 2**30  # what a probe's child may map: a bug reads /dev/zero into a MemoryError, not the machine's RAM


def capped(args: list[str], *, timeout: int = 180, stdin=None, cwd: Path = REPO, env: dict | None = None,
           ) -> subprocess.CompletedProcess:
    """``python args`` in a child whose address space is capped (`MEMORY_CAP`, which also stops thousands of
    threads being made) and that is killed after ``timeout`` s: a probe that would hang or fill the memory on a
    build without the checks fails in bounded time and memory. A hang comes back as returncode None."""
    import os
    import resource
    import sys

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    try:
        return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout, preexec_fn=limits, stdin=stdin)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(args, None, e.stdout or "", f"{e.stderr or ''}\n(hung: killed after "
                                                                         f"{timeout} s)")


def one_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    """The one ``error:`` line of a command that refused (exit 2, no traceback), holding every needle."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


LEGACY_CKPT = FIXTURES / "legacy-run" / "checkpoints" / "step-00000003.pt"


def forged_checkpoint(path: Path, **sections) -> Path:
    """The committed legacy checkpoint (a trusted fixture) with config sections changed, e.g.
    ``eval={"beam_size": 10**6}``, saved at ``path``."""
    import torch

    ckpt = torch.load(LEGACY_CKPT, weights_only=False)
    for name, changes in sections.items():
        ckpt["config"][name].update(changes)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


def legacy_run(tmp_path: Path, name: str = "legacy") -> Path:
    """A copy of the committed legacy run folder at ``tmp_path/runs/<name>`` (a fastmt run of an earlier format)."""
    run = tmp_path / "runs" / name
    shutil.copytree(FIXTURES / "legacy-run", run)
    return run


def victim(tmp_path: Path, text: str = "precious\n") -> Path:
    """A file of the user's that an attack tries to overwrite, truncate or delete."""
    p = tmp_path / "victim.txt"
    p.write_text(text)
    return p
