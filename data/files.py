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

Which folders fastmt may write into at all (owned by this user, nobody else may swap them) is `data.ownership`.
Nothing here imports torch or train/ (data/ never imports train/).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from .clean import DataInputError

_BOM = b"\xef\xbb\xbf"  # UTF-8 byte-order mark
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
    """``open(path, "rb")`` of a file this process's user wrote (a build's own scratch file it reads back): a link,
    or a file another user made (swapped into a shared cache), is refused (`open_read` with ``own=True``)."""
    return open_read(path, "scratch file", own=True)


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
# reading: the one door for every byte fastmt did not just write
# ----------------------------------------------------------------------------------------------
# The size cap of each kind of file fastmt reads whole (bytes). A file over its cap is refused before a byte of
# it is read; what is read is read at most cap + 1 bytes long (a file that grows while it is read, or a procfs
# file whose size says 0, cannot exceed it either).
KIB, MIB, GIB = 2**10, 2**20, 2**30
RECORD_MAX = 16 * MIB  # a JSON record: run.json, config.json, provenance, index, settings, export records, --config
LOCK_MAX = 64 * KIB  # a lock file's holder line
LOG_MAX = 256 * MIB  # metrics.jsonl
TEXTS_MAX = 4 * GIB  # a cache entry's valid/test texts; a test set read whole by evaluate
TOKENIZER_MAX = 256 * MIB  # a SentencePiece model
CHECKPOINT_MAX = 256 * GIB  # a checkpoint (its records are bounded by its own size: train/runs/checkpoint.py)
CHUNK_MAX = 256 * MIB  # one chunk of a data file read at once (`data.sources`: ~8 MB chunks, or a .json array)


class BadFileError(FileRefusedError):
    """A file whose content does not parse (not UTF-8, not JSON, nested too deeply, a damaged array header): one
    line naming the file and the cause. A ``ValueError`` (through `DataInputError`), so every caller that heals a
    damaged record catches it."""


class ReadRefusedError(FileRefusedError, OSError):
    """A read `open_read` could not start for a reason other than a missing file (permission, a folder in the
    path replaced by a file or a link while it was read, an I/O error, ...): one line naming the file and the
    cause, and still an ``OSError`` carrying the ``errno`` (callers that heal or explain OS errors keep working)."""

    def __init__(self, message: str, code: int | None):
        OSError.__init__(self, code, message)

    def __str__(self) -> str:
        return str(self.strerror)


def _size(n: int) -> str:
    return f"{n:,} bytes" if n < MIB else f"{n / MIB:,.1f} MB"


def _parts_below(root: str | os.PathLike, path: str | os.PathLike) -> list[str]:
    """The components of ``path`` below ``root`` (both taken as written, made absolute, never resolved)."""
    root_a, path_a = os.path.abspath(root), os.path.abspath(path)
    rel = os.path.relpath(path_a, root_a)
    parts = Path(rel).parts
    if not parts or rel == "." or parts[0] == ".." or os.path.isabs(rel):
        raise FileRefusedError(f"{path} is not inside {root}, the folder fastmt reads it from")
    return list(parts)


def _open_beneath(root: str | os.PathLike, path: str | os.PathLike, flags: int, what: str) -> int:
    """``os.open(path)`` walking from ``root`` one component at a time with ``O_NOFOLLOW``: no link is followed
    anywhere below ``root`` (``root`` itself is the user's path, links and all)."""
    parts = _parts_below(root, path)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    here = Path(root)
    try:
        for part in parts[:-1]:
            here = here / part
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(here):
                    raise FileRefusedError(f"{what} {path}: {here} is a symbolic link (to {_link_target(here)}): "
                                           f"fastmt follows no link inside {root}; remove it") from None
                raise
            os.close(dfd)
            dfd = nfd
        return os.open(parts[-1], flags | os.O_NOFOLLOW, dir_fd=dfd)
    finally:
        os.close(dfd)


