"""``python -m train.translate``: one output line per input line, a warning on truncation, no temp files;
lines translated as they arrive (a pipe, a terminal); a line that is not UTF-8 answered by an empty line;
decoding settings from the checkpoint's eval section unless a flag overrides them.

The checkpoints hold an untrained tiny model: the properties tested do not depend on translation quality.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import pty
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from data.tokenizer import Tokenizer
from models import Transformer, get_preset
from train.cli.translate import main
from train.config import tiny
from train.evaluation.decode import overlong, translate
from train.evaluation.load import load_for_inference

MAX_POSITIONS = 24
ROOT = Path(__file__).resolve().parents[3]
WAIT_S = 180  # a subprocess's start (torch import, model load) on a loaded 2-core machine, with room


def write_ckpt(path: Path, tok, config: dict | None = None) -> Path:
    """A checkpoint as the trainer writes it (the toy data's tokenizer, an untrained 1+1 x 32 model, the tiny
    preset's other sections), whose tokenizer file no longer exists (only its bytes); ``config``: fields of the
    other sections (eval, run) set."""
    torch.manual_seed(0)
    mcfg = get_preset("tiny", vocab_size=tok.vocab_size, d_model=32, n_heads=2, d_ff=64, enc_layers=1,
                      dec_layers=1, max_positions=MAX_POSITIONS)
    record = {**tiny().record(), "model": dataclasses.asdict(mcfg)}  # every section, as the trainer records it
    for section, values in (config or {}).items():
        record[section] = {**record[section], **values}
    torch.save({"model": Transformer(mcfg).state_dict(), "config": record,
                "position": {"epoch": 1, "batch_index": 0, "step": 1}, "tokenizer": {"model_file": str(path.parent / "gone" / "spm.model"), "key": tok.key,
                                              "model_bytes": tok.model_bytes()}}, path)
    return path


@pytest.fixture(scope="module")
def ckpt(toy_bundle, tmp_path_factory):
    tok = toy_bundle.tokenizer
    return write_ckpt(tmp_path_factory.mktemp("translate") / "best.pt", tok), tok


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """Point tempfile at an empty folder, to see whether anything is left in it. torch._dynamo is imported first:
    its first import makes torch's own compile-cache folder under tempfile's folder (torch 2.13), which is not
    fastmt's doing (this test failed when it ran before any other test had imported it)."""
    import torch._dynamo  # noqa: F401

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


# -- decoding settings: the checkpoint's, unless a flag says otherwise -------------------------------------
def test_decoding_defaults_come_from_the_checkpoint(toy_bundle, tmp_path, capsys):
    """A checkpoint whose run decoded with beam 3, length penalty 1.0 and a length limit of 0 x source + 2
    tokens (one subword and EOS): translate uses exactly those settings; a flag overrides its one setting."""
    tok = toy_bundle.tokenizer
    ev = {"beam_size": 3, "length_penalty": 1.0, "max_len_a": 0.0, "max_len_b": 2, "batch_size": 5}
    path = write_ckpt(tmp_path / "best.pt", tok, {"eval": ev, "run": {"precision": "fp32"}})
    texts = ["the cat sleeps under the table", "a big red house", "the old man sees the moon"]
    model, _, _ = load_for_inference(path)
    want = translate(model, tok, texts, torch.device("cpu"), beam_size=3, length_penalty=1.0, max_len_ratio=0.0,
                     max_len_extra=2, batch_size=5)
    assert main(["--ckpt", str(path), *texts]) == 0
    got = capsys.readouterr().out.splitlines()
    assert got == want
    longer = translate(model, tok, texts, torch.device("cpu"), beam_size=3, length_penalty=1.0, max_len_ratio=0.0,
                       max_len_extra=8, batch_size=5)
    assert main(["--ckpt", str(path), "--max-len-b", "8", *texts]) == 0
    assert capsys.readouterr().out.splitlines() == longer
    assert longer != want  # the flag, not the checkpoint, set the limit


@pytest.mark.parametrize("flag,value,says", [("--beam", "0", "--beam 0: must be >= 1"),
                                             ("--length-penalty", "nan", "--length-penalty nan: must be a finite"),
                                             ("--max-len-b", "1.5", "--max-len-b '1.5': not an integer"),
                                             ("--precision", "fp8", "--precision fp8: must be one of"),
                                             ("--device", "tpu", "--device 'tpu'")])
def test_bad_decoding_flags_fail_in_one_line(ckpt, capsys, flag, value, says):
    path, _ = ckpt
    assert main(["--ckpt", str(path), flag, value, "the cat"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("error: ") and says in out.err and out.err.count("\n") == 1


def test_not_a_checkpoint_fails_in_one_line(tmp_path, capsys):
    bad = tmp_path / "best.pt"
    bad.write_bytes(b"not a checkpoint")
    assert main(["--ckpt", str(bad), "the cat"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ckpt: cannot read checkpoint") and "Traceback" not in err
    assert main(["--ckpt", str(tmp_path / "none.pt"), "the cat"]) == 2
    assert "no such file" in capsys.readouterr().err


# -- stdin: line by line as it arrives, bad bytes answered in line -----------------------------------------
def test_non_utf8_line_gets_an_empty_line_and_a_warning(ckpt, capsys, monkeypatch):
    """Issue 20 row 11: one undecodable line must not cost the others their translations or their places."""
    path, _ = ckpt
    good = run(path, capsys, monkeypatch, stdin="the cat\n\na dog sleeps\nred\n")[0]
    data = b"the cat\n\xff\xfe caf\xe9\n\na dog sleeps\nred\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert main(["--ckpt", str(path), "--beam", "2"]) == 0
    out = capsys.readouterr()
    assert out.out.split("\n")[:-1] == [good[0], "", "", good[2], good[3]]
    assert out.err.count("warning:") == 1 and "input line 2 is not UTF-8 (byte 0xff at byte 1)" in out.err


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")  # the in-process reference translations run on one thread too
    env.pop("FASTMT_DEBUG", None)
    return env


def _read_lines(fd: int, n: int, deadline: float) -> list[bytes]:
    """The first ``n`` lines from ``fd`` as they come, or fewer if ``deadline`` (time.monotonic) passes."""
    buf = b""
    while buf.count(b"\n") < n and time.monotonic() < deadline:
        if select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            buf += chunk
    return buf.split(b"\n")[:n] if buf.count(b"\n") >= n else buf.split(b"\n")[:-1]


def test_pipe_streams_each_batch_before_stdin_closes(ckpt, capsys, monkeypatch):
    """A real process reading a pipe: the lines written so far are answered (flushed) while stdin is still
    open; a non-UTF-8 line among them gets an empty line and a warning naming it; output stays in line."""
    path, _ = ckpt
    first = b"the cat\n\xff bad \xfe\n\na dog sleeps\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(first), encoding="utf-8"))
    assert main(["--ckpt", str(path)]) == 0
    want = capsys.readouterr().out.split("\n")[:-1]
    proc = subprocess.Popen([sys.executable, "-m", "train.translate", "--ckpt", str(path)], cwd=ROOT, env=_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(first)
        proc.stdin.flush()
        got = _read_lines(proc.stdout.fileno(), 4, time.monotonic() + WAIT_S)
        assert proc.poll() is None  # still waiting for more lines
        assert [g.decode() for g in got] == want and want[1] == want[2] == "" and want[0] and want[3]
        proc.stdin.write(b"red")  # a last line without a newline
        proc.stdin.close()
        rest, err = proc.stdout.read(), proc.stderr.read().decode()
        assert proc.wait(WAIT_S) == 0
    finally:
        proc.kill()
    assert rest.decode() == run(path, capsys, monkeypatch, args=["red"])[0][0] + "\n"
    assert err.count("warning:") == 1 and "input line 2 is not UTF-8 (byte 0xff at byte 1)" in err


def test_terminal_answers_each_line_as_it_is_typed(ckpt, capsys, monkeypatch):
    """stdin a terminal (a pty): each typed line is answered before the next is typed; Ctrl-D ends."""
    path, _ = ckpt
    lines = ["the cat", "a dog sleeps"]
    # the answers of the same command given the lines as arguments, in the same kind of process (an untrained
    # model's near-ties may break differently in this test process, whose setup differs)
    args = subprocess.run([sys.executable, "-m", "train.translate", "--ckpt", str(path), *lines], cwd=ROOT,
                          env=_env(), capture_output=True, timeout=WAIT_S)
    want = args.stdout.decode().split("\n")[:-1]
    assert args.returncode == 0 and len(want) == 2, args.stderr.decode()[-2000:]
    try:
        master, slave = pty.openpty()
    except OSError as e:  # a sandbox without /dev/ptmx
        pytest.skip(f"no pseudo-terminal here: {e}")
    proc = subprocess.Popen([sys.executable, "-m", "train.translate", "--ckpt", str(path)], cwd=ROOT, env=_env(),
                            stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(slave)
    try:
        deadline = time.monotonic() + WAIT_S
        for line, expected in zip(lines, want):
            os.write(master, line.encode() + b"\n")
            assert _read_lines(proc.stdout.fileno(), 1, deadline) == [expected.encode()]
        os.write(master, b"\x04")  # Ctrl-D at the start of a line: end of input
        assert proc.wait(WAIT_S) == 0 and proc.stdout.read() == b""
        assert "Ctrl-D ends" in proc.stderr.read().decode()
    finally:
        proc.kill()
        os.close(master)
