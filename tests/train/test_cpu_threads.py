"""Issue 45 class 10: a CPU training adapts its thread count to what other programs take of its cores
(train/cpu_threads.py). The rule is checked on a fake /proc with a fake clock (exact tick counts, no timing); the
/proc readers on this machine's own /proc; the Trainer's wiring with a scripted adapter. The speed it buys, quiet and
beside busy neighbours, is measured, not tested: bench/results/cpu-threads.md."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from train import cpu_threads
from train.cpu_threads import ThreadAdapter, _cpu_busy_ticks, _tree_ticks

TICKS = cpu_threads._TICKS


class FakeProc:
    """A /proc holding ``cores`` CPUs' counters, this process (``pid``) and one child, advanced by hand."""

    def __init__(self, root: Path, cores: int, pid: int = 100, child: int = 101):
        self.root, self.cores, self.pid, self.child = root, cores, pid, child
        self.busy = [0] * cores
        self.idle = [0] * cores
        self.own = {pid: 0, child: 0}
        self.now = 0.0
        (root / str(pid) / "task" / str(pid)).mkdir(parents=True)
        (root / str(child) / "task" / str(child)).mkdir(parents=True)
        (root / str(pid) / "task" / str(pid) / "children").write_text(f"{child} ")
        (root / str(child) / "task" / str(child) / "children").write_text("")
        self.write()

    def write(self) -> None:
        lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
        for k in range(self.cores):  # user nice system idle iowait irq softirq steal guest guest_nice
            lines.append(f"cpu{k} {self.busy[k]} 0 0 {self.idle[k]} 0 0 0 0 0 0")
        (self.root / "stat").write_text("\n".join(lines) + "\n")
        for p, ticks in self.own.items():  # utime and stime are fields 14 and 15; a comm with a space and a ")"
            fields = ["S", "1", *["0"] * 9, str(ticks), "0", *["0"] * 30]
            (self.root / str(p) / "stat").write_text(f"{p} (py thon) x) {' '.join(fields)}\n")

    def advance(self, seconds: float, *, others: float, own: float, child: float = 0.0) -> None:
        """``seconds`` pass in which other programs use ``others`` cores, this process ``own``, its child ``child``."""
        self.now += seconds
        used = others + own + child
        assert used <= self.cores + 1e-9
        total = round(seconds * TICKS)
        for k in range(self.cores):  # spread the busy time over the cores
            b = round(total * used / self.cores)
            self.busy[k] += b
            self.idle[k] += total - b
        self.own[self.pid] += round(total * own)
        self.own[self.child] += round(total * child)
        self.write()


@pytest.fixture
def machine(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    proc = FakeProc(tmp_path, cores=2)
    calls: list[int] = []
    notes: list[str] = []
    adapter = ThreadAdapter(2, interval_s=0.5, probe_s=30.0, proc=tmp_path, set_threads=calls.append,
                            clock=lambda: proc.now, log=notes.append, pid=proc.pid)
    assert adapter.works and adapter.threads == 2
    return proc, adapter, calls, notes


def test_a_neighbour_takes_a_core_and_the_run_drops_to_one_thread_at_once(machine):
    proc, adapter, calls, notes = machine
    proc.advance(0.6, others=0.02, own=1.98)  # alone: the run's two threads keep both cores
    assert adapter.poll() == 2 and calls == []
    proc.advance(0.6, others=1.0, own=1.0)  # a busy loop of another login took a core
    assert adapter.poll() == 1 and calls == [1]
    assert adapter.others == pytest.approx(1.0, abs=0.05)
    assert len(notes) == 1 and "2 -> 1" in notes[0] and "run.cpu_adapt" in notes[0]


def test_the_count_comes_back_only_after_two_quiet_windows(machine):
    proc, adapter, calls, _ = machine
    proc.advance(0.6, others=1.0, own=1.0)
    adapter.poll()
    proc.advance(0.6, others=0.0, own=1.0)  # the neighbour ended: one quiet window is not enough
    assert adapter.poll() == 1
    proc.advance(0.6, others=1.0, own=1.0)  # it was a pause: the vote starts again
    assert adapter.poll() == 1
    proc.advance(0.6, others=0.0, own=1.0)
    assert adapter.poll() == 1
    proc.advance(0.6, others=0.0, own=1.0)
    assert adapter.poll() == 2 and calls == [1, 2] and adapter.changes == 2
    assert "1-2 threads; now 2" in adapter.summary()


def test_the_runs_own_children_are_not_counted_as_neighbours(machine):
    """Data workers and builds are this run's: their CPU time is the run's, not another program's."""
    proc, adapter, calls, _ = machine
    proc.advance(0.6, others=0.0, own=1.0, child=1.0)
    assert adapter.poll() == 2 and calls == [] and adapter.others == pytest.approx(0.0, abs=0.02)


def test_a_light_neighbour_keeps_every_thread_and_a_third_of_a_core_does_not(machine):
    proc, adapter, calls, _ = machine
    proc.advance(0.6, others=0.2, own=1.8)
    assert adapter.poll() == 2
    proc.advance(0.6, others=0.4, own=1.6)
    assert adapter.poll() == 1 and calls == [1]


def test_no_measure_before_the_interval_and_never_more_than_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3}, raising=False)
    proc = FakeProc(tmp_path, cores=4)
    calls: list[int] = []
    adapter = ThreadAdapter(3, interval_s=0.5, proc=tmp_path, set_threads=calls.append, clock=lambda: proc.now,
                            pid=proc.pid)
    assert adapter.max_threads == 3
    proc.advance(0.2, others=2.0, own=1.0)
    assert adapter.poll() == 3 and calls == []  # within the interval: nothing read, nothing set
    proc.advance(0.4, others=2.0, own=1.0)
    assert adapter.poll() == 2  # two of the four cores taken: two left
    for _ in range(2):
        proc.advance(0.6, others=0.0, own=2.0)
        adapter.poll()
    assert adapter.threads == 3 and calls == [2, 3]  # back to the cap (run.cpu_threads 3), not the 4 cores


