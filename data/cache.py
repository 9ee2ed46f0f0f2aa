"""The data cache under ``cfg.cache_dir``: keys, locks, atomic publishing, self-healing, file modes.

Layout (every entry immutable once published; fastmt owns everything in here):
  index/<ident>.json     file identity key -> the corpus entry it resolved to (the O(1) warm-start lookup)
  corpus-<key>/          one cleaned, split, encoded corpus (`data.build`): meta.json, .npy arrays, texts
  spm-<key>/             a SentencePiece model (spm.model) and its settings.json
  toy/                   the generated toy corpus
  locks/<key>.lock       flock(2) files: one builder per key; the others wait, then map the result
  .tmp-<key>-<pid>-*     a build in progress; left behind only by a killed build, removed at the next start

Keys. ``ident`` hashes the settings and each input file's identity (real path, size, mtime_ns, ctime_ns,
inode, device): a warm start stats the files and reads one small JSON, never the corpus. When ``ident``
misses (a new file, an edit, a ``touch``), the files' bytes are hashed (sha256, streaming) into the content
key; equal content reuses the entry, so a ``touch`` costs one read of the files, not a rebuild. An edit in
place changes mtime/ctime (ctime cannot be set back by ``touch -r``), so it is always detected.

Healing. An entry that fails to load or validate (truncated, empty or garbage files, a missing part) is
removed with a one-line warning and rebuilt. Files and folders are created with the modes the umask gives
(0644/0755 under umask 022), so a cache shared between users stays readable.

Safety (`data.files`): keys read from index and meta files must be the 20-hex-digit form `digest` writes (else
the record is damaged: reported, never joined into a path); every removal and rename stays inside the cache;
lock files are opened without following links; JSON records go through the one atomic writer. A cache the
process cannot write (read-only mount, another user's) is read without any lock or write: a complete entry
is used, a missing one fails in one line naming ``--data.cache_dir``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

from . import files as F
from .files import umask  # noqa: F401 - re-exported (the cache's modes follow it)
from .ownership import ownership_problem

TMP_PREFIX = ".tmp-"
_HELD: set[int] = set()  # fds of the locks this process holds (forked build workers close their copies)


def digest(obj) -> str:
    """20 hex digits of sha256 over ``obj`` as canonical JSON."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def file_identity(path: str) -> dict:
    """What a warm start compares instead of the bytes: real path, size, mtime_ns, ctime_ns, inode, device."""
    st = os.stat(path)
    return {"path": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "dev": st.st_dev}


def content_hash(paths, block: int = 1 << 20) -> str:
    """sha256 over the files' bytes (each prefixed by its size), read in 1 MiB blocks."""
    h = hashlib.sha256()
    for p in paths:
        with F.open_read(p, "data file") as f:
            h.update(f"{os.fstat(f.fileno()).st_size}\n".encode())
            while chunk := f.read(block):
                h.update(chunk)
    return h.hexdigest()[:32]


