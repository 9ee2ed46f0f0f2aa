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


def victim(tmp_path: Path, text: str = "precious\n") -> Path:
    """A file of the user's that an attack tries to overwrite, truncate or delete."""
    p = tmp_path / "victim.txt"
    p.write_text(text)
    return p