def test_a_reduced_run_probes_its_full_count_and_keeps_it_when_the_neighbour_yields(machine):
    """A nice-19 neighbour in the run's own scheduler group takes a core only while the run leaves it idle."""
    proc, adapter, calls, notes = machine
    proc.advance(0.6, others=1.0, own=1.0)
    adapter.poll()  # down to 1
    t_down = proc.now
    while proc.now - t_down < 30.0:  # the neighbour keeps the idle core: no change until the probe
        proc.advance(0.6, others=1.0, own=1.0)
        adapter.poll()
    assert calls[-1] == 2 and adapter.threads == 2 and adapter.changes == 1  # the probe: full count, not yet counted
    proc.advance(0.6, others=0.02, own=1.98)  # the neighbour yields to the run's second thread
    assert adapter.poll() == 2 and adapter.changes == 2 and "1 -> 2" in notes[-1]


def test_a_probe_beside_a_real_neighbour_goes_back_quietly(machine):
    proc, adapter, calls, notes = machine
    proc.advance(0.6, others=1.0, own=1.0)
    adapter.poll()
    t_down = proc.now
    while adapter.threads == 1:
        proc.advance(0.6, others=1.0, own=1.0)
        adapter.poll()
    assert proc.now - t_down >= 30.0
    proc.advance(0.6, others=1.0, own=1.0)  # the neighbour did not yield
    assert adapter.poll() == 1 and calls[-2:] == [2, 1] and adapter.changes == 1 and len(notes) == 1
    proc.advance(0.6, others=1.0, own=1.0)
    assert adapter.poll() == 1 and calls[-1] == 1  # no second probe before another 30 s


def test_restore_uninstalls_and_puts_the_starting_count_back(machine):
    proc, adapter, calls, _ = machine
    cpu_threads.install(adapter)
    proc.advance(0.6, others=1.0, own=1.0)
    adapter.poll()
    adapter.restore()
    assert calls == [1, 2] and adapter.threads == 2 and cpu_threads._active is None
    cpu_threads.poll()  # nothing installed: nothing measured
    assert calls == [1, 2]


