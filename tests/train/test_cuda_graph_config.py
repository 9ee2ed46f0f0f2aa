"""Activation checkpointing x CUDA-graph trees (pytorch#154306): the pair is refused when the config is built,
in one line, before anything is written; the out-of-memory advice never leads a user into it.

Which compile settings replay CUDA graphs is read from the installed torch (``list_mode_options``), not from
our own list, so a torch that changes its modes fails here instead of on a GPU.
"""

from __future__ import annotations

import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from tests.utils import first_batches, tiny_trainer
from train.config import RunConfig, apply_overrides, get_config

ROOT = Path(__file__).resolve().parents[2]
MODES = typing.get_args(typing.get_type_hints(RunConfig)["compile_mode"])


def torch_says_cuda_graphs(run: RunConfig) -> bool:
    """torch's own answer: does this backend/mode replay compiled regions as CUDA graphs?"""
    if run.compile_backend == "cudagraphs":
        return True
    mode_options = torch._inductor.list_mode_options(run.compile_mode)
    return run.compile_backend == "inductor" and bool(mode_options.get("triton.cudagraphs", False))


@pytest.mark.parametrize("overrides", [
    {"model.checkpointing": "true"},  # the fast preset: reduce-overhead
    {"model.checkpointing": "true", "run.compile_mode": "max-autotune"},
    {"model.checkpointing": "true", "run.compile_mode": "default", "run.compile_backend": "cudagraphs"},
    {"model.checkpointing": "true", "run.compile": "none"},  # compile on wherever CUDA is
], ids=["fast", "max-autotune", "cudagraphs-backend", "compile-auto"])
def test_checkpointing_under_cuda_graphs_is_refused(overrides):
    with pytest.raises(ValueError, match=r"model\.checkpointing=true cannot run under CUDA graphs.*pytorch#154306"
                                         r".*--run\.compile_mode default") as err:
        apply_overrides(get_config("fast"), overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compile_flag", ["true", "false"])
def test_the_refusal_is_exactly_torch_s_cuda_graph_modes(mode, compile_flag):
    """Refused iff compiled with a mode torch replays as CUDA graphs; every other pair trains."""
    overrides = {"model.checkpointing": "true", "run.compile_mode": mode, "run.compile": compile_flag}
    base = get_config("fast")
    run = apply_overrides(base, {k: v for k, v in overrides.items() if k.startswith("run.")}).run
    hazard = compile_flag == "true" and torch_says_cuda_graphs(run)
    if hazard:
        with pytest.raises(ValueError, match="pytorch#154306"):
            apply_overrides(base, overrides)
    else:
        cfg = apply_overrides(base, overrides)
        assert cfg.model.checkpointing and cfg.run.compile_mode == mode


def test_cli_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "train", "--preset", "fast", "--model.checkpointing", "true",
                          "--run.out_dir", str(tmp_path / "runs")], cwd=tmp_path, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "pytorch#154306" in errors[0], out.stderr
    assert list(tmp_path.iterdir()) == []  # no run folder, no cache


def _advised_overrides(message: str) -> dict[str, str]:
    return dict(re.findall(r"--(\w+\.\w+) (\S+?)[,)]?(?=\s|$)", message))


@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
def test_out_of_memory_advice_is_a_config_that_trains(toy_bundle, tmp_path, monkeypatch, mode):
    """A step that runs out of memory names flags; applied to the run's config they give a config the refusal
    accepts, and with CUDA graphs on, checkpointing only together with a mode without graphs."""
    # inductor + reduce-overhead as on the GPU; nothing compiles: the step fails before the first call
    tr = tiny_trainer(toy_bundle, tmp_path, compile=True, compile_backend="inductor", compile_mode=mode)
    (batch,) = first_batches(tr, 1)

    def out_of_memory(*_args, **_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("train.loop.forward_backward", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as err:
        tr.train_step(batch)
    tr.close()
    advice = _advised_overrides(str(err.value))
    assert int(advice["data.max_tokens"]) < tr.cfg.data.max_tokens
    assert int(advice["optim.accum_steps"]) == 2 * tr.cfg.optim.accum_steps
    assert advice.get("model.checkpointing") == "true"
    fixed = apply_overrides(tr.cfg, advice)
    assert not (fixed.model.checkpointing and torch_says_cuda_graphs(fixed.run))
