"""``fastmt export`` as a user meets it: refusals in one line with exit 2 before anything is written, OUT replaced
only with --force, the missing extra named, checkpoints of resumed and --init-from runs, and ``evaluate``/
``translate`` of the exported CTranslate2 folder scoring what the checkpoint scores."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.export.conftest import BASE_MODEL, TRAIN, variant_checkpoint
from tests.export.helpers import fastmt_logprobs, max_diff
from tests.utils import quiet, tiny_config, torch_threads
from train.cli.export import load_source
from train.cli.export import main as export
from train.export.common import source_ids
from train.loop import Trainer


def _refused(capsys, argv, *words) -> str:
    assert export(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "error:" in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, err
    return err


def test_bad_input_refused_before_writing(trained, tmp_path, capsys):
    out = tmp_path / "out"
    _refused(capsys, ["--ckpt", str(tmp_path / "nope.pt"), "--to", "ct2", str(out)], "nope.pt", "no such file")
    text = tmp_path / "text.pt"
    text.write_text("not a checkpoint")
    _refused(capsys, ["--ckpt", str(text), "--to", "ct2", str(out)], "text.pt")
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    _refused(capsys, ["--ckpt", str(other), "--to", "hf", str(out)], "other.pt")
    _refused(capsys, ["--ckpt", str(trained.ckpt), "--to", "onnx", str(out)], "'onnx'", "ct2", "hf")
    _refused(capsys, ["--ckpt", str(trained.ckpt), "--to", "ct2", "--quantization", "int4", str(out)], "int4")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["other.pt", "text.pt"]


def test_existing_out_needs_force(trained, tmp_path, capsys):
    """A folder of the user's files is never replaced (not even with --force), nor one holding the checkpoint; an
    earlier export is replaced with --force only, whole, with no temp folder left."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    for force in ([], ["--force"]):
        _refused(capsys, ["--ckpt", str(trained.ckpt), "--to", "ct2", *force, str(out)], "did not write")
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    _refused(capsys, ["--ckpt", str(trained.ckpt), "--to", "ct2", "--force", str(trained.ckpt.parent)], "holds the checkpoint")
    assert trained.ckpt.is_file()
    out2 = tmp_path / "out2"
    assert export(["--ckpt", str(trained.ckpt), "--to", "hf", str(out2)]) == 0
    _refused(capsys, ["--ckpt", str(out2), "--to", "ct2", str(tmp_path / "out3")], "out2")
    _refused(capsys, ["--ckpt", str(trained.ckpt), "--to", "ct2", str(out2)], "--force")
    assert export(["--ckpt", str(trained.ckpt), "--to", "ct2", "--force", str(out2)]) == 0
    assert (out2 / "model.bin").is_file() and not (out2 / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out2"]  # no temp folder left beside them
    card = (out2 / "README.md").read_text()
    assert "fastmt export --ckpt" in card and "ffn_norm False" in card


def test_ffn_norm_refused_for_ct2(trained, tmp_path, capsys):
    ckpt = variant_checkpoint(trained.ckpt, tmp_path / "ffn.pt", ffn_norm=True)
    _refused(capsys, ["--ckpt", str(ckpt), "--to", "ct2", str(tmp_path / "out")], "ffn_norm", "--model.ffn_norm false")
    assert not (tmp_path / "out").exists()


def test_missing_extra_named(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # import ctranslate2 raises ImportError
    _refused(capsys, ["--ckpt", str(trained.ckpt), "--to", "ct2", str(tmp_path / "out")], "pip install -e '.[export]'")
    monkeypatch.setitem(sys.modules, "safetensors", None)
    _refused(capsys, ["--ckpt", str(trained.ckpt), "--to", "hf", str(tmp_path / "out")], "safetensors", ".[export]")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["resume", "init_from"])
def test_continued_runs_export(trained, toy_bundle, tmp_path, how):
    """A checkpoint of a run resumed from, or started with --init-from, the trained one exports exactly."""
    if how == "resume":
        import shutil

        run = tmp_path / "runs" / "base"
        shutil.copytree(trained.run_dir, run)
        cfg = tiny_config(tmp_path, name="base", model=BASE_MODEL, **{**TRAIN, "max_steps": TRAIN["max_steps"] + 8})
        kwargs = {"resume": "auto"}
    else:
        cfg = tiny_config(tmp_path, name="tuned", model=BASE_MODEL, **{**TRAIN, "max_steps": 8})
        kwargs = {"init_from": trained.ckpt}
    from train.runs.report import translation_checkpoint

    with torch_threads(1):
        Trainer(cfg, data=toy_bundle, log=quiet, **kwargs).fit()
    ckpt = translation_checkpoint(tmp_path / "runs" / cfg.run.name)
    assert export(["--ckpt", str(ckpt), "--to", "ct2", str(tmp_path / "ct2")]) == 0
    from train.export.ct2 import CT2Translator

    src = load_source(ckpt)
    ids = source_ids(src.tok, trained.src, src.cfg.max_positions)
    tgt = source_ids(src.tok, trained.ref, src.cfg.max_positions)
    with torch_threads(1):
        assert max_diff(fastmt_logprobs(src.model, ids, tgt), CT2Translator(tmp_path / "ct2").score(ids, tgt)) <= 1e-4


def test_evaluate_and_translate_the_ct2_folder(trained, tmp_path, capsys):
    from train.cli.evaluate import main as evaluate
    from train.cli.translate import main as translate

    out = tmp_path / "ct2"
    assert export(["--ckpt", str(trained.ckpt), "--to", "ct2", str(out)]) == 0
    (tmp_path / "src.txt").write_text("".join(s + "\n" for s in trained.src))
    (tmp_path / "ref.txt").write_text("".join(s + "\n" for s in trained.ref))
    records = {}
    for name, ckpt, extra in (("ckpt", trained.ckpt, []), ("ct2", out, []), ("ct2-flag", out, ["--engine", "ct2"])):
        hyp = tmp_path / f"{name}.hyp"
        argv = ["--ckpt", str(ckpt), "--src", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "ref.txt"),
                "--beam", "1", "--out", str(hyp), "--device", "cpu", *extra]
        assert evaluate(argv) == 0
        records[name] = json.loads((tmp_path / f"{name}.hyp.json").read_text())
        records[name]["hyps"] = hyp.read_text()
    assert records["ct2"]["bleu"] == records["ckpt"]["bleu"] and records["ct2"]["hyps"] == records["ckpt"]["hyps"]
    # what ran: the engine, the type its weights are stored in, what it computed in, its CPU threads
    assert {k: records["ckpt"][k] for k in ("engine", "quantization", "compute", "threads")} == {
        "engine": "fastmt", "quantization": "float32", "compute": "fp32", "threads": torch.get_num_threads()}
    assert {k: records["ct2"][k] for k in ("engine", "quantization", "threads")} == {
        "engine": "ctranslate2", "quantization": "float32", "threads": torch.get_num_threads()}
    assert records["ct2"]["decoding"]["precision"] is None  # fastmt's autocast flag: not what CTranslate2 ran
    assert records["ct2"]["bleu_signature"] == records["ckpt"]["bleu_signature"]
    assert records["ct2-flag"]["hyps"] == records["ckpt"]["hyps"] and records["ckpt"]["bleu"] > 0
    capsys.readouterr()
    assert translate(["--ckpt", str(out), "--beam", "1", "--device", "cpu", *trained.src[:4]]) == 0
    assert capsys.readouterr().out.splitlines() == records["ckpt"]["hyps"].splitlines()[:4]
    assert translate(["--ckpt", str(trained.ckpt), "--engine", "ct2", "--device", "cpu", "x"]) == 2
    assert "--engine ct2" in capsys.readouterr().err


