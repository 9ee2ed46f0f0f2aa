"""``python -m bench.inference`` end to end: every engine translates the same sentences (CTranslate2 and HF generate
word for word as fastmt), exactly ``--sentences`` of them, each engine on ``--threads`` threads (1 by default), and
the result file names the machine, its load, the sha and the data; it goes to ``--out`` (by default outside the
tracked bench/results)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.inference import DEFAULT_OUT, build_parser
from bench.inference import main as bench


def _rows(text: str) -> dict[str, list[str]]:
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| engine")}


def _pairs(trained, path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"translation": {"en": s, "it": r}}) + "\n"
                            for s, r in zip(trained.src[:n], trained.ref[:n])))
    return path


def test_bench_inference_same_translations(trained, tmp_path):
    pairs = _pairs(trained, tmp_path / "pairs.jsonl", 12)
    assert bench(["--ckpt", str(trained.ckpt), "--data-files", str(pairs), "--sentences", "12", "--beam", "2",
                  "--repeats", "1", "--engines", "fastmt,ct2-float32,hf-generate", "--out", str(tmp_path / "res"),
                  "--device", "cpu"]) == 0
    text = (tmp_path / "res" / "inference-cpu.md").read_text()
    rows = _rows(text)
    assert set(rows) == {"fastmt", "ct2-float32", "hf-generate"}, text
    same = {name: cells[-1] for name, cells in rows.items()}
    assert same == {"fastmt": "12", "ct2-float32": "12", "hf-generate": "12"}, text
    assert "git " in text and "stand-in corpus (pairs.jsonl)" in text and "beam 2" in text
    assert "12 sentences" in text and "1 thread per engine" in text and "load average" in text
    assert "1 pass per engine" in text and "fastmt / ct2-float32:" in text


def test_bench_inference_defaults_and_sentence_count(trained, tmp_path):
    """One thread per engine and an output folder outside bench/results by default; --sentences is what is
    translated: more than the test set holds is an error, and the model it trains itself gets a test split of that
    size (the landed tree translated the toy corpus's 60 whatever --sentences said)."""
    args = build_parser().parse_args([])
    assert args.threads == 1 and args.out == DEFAULT_OUT and "bench/results" not in str(DEFAULT_OUT)
    pairs = _pairs(trained, tmp_path / "pairs.jsonl", 5)
    with pytest.raises(SystemExit, match="--sentences 6"):
        bench(["--ckpt", str(trained.ckpt), "--data-files", str(pairs), "--sentences", "6", "--engines", "fastmt",
               "--out", str(tmp_path / "res"), "--device", "cpu"])
    assert not (tmp_path / "res").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="--out"):  # said before any training or decoding
        bench(["--out", str(tmp_path / "file"), "--engines", "fastmt", "--device", "cpu"])
    assert bench(["--sentences", "70", "--train-steps", "3", "--repeats", "2", "--beam", "1", "--engines", "fastmt",
                  "--out", str(tmp_path / "own"), "--device", "cpu"]) == 0
    text = (tmp_path / "own" / "inference-cpu.md").read_text()
    assert "70 sentences, the test split of the toy corpus" in text and _rows(text)["fastmt"][-1] == "70", text
    assert "2 passes per engine" in text
