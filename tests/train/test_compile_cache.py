"""Inductor's mega-cache (train/compile_cache.py): keyed by versions, device, model and compile settings; a file
that is damaged, a link, or writable by others is ignored in one line and replaced; what a process compiled is
written once and loaded by the next process, whose compile then hits the cache."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from train.compile_cache import MegaCache, cache_key
from train.config import tiny

ROOT = Path(__file__).resolve().parents[2]


def test_the_key_follows_the_model_and_compile_settings_not_the_learning_rate():
    cfg = tiny()
    cpu = torch.device("cpu")
    key = cache_key(cfg, cpu)
    assert key == cache_key(tiny(), cpu)
    assert key == cache_key(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.5)), cpu)
    assert key != cache_key(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_ff=cfg.model.d_ff * 2)), cpu)
    assert key != cache_key(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, compile_mode="max-autotune")), cpu)


def _no_load(monkeypatch) -> list:
    calls: list = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: calls.append(data))
    return calls


def test_damaged_linked_or_shared_files_are_ignored_in_one_line_and_replaced(tmp_path, monkeypatch):
    logs: list[str] = []
    m = MegaCache(tmp_path, "k", log=logs.append)
    assert m.load() == "cold" and logs == []
    m.path.parent.mkdir(mode=0o700)
    m.path.write_bytes(b"not a cache")
    m.path.chmod(0o600)
    assert m.load() == "damaged" and len(logs) == 1 and str(m.path) in logs[0] and "does not load" in logs[0]
    calls = _no_load(monkeypatch)
    m.path.chmod(0o666)  # others may write it: code planted there would run
    assert m.load() == "refused" and "other users may write it" in logs[-1] and calls == []
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"x")
    m.path.unlink()
    m.path.symlink_to(target)
    assert m.load() == "refused" and "cannot open it" in logs[-1] and calls == []
    assert all("\n" not in line for line in logs)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artifacts", None))
    assert m.save() is True  # the link replaced by a file of ours, nobody else may read or write it
    assert not m.path.is_symlink() and m.path.read_bytes() == b"artifacts" and target.read_bytes() == b"x"
    assert m.path.stat().st_mode & 0o777 == 0o600
    assert m.save() is False  # the same artifacts: not written again


_PROBE = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = sys.argv[2]  # each process its own (empty) Inductor cache
    import torch
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from train.compile_cache import MegaCache

    inductor_config.fx_graph_cache = True
    inductor_config.compile_threads = 1
    mega = MegaCache(sys.argv[1], "probe", log=print)
    state = mega.load()
    y = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="inductor")(torch.arange(8.0))
    wrote = mega.save()
    print(json.dumps({"state": state, "hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"], "wrote": wrote, "y": y.tolist()}))
    """
)


@pytest.mark.slow  # two Inductor compiles on the CPU (C++): a minute or more each on 2 shared cores
def test_a_second_process_with_an_empty_inductor_cache_compiles_from_the_mega_cache(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    runs = []
    for name in ("first", "second"):
        out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "mega"), str(tmp_path / name)], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["state"] == "cold" and first["miss"] == 1 and first["hit"] == 0 and first["wrote"]
    assert second["state"] == "warm" and second["hit"] == 1 and second["miss"] == 0 and not second["wrote"]
    assert second["y"] == first["y"]