def test_evaluate_records_the_ct2_quantization_and_refuses_precision(trained, tmp_path, capsys):
    """An int8 folder's record says int8 (the landed tree said fp32: the checkpoint's precision), with the threads it
    ran on; --precision, which CTranslate2 does not take, is refused in one line before anything is decoded."""
    from train.cli.evaluate import main as evaluate

    out = tmp_path / "int8"
    assert export(["--ckpt", str(trained.ckpt), "--to", "ct2", "--quantization", "int8", str(out)]) == 0
    (tmp_path / "src.txt").write_text("".join(s + "\n" for s in trained.src[:8]))
    (tmp_path / "ref.txt").write_text("".join(s + "\n" for s in trained.ref[:8]))
    argv = ["--ckpt", str(out), "--src", str(tmp_path / "src.txt"), "--ref", str(tmp_path / "ref.txt"), "--beam", "1",
            "--device", "cpu", "--out", str(tmp_path / "h.hyp")]
    with torch_threads(1):
        assert evaluate(argv) == 0
    record = json.loads((tmp_path / "h.hyp.json").read_text())
    assert (record["engine"], record["quantization"], record["threads"]) == ("ctranslate2", "int8", 1)
    assert record["compute"].startswith("int8")
    assert "CTranslate2 int8" in capsys.readouterr().out
    assert evaluate([*argv[:-2], "--out", str(tmp_path / "p.hyp"), "--precision", "bf16"]) == 2
    err = capsys.readouterr().err
    assert "--precision bf16" in err and "CTranslate2" in err and not (tmp_path / "p.hyp").exists()
