"""``python -m train.evaluate --ckpt CKPT --src FILE [--ref FILE ...]``: translate a test set with a checkpoint
and score it with sacreBLEU (BLEU, chrF and their signatures).

Input: ``--src`` holds one source sentence per line and each ``--ref`` one reference per line (line k answers
line k; several ``--ref`` files give several references per sentence). Or ``--src`` is a file of pairs in a
training format (``.jsonl``/``.json``/``.parquet``/``.tsv``, as ``--data-files`` reads them), which holds the
references too. Every line is scored: nothing is filtered or sub-sampled. A source longer than the model's
positions is cut to fit and counted; a blank source line gets a blank hypothesis. A line that is not UTF-8,
a row of a pairs file that is not a usable pair, or files whose line counts differ stop the command before
it decodes anything (exit 2), naming the file and line.

Decoding: every option defaults to the checkpoint's own settings (train/cli/decoding.py), what the training
run's final test used: ``evaluate`` of a run's ``best.pt`` on its test split gives the run's test BLEU.

Output: the scores and signatures on stdout; the hypotheses, one per line, in ``--out`` (default
``<run folder>/eval/<src file name>.<checkpoint name>.hyp`` when the checkpoint lies in ``<run>/checkpoints/``,
else ``eval/`` beside the checkpoint; ``-``: stdout, the scores then go to stderr), and beside them
``<out>.json``: scores, signatures, decoding settings, counts, and the checkpoint and input files with their
sha256. An existing ``--out`` is replaced only when its ``.json`` record says this command wrote it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

from train.cli.decoding import add_decoding_options, load_for_command, quiet_closed_stdout, run_command
from train.errors import EXIT_OK, UserError
from train.evaluation.load import checkpoint_file

PAIR_FORMATS = (".jsonl", ".json", ".parquet", ".tsv")  # data.sources' formats: both sides in one file
WRITER = "python -m train.evaluate"  # the mark of this command's records (what it may overwrite)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--ckpt", required=True, help="a training checkpoint, e.g. runs/<name>/checkpoints/best.pt")
    p.add_argument("--src", required=True, metavar="FILE",
                   help=f"sources, one per line; or pairs ({', '.join(PAIR_FORMATS)}) holding the references too")
    p.add_argument("--ref", nargs="+", action="extend", metavar="FILE", help="references, one per line (several files: several "
                                                            "references per sentence); none: translate only")
    p.add_argument("--out", metavar="HYPS", help="where the hypotheses go (default: see below; -: stdout)")
    add_decoding_options(p)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error too")
    return p


# -- reading the test set ----------------------------------------------------------------------------------
def read_lines(path: str, digest=None) -> list[str]:
    """The lines of a UTF-8 text file as given (a final newline ends the last line; a trailing CR and a
    leading BOM are dropped); a byte that is not UTF-8 raises ``UserError`` naming the line. ``digest`` (a
    ``hashlib`` object) is fed the very bytes read: the record's hash names what was scored."""
    from data.files import TEXTS_MAX, read_bytes

    try:  # the one reader: a regular file (a FIFO or a device named here is refused), at most TEXTS_MAX bytes
        data = read_bytes(path, "test set", limit=TEXTS_MAX)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if digest is not None:
        digest.update(data)
    data = data.removeprefix(b"\xef\xbb\xbf")
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()
    lines = []
    for n, line in enumerate(raw, 1):
        try:
            lines.append(line.removesuffix(b"\r").decode("utf-8"))
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{n}: byte 0x{line[e.start]:02x} (byte {e.start + 1} of the line) is not "
                            f"UTF-8; a test set is scored whole, so fix the line or convert the file "
                            f"(e.g. iconv -f latin1 -t utf-8 IN > OUT)") from None
    return lines


def read_pairs(path: str, src_lang: str, tgt_lang: str, digest=None) -> tuple[list[str], list[str]]:
    """(sources, references) of a pairs file in a training format, every row kept: a row that is not a usable
    pair raises ``UserError`` with the reader's reasons and file:line examples (blank lines are not rows).
    ``digest`` (a ``hashlib`` object) is fed the bytes of the file read: it is held open and hashed while the
    data reader reads it by name, which must still be that file, unchanged, afterwards (else ``UserError``)."""
    from data.clean import CleanReport, DataInputError, clean_text
    from data.files import TEXTS_MAX, open_read
    from data.sources import load_local
    from train.runs.checkpoint import file_identity, hash_open_file

    try:
        with open_read(path, "test set", limit=TEXTS_MAX) if digest is not None else contextlib.nullcontext() as f:
            before = hash_open_file(f, digest) if f is not None else None
            raw = load_local((path,), src_lang, tgt_lang)
            if f is not None and (file_identity(os.fstat(f.fileno())) != before
                                  or file_identity(os.stat(path)) != before):
                raise UserError(f"--src {path} was replaced or written while it was read: its hash would not name "
                                f"what was scored; nothing was written. Run again once it is done")
    except DataInputError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    report: CleanReport = raw.report
    src, tgt, _ = clean_text(raw.translation, src_lang, tgt_lang, report, raw.where)
    bad = {k: v for k, v in report.dropped.items() if v and k != "blank_line"}
    if bad:
        examples = "; ".join(e for k in bad for e in report.examples.get(k, [])[:2])
        raise UserError(f"{path}: {sum(bad.values())} row(s) are not usable {src_lang}-{tgt_lang} pairs "
                        f"({', '.join(f'{k} {v}' for k, v in bad.items())}; e.g. {examples}); a test set is "
                        f"scored whole, so fix or remove them")
    if not src:
        raise UserError(f"{path}: no {src_lang}-{tgt_lang} pairs in it")
    return src, tgt


