"""Raw parallel rows, always through HF ``datasets``: a Hub id + config, or local files.

Local formats (one format per call, chosen by extension):
  * ``.jsonl`` / ``.json``: rows ``{"id": ..., "translation": {"en": ..., "it": ...}}``
  * ``.parquet``: same columns as jsonl
  * ``.tsv``: two columns ``src<TAB>tgt``, no header, no quoting

The Hub path never hangs in retries: with ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` set it only looks
in the local cache (fails at once); otherwise a short TCP probe of the Hub endpoint runs first.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".tsv": "csv"}


@dataclass
class RawCorpus:
    """Columns straight from the source, uncleaned (values may be None, non-str, missing)."""

    translation: list  # one entry per row: normally a dict {lang: text}; anything else is a bad row
    source: str  # human-readable origin, for logs and the split record


class HubUnavailableError(ConnectionError):
    """The Hub dataset cannot be loaded (no network and not cached)."""


def _fix_hint(dataset: str) -> str:
    return (
        f"Pass local files instead: `--data-files path/train.jsonl` (or env FASTMT_DATA_FILES=...; "
        f'jsonl/parquet rows {{"id", "translation": {{src, tgt}}}}, or tsv "src<TAB>tgt"). '
        f"If {dataset!r} is already in the HF cache, set HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 to use it offline."
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
    import datasets

    paths = [Path(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"data files not found: {missing}")
    exts = {p.suffix.lower() for p in paths}
    unknown = exts - set(_FORMATS)
    if unknown:
        raise ValueError(
            f"unsupported data file extension(s) {sorted(unknown)} in {files}; use .jsonl, .parquet or .tsv"
        )
    if len({_FORMATS[e] for e in exts}) > 1:
        raise ValueError(f"mixed formats {sorted(exts)} in {files}; pass files of one format")
    fmt = _FORMATS[exts.pop()]
    kwargs = {}
    if fmt == "csv":
        kwargs = dict(
            delimiter="\t",
            header=None,
            column_names=[src_lang, tgt_lang],
            quoting=3,
            keep_default_na=False,
            na_filter=False,
            features=datasets.Features(
                {src_lang: datasets.Value("string"), tgt_lang: datasets.Value("string")}
            ),
        )
    ds = datasets.load_dataset(fmt, data_files=[str(p) for p in paths], split="train", **kwargs)
    if fmt == "csv":
        translation = [{src_lang: s, tgt_lang: t} for s, t in zip(ds[src_lang], ds[tgt_lang])]
    elif "translation" in ds.column_names:
        translation = ds["translation"]
    else:
        raise ValueError(
            f"{files}: no 'translation' column (found {ds.column_names}); rows must be "
            f'{{"id": ..., "translation": {{"{src_lang}": ..., "{tgt_lang}": ...}}}}'
        )
    return RawCorpus(translation=list(translation), source="files:" + ",".join(str(p) for p in paths))


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
    """Local files (cfg.data_files or $FASTMT_DATA_FILES) if given, else the Hub dataset."""
    files = cfg.resolved_data_files()
    if files:
        return load_local(files, cfg.src_lang, cfg.tgt_lang)
    return load_hub(cfg.dataset, cfg.dataset_config, cfg.hf_split)
