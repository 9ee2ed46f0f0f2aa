"""The CPU race's shared pieces (issue 44): fastmt's split written out as files (every system reads the same
rows), the one scoring function, eole's recipe at fastmt's size, the race's summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from bench import eole_peer as E
from bench import race as R
from data.export_split import export_split, pairs_sha256, read_pairs
from data.toy import write_toy_corpus

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(config, bundle, export folder, record, corpus) of the tiny preset on a toy corpus, exported."""
    from data import build_data
    from train.config import apply_overrides, get_config

    tmp = tmp_path_factory.mktemp("race")
    corpus = write_toy_corpus(tmp / "toy.jsonl", n=600)
    cfg = apply_overrides(get_config("tiny"), {"data.data_files": str(corpus), "data.cache_dir": str(tmp / "cache"),
                                               "data.vocab_size": "400", "data.valid_size": "40",
                                               "data.test_size": "40", "data.max_len": "32"})
    bundle = build_data(cfg.data, log=lambda *_: None)
    rec = export_split(bundle, cfg.data, tmp / "split")
    return cfg, bundle, tmp / "split", rec, corpus


def _ids(sp, i, side):
    ids, off = (sp.src_ids, sp.src_offsets) if side == "src" else (sp.tgt_ids, sp.tgt_offsets)
    return np.asarray(ids[off[i]:off[i + 1]], dtype=np.int64)


def test_exported_split_holds_the_rows_fastmt_trains_validates_and_tests_on(exported):
    """The files (what eole reads) re-encode to the ids fastmt's cache holds (what fastmt and the HF baseline train
    on), row for row in every split, and the recorded hashes are the files' own."""
    import hashlib

    cfg, bundle, folder, rec, _ = exported
    tok = bundle.tokenizer
    for s in ("train", "valid", "test"):
        src, tgt = read_pairs(folder, s)
        sp = bundle.splits[s]
        assert len(src) == len(sp) == rec["splits"][s]["pairs"] > 0
        assert rec["splits"][s]["rows_sha256"] == pairs_sha256(src, tgt)
        for side, lines in (("src", src), ("tgt", tgt)):
            assert rec["splits"][s][f"{side}_sha256"] == hashlib.sha256((folder / f"{s}.{side}").read_bytes()).hexdigest()
            enc = tok.encode(lines)
            for i in range(len(sp)):
                assert np.array_equal(enc[i][: cfg.data.max_len - 1].astype(np.int64), _ids(sp, i, side)), (s, side, i)
        if sp.src_text is not None:  # valid/test: the texts fastmt scores against
            assert (src, tgt) == (list(sp.src_text), list(sp.tgt_text))
    assert (folder / "spm.model").read_bytes() == tok.model_bytes()


def test_every_system_is_pointed_at_the_same_files(exported):
    """eole's config reads the exported files and the exported SentencePiece model; the HF baseline's rows are
    fastmt's cache (bench.peers.encode_split), which the files re-encode to (the test above)."""
    from bench import peers as P

    cfg, bundle, folder, rec, _ = exported
    c = E.eole_config(folder, folder.parent / "eole", E.EoleRecipe(), rec["vocab_size"])
    assert c["data"]["corpus_1"] == {"path_src": str(folder / "train.src"), "path_tgt": str(folder / "train.tgt")}
    assert c["data"]["valid"] == {"path_src": str(folder / "valid.src"), "path_tgt": str(folder / "valid.tgt")}
    spm = c["transforms_configs"]["sentencepiece"]
    assert spm == {"src_subword_model": str(folder / "spm.model"), "tgt_subword_model": str(folder / "spm.model")}
    assert c["src_vocab_size"] == c["tgt_vocab_size"] == bundle.tokenizer.vocab_size and c["share_vocab"] is True
    src, tgt = P.encode_split(bundle.splits["train"], bundle.tokenizer.eos_id, cfg.model.max_positions)
    assert len(src) == rec["splits"]["train"]["pairs"]
    assert np.array_equal(src[0][:-1], _ids(bundle.splits["train"], 0, "src"))