def read_test_set(args, config: dict, hashes: dict | None = None) -> tuple[list[str], list[list[str]]]:
    """(sources, reference sets) from ``--src`` and ``--ref``; checked whole before anything is decoded.
    ``hashes``: receives ``src`` (the sha256 of the ``--src`` bytes read) and ``refs`` (of each ``--ref``'s)."""
    data = config.get("data") or {}
    digests = [hashlib.sha256() for _ in range(1 + len(args.ref or []))]
    if hashes is not None:
        hashes["src"], hashes["refs"] = digests[0], digests[1:]
    if Path(args.src).suffix.lower() in PAIR_FORMATS:
        if args.ref:
            raise UserError(f"--src {args.src} is a pairs file (it holds the references): drop --ref, or give "
                            f"the sources as a plain text file")
        src, ref = read_pairs(args.src, data.get("src_lang", "en"), data.get("tgt_lang", "it"), digests[0])
        return src, [ref]
    src = read_lines(args.src, digests[0])
    refs = [read_lines(r, d) for r, d in zip(args.ref or [], digests[1:])]
    for path, ref in zip(args.ref or [], refs):
        if len(ref) != len(src):
            raise UserError(f"--ref {path} has {len(ref):,} lines but --src {args.src} has {len(src):,}: line k of "
                            f"each must be the same sentence")
    if not src:
        raise UserError(f"--src {args.src} is empty: nothing to translate")
    return src, refs


# -- where the output goes ---------------------------------------------------------------------------------
def default_out(ckpt: Path, src: str) -> Path:
    """``<run>/eval/<src name>.<ckpt stem>.hyp`` for ``<run>/checkpoints/<ckpt>``, else ``eval/`` beside it."""
    ckpt = ckpt.resolve()
    home = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return home / "eval" / f"{Path(src).name}.{ckpt.stem}.hyp"


def record_path(out: Path) -> Path:
    return out.with_name(out.name + ".json")


def check_writable(out: Path) -> None:
    """Refuse, before decoding, an output that exists and is not this command's, or a folder not writable."""
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; give a file path")
    if out.exists() or out.is_symlink():
        from data.files import read_json

        try:  # the one reader: no link followed in the output's folder, a regular file, at most RECORD_MAX bytes
            mine = read_json(record_path(out), "evaluate record", inside=out.parent).get("written_by") == WRITER
        except (OSError, ValueError, AttributeError):
            mine = False
        if not mine:
            raise UserError(f"{out} exists and was not written by {WRITER} (no {record_path(out).name} record of "
                            f"it): pass another --out, or move it away")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"cannot write {out}: {parent} is a file, not a folder; pass --out PATH")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {out}: {parent} is not writable; pass --out PATH")


def check_eval_folder(folder: Path) -> None:
    """The default output folder ``<run>/eval`` (or the folder it would be made in) is a real folder of this user's
    that nobody else can change (`data.ownership.ownership_problem`), else ``UserError`` before anything is decoded."""
    from data.ownership import ownership_problem

    if folder.is_symlink():
        raise UserError(f"{folder} is a symbolic link (to {os.readlink(folder)}): fastmt writes the hypotheses only "
                        f"into a real folder, never through a link; remove it or pass --out PATH")
    problem = ownership_problem(folder if folder.exists() else folder.parent)
    if problem:
        raise UserError(f"cannot write into {folder}: {problem}; pass --out PATH (a folder of yours)")


