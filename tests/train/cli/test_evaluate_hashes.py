"""``evaluate`` credits its scores to the bytes it decoded (issue 45, class 2): the record's ``checkpoint_sha256``,
``src_sha256`` and ``refs_sha256`` are hashes of the files as they were read, never of whatever lies at those
paths after the decode (a run's ``best.pt`` is replaced while training goes on); a checkpoint written in place
while it is read is refused in one line.

The checkpoints hold untrained tiny models (two seeds: two different sets of weights)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from models import Transformer, get_preset
from train.cli.evaluate import main
from train.config import tiny
from train.evaluation import decode
from train.evaluation.load import load_for_inference
from train.runs.checkpoint import CheckpointIOError, load_checkpoint


def write_ckpt(path: Path, tok, seed: int) -> Path:
    """A checkpoint as the trainer writes it: the toy data's tokenizer and an untrained 1+1 x 32 model."""
    torch.manual_seed(seed)
    mcfg = get_preset("tiny", vocab_size=tok.vocab_size, d_model=32, n_heads=2, d_ff=64, enc_layers=1,
                      dec_layers=1, max_positions=24)
    record = {**tiny().record(), "model": dataclasses.asdict(mcfg)}  # every section, as the trainer records it
    torch.save({"model": Transformer(mcfg).state_dict(), "config": record,
                "position": {"epoch": 1, "batch_index": 0, "step": 1},
                "tokenizer": {"model_file": "spm.model", "key": tok.key, "model_bytes": tok.model_bytes()}}, path)
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def two_models(toy_bundle, tmp_path):
    tok = toy_bundle.tokenizer
    return write_ckpt(tmp_path / "a.pt", tok, 0), write_ckpt(tmp_path / "b.pt", tok, 1)


@pytest.mark.parametrize("pairs", [False, True], ids=["text-files", "pairs-file"])
def test_the_record_hashes_what_was_decoded_not_what_replaced_it(toy_bundle, two_models, tmp_path, monkeypatch,
                                                                  capsys, pairs):
    """best.pt, --src and --ref are replaced (os.replace, as training and editors do) while the test set is
    decoded: the hypotheses are the first model's, and so is every hash in the record."""
    a, b = two_models
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    best = run / "best.pt"
    shutil.copyfile(a, best)
    src_lines = list(toy_bundle.splits["test"].src_text[:6])
    ref_lines = list(toy_bundle.splits["test"].tgt_text[:6])
    if pairs:
        src = tmp_path / "test.jsonl"
        src.write_text("".join(json.dumps({"translation": {"en": s, "it": t}}) + "\n"
                               for s, t in zip(src_lines, ref_lines)))
        refs: list[Path] = []
    else:
        src, ref = tmp_path / "test.en", tmp_path / "test.it"
        src.write_text("".join(s + "\n" for s in src_lines))
        ref.write_text("".join(t + "\n" for t in ref_lines))
        refs = [ref]
    read = {p: sha(p) for p in (best, src, *refs)}
    real = decode.translate_lines

    def swap_then_decode(*args, **kwargs):
        for p in (best, src, *refs):  # what a training run (best.pt) or an editor (the texts) does meanwhile
            tmp = p.with_name(p.name + ".new")
            shutil.copyfile(b, tmp) if p == best else tmp.write_text(p.read_text().upper())
            os.replace(tmp, p)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "translate_lines", swap_then_decode)
    out = tmp_path / "hyp.txt"
    argv = ["--ckpt", str(best), "--src", str(src), *(["--ref", *map(str, refs)] if refs else []), "--out", str(out),
            "--beam", "1", "--device", "cpu"]
    assert main(argv) == 0, capsys.readouterr().err
    rec = json.loads(Path(f"{out}.json").read_text())
    assert sha(best) == sha(b) != read[best]  # the swap happened
    assert rec["checkpoint_sha256"] == read[best] == sha(a)
    assert rec["src_sha256"] == read[src] != sha(src)
    assert rec["refs_sha256"] == [read[r] for r in refs]
    greedy = dataclasses.replace(decode.Decoding(**decode.DECODING_DEFAULTS), beam_size=1)
    hyps = {}
    for name, path in (("a", a), ("b", b)):
        model, tok, _ = load_for_inference(path)
        hyps[name] = real(model, tok, src_lines, torch.device("cpu"), greedy)
    assert out.read_text().splitlines() == hyps["a"] != hyps["b"]  # the hypotheses are the first model's


def test_a_checkpoint_written_in_place_while_it_is_read_is_refused(two_models, monkeypatch):
    """The hash is taken through the descriptor the weights are loaded from; a file changed in place meanwhile (not
    replaced: the same inode) would make the hash name other bytes than those loaded: one line, no record."""
    a, _ = two_models
    real = torch.load

    def load_then_write(*args, **kwargs):
        value = real(*args, **kwargs)
        with open(a, "r+b") as f:  # a byte of the stored weights changed in place, after they were read
            f.seek(os.path.getsize(a) // 2)
            f.write(b"\x00")
        return value

    monkeypatch.setattr(torch, "load", load_then_write)
    with pytest.raises(CheckpointIOError, match=r"a\.pt was written to while it was read") as e:
        load_checkpoint(a, digest=hashlib.sha256())
    assert "\n" not in str(e.value)