def test_a_first_window_from_an_earlier_snapshot_decides_at_the_first_poll(tmp_path, monkeypatch):
    """A training's first window starts at its imports (`snapshot`): busy before it builds, it builds on one thread;
    a snapshot older than a minute (a long-lived process) is not used."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    proc = FakeProc(tmp_path, cores=2)
    monkeypatch.setattr(cpu_threads.os, "getpid", lambda: proc.pid)
    monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: proc.now)
    since = cpu_threads.snapshot(tmp_path)
    proc.advance(1.5, others=1.8, own=0.2)  # the imports: one thread of ours beside two busy neighbours
    calls: list[int] = []
    adapter = ThreadAdapter(2, proc=tmp_path, set_threads=calls.append, clock=lambda: proc.now, pid=proc.pid,
                            since=since)
    assert adapter.poll() == 1 and calls == [1]  # at once: no second window needed
    proc.advance(70.0, others=0.0, own=1.0)
    late = ThreadAdapter(2, proc=tmp_path, set_threads=calls.append, clock=lambda: proc.now, pid=proc.pid,
                         since=since)
    assert late.poll() == 2 and calls == [1]  # a stale snapshot: a window of its own first


def test_an_unreadable_proc_turns_the_adapter_off(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    calls: list[int] = []
    adapter = ThreadAdapter(2, proc=tmp_path / "absent", set_threads=calls.append, clock=lambda: 99.0)
    assert not adapter.works and adapter.poll() == 2 and calls == []
    proc = FakeProc(tmp_path, cores=2)
    now = [0.0]
    adapter = ThreadAdapter(2, proc=tmp_path, set_threads=calls.append, clock=lambda: now[0], pid=proc.pid)
    (tmp_path / "stat").write_text("cpu0 1 2\n")  # a damaged line: the adapter stops, the run goes on
    now[0] = 1.0
    assert adapter.poll() == 2 and not adapter.works and calls == []


def test_the_proc_readers_count_this_machine_and_a_child_process():
    """On this machine's own /proc: the usable cores' ticks grow, and a child's CPU time counts as the tree's."""
    cpus = set(os.sched_getaffinity(0))
    before = _cpu_busy_ticks(cpus, Path("/proc"))
    assert before is not None and 0 <= before[0] <= before[1]
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, time\n"
        "while sum(os.times()[:2]) < 0.3: pass\n"  # burn 0.3 s of CPU, then wait to be killed
        "print('done', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        own = _tree_ticks(os.getpid(), Path("/proc"))
        child_ticks = _tree_ticks(child.pid, Path("/proc"))
        assert child_ticks >= 0.3 * TICKS - 1
        assert own >= child_ticks  # the child is part of this process's tree
    finally:
        child.kill()
        child.wait()
    after = _cpu_busy_ticks(cpus, Path("/proc"))
    assert after[0] >= before[0] + 0.3 * TICKS - 1 and after[1] > before[1]


class Scripted(ThreadAdapter):
    """An adapter whose second poll drops to one thread (what a neighbour would cause), recording its polls."""

    polls = 0

    def __init__(self, max_threads, log=None, **_):
        self.max_threads = self.threads = self.lowest = max_threads
        self.changes, self.works, self.log, self.others, self.cpus = 0, True, log, 1.0, {0, 1}
        self._last = (time.monotonic(), 0, 0)
        self.set_threads = torch.set_num_threads

    def poll(self):
        Scripted.polls += 1
        if Scripted.polls == 2:
            self._set(1)
        return self.threads


def test_the_trainer_polls_between_steps_and_decoding_batches_and_reports_it(toy_bundle, tmp_path, monkeypatch):
    from tests.utils import tiny_trainer
    from train.runs.report import summary_lines

    monkeypatch.setattr(cpu_threads, "ThreadAdapter", Scripted)
    Scripted.polls = 0
    notes: list[str] = []
    torch.set_num_threads(2)  # (the package's fixture puts its one thread back)
    tr = tiny_trainer(toy_bundle, tmp_path, epochs=1, max_batches_per_epoch=3, max_sentences=4, log=notes.append)
    assert isinstance(tr.threads, Scripted) and cpu_threads._active is None  # installed by fit, not before
    seen = []
    monkeypatch.setattr(cpu_threads, "install", lambda a: (seen.append(a), setattr(cpu_threads, "_active", a)))
    summary = tr.fit()
    assert seen == [tr.threads] and Scripted.polls > 3  # every step (3) and every decoding batch of the validation
    assert any("2 -> 1" in n for n in notes) and "changed 1 time(s)" in summary["cpu_threads"]
    assert "now 1" in summary["cpu_threads"] and summary["cpu_threads"] in summary_lines(summary)
    # the run's end uninstalls it and puts back the count it started with (what runs next gets its threads)
    assert cpu_threads._active is None and torch.get_num_threads() == 2


def test_no_adapter_with_cpu_adapt_false_or_one_thread(toy_bundle, tmp_path):
    from tests.utils import tiny_config
    from train.loop import _thread_adapter

    torch.set_num_threads(2)
    cfg = tiny_config(tmp_path)
    assert isinstance(_thread_adapter(cfg, torch.device("cpu"), print), ThreadAdapter)
    assert cpu_threads._active is None  # built, not installed (fit installs it)
    cfg.run.cpu_adapt = False
    assert _thread_adapter(cfg, torch.device("cpu"), print) is None
    cfg.run.cpu_adapt = True
    torch.set_num_threads(1)
    assert _thread_adapter(cfg, torch.device("cpu"), print) is None
    assert _thread_adapter(cfg, torch.device("meta"), print) is None
