"""Checkpoints off the training step's path: a snapshot in (pinned) CPU memory, written by one background thread.

A checkpoint is taken in two halves, as torchtitan's asynchronous checkpointing does. In the loop, ``snapshot``
walks the state: containers are rebuilt (a record the loop appends to afterwards is not the one written), small
tensors (counters, RNG states: under `DEFER_BYTES`) are copied at once, and every large storage (the flat
parameter buffers, the optimizer's moments) is only noted. In the writer thread, ``Snapshot.stage`` copies each
noted storage once (one ``copy_`` per storage) into staging buffers kept between checkpoints (`StagingPool`:
page-locked on CUDA, copied on a side stream after the loop's work up to the save), rebuilds the views the state
held over the copies (``torch.save`` then writes the same storages, the same file), and only then writes the
file. Until the copies are done nothing may change those tensors: the loop calls ``wait_staged`` before the next
optimizer step and before loading other weights into the model (usually the copy finished long before, during
the next forward and backward, which only read the weights).

``BackgroundWriter`` is the one writer: one thread, at most one pending job. The next checkpoint first waits for the
previous write (the queue is bounded at one: memory holds at most one snapshot being written plus the best weights),
and a write's error is raised in the loop at that wait, or at the final ``wait`` of the run. Each write is still the
atomic temp file + fsync + ``os.replace`` + folder fsync of ``data.files.atomic_write``, so a kill -9 during a write
leaves a temp file (removed when the run folder is next claimed) and every earlier checkpoint as it was.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

DEFER_BYTES = 1 << 20  # storages at least this large are copied in the writer thread, smaller ones in the loop


class StagingPool:
    """CPU storages reused from one checkpoint to the next (allocating and faulting in hundreds of MB each time
    would cost more than the copy). ``pin``: page-locked memory (CUDA: asynchronous device-to-host copies).
    A storage is lent by ``take`` until ``reset``; ``keep`` marks storages that outlive it (the best weights)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._all: list[torch.UntypedStorage] = []
        self._lent: set[int] = set()  # id() of storages in the current snapshot
        self._kept: set[int] = set()  # id() of storages held for longer (the best weights)

    def reset(self, keep: set[int]) -> None:
        """A new snapshot starts: every storage is free again except those in ``keep``."""
        self._lent, self._kept = set(), set(keep)

    def take(self, nbytes: int) -> torch.UntypedStorage:
        for st in self._all:
            i = id(st)
            if st.nbytes() == nbytes and i not in self._lent and i not in self._kept:
                self._lent.add(i)
                return st
        st = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin).untyped_storage()
        self._all.append(st)
        self._lent.add(id(st))
        return st


class _Deferred:
    """A tensor of the state whose storage is copied by ``Snapshot.stage``: where it lies in its storage."""

    __slots__ = ("key", "dtype", "offset", "size", "stride")

    def __init__(self, key, t: torch.Tensor):
        self.key, self.dtype = key, t.dtype
        self.offset, self.size, self.stride = t.storage_offset(), tuple(t.size()), tuple(t.stride())


class Snapshot:
    """A state being copied to CPU memory. ``state``: the copy (complete once ``stage`` ran: before that the
    large tensors are placeholders); ``stage()`` (the writer thread) copies the large storages; ``wait_staged()``
    (the loop) waits for that and returns the seconds waited; ``storage_ids(part)``: the staging storages that
    the tensors under a staged ``part`` view."""

    def __init__(self, state: Any, sources: dict, pool: StagingPool, event, small: dict, device=None):
        self.state, self._device = state, device
        self._sources = sources  # key -> the live storage, as a uint8 tensor
        self._pool, self._event = pool, event
        self._staged_storages: dict = dict(small)  # key -> staging storage
        self._done = threading.Event()
        self._error: BaseException | None = None
        if not sources and event is None:
            self._done.set()

    @property
    def staged(self) -> bool:
        """The copies are done and ``state`` complete (False also when ``stage`` failed: the writer reports it)."""
        return self._done.is_set() and self._error is None

    def stage(self) -> None:
        try:
            self._copy()
            self.state = self._fill(self.state)
        except BaseException as e:
            self._error = e
            raise
        finally:
            self._sources = {}  # (no reference to the live tensors is kept)
            self._done.set()

    def _copy(self) -> None:
        if self._event is not None:  # CUDA: a side stream, after everything the loop queued up to the save
            stream = torch.cuda.Stream(device=self._device)
            stream.wait_event(self._event)
            with torch.cuda.stream(stream):
                for key, src in self._sources.items():
                    dst = self._pool.take(src.numel())
                    torch.empty(0, dtype=torch.uint8).set_(dst).copy_(src, non_blocking=True)
                    self._staged_storages[key] = dst
            stream.synchronize()
            return
        for key, src in self._sources.items():
            dst = self._pool.take(src.numel())
            torch.empty(0, dtype=torch.uint8).set_(dst).copy_(src)
            self._staged_storages[key] = dst

    def _fill(self, o: Any) -> Any:
        if isinstance(o, _Deferred):
            return torch.empty(0, dtype=o.dtype).set_(self._staged_storages[o.key], o.offset, o.size, o.stride)
        if isinstance(o, dict):
            for k, v in o.items():
                if isinstance(v, (_Deferred, dict, list)):
                    o[k] = self._fill(v)
            return o
        if isinstance(o, list):
            for i, v in enumerate(o):
                if isinstance(v, (_Deferred, dict, list)):
                    o[i] = self._fill(v)
            return o
        return o

    def wait_staged(self) -> float:
        """Wait until the large storages are copied (the live tensors may change again); seconds waited."""
        if self._done.is_set():
            return 0.0
        t0 = time.perf_counter()
        self._done.wait()
        return time.perf_counter() - t0

    def storage_ids(self, part: Any) -> set[int]:
        """id() of the staging storages that the tensors under ``part`` (a piece of the staged ``state``) view."""
        owner = {st.data_ptr(): st for st in self._staged_storages.values()}
        ids: set[int] = set()
        stack = [part]
        while stack:
            o = stack.pop()
            if isinstance(o, torch.Tensor):
                st = owner.get(o.untyped_storage().data_ptr())
                if st is not None:
                    ids.add(id(st))
            elif isinstance(o, dict):
                stack.extend(o.values())
            elif isinstance(o, (list, tuple)):
                stack.extend(o)
        return ids