def test_export_refuses_a_corpus_edited_since_the_build(exported, tmp_path):
    """The train texts are read again from the inputs: a file changed since the cache was built would export other
    rows, so the export stops with one line naming the cause (and writes nothing)."""
    cfg, bundle, _, _, corpus = exported
    lines = corpus.read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    for r in rows:  # every source reversed: the same row count, other texts
        r["translation"]["en"] = r["translation"]["en"][::-1]
    edited = tmp_path / "edited.jsonl"
    edited.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import dataclasses

    moved = dataclasses.replace(cfg.data, data_files=(str(edited),))
    with pytest.raises(ValueError, match="changed since the cache was built"):
        export_split(bundle, moved, tmp_path / "out")
    assert not (tmp_path / "out" / "train.src").exists()


def test_one_scoring_function_one_signature():
    """Every system's output is scored by bench.race.score: sacreBLEU's corpus BLEU/chrF (fastmt's validation
    function), the same numbers and signature as sacreBLEU called directly."""
    import sacrebleu

    hyps, refs = ["il gatto è sul tavolo", "una casa"], ["il gatto è sul tavolo .", "la casa"]
    got = R.score(hyps, refs)
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert got["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    bleu = sacrebleu.metrics.BLEU()
    bleu.corpus_score(hyps, [refs])
    assert got["bleu_signature"] == str(bleu.get_signature())
    assert got["bleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:")
    with pytest.raises(ValueError, match="1 translations for 2 references"):
        R.score(hyps[:1], refs)


def test_eole_recipe_is_its_wmt17_recipe_at_fastmts_size():
    """hidden/layers/heads/ffn from the model; the recipe's noam schedule, Adam(W) beta2 0.998, smoothing 0.1, no
    clipping, xavier init, token batches and normalisation; noam's factor puts the peak at peak_lr at the warm-up's
    end, and the warm-up is scaled to the run."""
    from models.config import get_preset

    m = get_preset("tiny")
    r = E.recipe_for(m, steps=1000, save_every=250, seed=3, tokens_per_step=2000, max_len=64, peak_lr=2e-3)
    c = E.eole_config(Path("/s"), Path("/w"), r, 8000)
    t, mo = c["training"], c["model"]
    assert (mo["hidden_size"], mo["layers"], mo["heads"], mo["transformer_ff"]) == (m.d_model, 2, m.n_heads, m.d_ff)
    assert mo["share_embeddings"] and mo["share_decoder_embeddings"] and mo["embeddings"]["word_vec_size"] == m.d_model
    assert (t["decay_method"], t["adam_beta2"], t["label_smoothing"], t["max_grad_norm"]) == ("noam", 0.998, 0.1, 0)
    assert (t["param_init_method"], t["batch_type"], t["normalization"]) == ("xavier_uniform", "tokens", "tokens")
    assert (t["train_steps"], t["save_checkpoint_steps"], t["batch_size"], c["seed"]) == (1000, 250, 2000, 3)
    w = t["warmup_steps"]
    assert w == E.warmup_for(1000) == 200
    noam = lambda step: t["learning_rate"] * m.d_model ** -0.5 * min(step ** -0.5, step * w ** -1.5)  # noqa: E731
    assert noam(w) == pytest.approx(2e-3) and noam(w // 2) < noam(w) and noam(4 * w) == pytest.approx(1e-3)
    assert E.warmup_for(50_000) == 4000  # the recipe's own at its own length
    with pytest.raises(ValueError, match="one layer count"):
        E.recipe_for(get_preset("tiny", dec_layers=3), steps=1, save_every=1, seed=0, tokens_per_step=8, max_len=8)


def test_eole_log_steps_and_a_missing_eole(tmp_path, monkeypatch):
    line = ("[2026-11-28 16:08:09,792 INFO] Step  4/   20; acc: 8.1; ppl: 6270.51; xent: 8.74; aux: 0.000; mtp: 0.000; "
            "attn_ent: 2.247; lr: 2.00e-03; sents:     544; bsz: 3280/3344/272; 1664/1697 tok/s;     12 sec;\n")
    assert E.step_seconds(line + line.replace("Step  4/", "Step 10/").replace("12 sec", "31 sec")) == {4: 12.0,
                                                                                                         10: 31.0}
    monkeypatch.setenv("FASTMT_EOLE", str(tmp_path / "nope" / "eole"))
    with pytest.raises(E.EoleMissing, match="requirements-peers.txt"):
        E.eole_binary()


def _record(points_by_run):
    runs = [{"system": s, "seed": seed, "status": "ok", "points": pts} for (s, seed), pts in points_by_run.items()]
    return {"config": {"systems": ["fastmt", "eole"], "threshold": 1.0, "seeds": [0, 1]}, "runs": runs}


def test_summary_means_spreads_and_time_to_threshold():
    p = lambda step, secs, bleu: {"step": step, "train_seconds": secs, "valid_bleu": bleu}  # noqa: E731
    rec = _record({("fastmt", 0): [p(10, 5.0, 0.5), p(20, 10.0, 1.5)], ("fastmt", 1): [p(10, 7.0, 1.1),
                                                                                          p(20, 12.0, 2.5)],
                   ("eole", 0): [p(10, 6.0, 0.1), p(20, 12.0, 0.2)], ("eole", 1): [p(10, 6.0, 0.3), p(20, 12.0, 0.9)]})
    f, e = R.summarize(rec)
    assert R.time_to(rec["runs"][0]["points"], 1.0) == 10.0 and R.time_to(rec["runs"][1]["points"], 1.0) == 7.0
    assert f["time_to_threshold"].startswith(f"{8.5:.2f} ± {math.sqrt(4.5):.2f} (n=2)")
    assert f["valid@20"] == f"{2.0:.2f} ± {math.sqrt(0.5):.2f} (n=2)"
    assert e["time_to_threshold"] == "never (2 runs)"
    with pytest.raises(ValueError, match="multiple of --eval-every"):
        R.RaceConfig(data_files=("a",), work=Path("w"), steps=10, eval_every=3)
    with pytest.raises(ValueError, match="unknown"):
        R.RaceConfig(data_files=("a",), work=Path("w"), systems=("marian",))
    with pytest.raises(ValueError, match="--jobs 0"):
        R.RaceConfig(data_files=("a",), work=Path("w"), jobs=0)


def test_checkpoint_averaging_scores_the_mean_of_each_fastmt_runs_last_k_kept_weights(tmp_path, monkeypatch):
    """``--average-last K`` averages each fastmt run's newest K step checkpoints (by step, not by name order of
    other files), scores them with the race's one scorer and reports them beside the last single point."""
    import train.runs.checkpoint as C

    (tmp_path / "split").mkdir()
    for name in ("valid", "test"):
        (tmp_path / "split" / f"{name}.src").write_text("a\nb\n")
        (tmp_path / "split" / f"{name}.tgt").write_text("il gatto dorme sul letto\nla casa è molto grande\n")
    ckpts = tmp_path / "fastmt-s0" / "checkpoints"
    ckpts.mkdir(parents=True)
    for step in (160, 320, 480):
        (ckpts / f"step-{step:08d}.pt").write_bytes(b"")
    (ckpts / "best.pt").write_bytes(b"")
    seen = {}
    monkeypatch.setattr(C, "average_checkpoints", lambda paths: seen.setdefault("paths", [p.name for p in paths]))
    monkeypatch.setattr(R, "translate_fastmt", lambda ckpt, src: ["il gatto dorme sul letto", "la casa è molto grande"] if ckpt.name == "average-last-2.pt"
                        else ["?"] * len(src))
    rec = _record({("fastmt", 0): [{"step": 480, "train_seconds": 1.0, "valid_bleu": 1.0, "test_bleu": 2.0}],
                   ("eole", 0): [{"step": 480, "train_seconds": 1.0, "valid_bleu": 1.0}]})
    rec["config"]["work"] = str(tmp_path)
    R.score_averages(rec, 2, log=lambda m: None)
    assert seen["paths"] == ["step-00000320.pt", "step-00000480.pt"]
    got = rec["runs"][0]["averaged"]["2"]
    assert got["valid_bleu"] == got["test_bleu"] == pytest.approx(100.0) and "averaged" not in rec["runs"][1]
    assert R.averages_table(rec)[-1] == ("| 0 | last 2: step-00000320.pt, step-00000480.pt | 1.00 | 100.00 | 2.00 "
                                         "| 100.00 |")
    with pytest.raises(R.RaceSetupError, match="keeps 3 step checkpoints"):
        R.score_averages(rec, 4, log=lambda m: None)
