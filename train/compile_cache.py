"""Inductor's mega-cache: every compile artifact of a run in one file, loaded before the first compiled step.

``torch.compiler.save_cache_artifacts()`` serialises what this process compiled (Inductor's FX graphs,
AOTAutograd entries, Triton kernels, autotune results); ``torch.compiler.load_cache_artifacts()`` puts them
back into the local caches, so a second process (or a fresh machine given the file) compiles from hits.
The file lives in the private compile cache (train/compile.py `check_private`) as
``<cache>/mega/<key>.bin``; the key hashes what the artifacts depend on (`cache_key`: torch, Triton and
Python versions, the device and its capability, the model config and the compile settings), so another
version or another model never reads it.

The file holds code (Inductor unpickles what it holds, Triton loads kernels), so it is read only when it is a
regular file of this user that nobody else can write, as the folder itself (`read`): anything else is ignored
in one line (and replaced by this run's own file). A file that does not load (damaged, truncated) is ignored
in one line and rewritten after the first compiled step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MEGA_MAX = 4 * 2**30  # bytes: a mega-cache file larger than this is refused unread


def cache_key(cfg, device) -> str:
    """A hex digest of what the compiled artifacts depend on: versions, device, model config, compile settings."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dev: dict[str, Any] = {"type": device.type}
    if device.type == "cuda":
        dev["name"] = torch.cuda.get_device_name(device)
        dev["capability"] = list(torch.cuda.get_device_capability(device))
    else:
        dev["machine"] = platform.machine()
    whole = cfg.to_dict()
    parts = {
        "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
        "cuda": torch.version.cuda, "device": dev, "model": whole["model"],
        "run": {k: whole["run"].get(k) for k in ("precision", "compile_scope", "compile_backend", "compile_mode",
                                                  "compile_dynamic")},
        "optim": {k: whole["optim"].get(k) for k in ("name", "grad_clip", "accum_steps")},
        "data": {k: whole["data"].get(k) for k in ("batching", "max_tokens")},
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def _keys(info) -> set[tuple[str, str]]:
    """(artifact type, key) pairs of a ``torch.compiler`` ``CacheInfo``."""
    artifacts = getattr(info, "artifacts", None) or {}
    return {(kind, key) for kind, keys in artifacts.items() for key in keys}


def _problem(st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.geteuid():
        return f"it belongs to user {st.st_uid}, not to you ({os.geteuid()})"
    if st.st_mode & 0o022:
        return f"other users may write it (mode {stat.filemode(st.st_mode)})"
    if st.st_size > MEGA_MAX:
        return f"it is {st.st_size:,} bytes, more than any mega-cache ({MEGA_MAX:,})"
    return None


class MegaCache:
    """The mega-cache file of one configuration: ``load()`` at start, ``save()`` after the first compiled step.

    ``state`` after ``load``: "warm" (artifacts loaded), "cold" (no file), "damaged" (did not load) or
    "refused" (not a file of this user's that only this user can write). ``load_seconds`` / ``save_seconds``.
    """

    def __init__(self, root: str | os.PathLike, key: str, log: Callable[[str], Any] = print):
        self.path = Path(root) / "mega" / f"{key}.bin"
        self.log = log
        self.state = "cold"
        self.load_seconds = 0.0
        self.save_seconds = 0.0
        self._saved_digest: str | None = None
        self._loaded: set[tuple[str, str]] = set()  # (type, key) of the artifacts the file gave this process

    def load(self) -> str:
        """Load the file's artifacts into this process's compile caches, if it is there and safe to read."""
        import torch

        t0 = time.perf_counter()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            self.state = "cold"
            return self.state
        except OSError as e:  # a link (ELOOP) or unreadable: ignored, rewritten after the first step
            self.state = "refused"
            self.log(f"compile mega-cache {self.path}: cannot open it ({e.strerror or e}); ignored, it will be "
                     f"rewritten after the first step")
            return self.state
        with os.fdopen(fd, "rb") as f:
            problem = _problem(os.fstat(f.fileno()))
            if problem:
                self.state = "refused"
                self.log(f"compile mega-cache {self.path}: {problem}; it holds code, so it was ignored and will be "
                         f"replaced after the first step")
                return self.state
            data = f.read(MEGA_MAX + 1)
        torch_log = logging.getLogger("torch.compiler._cache")  # it logs a damaged file with a traceback
        level = torch_log.level
        torch_log.setLevel(logging.ERROR)
        try:
            info, why = torch.compiler.load_cache_artifacts(data), "its records do not parse"
        except Exception as e:  # noqa: BLE001 - damaged: one line, compiled cold, rewritten
            info, why = None, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
        finally:
            torch_log.setLevel(level)
        self.load_seconds = time.perf_counter() - t0
        if info is None:  # (torch answers None for a file it cannot read)
            self.state = "damaged"
            self.log(f"compile mega-cache {self.path} does not load ({why}); ignored, it will be rewritten after "
                     f"the first step")
            return self.state
        self.state = "warm"
        self._saved_digest = hashlib.sha256(data).hexdigest()
        self._loaded = _keys(info)
        return self.state

    def save(self) -> bool:
        """Write this process's artifacts (atomic, mode 0600) unless they are the file's already; True if written.
        A failure is one line: the cache is an optimisation, never a reason to stop a run."""
        import torch

        from data.files import atomic_write

        t0 = time.perf_counter()
        try:
            got = torch.compiler.save_cache_artifacts()
            if got is None:
                return False
            data, info = got
            digest = hashlib.sha256(data).hexdigest()
            if digest == self._saved_digest or not data or (self._loaded and _keys(info) <= self._loaded):
                return False  # nothing the file does not hold already
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
                self.path.unlink()
            old = os.umask(0o077)
            try:
                atomic_write(self.path, data, what="compile mega-cache")
            finally:
                os.umask(old)
            self._saved_digest = digest
            return True
        except Exception as e:  # noqa: BLE001 - an optimisation: say so, keep training
            self.log(f"compile mega-cache {self.path}: not written ({type(e).__name__}: "
                     f"{' '.join(str(e).split())[:160]})")
            return False
        finally:
            self.save_seconds += time.perf_counter() - t0


def mega_cache(cfg, device, log: Callable[[str], Any] = print) -> MegaCache:
    """The mega-cache of ``cfg`` on ``device`` in the run's private compile cache (``run.cache_dir``, else
    train/compile.py's default), checked private as the rest of that folder."""
    from train.compile import check_private, default_cache_dir

    root = check_private(Path(cfg.run.cache_dir) if cfg.run.cache_dir else default_cache_dir())
    return MegaCache(root, cache_key(cfg, device), log=log)
