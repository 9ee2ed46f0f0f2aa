"""Raw parallel rows: a Hub id + config through HF ``datasets``, local files, or the generated toy corpus.

Local formats (by extension; files of different formats may be mixed):
  * ``.jsonl``: one row per line, ``{"id": ..., "translation": {"en": ..., "it": ...}}``
  * ``.json``: JSON lines as well, or one JSON array of such rows
  * ``.parquet``: a ``translation`` column of the same objects
  * ``.tsv``: two columns ``src<TAB>tgt``, no header, no quoting

Local text files are read line by line here, not through ``datasets``: its JSON and CSV builders parse a
whole file at once and stop at the first bad line (a traceback naming neither file nor line), while this
reader counts each bad line under its reason, with file and line, in the cleaning report and keeps the rest
(malformed JSON of any kind, deep nesting and over-long numbers included). Inputs are cut into `Chunk`s
(`plan_chunks`: ~8 MB of lines, or parquet row groups, or Hub row ranges) that `read_chunk` parses
independently, so a cold build streams through a corpus with one task per chunk (`data.build`).

The Hub path never hangs in retries: with ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` set it only looks
in the local cache (fails at once); otherwise a short TCP probe of the Hub endpoint runs first.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from . import files as F
from .clean import CleanReport, DataFilesNotFound, DataInputError, Tally

PROBE_TIMEOUT_S = 3.0
CHUNK_BYTES = 8 << 20  # a line file is read in pieces of about this many bytes (one task each)
CHUNK_ROWS = 50_000  # parquet / Hub: rows per task
_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".tsv": "tsv"}
_BOM = b"\xef\xbb\xbf"


@dataclass
class SourceFile:
    """One input (a local file, or the Hub dataset) and how its rows are numbered in messages."""

    path: str
    unit: str  # "line" (1-based), "row" (parquet / Hub, 0-based), "index" (JSON array, 0-based)
    fmt: str = "jsonl"  # "jsonl" | "tsv" | "json_array" | "parquet" | "hub"
    start: int = 0  # `load_local`: index of its first parsed row in RawCorpus.translation
    read: int = 0  # lines / rows / items read, bad ones included


@dataclass(frozen=True)
class Chunk:
    """A piece of one input read by one task: bytes [lo, hi) of a line file (cut after a newline), row groups
    [lo, hi) of a parquet file, rows [lo, hi) of the Hub dataset, or a whole JSON array file."""

    file: int  # index of its file in the input list
    path: str
    fmt: str
    lo: int
    hi: int
    base: int = 0  # position (row number) of its first row; line files: 0 (lines before it are counted later)


@dataclass
class ChunkRows:
    """What `read_chunk` parsed: rows (not yet cleaned), their positions inside the chunk, rejected rows."""

    translation: list  # one entry per parsed row: normally a dict {lang: text}; anything else is a bad row
    positions: list[int]  # 0-based position of each parsed row inside the chunk (line / row / item)
    read: int = 0  # lines / rows / items read, bad ones included
    rejects: Tally = field(default_factory=Tally)


@dataclass
class RawCorpus:
    """Columns straight from the source, uncleaned (values may be None, non-str, missing)."""

    translation: list  # one entry per parsed row: normally a dict {lang: text}; anything else is a bad row
    source: str  # human-readable origin, for logs and the split record
    report: CleanReport = field(default_factory=CleanReport)  # rows the reader already rejected, by reason
    files: list[SourceFile] = field(default_factory=list)  # local files in order; empty for the Hub
    positions: list[int] = field(default_factory=list)  # per parsed row: its line / row number in its file

    def where(self, i: int) -> str:
        """File and line (or row) of parsed row ``i``, for the cleaning report."""
        if not self.files:
            return f"{self.source} row {i}"
        f = self.files[bisect.bisect_right([f.start for f in self.files], i) - 1]
        return where(f, self.positions[i])

    def kept_per_file(self, kept: np.ndarray) -> list[int]:
        """How many of the parsed rows ``kept`` (indices into `translation`) come from each file."""
        starts = np.asarray([f.start for f in self.files], dtype=np.int64)
        owner = np.searchsorted(starts, kept, side="right") - 1
        return np.bincount(owner, minlength=len(self.files)).tolist()


def where(f: SourceFile, n: int) -> str:
    """``path:line``, ``path[index]`` or ``path row n``: where row ``n`` of ``f`` is."""
    return {"line": f"{f.path}:{n}", "index": f"{f.path}[{n}]"}.get(f.unit, f"{f.path} {f.unit} {n}")


class HubUnavailableError(ConnectionError):
    """The Hub dataset cannot be loaded (no network and not cached)."""


def _fix_hint(dataset: str) -> str:
    return (
        f"Pass local files instead: `--data-files path/train.jsonl` (or env FASTMT_DATA_FILES=...; "
        f'jsonl/parquet rows {{"id", "translation": {{src, tgt}}}}, or tsv "src<TAB>tgt"). '
        f"If {dataset!r} is already in the HF cache, set HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 to use it "
        f"offline. For a smoke run without data, `--data.dataset toy` generates a toy corpus."
    )


def _offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def probe_hub(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Open (and close) a TCP connection to the Hub endpoint. Returns None if reachable, else the reason."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:  # DNS failure, refused, unreachable, timeout
        return f"{host}:{port} unreachable within {timeout:.0f} s ({type(e).__name__}: {e})"


def missing_files_error(missing: list[str], *, from_env: bool = False, name: str = "data files") -> DataFilesNotFound:
    """The one message for paths that do not exist: names them, and says how several paths are given."""
    hint = ""
    pieces = [p for m in missing for p in re.split(r"[\s,]+", m) if p and p != m]
    if pieces and all(Path(p).is_file() for p in pieces):
        hint = " (a path is never split on spaces or commas: give several files as several arguments)"
    if from_env:
        hint += f" ($FASTMT_DATA_FILES holds paths separated by {os.pathsep!r}, os.pathsep)"
    folders = [m for m in missing if Path(m).is_dir()]
    if folders:
        hint += f" ({', '.join(folders)}: a folder, not a file; name the files in it)"
    return DataFilesNotFound(f"{name} not found: {missing}{hint}")


def plan_chunks(files: tuple[str, ...], chunk_bytes: int | None = None, *, from_env: bool = False,
                name: str = "data files") -> tuple[list[SourceFile], list[Chunk]]:
    """Check the files and cut them into chunks of about ``chunk_bytes`` (line files) or ``CHUNK_ROWS``
    rows (parquet row groups); a JSON array file is one chunk. Raises `DataInputError` for missing files,
    unknown extensions and unreadable parquet files."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise missing_files_error(missing, from_env=from_env, name=name)
    unknown = sorted({p.suffix.lower() for p in paths} - set(_FORMATS))
    if unknown:
        raise DataInputError(
            f"unsupported data file extension(s) {unknown} in {list(files)}; use .jsonl, .json, .parquet or .tsv"
        )
    out_files, chunks = [], []
    for k, p in enumerate(paths):
        fmt = _FORMATS[p.suffix.lower()]
        if fmt == "json":
            fmt = "json_array" if _first_byte(p) == b"[" else "jsonl"
        out_files.append(SourceFile(str(p), {"parquet": "row", "json_array": "index"}.get(fmt, "line"), fmt))
        if fmt == "parquet":
            chunks += _parquet_chunks(k, p)
        elif fmt == "json_array":
            chunks.append(Chunk(k, str(p), fmt, 0, 0))
        else:
            size = p.stat().st_size
            cuts = [0]
            with F.open_read(p, "data file") as fh:  # a regular file (a FIFO or device named here: refused)
                while cuts[-1] + chunk_bytes < size:
                    fh.seek(cuts[-1] + chunk_bytes)
                    fh.readline()  # the cut falls after a newline
                    if fh.tell() >= size:
                        break
                    cuts.append(fh.tell())
            cuts.append(size)
            chunks += [Chunk(k, str(p), fmt, a, b) for a, b in zip(cuts, cuts[1:]) if b > a or size == 0]
    return out_files, chunks


