"""Row cleaning with a per-reason report. Bad rows are counted, never raised.

Every input row either trains, is held out (valid/test), or is counted under one reason, in four stages: the
file readers (`data.sources`) count rows they cannot parse (`READ_REASONS`); `clean_row` counts parsed rows
without two usable sides (`TEXT_REASONS`); train pairs whose normalised source or target occurs in your own
valid/test files are removed (`LEAK_REASONS`); `length_mask` counts TRAIN pairs whose subword lengths fail
the limits (`LENGTH_REASONS`; valid and test are never length-filtered). The report keeps the first few
examples of each reason with their file and line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

READ_REASONS = ("blank_line", "bad_encoding", "bad_json", "not_an_object", "no_translation", "wrong_columns")
TEXT_REASONS = ("not_a_dict", "missing_language", "not_a_string", "bad_unicode", "empty")
LEAK_REASONS = ("in_eval_files",)
LENGTH_REASONS = ("too_long", "length_ratio")
REASONS = READ_REASONS + TEXT_REASONS + LEAK_REASONS + LENGTH_REASONS
MAX_EXAMPLES = 3  # examples kept per reason

HINTS = {  # the fix, printed under a reason that dropped rows
    "bad_encoding": "the file is not UTF-8: convert it, e.g. `iconv -f latin1 -t utf-8 IN > OUT`",
    "bad_json": "each line of a .jsonl file must be one JSON object",
    "not_an_object": 'each line must be an object {"id": ..., "translation": {src: ..., tgt: ...}}',
    "no_translation": 'rows need a "translation" object {src: ..., tgt: ...}',
    "wrong_columns": "tsv rows are exactly `src<TAB>tgt` (no header, no quoting)",
    "missing_language": "check data.src_lang / data.tgt_lang against the keys of the rows",
    "bad_unicode": "a lone UTF-16 surrogate escape (e.g. \\ud800 without its pair) is not text: fix the writer",
    "in_eval_files": "their normalised source or target occurs in data.valid_files / data.test_files",
    "too_long": "raise data.max_len (and data.max_tokens >= 2 x max_len) to keep them",
    "length_ratio": "raise data.max_len_ratio to keep them",
}


class DataInputError(ValueError):
    """The input cannot train anything (an empty file, no usable rows, every pair filtered out), or a setting
    the data cannot satisfy: one message naming the value, the file/line and the fix; no traceback."""


class DataFilesNotFound(DataInputError, FileNotFoundError):
    """Named data files do not exist (a `DataInputError` and a `FileNotFoundError`)."""


@dataclass
class Tally:
    """Rows rejected while reading or cleaning one chunk: counts per reason and the first `MAX_EXAMPLES`
    examples per reason as (reason, position in the chunk, detail); positions are resolved to file:line
    when chunks are merged in order (`CleanReport.merge`)."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: list[tuple[str, int, str]] = field(default_factory=list)

    def add(self, reason: str, pos: int, detail: str = "") -> None:
        n = self.counts.get(reason, 0)
        self.counts[reason] = n + 1
        if n < MAX_EXAMPLES:
            self.examples.append((reason, pos, detail))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass
class CleanReport:
    rows: int = 0  # raw rows read (lines of a text file, rows of a table), bad ones included
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    dropped_by_split: dict[str, dict[str, int]] = field(default_factory=dict)  # length reasons per split
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first "file:line: detail"
    # the split's leakage check (split_record["overlap"]) and valid/test pairs cut to max_len, once split
    overlap: dict | None = None
    truncated: dict | None = None

    @property
    def kept(self) -> int:
        return self.rows - sum(self.dropped.values())

    def drop(self, reason: str, where: str | None = None, detail: str = "") -> None:
        """Count one dropped row and keep it as an example (see `note`)."""
        self.dropped[reason] += 1
        if where is not None:
            self.note(reason, where, detail)

    def note(self, reason: str, where: str, detail: str = "") -> None:
        """Keep an example of ``reason`` while fewer than `MAX_EXAMPLES` are kept (counts unchanged)."""
        shown = self.examples.setdefault(reason, [])
        if len(shown) < MAX_EXAMPLES:
            shown.append(f"{where}: {detail}" if detail else where)

    def merge(self, tally: Tally, where: Callable[[int], str]) -> None:
        """Add a chunk's rejects (rows read are counted by the caller); ``where(pos)`` names a position."""
        for reason, n in tally.counts.items():
            self.dropped[reason] += n
        for reason, pos, detail in tally.examples:
            self.note(reason, where(pos), detail)

    @classmethod
    def from_dict(cls, d: dict) -> CleanReport:
        """The inverse of `as_dict` (a cached entry's report); reasons it lacks count 0."""
        return cls(rows=d["rows"], dropped={**dict.fromkeys(REASONS, 0), **d["dropped"]},
                   dropped_by_split=d.get("dropped_by_split", {}),
                   examples={k: list(v) for k, v in d.get("examples", {}).items()},
                   overlap=d.get("overlap"), truncated=d.get("truncated"))

    def as_dict(self) -> dict:
        return {
            "rows": self.rows,
            "kept": self.kept,
            "dropped": dict(self.dropped),
            "dropped_by_split": self.dropped_by_split,
            "examples": {k: list(v) for k, v in self.examples.items() if v},
            "overlap": self.overlap,
            "truncated": self.truncated,
        }

    def __str__(self) -> str:
        return format_report(self.as_dict())


