"""Raw parallel rows: a Hub id + config through HF ``datasets``, local files, or the generated toy corpus.

Local formats (by extension; files of different formats may be mixed):
  * ``.jsonl``: one row per line, ``{"id": ..., "translation": {"en": ..., "it": ...}}``
  * ``.json``: JSON lines as well, or one JSON array of such rows
  * ``.parquet``: a ``translation`` column of the same objects
  * ``.tsv``: two columns ``src<TAB>tgt``, no header, no quoting

Local text files are read line by line here, not through ``datasets``: its JSON and CSV builders parse a
whole file at once and stop at the first bad line (a traceback naming neither file nor line), while this
reader counts each bad line under its reason, with file and line, in the cleaning report and keeps the rest.

The Hub path never hangs in retries: with ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` set it only looks
in the local cache (fails at once); otherwise a short TCP probe of the Hub endpoint runs first.
"""

from __future__ import annotations

import bisect
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from .clean import CleanReport, DataInputError

PROBE_TIMEOUT_S = 3.0
_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".tsv": "tsv"}
_BOM = b"\xef\xbb\xbf"


@dataclass
class SourceFile:
    """One local input file and where its parsed rows sit in `RawCorpus.translation`."""

    path: str
    unit: str  # how its rows are numbered: "line" (1-based), "row" (parquet, 0-based), "index" (JSON array)
    start: int  # index of its first parsed row in RawCorpus.translation
    read: int = 0  # lines / rows / items read, bad ones included


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
        return _where(f, self.positions[i])

    def kept_per_file(self, kept: np.ndarray) -> list[int]:
        """How many of the parsed rows ``kept`` (indices into `translation`) come from each file."""
        starts = np.asarray([f.start for f in self.files], dtype=np.int64)
        owner = np.searchsorted(starts, kept, side="right") - 1
        return np.bincount(owner, minlength=len(self.files)).tolist()


def _where(f: SourceFile, n: int) -> str:
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


def load_local(files: tuple[str, ...], src_lang: str, tgt_lang: str) -> RawCorpus:
    """Read local files in order; rows that cannot be parsed are counted in ``report``, never raised."""
    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"data files not found: {missing}")
    unknown = sorted({p.suffix.lower() for p in paths} - set(_FORMATS))
    if unknown:
        raise ValueError(
            f"unsupported data file extension(s) {unknown} in {files}; use .jsonl, .json, .parquet or .tsv"
        )
    raw = RawCorpus(translation=[], source="files:" + ",".join(str(p) for p in paths))
    for p in paths:
        fmt = _FORMATS[p.suffix.lower()]
        if fmt == "json":
            fmt = "json_array" if _first_byte(p) == b"[" else "jsonl"
        f = SourceFile(
            str(p), {"parquet": "row", "json_array": "index"}.get(fmt, "line"), len(raw.translation)
        )
        raw.files.append(f)
        if fmt == "parquet":
            _read_parquet(f, raw)
        elif fmt == "json_array":
            _read_json_array(f, raw)
        else:
            _read_lines(f, raw, src_lang, tgt_lang, tsv=fmt == "tsv")
    return raw


def _reject(raw: RawCorpus, f: SourceFile, n: int, reason: str, detail: str = "") -> None:
    raw.report.rows += 1
    raw.report.drop(reason, _where(f, n), detail)


def _clip(text: str, width: int = 60) -> str:
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(4096).removeprefix(_BOM).lstrip()[:1]