def _parquet_chunks(k: int, p: Path) -> list[Chunk]:
    import pyarrow.parquet as pq

    with F.open_read(p, "data file") as fh:
        size = os.fstat(fh.fileno()).st_size
        try:
            meta = pq.ParquetFile(fh)
            names = meta.schema_arrow.names
            md = meta.metadata
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged or foreign file
            raise DataInputError(f"{p}: not a readable parquet file ({type(e).__name__}: {e})") from e
    check_parquet_size(p, md, size)
    if "translation" not in names:
        raise DataInputError(
            f"{p}: no 'translation' column (found {names}); rows must be "
            f'{{"id": ..., "translation": {{src: ..., tgt: ...}}}}'
        )
    chunks, lo, rows, base = [], 0, 0, 0
    groups = md.num_row_groups
    for g in range(groups):
        rows += md.row_group(g).num_rows
        if rows >= CHUNK_ROWS or g == groups - 1:
            chunks.append(Chunk(k, str(p), "parquet", lo, g + 1, base))
            lo, base, rows = g + 1, base + rows, 0
    return chunks or [Chunk(k, str(p), "parquet", 0, 0, 0)]


PARQUET_INFLATION = 1024  # the most uncompressed bytes a parquet file may declare per byte of it


def check_parquet_size(path, md, size: int) -> None:
    """Refuse (`DataInputError`) a parquet file whose footer declares more than it can honestly hold, before any row
    is decoded: more rows than bytes (a few KB of run-length-encoded rows would become gigabytes of Python rows), or
    more than `PARQUET_INFLATION` uncompressed bytes per byte of the file (a decompression bomb)."""
    rows = md.num_rows
    inflated = sum(md.row_group(g).total_byte_size for g in range(md.num_row_groups))
    if rows > max(size, 1) or inflated > PARQUET_INFLATION * max(size, 1):
        raise DataInputError(
            f"{path}: a {size:,}-byte parquet file that declares {rows:,} rows and {inflated:,} uncompressed bytes "
            f"(at most one row per byte and {PARQUET_INFLATION}x its size): a decompression bomb or a damaged "
            f"file, refused before reading; write the corpus as JSON lines or a plain parquet table")