def snapshot(state: Any, pool: StagingPool, defer_bytes: int = DEFER_BYTES) -> Snapshot:
    """``state`` with every tensor to be copied into ``pool``'s CPU storages, storage by storage (views kept as
    views): storages under ``defer_bytes`` now, the others by ``Snapshot.stage``. Containers are rebuilt (tuples
    holding tensors become lists only inside `_Deferred` parents: none in a checkpoint), other leaves shared
    (ints, floats, strings, bytes) or deep-copied."""
    sources: dict = {}
    small: dict = {}
    cuda_device = None

    def tensor(t: torch.Tensor):
        nonlocal cuda_device
        t = t.detach()
        if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg() or t.device.type == "meta":
            return t.to("cpu", copy=True)
        src = t.untyped_storage()
        if src.nbytes() == 0:
            return t.to("cpu", copy=True)
        key = (str(src.device), src.data_ptr(), src.nbytes())
        if src.device.type == "cuda":
            cuda_device = src.device
        if src.nbytes() >= defer_bytes:
            if key not in sources:
                sources[key] = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src)
            return _Deferred(key, t)
        dst = small.get(key)
        if dst is None:
            dst = pool.take(src.nbytes())
            whole = torch.empty(0, dtype=torch.uint8, device=src.device).set_(src)
            torch.empty(0, dtype=torch.uint8).set_(dst).copy_(whole, non_blocking=src.device.type == "cuda")
            small[key] = dst
        return torch.empty(0, dtype=t.dtype).set_(dst, t.storage_offset(), t.size(), t.stride())

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return tensor(o)
        if isinstance(o, dict):
            out = o.__class__() if type(o) is not dict else {}
            for k, v in o.items():
                out[k] = walk(v)
            return out
        if isinstance(o, list):
            return [walk(v) for v in o]
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            items = [walk(v) for v in o]
            if any(isinstance(v, _Deferred) for v in items):
                raise TypeError("snapshot: a large tensor inside a tuple (store it in a list or a dict)")
            return tuple(items)
        if o is None or isinstance(o, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
            return o
        return copy.deepcopy(o)

    out = walk(state)
    event = None
    if cuda_device is not None:  # the small copies and the point the large ones start from, on the loop's stream
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(cuda_device))
    return Snapshot(out, sources, pool, event, small, device=cuda_device)


class BackgroundWriter:
    """One thread that runs one job at a time; ``submit`` hands it the next job (after ``wait``), ``wait``
    blocks until the current one is done and raises its error, if any. ``seconds``: time spent writing."""

    def __init__(self, name: str = "fastmt-checkpoint-writer"):
        self._cv = threading.Condition()
        self._job: Callable[[], Any] | None = None
        self._busy = False
        self._error: BaseException | None = None
        self._name = name
        self._thread: threading.Thread | None = None
        self.seconds = 0.0  # wall seconds the thread spent in jobs
        self.jobs = 0

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._busy

    def submit(self, job: Callable[[], Any]) -> None:
        with self._cv:
            if self._busy:
                raise RuntimeError("BackgroundWriter.submit: the previous job is still running (wait() first)")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._job, self._busy = job, True
            self._cv.notify_all()

    def wait(self) -> float:
        """Wait for the job in progress; returns the seconds waited. Raises the job's error (once)."""
        t0 = time.perf_counter()
        with self._cv:
            while self._busy:
                self._cv.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error
        return time.perf_counter() - t0

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None:
                    self._cv.wait()
                job, self._job = self._job, None
            t0 = time.perf_counter()
            error = None
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - handed to the loop at its next wait
                error = e
            with self._cv:
                self.seconds += time.perf_counter() - t0
                self.jobs += 1
                self._error = error
                self._busy = False
                self._cv.notify_all()