def _same(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def check_not_an_input(out: Path, args) -> None:
    """The hypotheses and their record never replace what this command reads (a hypothesis file an earlier
    evaluate wrote, given as ``--src`` or ``--ref`` and as ``--out``: it would be read, then overwritten)."""
    inputs = [("--src", args.src), *(("--ref", r) for r in args.ref or []), ("--ckpt", args.ckpt)]
    for written in (out, record_path(out)):
        for flag, path in inputs:
            if _same(written, path):
                raise UserError(f"--out {out} would overwrite {flag} {path}, which this command reads: pass another "
                                f"--out")




def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` through `data.files.atomic_write` (temp file beside ``path``, fsync, rename; never through a
    link): a reader never sees half a file. A full or read-only disk raises ``UserError`` (the temp file removed,
    an older ``path`` left as it was)."""
    from data.files import atomic_write as write

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path, text, what="output")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror or e}; pass another --out") from None


# -- the command -------------------------------------------------------------------------------------------
def run(args) -> int:
    from train.evaluation.decode import overlong, translate_lines
    from train.evaluation.scores import corpus_scores
    from train.export.engine import engine_record

    args.ckpt = checkpoint_file(args.ckpt)
    to_stdout = args.out == "-"
    out = None if to_stdout else Path(args.out) if args.out else default_out(Path(args.ckpt), args.src)
    if out is not None:
        if not args.out:  # the run folder's eval/: fastmt's to make, never through a link or in another user's folder
            check_eval_folder(out.parent)
        check_not_an_input(out, args)
        check_writable(out)

    def inputs_exist() -> None:
        for path in [args.src, *(args.ref or [])]:
            if not Path(path).is_file():
                raise UserError(f"{path} is not a regular file (a FIFO, device or folder): give a file of lines"
                                if Path(path).exists() else f"no such file: {path}")

    # every hash is of the bytes read, taken as they are read: the checkpoint (or model.bin) the weights came from,
    # the test set decoded and scored; never the paths again after decoding, when they may hold other files
    loaded = load_for_command(args, inputs_exist, hash_weights=True)
    model, tok, config, device = loaded.model, loaded.tok, loaded.config, loaded.device
    decoding, given = loaded.decoding, loaded.given
    hashes: dict = {}
    src, refs = read_test_set(args, config, hashes)
    report = sys.stderr if to_stdout else sys.stdout
    limit = model.cfg.max_positions
    cut = overlong(tok, src, limit)
    if cut:
        lines = ", ".join(str(i + 1) for i, _ in cut[:10]) + (", ..." if len(cut) > 10 else "")
        print(f"note: {len(cut):,} of {len(src):,} sources are longer than the model's {limit} positions and are cut "
              f"to fit (lines {lines})", file=sys.stderr)
    ran = engine_record(model, device, decoding.precision)  # engine, quantization, compute, threads
    if ran["engine"] != "fastmt":  # the precision flag is fastmt's autocast: not what a CTranslate2 folder decodes in
        decoding_record = {**decoding.as_dict(), "precision": None}
    else:
        decoding_record = decoding.as_dict()
    t0 = time.perf_counter()
    hyps = translate_lines(model, tok, src, device, decoding,
                           cuda_graph=bool((config.get("eval") or {}).get("cuda_graphs", True)))
    seconds = time.perf_counter() - t0
    scores = corpus_scores(hyps, refs) if refs else {}
    record = {
        "written_by": WRITER, "checkpoint": str(Path(args.ckpt).resolve()), "checkpoint_sha256": loaded.weights_sha256,
        "src": str(Path(args.src).resolve()), "src_sha256": hashes["src"].hexdigest(),
        "refs": [str(Path(r).resolve()) for r in args.ref or []], "refs_sha256": [d.hexdigest() for d in hashes["refs"]],
        "sentences": len(src), "truncated_sources": len(cut), "max_positions": limit,
        "bleu": scores.get("bleu"), "chrf": scores.get("chrf"), "bleu_signature": scores.get("bleu_signature"),
        "chrf_signature": scores.get("chrf_signature"), "decoding": decoding_record,
        "decoding_from_flags": given, "device": str(device), **ran, "decode_seconds": seconds,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if to_stdout:
        try:
            sys.stdout.write("".join(h + "\n" for h in hyps))
            sys.stdout.flush()
        except BrokenPipeError:
            raise
        except OSError as e:
            raise UserError(f"cannot write the hypotheses to stdout: {e.strerror or e}") from None
    else:
        atomic_write(out, "".join(h + "\n" for h in hyps))
        atomic_write(record_path(out), json.dumps(record, indent=2) + "\n")
    if scores:
        print(f"BLEU {scores['bleu']:.2f}  chrF2 {scores['chrf']:.2f}  ({len(src):,} sentences, {len(cut):,} "
              f"sources cut to the model's {limit} positions)", file=report)
        print(f"  BLEU|{scores['bleu_signature']}\n  chrF2|{scores['chrf_signature']}", file=report)
    else:
        print(f"no --ref: {len(src):,} sentences translated, nothing scored", file=report)
    origin = ("the checkpoint's eval settings, what its final test used" if not given else
              f"{', '.join(given)} given; the rest from the checkpoint")
    threads = f", {ran['threads']} thread{'s' if ran['threads'] != 1 else ''}" if ran["threads"] else ""
    engine = (f"fastmt, {decoding.describe()}" if ran["engine"] == "fastmt" else
              f"CTranslate2 {ran['quantization']} (compute {ran['compute']}), {decoding.describe(precision=False)}")
    print(f"decoding: {engine} ({origin}); {seconds:.1f} s on {device}{threads}", file=report)
    if out is not None:
        print(f"hypotheses: {out} (record: {record_path(out)})", file=report)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and score; a user error prints one line (``error: ...``) and returns 2, Ctrl-C 130."""
    args = build_parser().parse_args(argv)
    try:
        return run_command(run, args, interrupted="interrupted: nothing written")
    except BrokenPipeError:  # the report piped into `head`: the files are written, the rest of it unread
        quiet_closed_stdout()
        return EXIT_OK