def read_chunk(chunk: Chunk, src_lang: str, tgt_lang: str) -> ChunkRows:
    """Parse one chunk; rows that cannot be parsed are counted in ``rejects``, never raised (a JSON array
    file or parquet file that cannot be read at all raises `DataInputError` naming it)."""
    out = ChunkRows([], [])
    if chunk.fmt == "parquet":
        _read_parquet(chunk, out)
    elif chunk.fmt == "json_array":
        _read_json_array(chunk, out)
    elif chunk.fmt == "hub":
        rows = hub_dataset(chunk.path)[chunk.lo : chunk.hi]["translation"]
        out.translation, out.positions, out.read = rows, list(range(len(rows))), len(rows)
    else:
        _read_lines(chunk, out, src_lang, tgt_lang, tsv=chunk.fmt == "tsv")
    return out


def read_local(files: tuple[str, ...], src_lang: str, tgt_lang: str, *, name: str = "data files"):
    """The one in-process reader of local files: ``(files, rows)`` where ``files`` are the `SourceFile` s (each
    one's ``read`` filled in as its chunks are read) and ``rows`` yields, chunk by chunk in input order,
    ``(chunk, file, base, ChunkRows)`` with ``base + position`` a row's line / row number in its file.
    `load_local` keeps rows the way a training corpus does; `data.build_scan.read_eval_files` strictly."""
    src_files, chunks = plan_chunks(tuple(files), name=name)

    def rows():
        lines_before = [0] * len(src_files)
        for c in chunks:
            f = src_files[c.file]
            got = read_chunk(c, src_lang, tgt_lang)
            yield c, f, lines_before[c.file] + 1 if f.unit == "line" else c.base, got
            lines_before[c.file] += got.read
            f.read += got.read

    return src_files, rows()


def load_local(files: tuple[str, ...], src_lang: str, tgt_lang: str) -> RawCorpus:
    """Read local files in order into memory (small inputs, tests); rows that cannot be parsed are counted
    in ``report``, never raised. `data.build` streams large corpora chunk by chunk instead."""
    src_files, chunks = read_local(files, src_lang, tgt_lang)
    raw = RawCorpus(translation=[], source="files:" + ",".join(files), files=src_files)
    for c, f, base, rows in chunks:
        if c.lo == 0:  # the file's first chunk
            f.start = len(raw.translation)
        raw.report.rows += rows.rejects.total
        raw.report.merge(rows.rejects, lambda pos, f=f, base=base: where(f, base + pos))
        raw.translation += rows.translation
        raw.positions += [base + p for p in rows.positions]
    return raw


