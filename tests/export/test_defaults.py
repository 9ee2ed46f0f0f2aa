"""A model trained with the defaults goes to CTranslate2 and to a stock Hugging Face folder (issue 36, row 1): the
mid-FFN LayerNorm (``model.ffn_norm``), which neither has a slot for, is off in every preset and the quick start.
The change strands no run: a run or checkpoint trained with it on keeps it when resumed, fine-tuned or loaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.export.conftest import BASE_MODEL, TRAIN
from tests.export.helpers import BOS, EOS, PAD, fastmt_decode
from tests.utils import tiny_config, torch_threads
from train.cli.export import load_source
from train.cli.export import main as export
from train.config import PRESETS, get_config
from train.export.common import source_ids
from train.loop import Trainer
from train.runs.checkpoint import load_checkpoint


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_trains_an_exportable_model(preset):
    assert get_config(preset).model.ffn_norm is False


def test_the_quick_start_and_make_train_models_are_exportable():
    """The README's quick start (--preset tiny) and make train (--auto: tiny on a CPU, fast on a GPU)."""
    from train.cli.flags import resolve_config

    for argv in (["--preset", "tiny", "--data.dataset", "toy"], ["--auto", "--data.dataset", "toy"]):
        cfg, _ = resolve_config(argv, log=lambda *a: None, machine=False)
        assert cfg.model.ffn_norm is False, argv
    assert get_config("fast").model.ffn_norm is False  # what --auto picks on CUDA


def test_default_model_exports_to_both_and_loads_as_stock_pegasus(trained, tmp_path):
    """The session's model was trained with the default switches: CTranslate2 takes it, and its Hugging Face folder
    loads with no remote code as a stock Pegasus whose generate() gives fastmt's greedy translations."""
    from transformers import AutoModelForSeq2SeqLM, MarianTokenizer, PegasusForConditionalGeneration

    src = load_source(trained.ckpt)
    assert src.cfg.ffn_norm is False
    assert export(["--ckpt", str(trained.ckpt), "--to", "ct2", str(tmp_path / "ct2")]) == 0
    assert export(["--ckpt", str(trained.ckpt), "--to", "hf", str(tmp_path / "hf")]) == 0
    hf = tmp_path / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "pegasus" and "auto_map" not in config and not (hf / "modeling_fastmt.py").exists()
    model = AutoModelForSeq2SeqLM.from_pretrained(str(hf)).eval()  # no trust_remote_code
    assert type(model) is PegasusForConditionalGeneration
    tok = MarianTokenizer.from_pretrained(str(hf))
    ids = source_ids(src.tok, trained.src, src.cfg.max_positions)
    with torch_threads(1), torch.inference_mode():
        enc = tok(trained.src, return_tensors="pt", padding=True, truncation=True)
        assert [row[: row.index(EOS)] for row in enc["input_ids"].tolist()] == ids  # the same ids as fastmt's
        out = model.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=30)
        ours = fastmt_decode(src.model, ids, beam=1, alpha=0.0, a=0.0, b=30)
    theirs = [[t for t in row[1:] if t != PAD] for row in out.tolist()]  # drop the decoder start <s>
    theirs = [row[: row.index(EOS)] if EOS in row else row for row in theirs]
    assert theirs == ours and BOS not in sum(theirs, [])


# ----------------------------------------------------------------------------------------------
# a run trained with ffn_norm on (the previous default) is never stranded
# ----------------------------------------------------------------------------------------------
def _ffn_norm_run(toy_bundle, tmp_path):
    cfg = tiny_config(tmp_path, name="ffn", model={**BASE_MODEL, "ffn_norm": True}, **{**TRAIN, "max_steps": 4})
    with torch_threads(1):
        Trainer(cfg, data=toy_bundle, log=lambda *a: None).fit()
    run = tmp_path / "runs" / "ffn"
    assert json.loads((run / "config.json").read_text())["model"]["ffn_norm"] is True
    return run


def test_a_run_trained_with_ffn_norm_resumes_and_fine_tunes_with_it(toy_bundle, tmp_path):
    """Resumed or fine-tuned by a command that does not name ffn_norm (the new default, off): the checkpoint's
    value is kept, said in one line, and the weights load exactly; a fresh run gets the new default."""
    run = _ffn_norm_run(toy_bundle, tmp_path)
    ckpt = sorted((run / "checkpoints").glob("step-*.pt"))[-1]
    saved = load_checkpoint(ckpt)
    plain = {**BASE_MODEL}  # no ffn_norm: the default
    for how, kwargs, name in (("resume", {"resume": "auto"}, "ffn"), ("init_from", {"init_from": ckpt}, "tuned")):
        logs: list[str] = []

        def log(*parts, logs=logs):
            logs.append(" ".join(map(str, parts)))

        cfg = tiny_config(tmp_path, name=name, model=plain, **{**TRAIN, "max_steps": 6})
        assert cfg.model.ffn_norm is False
        with torch_threads(1):
            tr = Trainer(cfg, data=toy_bundle, log=log, **kwargs)
        assert tr.cfg.model.ffn_norm is True, how
        assert any("model.ffn_norm=True" in line for line in logs), (how, logs)
        model = tr.model
        for key, value in saved["model"].items():
            torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
        with torch_threads(1):
            tr.fit()
        written = json.loads((tmp_path / "runs" / name / "config.json").read_text())
        assert written["model"]["ffn_norm"] is True, how
    fresh = tiny_config(tmp_path, name="fresh", model=plain)
    assert fresh.model.ffn_norm is False


def test_a_checkpoint_trained_with_ffn_norm_loads_and_exports_as_before(toy_bundle, tmp_path):
    """translate/evaluate load it with its mid-FFN LayerNorm; --to hf ships the remote code; --to ct2 refuses it."""
    from train.evaluation.load import load_for_inference

    run = _ffn_norm_run(toy_bundle, tmp_path)
    ckpt = sorted((run / "checkpoints").glob("step-*.pt"))[-1]
    model, _, saved = load_for_inference(ckpt)
    assert model.cfg.ffn_norm is True and saved["config"]["model"]["ffn_norm"] is True
    assert export(["--ckpt", str(ckpt), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "modeling_fastmt.py").is_file()
    assert export(["--ckpt", str(ckpt), "--to", "ct2", str(tmp_path / "ct2")]) == 2
    assert not (tmp_path / "ct2").exists()
    shutil.rmtree(tmp_path / "hf")
