"""Compilation in seconds: regional compilation traces one graph per block type (not per layer), never
recompiles on packed batches, breaks no graph, and a second process reuses the on-disk caches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.utils import first_batches, tiny_trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_graph_counts_and_no_recompiles(toy_bundle, tmp_path, scope):
    """blocks: one graph per block type (every layer, the first included with its zero residual, shares the code
    object and the guards), plus the projection + loss: 3 graphs for 3+3 layers, as for 6+6 (5 before the zero
    first residual, issue 43). model: one graph. None added after warm-up."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    tr = tiny_trainer(toy_bundle, tmp_path, model={"layout": "packed", "enc_layers": 3, "dec_layers": 3},
                      data={"batching": "packed", "cache_dir": toy_bundle.cfg.cache_dir}, compile=True,
                      compile_backend="aot_eager", compile_scope=scope)
    first, *rest = first_batches(tr, 4)
    tr.train_step(first)
    warm = int(counters["stats"]["unique_graphs"])
    for b in rest:
        tr.train_step(b)
    tr.close()
    assert warm == (3 if scope == "blocks" else 1)
    assert int(counters["stats"]["unique_graphs"]) == warm  # no recompile on new packed batches
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()


_PROBE = textwrap.dedent(
    """
    import dataclasses, json, sys, time
    from pathlib import Path
    import torch
    from torch._dynamo.utils import counters
    from tests.utils import first_batches, tiny_config
    from train.loop import Trainer

    data_cache, tmp = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    cfg = tiny_config(tmp, model={"layout": "packed", "dropout": 0.0},
                      data={"batching": "packed", "cache_dir": data_cache}, compile=True,
                      compile_backend="inductor", cache_dir=str(tmp / "cache"))
    tr = Trainer(cfg, log=lambda *a: None)
    batches = first_batches(tr, 2)
    t0 = time.perf_counter()
    losses = [tr.train_step(b).item() for b in batches]
    print(json.dumps({"seconds": time.perf_counter() - t0, "losses": losses,
                      "hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"]}))
    """
)


@pytest.mark.slow  # Inductor's first compile of the tiny model takes minutes on 2 shared cores
def test_second_process_reuses_the_compile_cache(toy_bundle, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env.pop("TRITON_CACHE_DIR", None)
    runs = []
    for _ in ("cold", "warm"):
        out = subprocess.run([sys.executable, "-c", _PROBE, toy_bundle.cfg.cache_dir, str(tmp_path / "run")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["miss"] > 0 and cold["hit"] == 0
    assert warm["hit"] == cold["miss"] and warm["miss"] == 0  # every graph came from the cache
    assert warm["losses"] == cold["losses"]
    assert (tmp_path / "run" / "cache" / "inductor").is_dir()


_COMPILES: list[tuple[bool, bool]] = []  # (grad enabled, inference mode) of each graph the backend below compiles


def _recording_backend(gm, example_inputs):
    """aot_eager, recording the autograd modes each graph is compiled under."""
    _COMPILES.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def test_evaluation_and_decoding_add_no_compiled_variant(toy_bundle, tmp_path):
    """train -> validation (loss + beam search) -> translate (2 sentences, then 1: fewer rows) -> train again.

    With ``compile_scope="blocks"`` every block call goes through its compiled forward, so evaluation (no
    grad) and the decoding encoder (inference mode, padded widths) used to add variants: 5 graphs became 13,
    the encoder block at dynamo's recompile limit (8), each a compile and a CUDA-graph recording on a GPU.
    Evaluation and decoding now run those regions eagerly: the 3 training graphs are all, all compiled with
    grad on and outside inference mode (pytorch#135892: compiled in inference mode, then trained), and the
    losses after the round trip are the eager twin's."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from models.layers import DecoderBlock, EncoderBlock
    from train.evaluation.decode import translate
    from train.evaluation.scores import evaluate_split

    compiles = _COMPILES
    compiles.clear()
    if "fastmt_recording" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_recording_backend, name="fastmt_recording")
    torch._dynamo.reset()
    losses = {}
    for compiled in (True, False):
        tr = tiny_trainer(toy_bundle, tmp_path / str(compiled), model={"layout": "packed", "dropout": 0.0},
                          data={"batching": "packed", "cache_dir": toy_bundle.cfg.cache_dir}, compile=compiled,
                          compile_backend="fastmt_recording", compile_scope="blocks")
        batches = first_batches(tr, 3)
        run = [tr.train_step(b).item() for b in batches[:2]]
        n_training = len(compiles)
        evaluate_split(tr.model, tr.data, "valid", tr.device, tr.cfg.eval, autocast=tr.autocast, decode="beam")
        for texts in (["the cat sleeps on the mat", "a dog"], ["hello"]):
            translate(tr.model, tr.data.tokenizer, texts, tr.device, beam_size=2, batch_size=4)
        assert len(compiles) == n_training, "evaluation or decoding compiled a variant"
        run.append(tr.train_step(batches[2]).item())
        tr.close()
        losses[compiled] = run
        if compiled:
            entries = [len(_debug_get_cache_entry_list(f.__code__)) for f in (EncoderBlock.forward,
                                                                              DecoderBlock.forward)]
            assert entries == [1, 1]  # one per block type: the first block's zero residual shares it (issue 43)
            assert len(compiles) == 3 and all(grad and not inference for grad, inference in compiles), compiles
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