def _clip(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def _first_byte(path: Path) -> bytes:
    with F.open_read(path, "data file") as fh:
        return fh.read(4096).removeprefix(_BOM).lstrip()[:1]


def _read_lines(c: Chunk, out: ChunkRows, src_lang: str, tgt_lang: str, *, tsv: bool) -> None:
    """JSON lines or ``src<TAB>tgt`` lines, each decoded on its own so one bad line costs one row."""
    with F.open_read(c.path, "data file") as fh:
        fh.seek(c.lo)
        data = fh.read(c.hi - c.lo)
    if c.lo == 0:
        data = data.removeprefix(_BOM)
    try:  # one decode for the chunk (no UTF-8 sequence spans a newline); a bad byte: each line on its own
        lines, decoded = data.decode("utf-8").split("\n"), True
    except UnicodeDecodeError:
        lines, decoded = data.split(b"\n"), False
    if lines and not lines[-1]:
        lines.pop()  # the text after the last newline: nothing
    out.read = len(lines)
    bad = out.rejects.add
    for n, line in enumerate(lines):
        if decoded:
            text = line.rstrip("\r")
        else:
            line = line.rstrip(b"\r")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                near = line[max(0, e.start - 20) : e.start + 20].decode("utf-8", "backslashreplace")
                bad("bad_encoding", n, f"byte 0x{line[e.start]:02x} (byte {e.start + 1} of the line) is not UTF-8, "
                                       f"near: {near}")
                continue
        text = text.removeprefix("\ufeff")  # a byte-order mark opening a line (files joined with cat): not the row's
        if not text.strip():
            bad("blank_line", n, "empty or whitespace only")
            continue
        if tsv:
            cols = text.split("\t")
            if len(cols) != 2:
                bad("wrong_columns", n, f"{len(cols)} tab-separated columns, expected 2: {_clip(text)}")
                continue
            row = {src_lang: cols[0], tgt_lang: cols[1]}
        else:
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                bad("bad_json", n, f"{e.msg} at column {e.colno}: {_clip(text)}")
                continue
            except RecursionError:
                bad("bad_json", n, f"nested too deeply for the JSON parser: {_clip(text)}")
                continue
            except ValueError as e:  # e.g. an integer literal over Python's digit limit
                bad("bad_json", n, f"{str(e)[:80]}: {_clip(text)}")
                continue
            if not isinstance(obj, dict):
                bad("not_an_object", n, f"a JSON {type(obj).__name__}: {_clip(text)}")
                continue
            if "translation" not in obj:
                bad("no_translation", n, f"keys {sorted(obj)[:8]}")
                continue
            row = obj["translation"]
        out.translation.append(row)
        out.positions.append(n)


def _read_json_array(c: Chunk, out: ChunkRows) -> None:
    """A .json file holding one array of rows: a single document, so a bad byte or syntax error stops it."""
    data = F.read_bytes(c.path, "JSON array file (give larger corpora as JSON lines)", limit=F.CHUNK_MAX
                        ).removeprefix(_BOM)
    try:
        items = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataInputError(
            f"{c.path}:{line}: byte 0x{data[e.start]:02x} is not UTF-8; convert the file, "
            f"e.g. `iconv -f latin1 -t utf-8 IN > OUT`"
        ) from None
    except json.JSONDecodeError as e:
        raise DataInputError(
            f"{c.path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); a .json file is one array of rows "
            f"or JSON lines"
        ) from None
    except (RecursionError, ValueError) as e:
        raise DataInputError(
            f"{c.path}: not valid JSON ({type(e).__name__}: {str(e)[:80]}); a .json file is one array of rows "
            f"or JSON lines"
        ) from None
    if not isinstance(items, list):
        raise DataInputError(f"{c.path}: a JSON {type(items).__name__}, expected an array of rows or JSON lines")
    out.read = len(items)
    for k, obj in enumerate(items):
        if not isinstance(obj, dict):
            out.rejects.add("not_an_object", k, f"a JSON {type(obj).__name__}: {_clip(json.dumps(obj))}")
        elif "translation" not in obj:
            out.rejects.add("no_translation", k, f"keys {sorted(obj)[:8]}")
        else:
            out.translation.append(obj["translation"])
            out.positions.append(k)


def _read_parquet(c: Chunk, out: ChunkRows) -> None:
    """Row groups [lo, hi) of a parquet table (typed already: pyarrow gives its rows)."""
    import pyarrow.parquet as pq

    try:
        with F.open_read(c.path, "data file") as fh:
            pf = pq.ParquetFile(fh)
            check_parquet_size(c.path, pf.metadata, os.fstat(fh.fileno()).st_size)
            table = pf.read_row_groups(list(range(c.lo, c.hi)), columns=["translation"])
    except DataInputError:
        raise
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged or foreign file
        raise DataInputError(f"{c.path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    rows = table.column("translation").to_pylist()
    out.translation, out.positions, out.read = rows, list(range(len(rows))), len(rows)


_HUB: dict[str, object] = {}  # Hub datasets by source name: set before the build forks its workers


def hub_dataset(name: str):
    """The Hub dataset a chunk names (loaded by `load_hub` in this or the parent process)."""
    if name not in _HUB:  # a worker that was not forked from the loader: load it again (local HF cache)
        dataset, config, split = name.removeprefix("hub:").rsplit("/", 2)
        load_hub(dataset, None if config == "None" else config, split, again=False)  # the parent's fresh copy
    return _HUB[name]


def load_hub(
    dataset: str, config: str | None, split: str, probe_timeout: float = PROBE_TIMEOUT_S, *, again: bool = True
) -> RawCorpus:
    """Load a Hub dataset; raise `HubUnavailableError` quickly (seconds) when it cannot be had. A local folder
    in the Hub's layout (``<dir>/<config>/*.parquet`` and a README.md whose ``configs:`` section names them,
    as ``Helsinki-NLP/opus_books`` is laid out) goes through the same ``datasets.load_dataset`` call, without
    the Hub probe; its mistakes (an unknown config, no such split) are `DataInputError`s naming the folder."""
    local = Path(dataset).is_dir()
    if not _offline() and not local:
        reason = probe_hub(probe_timeout)
        if reason is not None:
            raise HubUnavailableError(
                f"cannot reach the Hugging Face Hub for {dataset!r}: {reason}. {_fix_hint(dataset)}"
            )
    import datasets

    t0 = time.perf_counter()
    # a local folder is read again every time: datasets would serve its first Arrow copy of an edited folder
    # (measured: datasets 5.2 offline, a parquet file rewritten with other rows, the old rows came back; with a
    # forced reload its recorded split sizes refused the new ones)
    # (``again=False``: a build worker, which reads the copy its parent has just made)
    fresh = {"download_mode": "force_redownload", "verification_mode": "no_checks"} if local and again else {}
    try:
        ds = datasets.load_dataset(dataset, config, split=split, **fresh)
    except Exception as e:  # datasets raises ConnectionError / FileNotFoundError / ValueError offline
        if local:
            raise DataInputError(
                f"--data.dataset {dataset} (a local folder): cannot load config {config!r}, split {split!r}: "
                f"{type(e).__name__}: {str(e)[:300]}; give --data.dataset_config one of the folder's configs (its "
                f"README.md `configs:` section) and --data.hf_split one of its splits") from e
        where = "offline mode and not in the local HF cache" if _offline() else "load failed"
        raise HubUnavailableError(
            f"could not load {dataset!r} (config {config!r}, split {split!r}; {where}, "
            f"after {time.perf_counter() - t0:.1f} s): {type(e).__name__}: {e}. {_fix_hint(dataset)}"
        ) from e
    if "translation" not in ds.column_names:
        raise DataInputError(f"{dataset!r} (config {config!r}, split {split!r}) has no 'translation' column (found "
                             f"{ds.column_names}): rows must be {{\"translation\": {{\"<src>\": ..., \"<tgt>\": ...}}}}")
    name = f"hub:{dataset}/{config}/{split}"
    _HUB[name] = ds
    return RawCorpus(translation=[], source=name)


def hub_chunks(dataset: str, config: str | None, split: str) -> tuple[list[SourceFile], list[Chunk], str]:
    """Load the Hub dataset (memory-mapped Arrow in the HF cache) and cut it into chunks of `CHUNK_ROWS`
    rows; returns (files, chunks, datasets' fingerprint of it)."""
    name = f"hub:{dataset}/{config}/{split}"
    if name not in _HUB or Path(dataset).is_dir():  # a local folder may have been edited since: load it again
        load_hub(dataset, config, split)
    ds = _HUB[name]
    n = len(ds)
    chunks = [Chunk(0, name, "hub", a, min(a + CHUNK_ROWS, n), a) for a in range(0, n, CHUNK_ROWS)]
    fingerprint = str(getattr(ds, "_fingerprint", name))
    if Path(dataset).is_dir():  # the folder's files as they are now (a warm start compares them)
        fingerprint += ":" + folder_identity(Path(dataset))
    return [SourceFile(name, "row", "hub")], chunks, fingerprint


def folder_identity(folder: Path) -> str:
    """sha256 of every file under ``folder`` (hidden ones aside): relative path, size, mtime in ns."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts):
            st = p.stat()
            h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


def training_files(cfg) -> tuple[tuple[str, ...], str]:
    """The local files ``cfg`` trains on and the source label: ``data_files``, else the toy corpus (written
    into the cache once), else ``$FASTMT_DATA_FILES``; ``((), "hub:...")`` for the Hub."""
    if cfg.is_toy():
        from .toy import toy_corpus

        return (str(toy_corpus(cfg.cache_dir, cfg.toy_rows)),), f"toy:{cfg.toy_rows}"
    files = cfg.resolved_data_files()
    if files:
        return files, "files:" + ",".join(files)
    return (), f"hub:{cfg.dataset}/{cfg.dataset_config}/{cfg.hf_split}"
