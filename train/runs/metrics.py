"""Run records: provenance (config, git sha, versions, GPU), metrics.jsonl + TensorBoard, curves.png.

Every record is written without following a link (`data.files`): provenance and curves by the atomic writer,
metrics.jsonl appended through an ``O_NOFOLLOW`` open."""

from __future__ import annotations

import io
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from data.files import append_text, atomic_write, explain_os_errors, read_json_lines, refuse_link

_FIX = "free space or permissions there, or give --run.out_dir a writable folder"


def git_sha(repo: str | os.PathLike | None = None) -> str | None:
    """HEAD's sha, with "-dirty" when tracked files changed; else ``$FASTMT_GIT_SHA`` (a device copy of
    the tree travels without .git); else None."""
    repo = repo or Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        sha = out.stdout.strip() if out.returncode == 0 else None
        if sha:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                   capture_output=True, text=True, timeout=30).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("FASTMT_GIT_SHA", "").strip() or None


def environment() -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "cpu_threads": torch.get_num_threads(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("FASTMT_", "TORCH_", "TRITON_"))},
    }


def provenance(config: dict[str, Any], split_record: Any = None, extra: dict[str, Any] | None = None) -> dict:
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_sha": git_sha(),
        "argv": sys.argv,
        **environment(),
        "config": config,
        "data_split": split_record,
        **(extra or {}),
    }


def write_provenance(run_dir: Path, config: dict[str, Any], split_record: Any, extra: dict[str, Any], *,
                     step: int, log=print) -> Path:
    """``provenance.json`` at the start of a run (``provenance-resume-step<N>.json`` for a resumed one), and
    one summary line to ``log`` (the resolved config is in the file, and in the run folder's config.json)."""
    rec = provenance(config, split_record, extra)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ("provenance.json" if step == 0 else f"provenance-resume-step{step}.json")
    with explain_os_errors("the run folder", run_dir, _FIX):  # a full or read-only disk: one line, exit 2
        atomic_write(path, json.dumps(rec, indent=2, default=str), what="provenance record")
    log(f"provenance ({path}): git {rec['git_sha']}, torch {rec['torch']}, triton {rec['triton']}, cuda {rec['cuda']}, "
        f"gpu {rec['gpu']}, " + ", ".join(f"{k} {extra[k]}" for k in ("device", "world_size", "params", "compiled",
                                                                      "steps_per_epoch", "total_steps") if k in extra))
    return path


def _clean(v: Any) -> Any:
    """JSON-safe scalars: tensors -> float, non-finite floats -> null."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Appends one JSON object per line to ``metrics.jsonl``; mirrors scalars to TensorBoard.

    Disabled (a no-op) on ranks other than 0.
    """

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        refuse_link(self.run_dir / "tensorboard", "TensorBoard folder")  # its writer would follow one
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            except ImportError:
                print("metrics: tensorboard is not installed; writing metrics.jsonl only")

    def scalars(self, values: dict[str, Any], step: int, prefix: str = "") -> None:
        if not self.enabled or self.tb is None:
            return
        for k, v in values.items():
            v = _clean(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.tb.add_scalar(f"{prefix}{k}", v, step)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps({k: _clean(v) for k, v in record.items()})
        with explain_os_errors("the run folder", self.run_dir, _FIX):
            append_text(self.path, line + "\n", "metrics file")  # never through a link planted as metrics.jsonl

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` through the one reader (`data.files.read_json_lines`, no link followed in
    its folder); lines that are torn or not JSON objects are left out."""
    path = Path(path)
    return [rec for _, rec in read_json_lines(path, "metrics file", inside=path.parent) if isinstance(rec, dict)]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def plot_curves(metrics_path: str | os.PathLike, out_png: str | os.PathLike) -> Path | None:
    """Two panels: loss against optimizer steps (training, mean of each epoch and its last batch; validation),
    and validation BLEU / chrF against the run's wall seconds (the objective: time to BLEU). Returns the
    file written, or None (no epoch records, or matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("metrics: matplotlib is not installed; no curves.png")
        return None
    # one point per epoch: the last record wins (a run resumed from an earlier checkpoint re-logs epochs)
    # (a record of another shape, in a copied-in run folder, is left out rather than plotted or raised on)
    by_epoch = {r["epoch"]: {k: v for k, v in r.items() if _number(v)} for r in read_metrics(metrics_path)
                if r.get("kind", "epoch") == "epoch" and _number(r.get("epoch"))}
    rows = [by_epoch[e] for e in sorted(by_epoch)]
    if not rows:
        return None
    fig, (ax_l, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r.get("step") for r in rows]
    for key, label in [("train_loss", "training loss (epoch mean, label-smoothed)"),
                       ("train_loss_last_batch", "training loss (last batch of the epoch)"),
                       ("valid_loss", "validation loss (no smoothing)")]:
        pts = [(x, r.get(key)) for x, r in zip(steps, rows) if x is not None and r.get(key) is not None]
        if pts:
            ax_l.plot(*zip(*pts), marker="o", label=label)
    ax_l.set_xlabel("optimizer step")
    ax_l.set_ylabel("cross-entropy (nats per target token)")
    if ax_l.get_legend_handles_labels()[0]:
        ax_l.legend(fontsize=8)
    ax_l.grid(alpha=0.3)
    for key, label in (("bleu", "validation BLEU"), ("chrf", "validation chrF")):
        pts = [(r["wall_seconds"], r[key]) for r in rows if r.get(key) is not None and r.get("wall_seconds") is not None]
        if pts:
            ax_b.plot(*zip(*pts), marker="o", label=label)
    ax_b.set_xlabel("wall seconds since the run started (setup, compilation and evaluation included)")
    ax_b.set_ylabel("score")
    if ax_b.get_legend_handles_labels()[0]:  # no validation split: nothing to plot there
        ax_b.legend(fontsize=8)
    else:
        ax_b.text(0.5, 0.5, "no validation scores", ha="center", va="center", transform=ax_b.transAxes)
    ax_b.grid(alpha=0.3)
    fig.suptitle(Path(metrics_path).parent.name)
    fig.tight_layout()
    out_png = Path(out_png)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    atomic_write(out_png, buf.getvalue(), what="plot")
    return out_png
