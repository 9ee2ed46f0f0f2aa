"""``python -m train.translate``: one output line per input line, a warning on truncation, no temp files.

The checkpoint holds an untrained tiny model: the properties tested do not depend on translation quality.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import tempfile

import pytest
import torch

from data.tokenizer import Tokenizer
from models import Transformer, get_preset
from train.translate import load_for_inference, main, overlong

MAX_POSITIONS = 24


@pytest.fixture(scope="module")
def ckpt(toy_bundle, tmp_path_factory):
    """A checkpoint as the trainer writes it (the toy data's tokenizer), whose tokenizer file no longer
    exists (only its bytes)."""
    tmp = tmp_path_factory.mktemp("translate")
    tok = toy_bundle.tokenizer
    torch.manual_seed(0)
    mcfg = get_preset("tiny", vocab_size=tok.vocab_size, d_model=32, n_heads=2, d_ff=64, enc_layers=1,
                      dec_layers=1, max_positions=MAX_POSITIONS)
    path = tmp / "best.pt"
    torch.save({"model": Transformer(mcfg).state_dict(), "config": {"model": dataclasses.asdict(mcfg)},
                "position": {}, "tokenizer": {"model_file": str(tmp / "gone" / "spm.model"), "key": tok.key,
                                              "model_bytes": tok.model_bytes()}}, path)
    return path, tok


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Point tempfile at an empty folder, to see whether anything is left in it."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def run(ckpt_path, capsys, monkeypatch, stdin: str | None = None, args=()) -> tuple[list[str], str]:
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert main(["--ckpt", str(ckpt_path), "--beam", "2", *args]) == 0
    out = capsys.readouterr()
    return out.out.split("\n")[:-1], out.err


def test_blank_lines_kept_in_place_and_order_kept(ckpt, capsys, monkeypatch, private_tmp):
    path, _ = ckpt
    single = {s: run(path, capsys, monkeypatch, args=[s])[0] for s in ("the cat", "a dog sleeps", "red")}
    assert all(len(v) == 1 and v[0].strip() for v in single.values())  # untrained, but it says something
    out, err = run(path, capsys, monkeypatch, stdin="\nthe cat\n\n   \na dog sleeps\r\nred\n\n")
    assert out == ["", *single["the cat"], "", "", *single["a dog sleeps"], *single["red"], ""]
    assert err == ""
    assert list(private_tmp.iterdir()) == []  # the tokenizer came from the checkpoint's bytes, in memory


def test_overlong_input_warns_with_the_cut(ckpt, capsys, monkeypatch):
    path, tok = ckpt
    long = " ".join(["the big green tree"] * 40)
    n = len(tok.encode([long])[0]) + 1
    assert n > MAX_POSITIONS
    out, err = run(path, capsys, monkeypatch, stdin=f"the cat\n\n{long}\n")
    assert len(out) == 3 and out[1] == ""
    assert err.count("warning:") == 1
    assert f"input line 3 is {n:,} tokens" in err
    assert f"its last {n - MAX_POSITIONS:,} tokens are not translated" in err
    assert overlong(tok, ["the cat", long], MAX_POSITIONS) == [(1, n)]
    ids = tok.encode(["the cat"])[0]
    assert overlong(tok, ["the cat"], len(ids) + 1) == []  # exactly fits: tokens + EOS
    assert overlong(tok, ["the cat"], len(ids)) == [(0, len(ids) + 1)]


def test_tokenizer_from_checkpoint_bytes_matches_the_file_and_pickles(ckpt, private_tmp):
    path, tok = ckpt
    _, loaded, _ = load_for_inference(path)
    assert loaded.model_file is None and loaded.vocab_size == tok.vocab_size
    texts = ["the cat sleeps under the table", "il gatto dorme — ü 🐈"]
    assert [x.tolist() for x in loaded.encode(texts)] == [x.tolist() for x in tok.encode(texts)]
    again = pickle.loads(pickle.dumps(loaded))  # DataLoader workers pickle the tokenizer
    assert again.decode(again.encode(texts)) == tok.decode(tok.encode(texts))
    assert list(private_tmp.iterdir()) == []
    with pytest.raises(TypeError, match="exactly one"):
        Tokenizer()