def open_read(path: str | os.PathLike, what: str, *, limit: int | None = None, inside: str | os.PathLike | None = None,
              own: bool = False) -> IO[bytes]:
    """The one way fastmt opens a file it did not just write: a binary reader of a **regular file** (a FIFO, device,
    socket or folder is refused before it is read: a FIFO would block, ``/dev/zero`` fill the memory), at most
    ``limit`` bytes long (refused by its size before a byte is read).

    ``inside``: the folder fastmt owns that holds ``path`` (a run folder, a cache, an export folder): no component
    below it may be a link (each is opened ``O_NOFOLLOW``), so a link planted there is refused, never read through.
    Without it ``path`` is one the user named, links followed (their own). ``own``: the file must belong to this
    user (a scratch file fastmt reads back). Refusals are `FileRefusedError` (one line naming ``what`` and the
    path); a missing file is ``FileNotFoundError``; any other OS error is `ReadRefusedError` (one line naming the
    file and the cause, and an ``OSError`` with its errno): never a raw ``OSError``, even when a folder of the path
    is swapped for a file or a link while it is read."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    try:
        if inside is not None:
            fd = _open_beneath(inside, path, flags, what)
        else:
            fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        if isinstance(e, DataInputError):  # a refusal of `_open_beneath` already
            raise
        if e.errno == errno.ELOOP:
            raise FileRefusedError(f"{what} {path} is a symbolic link (to {_link_target(path)}"
                                   f"): fastmt follows no link inside {inside}; remove it") from None
        if e.errno == errno.ENXIO:  # a socket, or a device without its driver
            raise FileRefusedError(f"{what} {path} is not a regular file: remove it") from None
        raise _read_refused(e, what, path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or
                    stat.S_ISBLK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file")
            raise FileRefusedError(f"{what} {path} is {kind}, not a regular file: fastmt reads only regular files "
                                   f"(a FIFO would block it, a device fill the memory); remove or replace it")
        if own and st.st_uid != os.geteuid():
            raise FileRefusedError(f"{what} {path} belongs to another user (uid {st.st_uid}): fastmt reads back only "
                                   f"what it wrote; is someone else writing in this folder?")
        if limit is not None and st.st_size > limit:
            raise FileRefusedError(f"{what} {path} is {_size(st.st_size)}; a {what} is at most {_size(limit)}: a "
                                   f"damaged or foreign file (nothing was read)")
        os.set_blocking(fd, True)
        f = open(fd, "rb", closefd=True)  # the one plain open of a checked descriptor
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError) and not isinstance(e, DataInputError):
            raise _read_refused(e, what, path) from None
        raise
    f.raw.name = os.fspath(path)  # (numpy's memory maps record it: the collators re-open maps by name)
    return f


def _link_target(path: str | os.PathLike) -> str:
    """Where the link ``path`` points, or ``?`` (it may be gone or replaced by now: a racing writer)."""
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def _read_refused(e: OSError, what: str, path: str | os.PathLike) -> ReadRefusedError:
    """The one line for an ``OSError`` of opening ``path`` to read (not a missing file): `ReadRefusedError`."""
    cause = cause_of(e, path)
    if e.errno in (errno.ENOTDIR, errno.EINVAL):  # a folder on the path swapped for a file while it was opened
        cause = f"{(e.strerror or 'refused').lower()} (did a folder on its path change while fastmt read it?)"
    return ReadRefusedError(" ".join(f"cannot read {what} {path}: {cause}".split()), e.errno)


def read_bytes(path: str | os.PathLike, what: str, *, limit: int, inside: str | os.PathLike | None = None,
               own: bool = False) -> bytes:
    """The bytes of ``path`` through `open_read` (never more than ``limit``), read into one buffer of the file's
    size (a file that grows while it is read, or a /proc file of size 0: in blocks up to the limit)."""
    with open_read(path, what, limit=limit, inside=inside, own=own) as f:
        size = os.fstat(f.fileno()).st_size
        if 0 < size <= limit:  # one buffer of the file's size (+1 byte to see it grow): never a second copy
            data = f.read(size + 1)
            if len(data) <= size:
                return data
            data = bytearray(data)
        else:
            data = bytearray()
        # in blocks, never a buffer of the whole cap at once (a 4 GB cap is not 4 GB of memory for a 1 KB file)
        while chunk := f.read(min(16 * MIB, limit + 1 - len(data))):
            data += chunk
            if len(data) > limit:  # it grew while being read (or procfs said 0)
                raise FileRefusedError(f"{what} {path} holds more than {_size(limit)}; a {what} is at most that")
    return bytes(data)


def decode_text(data: bytes, path: str | os.PathLike, what: str, *, bom: bool = True) -> str:
    """UTF-8 text (a leading byte-order mark dropped when ``bom``); a byte that is not UTF-8 is `BadFileError`
    naming the line."""
    if bom:
        data = data.removeprefix(_BOM)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise BadFileError(f"{what} {path}:{line}: byte 0x{data[e.start]:02x} is not UTF-8: a damaged or foreign "
                           f"file") from None


def read_text(path: str | os.PathLike, what: str, *, limit: int = RECORD_MAX, inside: str | os.PathLike | None = None,
              own: bool = False) -> str:
    """UTF-8 text of ``path`` through `open_read` (`decode_text`)."""
    return decode_text(read_bytes(path, what, limit=limit, inside=inside, own=own), path, what)


def parse_json(text: str | bytes, where: str | os.PathLike, what: str = "file") -> Any:
    """``json.loads(text)``, every way it can fail (bad syntax, not UTF-8, nested too deeply, too large a number,
    out of memory) one `BadFileError` line naming ``where`` (a file, or ``file:line``)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadFileError(f"{what} {where}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise BadFileError(f"{what} {where}: JSON nested too deeply to be a record fastmt wrote") from None
    except MemoryError:
        raise BadFileError(f"{what} {where}: out of memory parsing it") from None
    except (ValueError, TypeError) as e:  # UnicodeDecodeError, a number over the int digit limit
        raise BadFileError(f"{what} {where}: not valid JSON ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
                           ) from None


def read_json(path: str | os.PathLike, what: str, *, limit: int = RECORD_MAX, inside: str | os.PathLike | None = None,
              own: bool = False) -> Any:
    """The JSON document in ``path`` through `open_read` (`parse_json`; a byte-order mark is allowed)."""
    return parse_json(read_text(path, what, limit=limit, inside=inside, own=own), path, what)


def read_json_lines(path: str | os.PathLike, what: str, *, limit: int = LOG_MAX,
                    inside: str | os.PathLike | None = None) -> list[tuple[bytes, Any]]:
    """Each line of a JSON-lines file as ``(raw line with its newline, the parsed value or None)``: a line that is
    blank, torn or not JSON gives None, never an error (the file as a whole through `open_read`); a byte-order
    mark at the start of a line (the first or any other) is dropped before the line is parsed."""
    out = []
    for raw in read_bytes(path, what, limit=limit, inside=inside).splitlines(keepends=True):
        try:  # a byte-order mark opening a line (an editor's, or a file appended to one) is not part of the record
            text = raw.removeprefix(_BOM)
            value = parse_json(text.decode("utf-8"), path, what) if text.strip() else None
        except (BadFileError, UnicodeDecodeError):
            value = None
        out.append((raw, value))
    return out


def load_npy(path: str | os.PathLike, what: str = "array", *, inside: str | os.PathLike | None = None,
             own: bool = False, mmap: bool = True):
    """A ``.npy`` array through `open_read`: its header is checked against the file before anything is allocated
    (a plain number dtype in this machine's byte order: no objects, strings, unicode, void, structured or
    sub-array dtypes; and the shape it declares exactly the bytes the file holds), then memory-mapped
    read-only (``mmap``) or read. A damaged header is `BadFileError`, never an allocation or a crash."""
    import numpy as np

    with open_read(path, what, inside=inside, own=own) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"format version {version}")
            if dtype.hasobject or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise ValueError(f"dtype {dtype} / shape {shape} is not a plain array")
            if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
                raise ValueError(f"dtype {dtype.str} is not a plain number (fastmt writes only bool, int, uint, float)")
            if not dtype.isnative:
                raise ValueError(f"dtype {dtype.str} is not this machine's byte order (fastmt writes only that)")
            offset = f.tell()
            need = dtype.itemsize
            for n in shape:
                need *= n  # python ints: never overflows
            if offset + need != size:
                raise ValueError(f"its header declares {dtype}{tuple(shape)} = {need:,} bytes, the file holds "
                                 f"{size - offset:,} after the header")
        except (ValueError, TypeError, SyntaxError, OverflowError, EOFError, MemoryError, RecursionError) as e:
            raise BadFileError(f"{what} {path}: not a .npy array fastmt wrote ({' '.join(str(e).split())[:160]})"
                               ) from None
        order = "F" if fortran else "C"
        if mmap and need:
            return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=tuple(shape), order=order)
        a = np.fromfile(f, dtype=dtype, count=need // dtype.itemsize if dtype.itemsize else 0)
        return a.reshape(shape, order=order)


def sha256_file(path: str | os.PathLike, what: str = "file", *, inside: str | os.PathLike | None = None) -> str:
    """The sha256 of a regular file read through `open_read` in 1 MiB blocks (any size: nothing is kept)."""
    import hashlib

    h = hashlib.sha256()
    with open_read(path, what, inside=inside) as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def check_stored_zip(f: IO[bytes], path: str | os.PathLike, what: str) -> None:
    """Refuse (`BadFileError`) a zip archive (a torch checkpoint) whose records would inflate: every record must be
    stored uncompressed (what ``torch.save`` writes) and the records together no larger than the file, so nothing
    read from it can be larger than the file itself. ``f`` is read from its start and left there."""
    import zipfile

    size = os.fstat(f.fileno()).st_size
    try:
        f.seek(0)
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
        total = 0
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
                raise ValueError(f"its record {info.filename[:80]!r} is compressed ({info.compress_size:,} bytes "
                                 f"that inflate to {info.file_size:,}); torch.save stores records as they are")
            total += info.file_size
        if total > size:
            raise ValueError(f"its records declare {total:,} bytes, more than the file's {size:,}")
    except zipfile.BadZipFile as e:
        raise BadFileError(f"{what} {path} is not a torch zip checkpoint ({e}); fastmt writes only those") from None
    except (ValueError, OverflowError, EOFError, RecursionError, MemoryError) as e:
        raise BadFileError(f"{what} {path}: {' '.join(str(e).split())[:200]}: refused before loading (a decompression "
                           f"bomb or a damaged file)") from None
    finally:
        f.seek(0)


def fd_path(f: IO[bytes]) -> str:
    """A name for the file already opened (checked) as ``f``, for a library that opens by name (``torch.load``'s
    memory map): ``/proc/self/fd/N`` reaches that very file, whatever is now at its path."""
    return f"/proc/self/fd/{f.fileno()}"


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
    errno.EFBIG: "a file would pass this process's file-size limit (ulimit -f: {fsize})",
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
    """A few words for ``e``'s errno (free space added for ENOSPC, the file-size limit for EFBIG)."""
    free = "?"
    if e.errno == errno.ENOSPC and path is not None:
        with contextlib.suppress(OSError):
            free = f"{shutil.disk_usage(_mount_point(Path(path))).free / 2**20:.1f} MB"
    text = _CAUSES.get(e.errno)
    if text is None:
        return (e.strerror or str(e)).rstrip(".")
    return text.format(uid=os.geteuid(), free=free, fsize=fsize_limit())


def fsize_limit() -> str:
    """This process's file-size limit (RLIMIT_FSIZE) in words."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else _size(soft)


def os_error_line(e: OSError, what: str, path: str | os.PathLike, fix: str) -> str:
    """``cannot use <what> <path>: <cause> (<file it failed on>). Fix: <fix>`` on one line."""
    on = f" (at {e.filename})" if getattr(e, "filename", None) and str(e.filename) != str(path) else ""
    if e.errno == errno.EFBIG:  # no folder has room past this limit: it is the process's
        fix = "raise the file-size limit of this shell (ulimit -f unlimited) or of the job that started fastmt"
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
