"""An export folder as an MT engineer shares and deploys it (issue 36, rows 2-4 and 6): a folder that needs
fastmt's code is refused without ``trust_remote_code`` (never loaded as a different model), the model card carries
the Hub's YAML metadata with the test scores and their signatures, no file names a folder of the author's machine,
file modes follow the umask, and the CTranslate2 options the folder recommends take a source of any length."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from tests.export.conftest import variant_checkpoint
from tests.export.helpers import fastmt_decode
from tests.utils import torch_threads
from train.cli.export import load_source
from train.cli.export import main as export
from train.export.common import source_ids


def _test_record(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == "test"][-1]


def test_ffn_norm_folder_refused_without_remote_code(trained, tmp_path):
    """Its own model_type: transformers refuses it naming trust_remote_code (a stock Pegasus would drop the mid-FFN
    LayerNorms with a warning and translate differently); with the flag it is fastmt's model."""
    from transformers import AutoModelForSeq2SeqLM

    ckpt = variant_checkpoint(trained.ckpt, tmp_path / "ffn.pt", ffn_norm=True)
    out = tmp_path / "hf"
    assert export(["--ckpt", str(ckpt), "--to", "hf", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "fastmt_pegasus" and config["auto_map"]["AutoConfig"].startswith("modeling_fastmt.")
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForSeq2SeqLM.from_pretrained(str(out))
    model = AutoModelForSeq2SeqLM.from_pretrained(str(out), trust_remote_code=True)
    assert type(model).__name__ == "FastmtPegasusForConditionalGeneration"
    assert sum(1 for name, _ in model.named_parameters() if "activation_fn.ln" in name) == 2 * (2 + 2)  # w, b per layer
    assert "trust_remote_code=True" in (out / "README.md").read_text()


@pytest.mark.parametrize("to", ["ct2", "hf"])
def test_model_card_metadata(trained, tmp_path, to):
    """The YAML block parses with huggingface_hub: languages, license, library, tags, metrics, pipeline tag, and the
    run's test BLEU/chrF as model-index results with their sacreBLEU signatures; no base model."""
    from huggingface_hub import ModelCard

    out = tmp_path / to
    assert export(["--ckpt", str(trained.ckpt), "--to", to, "--license", "cc-by-4.0", str(out)]) == 0
    text = (out / "README.md").read_text()
    card = ModelCard(text)
    meta = card.data.to_dict()
    assert meta["language"] == ["en", "it"] and meta["license"] == "cc-by-4.0"
    assert meta["pipeline_tag"] == "translation" and {"translation", "fastmt"} <= set(meta["tags"])
    assert meta["library_name"] == {"ct2": "ctranslate2", "hf": "transformers"}[to]
    assert set(meta["metrics"]) == {"bleu", "chrf"} and "base_model" not in meta
    assert "datasets" not in meta  # the generated toy corpus is no Hub dataset
    test = _test_record(trained.run_dir)
    results = {r.metric_type: r for r in card.data.eval_results}
    assert set(results) == {"bleu", "chrf"}
    for metric, key in (("bleu", "test_bleu"), ("chrf", "test_chrf")):
        r = results[metric]
        assert r.task_type == "translation" and r.dataset_split == "test"
        assert r.metric_value == pytest.approx(test[key], abs=0.005)
        assert r.metric_args["signature"].endswith(test[f"{key}_signature"])
        assert r.metric_args["sentences"] == test["test_sentences"]
    assert f"BLEU {test['test_bleu']:.2f}" in text


def test_bad_license_refused(trained, tmp_path, capsys):
    assert export(["--ckpt", str(trained.ckpt), "--to", "ct2", "--license", "my license", str(tmp_path / "o")]) == 2
    assert "--license" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_no_folder_of_the_machine_in_any_file(trained, tmp_path, tmp_path_factory):
    """Every file of both folders (the card, the configs, the SentencePiece models CTranslate2 and HF get, the
    weights) names no folder of this machine: not the checkpoint's, the data's or the tokenizer's (all under pytest's
    base temp), not the working directory, not OUT's; the scrubbed SentencePiece model encodes as fastmt's does."""
    import sentencepiece as spm

    src = load_source(trained.ckpt)
    for to in ("ct2", "hf"):
        out = tmp_path / to
        assert export(["--ckpt", str(trained.ckpt.resolve()), "--to", to, str(out.resolve())]) == 0
        forbidden = {str(tmp_path_factory.getbasetemp()), os.getcwd(), str(Path.home()), str(out.resolve().parent)}
        for f in out.rglob("*"):
            data = f.read_bytes()
            for path in forbidden:
                assert path.encode() not in data, (f.name, path)
        model_file = out / ("spm.model" if to == "ct2" else "source.spm")
        sp = spm.SentencePieceProcessor(model_file=str(model_file))
        assert sp.encode(trained.src) == [list(map(int, ids)) for ids in src.tok.encode(trained.src)]
    config = json.loads((tmp_path / "ct2" / "fastmt_config.json").read_text())
    assert config["data"]["cache_dir"] == Path(src.config["data"]["cache_dir"]).name
    assert config["run"]["out_dir"] == Path(src.config["run"]["out_dir"]).name


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_file_modes_follow_the_umask(trained, tmp_path, mask):
    """model.safetensors too (safetensors writes it 0600), and the folders."""
    before = os.umask(mask)
    try:
        for to in ("ct2", "hf"):
            assert export(["--ckpt", str(trained.ckpt), "--to", to, str(tmp_path / to)]) == 0
    finally:
        os.umask(before)
    for to in ("ct2", "hf"):
        out = tmp_path / to
        assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~mask
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.rglob("*") if f.is_file()}
        assert modes and set(modes.values()) == {0o666 & ~mask}, modes
    assert "model.safetensors" in {f.name for f in (tmp_path / "hf").iterdir()}


def test_recommended_ct2_options_take_any_source_length(trained, tmp_path):
    """CTranslate2 called directly with the options fastmt_decoding.json recommends: a source longer than the
    position table is cut as fastmt cuts it (its first max_positions - 1 pieces + </s>), and the translation is
    fastmt's of that cut source (beam search, alpha 0)."""
    import ctranslate2
    import sentencepiece as spm

    out = tmp_path / "ct2"
    assert export(["--ckpt", str(trained.ckpt), "--to", "ct2", str(out)]) == 0
    settings = json.loads((out / "fastmt_decoding.json").read_text())
    options = settings["ctranslate2"]["translate_batch"]
    positions = settings["max_positions"]
    assert options["max_input_length"] == positions and options["max_decoding_length"] == positions - 1
    sp = spm.SentencePieceProcessor(model_file=str(out / "spm.model"))
    long = " ".join(trained.src * 8)
    pieces = sp.encode(long, out_type=str)
    assert len(pieces) > 2 * positions
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    short = sp.encode(trained.src[0], out_type=str)
    results = translator.translate_batch([pieces, short], **options)
    src = load_source(trained.ckpt)
    ids = [sp.piece_to_id(p) for p in pieces][: positions - 1]
    with torch_threads(1):
        ours = fastmt_decode(src.model, [ids, source_ids(src.tok, trained.src[:1], positions)[0]],
                             beam=options["beam_size"], alpha=0.0, a=0.0, b=positions - 1)
    theirs = [[sp.piece_to_id(p) for p in r.hypotheses[0] if p != "</s>"] for r in results]
    assert theirs == ours
    assert torch.is_tensor(torch.tensor(ids))  # (the cut source is non-empty)


def test_card_names_hub_datasets_only(trained, tmp_path):
    """``datasets`` lists a Hub dataset the run read, never the toy corpus or a local folder (by its name)."""
    from train.export.common import corpus_name, hub_dataset

    assert hub_dataset({"dataset": "Helsinki-NLP/opus_books"}) == "Helsinki-NLP/opus_books"
    assert hub_dataset({"dataset": "Helsinki-NLP/opus_books", "data_files": ["a.jsonl"]}) is None
    assert hub_dataset({"dataset": "toy"}) is None and hub_dataset({"dataset": str(tmp_path)}) is None
    assert corpus_name({"dataset": str(tmp_path)}) == f"a local dataset folder {tmp_path.name}"
    assert corpus_name({"data_files": [str(tmp_path / "x" / "a.jsonl")]}) == "local files a.jsonl"