def format_report(r: dict) -> str:
    """The report (`CleanReport.as_dict` form): totals, then each reason that dropped rows with its
    examples and fix."""
    lines = [f"rows read {r['rows']:>9,}", f"rows kept {r['kept']:>9,}"]
    for reason, n in r["dropped"].items():
        if not n:
            continue
        lines.append(f"  dropped {n:>9,}  {reason}" + (f"  ({HINTS[reason]})" if reason in HINTS else ""))
        lines += [f"      e.g. {e}" for e in r.get("examples", {}).get(reason, [])]
    if r["kept"] == r["rows"]:
        lines.append("  dropped         0")
    ov = r.get("overlap")
    if ov:
        def pair(when: str, side: str) -> str:
            return "/".join(str(ov[when][s][side]) if ov[when] and s in ov[when] else "-" for s in ("valid", "test"))

        lines.append(f"valid/test rows whose normalised source / target is also in train: before grouping "
                     f"{pair('before', 'source')} / {pair('before', 'target')}, after {pair('after', 'source')} / "
                     f"{pair('after', 'target')}")
    tr = r.get("truncated")
    if tr and any(tr.values()):
        lines.append(f"valid/test pairs over max_len kept whole, token arrays cut: {tr['valid']:,} valid, "
                     f"{tr['test']:,} test")
    return "\n".join(lines)


def clean_row(row, src_lang: str, tgt_lang: str, *, keep_empty: bool = False) -> tuple[str, str] | tuple[None, str, str]:
    """``(src, tgt)`` stripped, or ``(None, reason, detail)`` for a row that is not a dict, lacks a language,
    holds a non-str, a lone surrogate (not encodable as UTF-8) or, unless ``keep_empty``, an empty side."""
    if not isinstance(row, dict):
        return None, "not_a_dict", f"translation is {_short(row)}, not an object"
    if src_lang not in row or tgt_lang not in row:
        missing = [k for k in (src_lang, tgt_lang) if k not in row]
        return None, "missing_language", f"no {missing[0]!r} (keys {sorted(map(str, row))})"
    s, t = row[src_lang], row[tgt_lang]
    if not isinstance(s, str) or not isinstance(t, str):  # None, numbers, lists
        lang, v = (src_lang, s) if not isinstance(s, str) else (tgt_lang, t)
        return None, "not_a_string", f"{lang!r} is {_short(v)}"
    for lang, text in ((src_lang, s), (tgt_lang, t)):
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                return None, "bad_unicode", (f"{lang!r} holds a lone surrogate U+{ord(text[e.start]):04X} at "
                                             f"character {e.start + 1}")
    s, t = s.strip(), t.strip()
    if not keep_empty and (not s or not t):
        return None, "empty", f"{src_lang if not s else tgt_lang!r} is empty or blank"
    return s, t


def clean_text(
    translation: list,
    src_lang: str,
    tgt_lang: str,
    report: CleanReport,
    where: Callable[[int], str] | None = None,
) -> tuple[list[str], list[str], np.ndarray]:
    """`clean_row` over a list: drops (and counts) rows without two usable sides.

    ``where(i)`` names row i (file and line) in the report's examples. Returns (src, tgt, kept_row_indices).
    """
    src, tgt, keep = [], [], []
    report.rows += len(translation)
    for i, row in enumerate(translation):
        got = clean_row(row, src_lang, tgt_lang)
        if got[0] is None:
            report.drop(got[1], where(i) if where is not None else f"row {i}", got[2])
            continue
        src.append(got[0])
        tgt.append(got[1])
        keep.append(i)
    return src, tgt, np.asarray(keep, dtype=np.int64)


def length_mask(
    src_len: np.ndarray, tgt_len: np.ndarray, max_len: int, max_ratio: float
) -> tuple[np.ndarray, dict[str, int]]:
    """Keep-mask over pairs by subword length (incl. EOS/BOS) and length ratio; counts per reason.

    A pair failing both tests is counted once, under ``too_long``.
    """
    too_long, bad_ratio = _length_failures(src_len, tgt_len, max_len, max_ratio)
    return ~(too_long | bad_ratio), {"too_long": int(too_long.sum()), "length_ratio": int(bad_ratio.sum())}


def length_examples(
    src_len: np.ndarray, tgt_len: np.ndarray, max_len: int, max_ratio: float
) -> list[tuple[int, str, str]]:
    """(pair index, reason, detail) of the first `MAX_EXAMPLES` pairs per reason that `length_mask` drops."""
    out = []
    for reason, bad in zip(LENGTH_REASONS, _length_failures(src_len, tgt_len, max_len, max_ratio)):
        limit = f"max_len {max_len}" if reason == "too_long" else f"max_len_ratio {max_ratio:g}"
        for i in np.flatnonzero(bad)[:MAX_EXAMPLES].tolist():
            out.append((i, reason, f"src {src_len[i]} / tgt {tgt_len[i]} tokens ({limit})"))
    return out


def _length_failures(src_len, tgt_len, max_len, max_ratio) -> tuple[np.ndarray, np.ndarray]:
    too_long = (src_len > max_len) | (tgt_len > max_len)
    lo = np.minimum(src_len, tgt_len).astype(np.float64)
    hi = np.maximum(src_len, tgt_len).astype(np.float64)
    return too_long, (hi > max_ratio * lo) & ~too_long


def _short(v, width: int = 40) -> str:
    """A value for a message: its type and a clipped repr."""
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= width else text[: width - 3] + '...'}"
