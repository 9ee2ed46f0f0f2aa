"""Checks the Trainer runs before it creates, moves or writes any run folder: every setting that would only
fail later (at the first long batch, the first evaluation, the first step on a device) fails here, in one
line naming the value and the fix (``UserError``, exit 2).

- ``build_data_checked``: the data (via ``data.build_data``), with SentencePiece's "vocabulary too small"
  turned into a one-line error naming ``data.vocab_size``;
- ``check_model_fits_data``: the model's positions cover the longest sequence a training or validation batch
  of this data holds (the settings' own cross-field checks, layout vs batching among them, are the config's:
  ``train.config.check_consistency``, which the Trainer runs first);
- ``tokenizer_of``: a checkpoint's own tokenizer (``--init-from``).
Device availability is checked by ``train.distributed.resolve_device``, the resume compatibility by
``train.runs.resume`` and ``train.runs.checkpoint.check_tokenizer``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from train.errors import UserError

_SPM_VOCAB = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def build_data_checked(cfg, *, log, tokenizer=None):
    """``data.build_data(cfg.data)`` (with ``tokenizer`` when given), its predictable failures as ``UserError``."""
    from data import build_data

    kwargs = {} if tokenizer is None else {"tokenizer": tokenizer}
    try:
        return build_data(cfg.data, log=log, **kwargs)
    except RuntimeError as e:
        m = _SPM_VOCAB.search(str(e))
        if m is None:
            raise
        asked, need = int(m.group(1)), int(m.group(2))
        d = cfg.data
        raise UserError(
            f"data.vocab_size={asked} is too small for this text: SentencePiece needs {need} pieces for its "
            f"characters alone (data.character_coverage={d.character_coverage:g}); raise --data.vocab_size "
            f"(e.g. {max(2 * need, 1000)}) or lower --data.character_coverage") from e


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def longest_position(cfg, data) -> int:
    """The longest sequence (tokens incl. EOS/BOS, padding included) a training or validation batch of
    ``data`` under ``cfg.data``'s batching gives the model."""
    from train.config import positions_needed

    d = cfg.data
    if d.batching in ("packed", "fixed"):  # the static bound the model is told: max_len segments, seq_len rows
        return positions_needed(d)
    longest = 0
    for split in ("train", "valid"):
        sp = data.splits.get(split)
        if sp is not None and len(sp):
            longest = max(longest, int(np.max(sp.src_lengths)), int(np.max(sp.tgt_lengths)))
    return _round_up(longest, d.pad_multiple)


def check_model_fits_data(cfg, data) -> None:
    """The model can take every batch of ``data``: its positions cover the lengths."""
    batching = cfg.data.batching  # layout vs batching: the config's own check (train.config.check_layout)
    need, have = longest_position(cfg, data), cfg.model.max_positions
    if need > have:
        raise UserError(
            f"model.max_positions={have} is shorter than the longest sequence of this data ({need} tokens incl. "
            f"EOS/BOS, with data.max_len={cfg.data.max_len}, batching {batching!r}): raise --model.max_positions to "
            f"{need} or lower --data.max_len")


def tokenizer_of(ckpt: dict[str, Any], path: Path):
    """The tokenizer a checkpoint was trained with (its embedded SentencePiece model, else its model file)."""
    from data.tokenizer import Tokenizer

    ref = ckpt.get("tokenizer") or {}
    if ref.get("model_bytes"):
        return Tokenizer(model_proto=ref["model_bytes"], key=ref.get("key", ""))
    if ref.get("model_file") and Path(ref["model_file"]).is_file():
        return Tokenizer(ref["model_file"], key=ref.get("key", ""))
    raise UserError(f"{path}: the checkpoint carries no tokenizer and its model file {ref.get('model_file')!r} is "
                    f"gone: nothing can read its token ids (give a checkpoint of a run that embedded its tokenizer)")
