"""``python -m train.translate --ckpt C "text" ...`` (or one sentence per stdin line): beam-search translations.

One output line per input, in order: a blank input gives a blank output line, and a line break inside a
translation is printed as a space, so output line k always answers input line k. Lines read from stdin are
translated as they arrive: each batch is whatever complete lines are there (at most ``--batch-size``), and
its translations are printed and flushed before the next batch is read. Typed at a terminal, a line in
gives a line out; from a pipe, the first batch prints while the rest is still coming. A stdin line that is
not UTF-8 gets an empty output line and a warning on stderr naming it; the other lines are translated.
An input longer than the model's positions is cut to fit, with a warning on stderr saying by how many tokens.
The model and tokenizer are rebuilt from the checkpoint alone: its config gives the architecture, and it
carries the SentencePiece model (bytes, loaded in memory, plus the path and cache key it was trained under).
Decoding defaults to the checkpoint's eval settings, what its final test used (train/cli/decoding.py).
"""

from __future__ import annotations

import argparse
import io
import os
import select
import sys
from collections import deque
from collections.abc import Iterator

from train.cli.decoding import add_decoding_options, load_for_command, quiet_closed_stdout, run_command
from train.errors import EXIT_OK, UserError
from train.evaluation.decode import overlong, translate_lines

__all__ = ["main", "stdin_batches"]


_CHUNK = 1 << 16  # bytes per read of stdin
MAX_LINE_BYTES = 1 << 20  # a longer stdin line is answered by an empty line, never buffered (`translate < /dev/zero`)


def _ready(fd: int) -> bool:
    """Can ``fd`` be read without blocking now?"""
    return bool(select.select([fd], [], [], 0)[0])


def _fd_batches(fd: int, batch_size: int) -> Iterator[list[bytes | None]]:
    """Batches of raw lines read from a file descriptor: wait for one complete line, then take the lines
    already there (never waiting for more), at most ``batch_size``. A line longer than `MAX_LINE_BYTES` is
    None (its bytes are dropped as they come: memory stays bounded whatever the input)."""
    pending: deque[bytes | None] = deque()
    partial = bytearray()
    eof = False
    overlong = False  # the line being read passed MAX_LINE_BYTES: skip to its end

    def read_once() -> None:
        nonlocal eof, overlong
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            eof = True
            if partial or overlong:
                pending.append(None if overlong else bytes(partial))
                partial.clear()
            return
        partial.extend(chunk)
        if b"\n" in chunk:
            *lines, rest = bytes(partial).split(b"\n")
            if overlong:
                lines[0], overlong = None, False
            pending.extend(None if line is not None and len(line) > MAX_LINE_BYTES else line for line in lines)
            partial[:] = rest
        if len(partial) > MAX_LINE_BYTES:
            partial.clear()
            overlong = True

    while True:
        while not pending and not eof:
            read_once()  # blocks until something arrives
        while len(pending) < batch_size and not eof and _ready(fd):
            read_once()
        if not pending:
            return
        yield [pending.popleft() for _ in range(min(batch_size, len(pending)))]


def stdin_batches(stream, batch_size: int) -> Iterator[list[bytes | None]]:
    """Raw stdin lines (bytes, without the newline) in batches, as they arrive: a real file descriptor is read
    without buffering (what is there now is translated now); other streams (tests, wrappers) line by line."""
    binary = getattr(stream, "buffer", stream)
    try:
        fd = binary.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fd = None
    if fd is not None:
        yield from _fd_batches(fd, batch_size)
        return
    batch: list[bytes | None] = []
    while line := binary.readline(MAX_LINE_BYTES + 1):
        line = line.encode("utf-8", "surrogateescape") if isinstance(line, str) else line
        if len(line.removesuffix(b"\n")) > MAX_LINE_BYTES:  # skip the rest of it, never buffered whole
            while line and not line.endswith(b"\n"):
                line = binary.readline(MAX_LINE_BYTES + 1)
                line = line.encode("utf-8", "surrogateescape") if isinstance(line, str) else line
            batch.append(None)
        else:
            batch.append(line.removesuffix(b"\n"))
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def decode_line(raw: bytes | None, number: int, warn) -> str | None:
    """A stdin line as text (BOM on line 1 and a trailing CR dropped); None, with a warning, if not UTF-8 or
    longer than `MAX_LINE_BYTES` (``raw`` None)."""
    if raw is None:
        warn(f"warning: input line {number} is longer than {MAX_LINE_BYTES:,} bytes: answered by an empty line")
        return None
    if number == 1:
        raw = raw.removeprefix(b"\xef\xbb\xbf")
    raw = raw.removesuffix(b"\r")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        warn(f"warning: input line {number} is not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1}): "
             f"answered by an empty line")
        return None


class _Out:
    """stdout as UTF-8 lines, flushed per batch; a closed pipe (``| head``) ends the output quietly."""

    def __init__(self):
        self.binary = getattr(sys.stdout, "buffer", None)
        self.closed = False

    def write_lines(self, lines: list[str]) -> None:
        text = "".join(line + "\n" for line in lines)
        try:
            if self.binary is not None:
                sys.stdout.flush()
                self.binary.write(text.encode("utf-8"))
                self.binary.flush()
            else:
                sys.stdout.write(text)
                sys.stdout.flush()
        except BrokenPipeError:
            self.closed = True
            quiet_closed_stdout()  # no second error when Python flushes stdout at exit
        except OSError as e:  # a full disk behind a redirection
            raise UserError(f"cannot write the translations to stdout: {e.strerror or e}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.translate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--ckpt", required=True, help="a checkpoint from runs/<name>/checkpoints/ (e.g. best.pt)")
    add_decoding_options(p)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error too")
    p.add_argument("text", nargs="*", help="sentences to translate; none: read lines from stdin")
    return p


def run(args) -> int:
    loaded = load_for_command(args)  # --ckpt: a file, or a run folder's best.pt
    model, tok, device, decoding = loaded.model, loaded.tok, loaded.device, loaded.decoding
    limit = model.cfg.max_positions
    out = _Out()

    def warn(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def answer(lines: list[str | None], first: int, where: str) -> None:
        todo = [k for k, line in enumerate(lines) if line is not None and line.strip()]
        for i, n in overlong(tok, [lines[k] for k in todo], limit):
            warn(f"warning: input {where} {first + todo[i]} is {n:,} tokens (incl. EOS) but the model reads at most "
                 f"{limit}: its last {n - limit:,} tokens are not translated")
        out.write_lines(translate_lines(model, tok, lines, device, decoding))

    if args.text:
        answer(list(args.text), 1, "argument")
        return EXIT_OK
    if sys.stdin is None:
        raise UserError("no text arguments and no stdin to read lines from")
    if sys.stdin.isatty():
        warn("reading lines to translate (Ctrl-D ends)")
    number = 1
    for batch in stdin_batches(sys.stdin, decoding.batch_size):
        answer([decode_line(raw, number + k, warn) for k, raw in enumerate(batch)], number, "line")
        number += len(batch)
        if out.closed:
            break
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and translate; a user error prints one line (``error: ...``) and returns 2, Ctrl-C one line
    and 130."""
    parser = build_parser()
    return run_command(run, parser.parse_args(argv),
                       interrupted=f"{parser.prog}: interrupted (Ctrl-C): stopped at once; the input after the last "
                                   f"translation printed was not translated")


if __name__ == "__main__":
    sys.exit(main())
