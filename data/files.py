"""Safe file operations for the folders fastmt owns (the data cache, run folders) and the files it writes there.

Threat model: another user of a shared machine, or a file copied in from someone else, may have planted links,
poisoned records or odd files in a cache or run folder. So:

- **No write follows a symlink.** Records and checkpoints are written by `atomic_write` (a ``mkstemp`` file in
  the target folder, fsync, ``os.replace``, folder fsync); lock files and appended logs are opened by
  `open_nofollow` (``O_NOFOLLOW``, ``O_EXCL`` when made new, a regular file checked). A target that is a
  symbolic link is refused in one line naming it (`FileRefusedError`).
- **Nothing is removed or renamed outside the folder that owns it.** `remove_inside` / `rename_inside` check
  that the path (its parent resolved, the last component itself never followed) lies inside ``root``.
- **Names read from files are checked** before they become path components (`check_key`: exactly the hex form
  fastmt writes).
- **An OSError on a path the user named** (a cache, an output folder) becomes one line naming the path, the
  cause and the fix (`os_error_line`, `FileRefusedError`): exit code 2 in every command.

Nothing here imports torch or train/ (data/ never imports train/).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from .clean import DataInputError

KEY_RE = re.compile(r"^[0-9a-f]{20}$")  # data.cache.digest: 20 lower-case hex digits


class FileRefusedError(DataInputError):
    """A file or folder fastmt refuses to use (a planted link, a path outside the folder it owns, a name read
    from a file that is not one fastmt writes) or that the operating system refused (read-only, no space,
    permission denied, ...). One line naming the path, the cause and the fix; exit code 2."""


# ----------------------------------------------------------------------------------------------
# names and containment
# ----------------------------------------------------------------------------------------------
def check_key(value, what: str = "key") -> str:
    """``value`` if it is a cache key fastmt writes (20 lower-case hex digits); else ``ValueError`` (the
    caller treats the record as damaged: it is reported and never joined into a path)."""
    if not isinstance(value, str) or not KEY_RE.match(value):
        raise ValueError(f"{what} {str(value)[:60]!r} is not a cache key (20 hex digits)")
    return value


def _real(path: Path) -> Path:
    """``path`` with its folder resolved and its last component kept as it is (a link is not followed)."""
    path = Path(path)
    return path.parent.resolve() / path.name


def is_inside(root: str | os.PathLike, path: str | os.PathLike) -> bool:
    """True when ``path`` (last component not followed) lies strictly inside the resolved ``root``."""
    root_r, real = Path(root).resolve(), _real(Path(path))
    return Path(path).name not in ("", ".", "..") and real != root_r and real.is_relative_to(root_r)


def check_inside(root: str | os.PathLike, path: str | os.PathLike, action: str) -> Path:
    """``path``, refused (`FileRefusedError`) unless it lies inside ``root``: what fastmt may ``action``."""
    if not is_inside(root, path):
        raise FileRefusedError(f"refusing to {action} {path}: it is not inside {root}, the folder fastmt owns "
                               f"there (a damaged or planted record names it); nothing was changed")
    return Path(path)


def remove_inside(root: str | os.PathLike, path: str | os.PathLike) -> None:
    """Remove the file, link or folder ``path`` inside ``root`` (missing is fine). A link is removed itself,
    never followed; a folder's contents are removed without following links (``shutil.rmtree``)."""
    path = check_inside(root, path, "remove")
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def rename_inside(root: str | os.PathLike, src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """``os.rename(src, dst)`` with both inside ``root``; returns ``dst``."""
    check_inside(root, src, "move")
    check_inside(root, dst, "move a file to")
    os.rename(src, dst)
    return Path(dst)


# ----------------------------------------------------------------------------------------------
# opening and writing without following links
# ----------------------------------------------------------------------------------------------
def refuse_link(path: str | os.PathLike, what: str = "file") -> None:
    """`FileRefusedError` when ``path`` is a symbolic link (fastmt never writes through one)."""
    if Path(path).is_symlink():
        raise FileRefusedError(f"{what} {path} is a symbolic link (to {os.readlink(path)}): fastmt never writes "
                               f"through a link, which someone else may have planted; remove the link")


def check_regular(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` if it is a regular file itself (not a link, FIFO, device or folder), else `FileRefusedError`:
    for readers that open by name (numpy, SentencePiece), which a planted FIFO would block."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return Path(path)  # the reader says it is missing
    if not stat.S_ISREG(mode):
        raise FileRefusedError(f"{what} {path} is not a regular file (a link, FIFO, device or folder): remove it")
    return Path(path)


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o666, what: str = "file") -> int:
    """``os.open`` that never follows a link at ``path`` and only opens a regular file: a link is refused in
    one line (`FileRefusedError`); other ``OSError``s propagate. Returns the fd."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.EEXIST and Path(path).is_symlink()):
            refuse_link(path, what)
        if e.errno == errno.ENXIO:  # a FIFO without a reader (or a socket) planted there
            raise FileRefusedError(f"{what} {path} is not a regular file: remove it") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileRefusedError(f"{what} {path} is not a regular file: remove it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_own(path: str | os.PathLike) -> IO[bytes]:
    """``open(path, "rb")`` of a file this process's user wrote (a build's own scratch file, e.g. a pickle it
    reads back): a link, or a file another user made (swapped into a shared cache), is refused."""
    fd = open_nofollow(path, os.O_RDONLY, what="scratch file")
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise FileRefusedError(f"scratch file {path} belongs to another user: fastmt reads back only what it wrote; "
                               f"is someone else writing in this cache?")
    return os.fdopen(fd, "rb")


def append_text(path: str | os.PathLike, text: str, what: str = "log") -> None:
    """Append ``text`` to ``path`` (created with the umask's mode), never through a symbolic or hard link."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666, what)
    try:
        if os.fstat(fd).st_nlink > 1:  # a hard link to someone's file (fastmt's own logs never have one)
            raise FileRefusedError(f"{what} {path} has other hard links: fastmt appends only to a file of its own; "
                                   f"remove it")
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def umask() -> int:
    """The process umask, read without changing it (Linux: /proc/self/status; else set-and-restore)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync a folder (a rename in it is then durable); file systems that cannot are skipped."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[IO[bytes]], None], *,
                 prefix: str | None = None, what: str = "file") -> Path:
    """The one atomic writer: ``path`` ends up holding ``data`` (bytes, text, or what ``data(file)`` writes)
    or keeps its old content, never a part. A ``mkstemp`` file in the same folder (random name, ``O_EXCL``,
    made with the umask's mode: a shared cache stays readable), fsync, ``os.replace``, folder fsync. A link at
    ``path`` is refused (`FileRefusedError`). ``prefix``: the temp file's name prefix (default
    ``.<name>.tmp-<pid>-``, which `train.runs.folder.remove_stale_temp_files` recognises)."""
    path = Path(path)
    refuse_link(path, what)
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):  # (tests swap in /dev/full: never chmod a device)
            os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


# ----------------------------------------------------------------------------------------------
# OSErrors on paths the user named: one line, the cause and the fix
# ----------------------------------------------------------------------------------------------
def _mount_point(path: Path) -> Path:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p):
        p = p.parent
    return p


_CAUSES = {
    errno.EROFS: "it is on a read-only file system",
    errno.EACCES: "permission denied (user {uid})",
    errno.EPERM: "operation not permitted (user {uid})",
    errno.ENOSPC: "no space left on the device ({free} free)",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.ENAMETOOLONG: "a name in it is too long for the file system",
    errno.EISDIR: "it is a folder",
    errno.ELOOP: "too many symbolic links (or a link where none may be)",
    errno.EIO: "an I/O error (check the disk: dmesg)",
    errno.ENOMEM: "out of memory",
    errno.EMFILE: "too many open files (ulimit -n)",
    errno.EINVAL: "the file system refuses this name",
    errno.EILSEQ: "the file system refuses this name's characters",
    errno.EXDEV: "it crosses file systems",
}


def cause_of(e: OSError, path: str | os.PathLike | None = None) -> str:
    """A few words for ``e``'s errno (free space added for ENOSPC)."""
    free = "?"
    if e.errno == errno.ENOSPC and path is not None:
        with contextlib.suppress(OSError):
            free = f"{shutil.disk_usage(_mount_point(Path(path))).free / 2**20:.1f} MB"
    text = _CAUSES.get(e.errno)
    if text is None:
        return (e.strerror or str(e)).rstrip(".")
    return text.format(uid=os.geteuid(), free=free)


def os_error_line(e: OSError, what: str, path: str | os.PathLike, fix: str) -> str:
    """``cannot use <what> <path>: <cause> (<file it failed on>). Fix: <fix>`` on one line."""
    on = f" (at {e.filename})" if getattr(e, "filename", None) and str(e.filename) != str(path) else ""
    return " ".join(f"cannot use {what} {path}: {cause_of(e, path)}{on}. Fix: {fix}".split())


@contextlib.contextmanager
def explain_os_errors(what: str, path: str | os.PathLike, fix: str) -> Iterator[None]:
    """Turn an ``OSError`` raised inside the block (other than one already explained) into a one-line
    `FileRefusedError` naming ``what`` ``path``, the cause and ``fix``."""
    try:
        yield
    except FileRefusedError:
        raise
    except OSError as e:
        if isinstance(e, DataInputError) or e.errno not in _CAUSES:  # a message already, or not the file system's
            raise
        raise FileRefusedError(os_error_line(e, what, path, fix)) from e
