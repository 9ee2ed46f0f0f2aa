"""The run lock: one writer per run folder, ``fcntl.flock`` on ``<run_dir>/.lock``.

The kernel drops the lock when the holder exits, however it exits (kill -9 included), so a lock file left
behind never blocks. Local file systems only: flock over NFS depends on the client. POSIX only
(``fcntl``); nothing here imports torch. Forked children (DataLoader workers) do not keep it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Any

from data.files import (
    LOCK_MAX,
    MIB,
    BadFileError,
    FileRefusedError,
    open_nofollow,
    parse_json,
    read_bytes,
)
from data.ownership import ownership_problem, swap_problem
from train.errors import UserError

LOCK_NAME = ".lock"
CMDLINE_MAX = 4 * MIB  # /proc/<pid>/cmdline (the kernel's argument limit is 2 MB)


def _one_line(text: Any, limit: int = 300) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


class RunLockedError(UserError, RuntimeError):
    """Another live process holds the run folder's lock."""


def _same_file(fd: int, path: Path) -> bool:
    """True when ``fd`` is still the file at ``path`` (not removed or replaced since it was opened)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read_holder(fd: int) -> dict[str, Any]:
    """What the holder wrote in the lock file (at most `LOCK_MAX` bytes of the fd `open_nofollow` checked); a line
    that does not parse (torn, not JSON, nested too deeply) is shown as it is, cut."""
    raw = os.pread(fd, LOCK_MAX, 0).decode("utf-8", "replace")
    try:
        info = parse_json(raw, "run lock")
    except BadFileError:
        info = None
    return info if isinstance(info, dict) else {"raw": _one_line(raw, 120)}


def _command_line(pid: int) -> str | None:
    try:
        raw = read_bytes(f"/proc/{pid}/cmdline", "command line", limit=CMDLINE_MAX)
    except (OSError, ValueError):
        return None
    return _one_line(raw.replace(b"\0", b" ").decode("utf-8", "replace"), 200) or None


_HELD: weakref.WeakSet[RunLock] = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) shares the parent's lock: close its copy, so the lock
    dies with the parent, and mark its RunLocks unheld, so the child never removes the parent's file."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


class RunLock:
    """An exclusive, non-blocking ``flock`` on ``<run_dir>/.lock``, held for a run's life.

    ``acquire()`` creates the folder if needed and fails at once with ``RunLockedError`` naming the
    holder (PID, host, start time, command line) when another open of the file holds it — another
    process, or this one through a second ``RunLock``. A link (or anything but a regular file) at ``.lock`` is
    refused in one line (``data.files.FileRefusedError``), never followed. The file holds the holder's PID, host, start
    time and argv as JSON; ``release()`` removes it. Use as a context manager or acquire/release.
    Forked children do not keep it (their copy is closed at fork), so it ends with this process.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        if self._fd is not None:
            raise RuntimeError(f"{self.path} is already locked by this RunLock")
        self.check_owner()
        for _ in range(10):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.check_owner()  # (made by someone else between the check and the mkdir)
            fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT, 0o644, "run lock")  # a planted link: refused
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read_holder(fd) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
                os.close(fd)
                if holder is None:
                    raise
                raise RunLockedError(self._busy_message(holder)) from None
            # the holder before us may have removed (released) the file between our open and flock:
            # then we hold a lock on a file nobody else will open, so start over on the current one
            if _same_file(fd, self.path):
                break
            os.close(fd)
        else:
            raise RunLockedError(f"{self.path} kept being replaced while locking it; is something deleting it?")
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "argv": _command_line(os.getpid())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        _HELD.add(self)
        return self

    def check_owner(self) -> None:
        """Refuse (`data.files.FileRefusedError`, one line) a run folder that another user owns or may change, or
        one that a folder above it lets another user swap: they could redirect ``checkpoints/`` or replace what
        the run writes. Checked before the lock file is made, so a refusal writes nothing."""
        here = self.run_dir
        if here.exists():
            problem = ownership_problem(here)
        else:
            while not here.exists() and here != here.parent:
                here = here.parent
            problem = swap_problem(here, "a folder the run folder would be made in")
        if problem:
            raise FileRefusedError(f"run folder {self.run_dir}: {problem}: fastmt writes a run only where nobody else "
                                   f"can change it (they could redirect its checkpoints). Fix: give --run.out_dir a "
                                   f"folder of yours that only you may write")

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in that order, so a waiter never keeps a stale file)."""
        fd, self._fd = self._fd, None
        _HELD.discard(self)
        if fd is None:
            return
        try:
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:  # a dropped holder (e.g. a Trainer never fit) frees the name
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down os/pathlib
            pass

    def _busy_message(self, holder: dict[str, Any]) -> str:
        pid, host = holder.get("pid"), holder.get("host")
        if pid is None:
            who = "another process (it has not written its PID yet" + (
                f"; the file reads {holder['raw']!r})" if holder.get("raw") else ")")
            kill = "stop that process"
        else:
            local = host in (None, socket.gethostname())
            cmd = (_command_line(pid) if local else None) or holder.get("argv") or "command line unknown"
            this = " (this process)" if local and pid == os.getpid() else ""
            who = f"PID {pid}{this} on {host or 'this host'}, started {holder.get('started', '?')}: {cmd}"
            kill = f"stop it (kill {pid})" + ("" if local else f" on {host}")
        return (f"run folder {self.run_dir} is in use by {who}. Wait for that run to finish, {kill}, "
                f"or start this one under another --run.name")
