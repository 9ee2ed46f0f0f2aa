"""Row cleaning with a per-reason report. Bad rows are counted, never raised.

Two stages: `clean_text` runs on raw rows (before the split and the tokenizer); `length_mask` runs on
subword lengths after encoding (max length and length ratio), per split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TEXT_REASONS = ("not_a_dict", "missing_language", "not_a_string", "empty")
LENGTH_REASONS = ("too_long", "length_ratio")


@dataclass
class CleanReport:
    rows: int = 0  # raw rows read
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TEXT_REASONS + LENGTH_REASONS, 0))
    dropped_by_split: dict[str, dict[str, int]] = field(default_factory=dict)  # length reasons per split

    @property
    def kept(self) -> int:
        return self.rows - sum(self.dropped.values())

    def as_dict(self) -> dict:
        return {
            "rows": self.rows,
            "kept": self.kept,
            "dropped": dict(self.dropped),
            "dropped_by_split": self.dropped_by_split,
        }

    def __str__(self) -> str:
        lines = [f"rows read {self.rows:>9,}", f"rows kept {self.kept:>9,}"]
        lines += [f"  dropped {n:>9,}  {reason}" for reason, n in self.dropped.items()]
        return "\n".join(lines)


def clean_text(
    translation: list, src_lang: str, tgt_lang: str, report: CleanReport
) -> tuple[list[str], list[str], np.ndarray]:
    """Strip both sides; drop rows that are not dicts, lack a language, hold a non-str or an empty side.

    Returns (src, tgt, kept_row_indices).
    """
    src, tgt, keep = [], [], []
    report.rows += len(translation)
    for i, row in enumerate(translation):
        if not isinstance(row, dict):
            report.dropped["not_a_dict"] += 1
            continue
        if src_lang not in row or tgt_lang not in row:
            report.dropped["missing_language"] += 1
            continue
        s, t = row[src_lang], row[tgt_lang]
        if not isinstance(s, str) or not isinstance(t, str):  # None, numbers, lists
            report.dropped["not_a_string"] += 1
            continue
        s, t = s.strip(), t.strip()
        if not s or not t:
            report.dropped["empty"] += 1
            continue
        src.append(s)
        tgt.append(t)
        keep.append(i)
    return src, tgt, np.asarray(keep, dtype=np.int64)


def length_mask(
    src_len: np.ndarray, tgt_len: np.ndarray, max_len: int, max_ratio: float
) -> tuple[np.ndarray, dict[str, int]]:
    """Keep-mask over pairs by subword length (incl. EOS/BOS) and length ratio; counts per reason.

    A pair failing both tests is counted once, under ``too_long``.
    """
    too_long = (src_len > max_len) | (tgt_len > max_len)
    lo = np.minimum(src_len, tgt_len).astype(np.float64)
    hi = np.maximum(src_len, tgt_len).astype(np.float64)
    bad_ratio = (hi > max_ratio * lo) & ~too_long
    return ~(too_long | bad_ratio), {"too_long": int(too_long.sum()), "length_ratio": int(bad_ratio.sum())}