def _read_lines(f: SourceFile, raw: RawCorpus, src_lang: str, tgt_lang: str, *, tsv: bool) -> None:
    """JSON lines or ``src<TAB>tgt`` lines, each decoded on its own so one bad line costs one row."""
    with open(f.path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            f.read = n
            if n == 1:
                line = line.removeprefix(_BOM)
            line = line.rstrip(b"\n").rstrip(b"\r")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                near = line[max(0, e.start - 20) : e.start + 20].decode("utf-8", "backslashreplace")
                detail = (
                    f"byte 0x{line[e.start]:02x} (byte {e.start + 1} of the line) is not UTF-8, near: {near}"
                )
                _reject(raw, f, n, "bad_encoding", detail)
                continue
            if not text.strip():
                _reject(raw, f, n, "blank_line", "empty or whitespace only")
                continue
            if tsv:
                cols = text.split("\t")
                if len(cols) != 2:
                    _reject(
                        raw,
                        f,
                        n,
                        "wrong_columns",
                        f"{len(cols)} tab-separated columns, expected 2: {_clip(text)}",
                    )
                    continue
                row = {src_lang: cols[0], tgt_lang: cols[1]}
            else:
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    _reject(raw, f, n, "bad_json", f"{e.msg} at column {e.colno}: {_clip(text)}")
                    continue
                if not isinstance(obj, dict):
                    _reject(raw, f, n, "not_an_object", f"a JSON {type(obj).__name__}: {_clip(text)}")
                    continue
                if "translation" not in obj:
                    _reject(raw, f, n, "no_translation", f"keys {sorted(obj)[:8]}")
                    continue
                row = obj["translation"]
            raw.translation.append(row)
            raw.positions.append(n)


def _read_json_array(f: SourceFile, raw: RawCorpus) -> None:
    """A .json file holding one array of rows: a single document, so a bad byte or syntax error stops it."""
    data = Path(f.path).read_bytes().removeprefix(_BOM)
    try:
        items = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataInputError(
            f"{f.path}:{line}: byte 0x{data[e.start]:02x} is not UTF-8; convert the file, "
            f"e.g. `iconv -f latin1 -t utf-8 IN > OUT`"
        ) from None
    except json.JSONDecodeError as e:
        raise DataInputError(
            f"{f.path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); a .json file is one array of rows "
            f"or JSON lines"
        ) from None
    if not isinstance(items, list):
        raise DataInputError(
            f"{f.path}: a JSON {type(items).__name__}, expected an array of rows or JSON lines"
        )
    f.read = len(items)
    for k, obj in enumerate(items):
        if not isinstance(obj, dict):
            _reject(raw, f, k, "not_an_object", f"a JSON {type(obj).__name__}: {_clip(json.dumps(obj))}")
        elif "translation" not in obj:
            _reject(raw, f, k, "no_translation", f"keys {sorted(obj)[:8]}")
        else:
            raw.translation.append(obj["translation"])
            raw.positions.append(k)


def _read_parquet(f: SourceFile, raw: RawCorpus) -> None:
    """A parquet table is typed already: pyarrow (what ``datasets`` reads it with) gives its rows."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(f.path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a damaged or foreign file
        raise DataInputError(f"{f.path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    if "translation" not in table.column_names:
        raise DataInputError(
            f"{f.path}: no 'translation' column (found {table.column_names}); rows must be "
            f'{{"id": ..., "translation": {{src: ..., tgt: ...}}}}'
        )
    rows = table.column("translation").to_pylist()
    f.read = len(rows)
    raw.translation += rows
    raw.positions += range(len(rows))


def load_hub(
    dataset: str, config: str | None, split: str, probe_timeout: float = PROBE_TIMEOUT_S
) -> RawCorpus:
    """Load a Hub dataset; raise `HubUnavailableError` quickly (seconds) when it cannot be had."""
    if not _offline():
        reason = probe_hub(probe_timeout)
        if reason is not None:
            raise HubUnavailableError(
                f"cannot reach the Hugging Face Hub for {dataset!r}: {reason}. {_fix_hint(dataset)}"
            )
    import datasets

    t0 = time.perf_counter()
    try:
        ds = datasets.load_dataset(dataset, config, split=split)
    except Exception as e:  # datasets raises ConnectionError / FileNotFoundError / ValueError offline
        where = "offline mode and not in the local HF cache" if _offline() else "load failed"
        raise HubUnavailableError(
            f"could not load {dataset!r} (config {config!r}, split {split!r}; {where}, "
            f"after {time.perf_counter() - t0:.1f} s): {type(e).__name__}: {e}. {_fix_hint(dataset)}"
        ) from e
    if "translation" not in ds.column_names:
        raise ValueError(f"{dataset!r} has no 'translation' column (found {ds.column_names})")
    return RawCorpus(translation=list(ds["translation"]), source=f"hub:{dataset}/{config}/{split}")


def load_raw(cfg) -> RawCorpus:
    """``cfg.data_files``, else the toy corpus (``dataset="toy"``), else $FASTMT_DATA_FILES, else the Hub."""
    if cfg.is_toy():
        from .toy import toy_corpus

        raw = load_local((str(toy_corpus(cfg.cache_dir, cfg.toy_rows)),), cfg.src_lang, cfg.tgt_lang)
        raw.source = f"toy:{cfg.toy_rows}"
        return raw
    files = cfg.resolved_data_files()
    if files:
        return load_local(files, cfg.src_lang, cfg.tgt_lang)
    return load_hub(cfg.dataset, cfg.dataset_config, cfg.hf_split)
