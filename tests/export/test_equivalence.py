"""The exported model is the same model: CTranslate2 and Hugging Face give fastmt's log-probs (within 1e-4) and,
under fastmt's decoding rules, its tokens (greedy and beam search with alpha 0; GNMT alpha by n-best rescoring)."""

from __future__ import annotations

import json

import pytest

from tests.export.conftest import variant_checkpoint
from tests.export.helpers import fastmt_decode, fastmt_logprobs, max_diff
from tests.utils import torch_threads
from train.cli.export import load_source
from train.cli.export import main as export
from train.export.common import source_ids


def _export(ckpt, out, to, *extra) -> None:
    assert export(["--ckpt", str(ckpt), "--to", to, str(out), *extra]) == 0


def _translator(to, out):
    if to == "ct2":
        from train.export.ct2 import CT2Translator

        return CT2Translator(out, threads=1)
    from train.export.hf import HFTranslator

    return HFTranslator(out)


@pytest.mark.parametrize("to", ["ct2", "hf"])
def test_trained_model_same_logprobs_and_tokens(trained, tmp_path, to):
    src = load_source(trained.ckpt)
    _export(trained.ckpt, tmp_path / to, to)
    tr = _translator(to, tmp_path / to)
    ids = source_ids(src.tok, trained.src, src.cfg.max_positions)
    tgt = source_ids(src.tok, trained.ref, src.cfg.max_positions)
    with torch_threads(1):
        assert max_diff(fastmt_logprobs(src.model, ids, tgt), tr.score(ids, tgt)) <= 1e-4
        greedy = fastmt_decode(src.model, ids, beam=1, alpha=0.0)
        assert len({tuple(h) for h in greedy}) >= 16, "the trained model should not repeat one answer"
        for beam, alpha in ((1, 0.0), (4, 0.0), (4, 0.6)):
            ours = fastmt_decode(src.model, ids, beam=beam, alpha=alpha)
            theirs = tr.translate_ids(ids, beam_size=beam, length_penalty=alpha, max_len_a=1.5, max_len_b=10)
            assert theirs == ours, (to, beam, alpha)


VARIANTS = {
    "sharing_all": dict(sharing="all", enc_layers=3, dec_layers=3),
    "cycle_rev": dict(sharing="cycle_rev", enc_layers=3, dec_layers=3, enc_unique=2, dec_unique=2),
    "learned_positions": dict(positions="learned"),
    "untied": dict(tie_embeddings=False),
    "relu": dict(activation="relu"),
    "gelu_tanh": dict(activation="gelu_tanh"),
    "ffn_norm": dict(ffn_norm=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_architectures(trained, tmp_path, name):
    ckpt = variant_checkpoint(trained.ckpt, tmp_path / "v.pt", **VARIANTS[name])
    src = load_source(ckpt)
    ids = source_ids(src.tok, trained.src[:16], src.cfg.max_positions)
    tgt = source_ids(src.tok, trained.ref[:16], src.cfg.max_positions)
    with torch_threads(1):
        ref_lp = fastmt_logprobs(src.model, ids, tgt)
        greedy = fastmt_decode(src.model, ids, beam=1, alpha=0.0, b=5)
        assert len({tuple(h) for h in greedy}) >= 8
        for to in ("hf",) if name == "ffn_norm" else ("ct2", "hf"):
            _export(ckpt, tmp_path / to, to)
            tr = _translator(to, tmp_path / to)
            assert max_diff(ref_lp, tr.score(ids, tgt)) <= 1e-4, to
            assert tr.translate_ids(ids, beam_size=1, length_penalty=0.0, max_len_a=1.5, max_len_b=5) == greedy, to


@pytest.mark.parametrize("quantization", ["int8", "float16"])
def test_quantized_ct2(trained, tmp_path, quantization):
    """``--quantization`` stores smaller weights that CTranslate2 loads and decodes on the CPU close to fastmt."""
    from train.export.ct2 import CT2Translator

    _export(trained.ckpt, tmp_path / "f32", "ct2")
    _export(trained.ckpt, tmp_path / "q", "ct2", "--quantization", quantization)
    size = {k: (tmp_path / k / "model.bin").stat().st_size for k in ("f32", "q")}
    assert size["q"] < 0.6 * size["f32"], size
    assert json.loads((tmp_path / "q" / "fastmt_decoding.json").read_text())["quantization"] == quantization
    src = load_source(trained.ckpt)
    ids = source_ids(src.tok, trained.src, src.cfg.max_positions)
    tgt = source_ids(src.tok, trained.ref, src.cfg.max_positions)
    tr = CT2Translator(tmp_path / "q", threads=1)
    with torch_threads(1):
        diff = max_diff(fastmt_logprobs(src.model, ids, tgt), tr.score(ids, tgt))
        greedy = fastmt_decode(src.model, ids, beam=1, alpha=0.0)
    same = sum(a == b for a, b in zip(tr.translate_ids(ids, beam_size=1, length_penalty=0.0, max_len_a=1.5,
                                                        max_len_b=10), greedy))
    bound, agree = {"int8": (0.2, 24), "float16": (0.01, 30)}[quantization]  # measured: 0.044 / 30, 0.0025 / 32
    assert diff < bound and same >= agree, (diff, same)
