"""CPU threads adapted while a run trains: every core when the machine is ours, one thread while others use it.

PyTorch's CPU kernels run their parallel regions on OpenMP threads, which wait for each other at the end of every
region. OpenMP's default wait spins (fastest on a machine of one's own); the passive wait sleeps (safe beside other
programs, slower alone). Measured on a shared 2-core machine (bench/results/cpu-threads.md, issue 45): alone,
spinning threads trained the tiny preset's 3 toy epochs in 8.3-8.5 s against 9.7 s passive; beside one busy
neighbour from another login, spinning took 200-214 s (0.04x: a thread spins through the time slices of the thread
whose core the neighbour took) and passive 10.1 s; beside two, passive 19.6 s, while one thread keeps ~0.9x.

So a training run keeps OpenMP's spinning wait (train/cli/cpu_wait.py leaves training's policy alone) and this
adapter watches the machine: every ``interval_s`` it measures how much of the cores this process may use went to
*other* programs (the busy time of those cores in /proc/stat, less this process's and its children's CPU time), and
sets ``torch.set_num_threads`` to the cores left over (at least 1, at most the run's ``run.cpu_threads`` or torch's
own count). It goes down at once (a spinning thread beside a neighbour costs the most) and back up only after two
windows agree (no flapping). A neighbour at a low priority in this run's own scheduler group (``nice make test`` in
the same terminal) takes a core only while this run leaves it idle, so the measure alone would keep a run at one
thread beside it: every ``probe_s`` a reduced run tries its full count for one window and keeps it if the others'
share falls (the neighbour yields), paying at most one slow window when it does not. With one thread nothing waits, whatever the policy. ``run.cpu_adapt false`` keeps the
count fixed. Reads /proc only (Linux); elsewhere, or when /proc cannot be read, it does nothing.

The adapter is polled from the training thread (between optimizer steps, and between decoding batches through
`poll`): OpenMP's thread count is a setting of the thread that starts the parallel regions.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_busy_ticks(cpus: set[int], proc: Path, text: str | None = None) -> tuple[int, int] | None:
    """(busy, total) clock ticks of ``cpus`` since boot, from /proc/stat's per-CPU lines (None: unreadable);
    ``text``: /proc/stat as read earlier."""
    if text is None:
        try:
            text = (proc / "stat").read_text()
        except OSError:
            return None
    busy = total = 0
    seen = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        v = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
        if len(v) < 8:
            return None
        total += sum(v)
        busy += sum(v) - v[3] - v[4]
        seen += 1
    return (busy, total) if seen else None


def _tree_ticks(pid: int, proc: Path) -> int:
    """CPU clock ticks (user + system) of process ``pid`` and its living descendants (data workers, builds)."""
    ticks, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            stat = (proc / str(p) / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
            for task in (proc / str(p) / "task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or no children file (an older kernel): its time is simply not counted
    return ticks


def snapshot(proc: Path = PROC) -> tuple[float, str, int] | None:
    """(time, /proc/stat, this process tree's CPU ticks) now: the start of a first window (None: unreadable)."""
    try:
        return time.monotonic(), (proc / "stat").read_text(), _tree_ticks(os.getpid(), proc)
    except OSError:
        return None


AT_IMPORT = snapshot()  # a training's first window starts here, at its imports: its first count is set before it builds


class ThreadAdapter:
    """Sets torch's CPU thread count from the share of this process's cores that other programs take."""

    def __init__(self, max_threads: int, *, interval_s: float = 0.5, probe_s: float = 30.0, proc: Path = PROC,
                 set_threads: Callable[[int], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] | None = None, pid: int | None = None,
                 since: tuple[float, str, int] | None = None):
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.proc, self.clock, self.log, self.set_threads = proc, clock, log, set_threads
        self.pid = os.getpid() if pid is None else pid
        try:
            self.cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = set(range(os.cpu_count() or 1))
        self.max_threads = max(1, min(int(max_threads), len(self.cpus)))
        self.threads = self.max_threads
        self.interval_s, self.probe_s = interval_s, probe_s
        self._probing = False
        self._before_probe = self.max_threads
        self._reduced_since = 0.0
        self.changes = 0  # how many times the count changed
        self.lowest = self.max_threads
        self.others = 0.0  # cores other programs used in the last window
        self._up_votes = 0
        self._last = self._sample()
        self.works = self._last is not None
        fresh = since is not None and self.works and 0 < self._last[0] - since[0] < 60.0  # (a long process: stale)
        busy = _cpu_busy_ticks(self.cpus, proc, since[1]) if fresh else None
        if busy is not None:  # the first window started earlier (`snapshot`): the first poll may decide at once
            self._last = (since[0], busy[0], since[2])

    def _sample(self) -> tuple[float, int, int] | None:
        cpu = _cpu_busy_ticks(self.cpus, self.proc)
        if cpu is None:
            return None
        return self.clock(), cpu[0], _tree_ticks(self.pid, self.proc)

    def target(self, others: float) -> int:
        """Threads for a window in which other programs used ``others`` cores: the cores left, rounded so that a
        neighbour using a third of a core or more takes its core away."""
        free = len(self.cpus) - others
        return max(1, min(self.max_threads, int(free + 0.35)))

    def poll(self) -> int:
        """Measure the last window (at most every ``interval_s``) and set the thread count; returns it."""
        if not self.works or self.clock() - self._last[0] < self.interval_s:
            return self.threads
        now = self._sample()
        if now is None:
            self.works = False
            return self.threads
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        wall_ticks = (t1 - t0) * _TICKS
        if wall_ticks <= 0:
            return self.threads
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall_ticks
        want = self.target(self.others)
        if self._probing:  # the window at the full count: keep it if the others yielded, else back down quietly
            self._probing = False
            if want < self.threads:
                self.set_threads(self._before_probe)
                self.threads = self._before_probe
                self._reduced_since = t1
            else:
                self.threads = self._before_probe
                self._set(self.max_threads)
            return self.threads
        if want < self.threads:
            self._up_votes = 0
            self._set(want)
        elif want > self.threads:
            self._up_votes += 1
            if self._up_votes >= 2:
                self._up_votes = 0
                self._set(want)
        else:
            self._up_votes = 0
            if self.threads < self.max_threads and t1 - self._reduced_since >= self.probe_s:
                self._probing = True  # try the full count for the next window
                self._before_probe = self.threads
                self._reduced_since = t1
                self.set_threads(self.max_threads)
                self.threads = self.max_threads
        return self.threads

    def _set(self, n: int) -> None:
        if self.log is not None and self.changes < 5:
            self.log(f"cpu threads: {self.threads} -> {n} (other programs used {self.others:.1f} of the "
                     f"{len(self.cpus)} cores this run may use; run.cpu_adapt)"
                     + ("; further changes are counted in the summary" if self.changes == 4 else ""))
        self.set_threads(n)
        self.threads = n
        self._reduced_since = self._last[0]
        self.changes += 1
        self.lowest = min(self.lowest, n)

    def restore(self) -> None:
        """The run is over: uninstall this adapter (`poll` no longer drives it) and put back the thread count it
        started with, so what runs next in this process (a test, an export) gets the threads it asked for."""
        global _active
        if _active is self:
            _active = None
        if self.threads != self.max_threads:
            self.set_threads(self.max_threads)
            self.threads = self.max_threads

    def summary(self) -> str | None:
        if not self.changes:
            return None
        return (f"cpu threads: changed {self.changes} time(s) while other programs used the cores "
                f"({self.lowest}-{self.max_threads} threads; now {self.threads})")


_active: ThreadAdapter | None = None


def install(adapter: ThreadAdapter | None) -> None:
    """Make ``adapter`` the one `poll` drives (None: none)."""
    global _active
    _active = adapter


def poll() -> None:
    """Poll the installed adapter, if any (decoding loops call this between batches)."""
    if _active is not None:
        _active.poll()
