"""One door for every foreign byte (issue 35): every read of a file fastmt did not just write goes through
``data.files.open_read`` (a regular file only, no link followed below the folder fastmt owns, a size cap per kind,
every parse failure one line), so a FIFO, a ``/dev/zero`` link, a link to someone's private file or a record nested
ten thousand deep planted in a run folder, an export folder or a cache is refused by name, never read, and never
hangs or fills the memory. The command-level probes run in a child capped in memory and time (``capped``)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from data import files as F
from tests.security.conftest import capped, legacy_run, one_error_line, victim

DEEP = "[" * 100_000 + "]" * 100_000  # JSON that parses only by recursing 100,000 levels


# ----------------------------------------------------------------------------------------------
# the reader itself
# ----------------------------------------------------------------------------------------------
def test_the_reader_takes_regular_files_only_and_follows_no_link_inside(tmp_path):
    root = tmp_path / "run"
    (root / "sub").mkdir(parents=True)
    (root / "ok.json").write_text('{"a": 1}')
    assert F.read_json(root / "ok.json", "record", inside=root) == {"a": 1}
    os.mkfifo(root / "fifo.json")
    (root / "zero.json").symlink_to("/dev/zero")
    (root / "link.json").symlink_to(victim(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.json").write_text("{}")
    (root / "hop").symlink_to(tmp_path / "elsewhere")
    for name, why in (("fifo.json", "a FIFO"), ("zero.json", "symbolic link"), ("link.json", "symbolic link"),
                      ("hop/x.json", "symbolic link"), ("sub", "a folder")):
        with pytest.raises(F.FileRefusedError, match=why) as e:
            F.read_bytes(root / name, "record", limit=F.RECORD_MAX, inside=root)
        assert "\n" not in str(e.value) and str(root) in str(e.value)
    # a path the user named follows their links, but still only to a regular file (not /dev/zero, not a FIFO)
    assert F.read_json(root / "hop" / "x.json", "record") == {}
    with pytest.raises(F.FileRefusedError, match="a device"):
        F.read_bytes(root / "zero.json", "record", limit=10)


def test_the_reader_caps_each_kind_of_file_and_says_so_before_reading(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(F.RECORD_MAX + 1)  # sparse: costs nothing on disk
    with pytest.raises(F.FileRefusedError, match="at most 16.0 MB"):
        F.read_json(big, "record")


@pytest.mark.parametrize("text, why", [(DEEP, "nested too deeply"), ("{", "not valid JSON"),
                                       ("1" * 5000, "not valid JSON"), (b"\xff\xfe", "not UTF-8")],
                         ids=["deep", "torn", "huge-int", "not-utf8"])
def test_every_parse_failure_is_one_line_naming_the_file(tmp_path, text, why):
    path = tmp_path / "r.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(F.BadFileError, match=why) as e:
        F.read_json(path, "record")
    assert isinstance(e.value, ValueError) and str(path) in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------------------------
# reads by name: FIFOs and /dev/zero links planted in a run folder, an export folder, eval/
# ----------------------------------------------------------------------------------------------
def _plant(path: Path, how: str) -> None:
    path.unlink(missing_ok=True)
    if how == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


def _resume(tmp_path: Path, *extra: str):
    run = tmp_path / "runs" / "legacy"
    return capped(["-m", "train", "--config", str(run / "config.json"), "--run.out_dir", str(tmp_path / "runs"),
                   "--data.cache_dir", str(tmp_path / "cache"), "--run.device", "cpu", *extra], timeout=240)


@pytest.mark.parametrize("how", ["fifo", "dev-zero"])
@pytest.mark.parametrize("name", ["run.json", "provenance.json", "metrics.jsonl"])
def test_a_record_planted_in_a_run_folder_stops_resume_in_one_line(tmp_path, name, how):
    run = legacy_run(tmp_path)
    if name == "provenance.json":  # read when the run folder has no marker (a run of an earlier fastmt)
        (run / "run.json").unlink()
    _plant(run / name, how)
    r = _resume(tmp_path, "--resume", "auto")
    one_error_line(r, name)
    assert not list(run.glob("metrics.cut-*"))


def test_resume_path_never_hangs_on_its_run_folder(tmp_path):
    run = legacy_run(tmp_path)
    (run / "run.json").unlink()
    _plant(run / "provenance.json", "fifo")
    r = _resume(tmp_path, "--resume", str(run / "checkpoints" / "step-00000003.pt"))
    one_error_line(r, str(run))  # (a folder whose records cannot be read is not taken for a run: refused)


@pytest.mark.parametrize("how", ["fifo", "dev-zero"])
def test_evaluate_never_reads_a_planted_record_beside_its_output(tmp_path, how):
    run = legacy_run(tmp_path)
    src = tmp_path / "src.txt"
    src.write_text("the cat\n")
    out = run / "eval" / "src.txt.step-00000003.hyp"
    out.parent.mkdir()
    out.write_text("old\n")
    _plant(Path(str(out) + ".json"), how)
    r = capped(["-m", "train.evaluate", "--ckpt", str(run / "checkpoints" / "step-00000003.pt"), "--src", str(src),
                "--device", "cpu"])
    one_error_line(r, str(out), "was not written by")
    assert out.read_text() == "old\n"


def _ct2_folder(tmp_path: Path, **config) -> Path:
    """A folder shaped like a CTranslate2 export (what is_ct2_dir recognises): the refusals come before
    CTranslate2 would read model.bin."""
    import torch

    from tests.security.conftest import LEGACY_CKPT

    ckpt = torch.load(LEGACY_CKPT, weights_only=False)
    d = tmp_path / "ct2"
    d.mkdir()
    (d / "model.bin").write_bytes(b"\0" * 64)
    (d / "spm.model").write_bytes(ckpt["tokenizer"]["model_bytes"])
    (d / "fastmt_decoding.json").write_text(json.dumps({"max_positions": 40, "beam_size": 2}))
    cfg = ckpt["config"]
    for section, values in config.items():
        cfg[section].update(values)
    (d / "fastmt_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name", ["fastmt_config.json", "spm.model", "shared_vocabulary.json"])
def test_a_fifo_in_an_exported_folder_is_refused_before_any_library_opens_it(tmp_path, name):
    pytest.importorskip("ctranslate2")
    d = _ct2_folder(tmp_path)
    _plant(d / name, "fifo")
    r = capped(["-m", "train.translate", "--ckpt", str(d), "--device", "cpu", "hello"], timeout=120)
    one_error_line(r, name)


_CARD = """
import sys
from pathlib import Path
from train.export.common import _test_record
src = type("S", (), {"path": Path(sys.argv[1]) / "checkpoints" / "best.pt"})()
print("RECORD", _test_record(src))
"""


@pytest.mark.parametrize("how", ["fifo", "dev-zero", "link-to-a-file"])
def test_the_model_card_never_reads_a_planted_metrics_file(tmp_path, how):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if how == "link-to-a-file":  # someone's file: its test record is not theirs to put on this model's card
        (run / "metrics.jsonl").symlink_to(victim(tmp_path, json.dumps({"kind": "test", "test_bleu": 99.0}) + "\n"))
    else:
        _plant(run / "metrics.jsonl", how)
    r = capped(["-c", _CARD, str(run)], timeout=60)  # (a FIFO would block the read, /dev/zero fill the memory)
    assert r.returncode == 0 and "RECORD None" in r.stdout, r.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# read before refuse: nothing is copied out of a file a link points to
# ----------------------------------------------------------------------------------------------
def test_resume_never_copies_a_linked_metrics_file_into_a_side_file(tmp_path):
    from train.runs.folder import cut_metrics

    secret = tmp_path / "private.jsonl"
    secret.write_text(json.dumps({"kind": "epoch", "epoch": 5, "step": 50, "secret": "s3cr3t"}) + "\n")
    secret.chmod(0o600)
    run = legacy_run(tmp_path)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to(secret)
    with pytest.raises(F.FileRefusedError, match="symbolic link"):
        cut_metrics(run / "metrics.jsonl", keep=(0, 0), log=lambda *a: None)
    assert not list(run.glob("metrics.cut-*")) and (run / "metrics.jsonl").is_symlink()
    r = _resume(tmp_path, "--resume", "auto")  # the user's command: one line, nothing written
    one_error_line(r, "metrics.jsonl")
    leaked = [p for p in run.rglob("*") if p.is_file() and not p.is_symlink() and "s3cr3t" in p.read_text("latin1")]
    assert not leaked and stat.S_IMODE(secret.stat().st_mode) == 0o600


# ----------------------------------------------------------------------------------------------
# tracebacks: foreign records of odd shapes are one line
# ----------------------------------------------------------------------------------------------
def test_deeply_nested_json_in_metrics_or_the_lock_is_not_a_traceback(tmp_path):
    from train.runs.folder import run_finished
    from train.runs.lock import RunLock, RunLockedError

    run = legacy_run(tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write(DEEP + "\n")
    assert run_finished(run)["kind"] == "done"  # the odd line after the done record is skipped, not raised
    holder = RunLock(run).acquire()
    try:
        os.pwrite(holder._fd, DEEP.encode()[: F.LOCK_MAX], 0)
        with pytest.raises(RunLockedError) as e:
            RunLock(run).acquire()
        assert "\n" not in str(e.value) and len(str(e.value)) < 1000
    finally:
        holder.release()


def test_a_string_beam_size_in_a_checkpoint_is_one_line(tmp_path):
    from tests.security.conftest import forged_checkpoint

    ckpt = forged_checkpoint(tmp_path / "best.pt", eval={"beam_size": "5"})
    r = capped(["-m", "train.translate", "--ckpt", str(ckpt), "--device", "cpu", "hello"])
    one_error_line(r, "eval.beam_size", "--beam")


def test_a_test_record_of_another_shape_never_breaks_the_model_card(tmp_path):
    from train.export.common import _test_record

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "test", "test_bleu": "high", "test_chrf": [1],
                                                   "decoding": "beam", "test_bleu_signature": "x" * 10**6}) + "\n")
    rec = _test_record(type("S", (), {"path": run / "checkpoints" / "best.pt"})())
    assert "test_bleu" not in rec and "test_chrf" not in rec and rec["decoding"] == {}
    assert len(rec["test_bleu_signature"]) <= 300


@pytest.mark.parametrize("name", ["é" * 101, "x" * 300, "a" * 10_000_000], ids=["202-bytes", "300-bytes", "10MB"])
def test_a_run_name_is_measured_in_bytes_and_never_echoed_whole(tmp_path, name):
    from train.config import load_config_file, tiny

    cfg = tiny().to_dict()
    cfg["run"]["name"] = name
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="bytes long") as e:
        load_config_file(path)
    assert len(str(e.value)) < 1000
