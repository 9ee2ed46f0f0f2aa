"""``python -m train.evaluate``: a checkpoint scored on a test set reproduces the BLEU/chrF its own run
reported for that test set (same decoding settings, from the checkpoint) and the sacreBLEU command line's
scores of the hypotheses it wrote; the run's final test decodes its whole test split, with signatures.

One module-scoped run: the tiny preset's 2+2 x 32 model, 8 epochs on the toy corpus (~10 s), which reaches a
test BLEU well above 0 so that equal scores mean equal translations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.decoding import beam_search
from tests.utils import quiet, records, tiny_trainer
from train.cli.evaluate import main
from train.evaluation.decode import translate
from train.evaluation.load import load_for_inference

ROOT = Path(__file__).resolve().parents[3]
SACREBLEU = Path(sys.executable).with_name("sacrebleu")
BLEU_SIG = "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:"
CHRF_SIG = "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:"


@pytest.fixture(scope="module")
def trained(toy_bundle, tmp_path_factory):
    """(run folder, test split, a folder with the test split as text files: test.en, test.it, test.jsonl)."""
    tmp = tmp_path_factory.mktemp("score")
    trainer = tiny_trainer(toy_bundle, tmp, log=quiet, epochs=8, test_at_end=True, max_sentences=16)
    trainer.fit()
    sp = toy_bundle.splits["test"]
    files = tmp / "files"
    files.mkdir()
    (files / "test.en").write_text("".join(s + "\n" for s in sp.src_text))
    (files / "test.it").write_text("".join(s + "\n" for s in sp.tgt_text))
    (files / "test.jsonl").write_text("".join(json.dumps({"id": str(i), "translation": {"en": s, "it": t}}) + "\n"
                                              for i, (s, t) in enumerate(zip(sp.src_text, sp.tgt_text))))
    return trainer.run_dir, sp, files


def test_final_test_scores_the_whole_test_split_with_signatures(trained):
    """eval.max_sentences (16) caps the periodic validation only: the test decodes every test sentence."""
    run, sp, _ = trained
    epochs, (test,) = records(run, "epoch"), records(run, "test")
    assert all(r["eval_sentences"] == 16 for r in epochs)
    assert len(sp) > 16 and test["test_sentences"] == len(sp)
    assert test["test_bleu"] > 1 and test["test_chrf"] > 10
    assert test["test_bleu_signature"].startswith(BLEU_SIG) and test["test_chrf_signature"].startswith(CHRF_SIG)
    assert all(r["bleu_signature"].startswith(BLEU_SIG) and r["chrf_signature"].startswith(CHRF_SIG) for r in epochs)
    assert test["test_truncated_sources"] == 0  # the toy sentences fit the model's 64 positions
    assert test["decoding"] == {"decode": "beam", "beam_size": 2, "length_penalty": 0.6, "max_len_a": 1.5,
                                "max_len_b": 10}


def test_evaluate_reproduces_the_runs_test_score_and_sacrebleus(trained, tmp_path, capsys):
    """The run's best.pt on its test split, default settings: the run's test BLEU and chrF; the sacreBLEU CLI
    on the written hypotheses: the same numbers; a pairs file (jsonl) in place of two text files: the same."""
    run, sp, files = trained
    (test,) = records(run, "test")
    ckpt = run / "checkpoints" / "best.pt"
    assert main(["--ckpt", str(ckpt), "--src", str(files / "test.en"), "--ref", str(files / "test.it")]) == 0
    out = capsys.readouterr().out
    hyp_path = run / "eval" / "test.en.best.hyp"
    rec = json.loads((run / "eval" / "test.en.best.hyp.json").read_text())
    assert rec["bleu"] == pytest.approx(test["test_bleu"], abs=1e-9)
    assert rec["chrf"] == pytest.approx(test["test_chrf"], abs=1e-9)
    assert rec["sentences"] == len(sp) and rec["truncated_sources"] == 0 and rec["decoding_from_flags"] == []
    assert (rec["bleu_signature"], rec["chrf_signature"]) == (test["test_bleu_signature"], test["test_chrf_signature"])
    assert {k: rec["decoding"][k] for k in test["decoding"] if k != "decode"} == {
        k: v for k, v in test["decoding"].items() if k != "decode"}
    assert f"BLEU {test['test_bleu']:.2f}  chrF2 {test['test_chrf']:.2f}" in out and f"BLEU|{BLEU_SIG}" in out
    hyps = hyp_path.read_text().splitlines()
    assert len(hyps) == len(sp)
    cli = subprocess.run([str(SACREBLEU), str(files / "test.it"), "-i", str(hyp_path), "-m", "bleu", "chrf", "-b",
                          "-w", "6"], capture_output=True, text=True, check=True)
    assert json.loads(cli.stdout) == pytest.approx([test["test_bleu"], test["test_chrf"]], abs=2e-6)

    assert main(["--ckpt", str(ckpt), "--src", str(files / "test.jsonl"), "--out", str(tmp_path / "h.txt")]) == 0
    pairs = json.loads((tmp_path / "h.txt.json").read_text())
    assert (pairs["bleu"], pairs["chrf"]) == (rec["bleu"], rec["chrf"])
    assert (tmp_path / "h.txt").read_text().splitlines() == hyps


def test_flags_override_the_checkpoints_decoding(trained, tmp_path, capsys):
    """--beam 1 --max-len-b 3: greedy decoding with that limit (the library's translate with those settings);
    the record says which flags were given."""
    run, sp, files = trained
    ckpt = run / "checkpoints" / "best.pt"
    out = tmp_path / "greedy.hyp"
    assert main(["--ckpt", str(ckpt), "--src", str(files / "test.en"), "--ref", str(files / "test.it"),
                 "--beam", "1", "--max-len-b", "3", "--batch-size", "7", "--out", str(out)]) == 0
    rec = json.loads(Path(f"{out}.json").read_text())
    assert rec["decoding_from_flags"] == ["--beam", "--max-len-b", "--batch-size"]
    assert rec["decoding"] == {"beam_size": 1, "length_penalty": 0.6, "max_len_a": 1.5, "max_len_b": 3,
                               "batch_size": 7, "precision": "fp32"}
    model, tok, _ = load_for_inference(ckpt)
    want = translate(model, tok, list(sp.src_text), torch.device("cpu"), beam_size=1, max_len_extra=3, batch_size=7)
    assert out.read_text().splitlines() == want
    assert "--beam, --max-len-b, --batch-size given" in capsys.readouterr().out


def test_overlong_sources_are_cut_counted_and_scored(trained, tmp_path, capsys):
    """A source far over the model's 64 positions is translated from its first 63 tokens + EOS, counted in the
    record and named on stderr; every line is scored, blank source lines get blank hypotheses."""
    run, sp, _ = trained
    ckpt = run / "checkpoints" / "best.pt"
    long = " ".join(["the big green tree sees the old man"] * 12)
    src, ref = ["the cat", long, "", "red"], ["il gatto", "l'albero", "", "rosso"]
    (tmp_path / "s.txt").write_text("\n".join(src) + "\n")
    (tmp_path / "r.txt").write_text("\n".join(ref) + "\n")
    out = tmp_path / "o.hyp"
    assert main(["--ckpt", str(ckpt), "--src", str(tmp_path / "s.txt"), "--ref", str(tmp_path / "r.txt"),
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    rec = json.loads(Path(f"{out}.json").read_text())
    assert rec["sentences"] == 4 and rec["truncated_sources"] == 1 and rec["max_positions"] == 64
    assert "1 of 4 sources are longer than the model's 64 positions" in err and "(lines 2)" in err
    model, tok, _ = load_for_inference(ckpt)
    ids = tok.encode([long])[0]
    assert len(ids) + 1 > 64
    src_ids = torch.tensor([*ids[:63].tolist(), tok.eos_id], dtype=torch.int32)[None]  # (1, 64)
    want = beam_search(model, src_ids, torch.tensor([64], dtype=torch.int32), bos_id=tok.bos_id, eos_id=tok.eos_id,
                       pad_id=tok.pad_id, beam_size=2, length_penalty=0.6)
    hyps = out.read_text().split("\n")
    assert len(hyps) == 5 and hyps[2] == "" and hyps[4] == ""
    assert hyps[1] == tok.decode(want)[0] and hyps[1]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FASTMT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "train.evaluate", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_command_line_refuses_mistakes_in_one_line_before_writing(trained, tmp_path, capsys):
    """No arguments: usage, exit 2 (never a silent success). Bad input: one line naming the file and line, exit 2,
    nothing written; an --out that exists and is not this command's is never overwritten."""
    run, sp, files = trained
    ckpt = str(run / "checkpoints" / "best.pt")
    bare = _cli(cwd=tmp_path)
    assert bare.returncode == 2 and "--ckpt" in bare.stderr and "required" in bare.stderr and bare.stdout == ""
    (tmp_path / "bad.en").write_bytes(b"the cat\nred \xff\n")
    (tmp_path / "two.it").write_text("il gatto\nrosso\n")
    (tmp_path / "one.it").write_text("il gatto\n")
    (tmp_path / "bad.jsonl").write_text('{"translation": {"en": "a", "it": "b"}}\n{"translation": {"en": "c"}}\n')
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    cases = [
        (["--src", str(tmp_path / "bad.en"), "--ref", str(tmp_path / "two.it")], "bad.en:2: byte 0xff"),
        (["--src", str(files / "test.en"), "--ref", str(tmp_path / "one.it")], f"has 1 lines but --src {files}"),
        (["--src", str(tmp_path / "bad.jsonl")], "1 row(s) are not usable en-it pairs (missing_language 1"),
        (["--src", str(files / "test.jsonl"), "--ref", str(files / "test.it")], "is a pairs file"),
        (["--src", str(files / "test.en"), "--out", str(mine)], "exists and was not written by"),
        (["--src", str(files / "test.en"), "--beam", "-1"], "--beam -1: must be >= 1"),
    ]
    for args, says in cases:
        out = [] if "--out" in args else ["--out", str(tmp_path / "o.hyp")]
        assert main(["--ckpt", ckpt, *args, *out]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, (args, err)
    assert mine.read_text() == "my notes\n" and not (tmp_path / "o.hyp").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.en", "bad.jsonl", "notes.txt", "one.it", "two.it"]
    proc = _cli("--ckpt", ckpt, "--src", str(tmp_path / "bad.en"), "--ref", str(tmp_path / "two.it"), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
