"""The records of a run a config field may be read from when another record lacks it (field provenance,
``train.fields.provenance``): a run folder's ``config.json`` beside a checkpoint, and the config of the run's newest
checkpoint beside a ``config.json``. Read as every record is (the one reader; no link followed inside the folder);
a record that does not load records nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from train.errors import UserError


def run_folder_of(ckpt_path: str | Path) -> Path | None:
    """The run folder a checkpoint file lies in (``<run>/checkpoints/<file>``, the path as named: no link is
    resolved), or None."""
    parent = Path(ckpt_path).absolute().parent
    return parent.parent if parent.name == "checkpoints" else None


def run_config_json(run: Path | None) -> list[tuple[str, dict[str, Any]]]:
    """``[(path, record)]`` of run folder ``run``'s ``config.json`` read through the one reader (a regular file
    inside the folder, no link followed, at most `data.files.RECORD_MAX` bytes), or ``[]``: no run folder, no such
    file, or not a JSON object (then it records nothing)."""
    from data.files import parse_json, read_text

    if run is None or not (run / "config.json").is_file() or (run / "config.json").is_symlink():
        return []
    try:
        d = parse_json(read_text(run / "config.json", "run config", inside=run), run / "config.json")
    except (OSError, ValueError):
        return []
    return [(str(run / "config.json"), d)] if isinstance(d, dict) else []


def run_checkpoint_config(run: Path) -> list[tuple[str, dict[str, Any]]]:
    """``[(path, its config)]`` of run folder ``run``'s newest checkpoint that loads (the one ``--resume auto``
    continues; best.pt when no step checkpoint loads), read as every checkpoint is (no link followed below
    ``checkpoints/``), or ``[]``."""
    from train.runs.checkpoint import load_checkpoint, step_checkpoints

    folder = run / "checkpoints"
    if folder.is_symlink() or not folder.is_dir():
        return []
    for path in [*reversed(step_checkpoints(folder)), folder / "best.pt"]:
        if not path.is_file() or path.is_symlink():
            continue
        try:
            ckpt = load_checkpoint(path, inside=folder)
        except (RuntimeError, OSError, UserError):
            continue
        return [(str(path), ckpt["config"])]
    return []