def mkdirs(path: Path) -> Path:
    """``mkdir -p`` with the umask's modes (what ``Path.mkdir`` does; stated because temp folders do not)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def _open_lock(path: Path) -> int | None:
    """The lock file's fd (made if missing, never through a link); None when the cache cannot be written
    (read-only, another user's) and the file is missing: a reader then needs no lock (entries are published
    by an atomic rename, so nothing half-built is ever visible)."""
    try:
        return F.open_nofollow(path, os.O_RDWR | os.O_CREAT, 0o666, "lock file")
    except OSError as e:
        if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
    try:
        return F.open_nofollow(path, os.O_RDONLY, what="lock file")  # flock works on a read-only fd
    except FileNotFoundError:
        return None


def writable(cache: Path) -> bool:
    """May this process write in ``cache``? Not on a read-only mount, nor without permission, nor in a cache that
    another user owns or that group/others may change (`data.ownership.ownership_problem`, at every folder above it
    too): such a cache is used read-only (a complete entry is read, nothing is built, locked or recorded)."""
    try:
        return (os.access(cache, os.W_OK | os.X_OK) and not os.statvfs(cache).f_flag & os.ST_RDONLY
                and ownership_problem(cache) is None)
    except OSError:
        return False


def why_read_only(cache: Path) -> str:
    """A few words on why `writable` says no (for the log line of a read-only cache)."""
    try:
        if os.statvfs(cache).f_flag & os.ST_RDONLY:
            return "a read-only file system"
    except OSError as e:
        return e.strerror or str(e)
    return ownership_problem(cache) or f"user {os.geteuid()} may not write in it"


def subfolder(cache: Path, name: str) -> Path:
    """``<cache>/<name>`` made if missing; a link there is refused (fastmt never writes through one)."""
    path = Path(cache) / name
    F.refuse_link(path, "cache folder")
    return mkdirs(path)


@contextlib.contextmanager
def locked(cache: Path, key: str, log=print, what: str = "this data"):
    """Hold ``locks/<key>.lock`` exclusively (flock; released when the process dies, even by kill -9).
    Another holder is waited for, with one line naming its pid. In a cache this process cannot write, the
    lock is taken shared on an existing file, or not at all (nothing is written)."""
    folder = Path(cache) / "locks"
    if writable(cache):
        subfolder(cache, "locks")
    path = folder / f"{F.check_key(key)}.lock"
    fd = _open_lock(path) if folder.is_dir() else None
    if fd is None:
        yield
        return
    mine = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    kind = fcntl.LOCK_EX if mine else fcntl.LOCK_SH
    try:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = "".join(c for c in os.pread(fd, 32, 0).decode(errors="replace") if c.isdigit()) or "?"
            log(f"[data] waiting for process {holder}, which is building {what} ({path})")
            t0 = time.perf_counter()
            fcntl.flock(fd, kind)
            log(f"[data] done waiting ({time.perf_counter() - t0:.1f} s)")
        if mine:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD.add(fd)
        yield
    finally:
        _HELD.discard(fd)
        os.close(fd)  # closing releases the lock (once no forked child holds a copy: see `forget_locks`)


def forget_locks() -> None:
    """In a forked child: close the inherited copies of the parent's lock fds. A flock lives as long as any
    copy is open, so a worker that outlived a killed parent would otherwise hold the build lock forever."""
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


def _lock_is_free(cache: Path, key: str) -> bool:
    path = Path(cache) / "locks" / f"{key}.lock"
    try:
        fd = F.open_nofollow(path, os.O_RDONLY, what="lock file")
    except FileNotFoundError:
        return True
    except OSError:  # a link or something odd planted as a lock: leave that temp entry alone
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def temp_dir(cache: Path, key: str) -> Path:
    """A fresh ``.tmp-<key>-<pid>-<n>`` folder for a build of ``key`` (call it holding ``locked(key)``)."""
    for n in range(1000):
        path = Path(cache) / f"{TMP_PREFIX}{key}-{os.getpid()}-{n}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"cannot create a temp folder for {key} in {cache}")


def clean_stale_temps(cache: Path, log=print) -> int:
    """Remove the temp folders/files of builds that died (their key's lock is free); returns how many."""
    cache = Path(cache)
    removed = []
    entries = []
    for folder in (cache, cache / "index"):  # build folders; index files being written
        try:
            entries += list(os.scandir(folder))
        except FileNotFoundError:
            pass
    for e in entries:
        if not e.name.startswith(TMP_PREFIX):
            continue
        key = e.name[len(TMP_PREFIX):].split("-", 1)[0]
        if F.KEY_RE.match(key) and _lock_is_free(cache, key):
            remove(Path(e.path), cache)
            removed.append(e.name)
    if removed:
        log(f"[data] removed {len(removed)} temp entr{'y' if len(removed) == 1 else 'ies'} of interrupted builds "
            f"in {cache}: {', '.join(removed[:3])}{' ...' if len(removed) > 3 else ''}")
    return len(removed)


def remove(path: Path, cache: Path | None = None) -> None:
    """Remove a file or folder of the cache (missing is fine), never outside ``cache`` (default: the path's
    own folder) and never through a link (`data.files.remove_inside`)."""
    path = Path(path)
    F.remove_inside(path.parent if cache is None else cache, path)


def discard(path: Path, why: str, log=print, cache: Path | None = None) -> None:
    """Remove a cache entry that failed to load or validate, with one line saying which and why. In a cache this
    process may not write (read-only, another user's) the entry cannot be healed: `data.files.FileRefusedError`,
    one line naming it, the cause and the fix (never a crash on this and every later run)."""
    root = Path(path).parent if cache is None else Path(cache)
    if not writable(root):
        raise F.FileRefusedError(
            f"the data cache --data.cache_dir {root} holds a damaged entry {path} ({why}) and this process cannot "
            f"repair it ({why_read_only(root)}). Fix: ask the cache's owner to remove that entry, or give "
            f"--data.cache_dir a folder of your own")
    log(f"[data] warning: cache entry {path} is unusable ({why}); removing it and rebuilding")
    remove(path, cache)


def publish(tmp: Path, final: Path) -> bool:
    """Move a finished build folder into place atomically. If another process published ``final`` first, its
    entry stays and ``tmp`` is removed. Returns True when ours was published. (The folder and its files were
    made with the umask's modes: ``mkdir``, ``np.save`` and `data.files.atomic_write` all honour it.)"""
    try:
        F.rename_inside(tmp.parent, tmp, final)
        return True
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.is_dir():
            raise
        remove(tmp)
        return False


def write_json(path: Path, obj) -> None:
    """Write JSON atomically (`data.files.atomic_write`: a temp file ``.tmp-<stem>-<pid>-*`` in the same folder,
    which `clean_stale_temps` recognises, then rename), mode from the umask, never through a link."""
    path = Path(path)
    F.atomic_write(path, json.dumps(obj, indent=1, ensure_ascii=False),
                   prefix=f"{TMP_PREFIX}{path.stem}-{os.getpid()}-", what="cache record")


def read_json(path: Path, limit: int = F.RECORD_MAX):
    """Parsed JSON through `data.files.read_json`, or raises ValueError/OSError (the caller heals): a regular file
    at most ``limit`` bytes, no link followed below the cache (every record lies one folder down in it: ``index/``,
    ``corpus-<key>/``, ``spm-<key>/``), so a FIFO or ``/dev/zero`` planted in a shared cache never hangs the read
    or fills the memory, and a parse failure of any kind is one line."""
    path = Path(path)
    return F.read_json(path, "cache record", limit=limit, inside=path.parent.parent)
