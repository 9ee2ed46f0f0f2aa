"""``python -m bench.inference`` end to end on a trained checkpoint: every engine translates the same sentences,
CTranslate2 and HF generate word for word as fastmt, and the result file names the machine, the sha and the data."""

from __future__ import annotations

import json

from bench.inference import main as bench


def test_bench_inference_same_translations(trained, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"translation": {"en": s, "it": r}}) + "\n"
                             for s, r in zip(trained.src[:12], trained.ref[:12])))
    assert bench(["--ckpt", str(trained.ckpt), "--data-files", str(pairs), "--sentences", "12", "--beam", "2",
                  "--threads", "1", "--engines", "fastmt,ct2-float32,hf-generate", "--out", str(tmp_path / "res"),
                  "--device", "cpu"]) == 0
    text = (tmp_path / "res" / "inference-cpu.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| engine")}
    assert set(rows) == {"fastmt", "ct2-float32", "hf-generate"}, text
    same = {name: cells[-1] for name, cells in rows.items()}
    assert same == {"fastmt": "12", "ct2-float32": "12", "hf-generate": "12"}, text
    assert "git " in text and "stand-in corpus (pairs.jsonl)" in text and "beam 2" in text
