"""The one benchmark harness of fastmt: timing, device ceilings, provenance, counts and writers.

Used by ``bench.kernels`` (kernel providers) and the training ladder; nothing here knows about a
particular kernel. One result is one ``dict`` row; a run appends its rows to a CSV and rewrites a
markdown table and a PNG beside it, all named after the GPU (``kernels-h100.csv``, ``-cpu`` on CPU).

Timing
  CUDA: ``triton.testing.do_bench`` (CUDA events, L2 flushed before every repetition, the first
  call and a warm-up untimed, so compilation and autotuning never land in a number), reporting the
  median and the 20th/80th percentiles in milliseconds.
  CPU: a wall-clock loop with the same statistics so the smoke path runs anywhere.
Ceilings (``measure_peaks``), measured in the same run as the numbers they normalise:
  a large device-to-device copy (GB/s counting bytes read + bytes written) and a large random bf16
  matrix product (TFLOP/s, 2*M*N*K). Rates are reported in GB/s = 1e9 B/s and TFLOP/s = 1e12 FLOP/s.
Counting conventions (``attention_flops``, ``layer_norm_bytes``)
  Attention counts the FLOPs of the two matrix products on real (unmasked) positions:
  4 * H * D * sum_b(Lq_b * Lk_b), halved when causal, backward = 2.5x forward and forward+backward
  = 3.5x forward -- FlashAttention-2's convention (its ``benchmark_flash_attention.py``), so numbers
  compare with its published ones. Padding a baseline computes is never counted as useful work.
  LayerNorm counts the fewest bytes any implementation must move (each input read once, each output
  written once; saved statistics excluded because they can be recomputed from the row).
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import platform
import re
import subprocess
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
MODES = ("fwd", "bwd", "fwd+bwd")
# FLOPs of backward and forward+backward relative to forward (FlashAttention-2's convention:
# the forward does 2 matrix products, the backward 5 -- one of them recomputing S = QK^T).
ATTENTION_MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
QUANTILES = (0.5, 0.2, 0.8)  # median, p20, p80

Row = dict[str, Any]


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and the 20th / 80th percentiles."""

    ms: float
    p20: float
    p80: float


def bench(
    fn: Callable[[], Any],
    *,
    device: torch.device | str = "cuda",
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> Timing:
    """Time ``fn()``; ``grad_to_none`` tensors get ``.grad = None`` before every timed repetition.

    CUDA: ``triton.testing.do_bench`` (its first call, a 5-call estimate and ``warmup_ms`` of
    warm-up are untimed; then ``rep_ms`` worth of repetitions, each after an L2 flush).
    CPU: the same protocol with ``time.perf_counter`` (3 to 1000 repetitions).
    """
    device = torch.device(device)
    grads = list(grad_to_none) if grad_to_none is not None else None
    if device.type == "cuda":
        import triton.testing

        ms, p20, p80 = triton.testing.do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grads, quantiles=list(QUANTILES)
        )
        return Timing(float(ms), float(p20), float(p80))
    return _bench_wallclock(fn, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grads)


def _bench_wallclock(fn, *, warmup_ms, rep_ms, grad_to_none, min_reps=3, max_reps=1000) -> Timing:
    fn()  # first call: compilation, allocation
    t0 = time.perf_counter()
    fn()
    estimate_ms = max((time.perf_counter() - t0) * 1e3, 1e-3)
    for _ in range(max(0, min(max_reps, int(warmup_ms / estimate_ms)))):
        fn()
    times = []
    for _ in range(max(min_reps, min(max_reps, int(rep_ms / estimate_ms)))):
        if grad_to_none is not None:
            for t in grad_to_none:
                t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return Timing(*quantiles(times, QUANTILES))


def quantiles(values: Sequence[float], qs: Sequence[float]) -> list[float]:
    """Linear-interpolated quantiles (numpy's default method), without numpy."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantiles of an empty sequence")
    out = []
    for q in qs:
        pos = q * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
    return out


def synchronize(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(
    fn: Callable[[], Any], device: torch.device | str, grad_to_none: Sequence[torch.Tensor] = ()
) -> float:
    """Peak allocated device memory (MiB) during one call of ``fn`` (live inputs included); NaN on CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return float("nan")
    for t in grad_to_none:
        t.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


# ----------------------------------------------------------------------------------------------
# Device ceilings, measured in the same run
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Peaks:
    copy_gbps: float  # device-to-device copy, bytes read + bytes written
    matmul_tflops: float  # random (n x n) @ (n x n) in `dtype`
    copy_bytes: int  # size of the copied buffer
    matmul_n: int
    dtype: str

    def as_row(self) -> Row:
        return {"peak_gbps": self.copy_gbps, "peak_tflops": self.matmul_tflops}


def measure_peaks(
    device: torch.device | str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
) -> Peaks:
    """Copy bandwidth and matmul rate of ``device`` (defaults: 1 GiB and n=8192 on CUDA; small on CPU).

    Random data throughout: a product of zeros runs measurably faster on Hopper.
    """
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (2**30 if on_cuda else 16 * 2**20)
    matmul_n = matmul_n or (8192 if on_cuda else 256)
    t_copy = _time_copy(copy_bytes, device, warmup_ms, rep_ms)
    t_mm = _time_matmul(matmul_n, dtype, device, warmup_ms, rep_ms)
    if on_cuda:
        torch.cuda.empty_cache()
    return Peaks(
        copy_gbps=gbps(2 * copy_bytes, t_copy.ms),
        matmul_tflops=tflops(2 * matmul_n**3, t_mm.ms),
        copy_bytes=copy_bytes,
        matmul_n=matmul_n,
        dtype=str(dtype).removeprefix("torch."),
    )


def matmul_tflops(device: torch.device | str, dtype: torch.dtype, *, tf32: bool = False, n: int | None = None,
                  warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """TFLOP/s of a random (n x n) @ (n x n) product in ``dtype`` (default n: 8192 on CUDA, large
    enough to reach the tensor cores' rate; 256 on CPU). ``tf32``: fp32 inputs with TF32 matmuls
    allowed for this measurement only (torch's matmul precision is restored after)."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 256)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        t = _time_matmul(n, dtype, device, warmup_ms, rep_ms)
    finally:
        torch.set_float32_matmul_precision(before)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return tflops(2 * n**3, t.ms)


def _time_copy(nbytes: int, device: torch.device, warmup_ms: float, rep_ms: float) -> Timing:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src), device=device, warmup_ms=warmup_ms, rep_ms=rep_ms)


def _time_matmul(n: int, dtype: torch.dtype, device: torch.device, warmup_ms: float, rep_ms: float) -> Timing:
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return bench(lambda: a @ b, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms)


# ----------------------------------------------------------------------------------------------
# Counting: FLOPs and bytes
# ----------------------------------------------------------------------------------------------
def _as_list(x: int | Sequence[int] | torch.Tensor) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]


def attention_flops(
    q_lengths: int | Sequence[int] | torch.Tensor,
    k_lengths: int | Sequence[int] | torch.Tensor,
    n_heads: int,
    head_dim: int,
    *,
    causal: bool,
    mode: str = "fwd",
) -> float:
    """FLOPs of attention on real positions (FlashAttention-2's convention, see module docstring).

    ``q_lengths``/``k_lengths``: one length per sequence (an int means one sequence).
    Forward = 4 * H * D * sum_b(Lq_b * Lk_b), / 2 when causal; bwd 2.5x, fwd+bwd 3.5x.
    """
    if mode not in ATTENTION_MODE_FACTOR:
        raise ValueError(f"mode={mode!r} is not one of {tuple(ATTENTION_MODE_FACTOR)}")
    lq, lk = _as_list(q_lengths), _as_list(k_lengths)
    if len(lq) != len(lk):
        raise ValueError(f"{len(lq)} query lengths but {len(lk)} key lengths")
    pairs = sum(a * b for a, b in zip(lq, lk))
    fwd = 4.0 * n_heads * head_dim * pairs / (2 if causal else 1)
    return fwd * ATTENTION_MODE_FACTOR[mode]


def layer_norm_bytes(
    rows: int,
    width: int,
    *,
    mode: str = "fwd",
    elem_bytes: int = 2,
    param_bytes: int | None = None,
    residual: bool = True,
    bias: bool = True,
) -> int:
    """Fewest bytes fused ``y = act(LayerNorm(x + r) * w + b)`` (returning ``s = x + r``) must move.

    fwd: read x (and r), w (and b); write y (and s).
    bwd: read dy (and ds, the gradient arriving at s from the residual stream), s (x when there is
         no residual), w (and b, needed for the activation's derivative); write dx -- one tensor, it
         is also d(residual) -- and dw (and db).
    fwd+bwd: the sum. Mean and rstd (8 bytes per row) are not counted: a kernel may recompute them.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not one of {MODES}")
    param_bytes = elem_bytes if param_bytes is None else param_bytes
    n_params = 2 if bias else 1
    act_fwd = (2 if residual else 1) + (2 if residual else 1)  # x, r in; y, s out
    act_bwd = (2 if residual else 1) + 1 + 1  # dy, ds, s in; dx out
    fwd = rows * width * elem_bytes * act_fwd + width * param_bytes * n_params
    bwd = rows * width * elem_bytes * act_bwd + width * param_bytes * 2 * n_params
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12 if ms and ms > 0 else float("nan")


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9 if ms and ms > 0 else float("nan")


# ----------------------------------------------------------------------------------------------
# Provenance
# ----------------------------------------------------------------------------------------------
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "instinct", "radeon", "intel"}
_MEMORY_WORDS = re.compile(r"^(\d+gb|hbm\d*e?|gddr\d*x?|sxm\d*)$")


def gpu_slug(name: str) -> str:
    """A file-name slug of a device name: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200',
    'NVIDIA H100 PCIe' -> 'h100-pcie', 'NVIDIA GeForce RTX 4090' -> 'rtx-4090', 'cpu' -> 'cpu'."""
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    words = [w for w in words if w not in _VENDOR_WORDS and not _MEMORY_WORDS.match(w)]
    return "-".join(words) or "gpu"


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def git_sha(root: Path = REPO_ROOT) -> tuple[str, str]:
    """(sha, dirty) of the checkout: git, else ``$FASTMT_GIT_SHA`` (a device copy without .git),
    else 'unknown'. ``dirty`` is 'yes'/'no' (tracked files changed), '' when unknown."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=30, check=True).stdout
        if sha:
            return sha, ("yes" if status.strip() else "no")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("FASTMT_GIT_SHA", "").strip() or "unknown", ""


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0] if out.strip() else ""
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def provenance(device: torch.device | str) -> Row:
    """Columns every result row carries: when, where, with what (GPU, versions, git sha)."""
    device = torch.device(device)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = ""
    name = device_name(device)
    sha, dirty = git_sha()
    row: Row = {
        "timestamp": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": name,
        "gpu_slug": gpu_slug(name),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "",
        "driver": _nvidia_driver() if device.type == "cuda" else "",
        "python": platform.python_version(),
        "git_sha": sha,
        "git_dirty": dirty,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        row["sm_count"] = props.multi_processor_count
        row["gpu_mem_gb"] = round(props.total_memory / 1e9, 1)
    return row


PROVENANCE_COLUMNS = ("gpu", "gpu_slug", "torch", "triton", "cuda", "driver", "python", "git_sha", "git_dirty")


# ----------------------------------------------------------------------------------------------
# Writers: CSV (appended), markdown, console table, plots
# ----------------------------------------------------------------------------------------------
def result_path(out_dir: Path | str, name: str, slug: str, ext: str) -> Path:
    """``<out_dir>/<name>-<slug>.<ext>``, e.g. ``bench/results/kernels-h100.csv``."""
    return Path(out_dir) / f"{name}-{slug}.{ext}"


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return str(v)


def append_csv(path: Path | str, rows: Iterable[Mapping[str, Any]], columns: Sequence[str] = ()) -> Path:
    """Append ``rows`` to ``path``; header = ``columns`` then any other keys in first-seen order.

    If the file exists with a different header, it is rewritten once with the union of both, so
    older rows keep their values under new columns (empty where they had none).
    """
    path = Path(path)
    rows = [dict(r) for r in rows]
    header = list(columns)
    for r in rows:
        header += [k for k in r if k not in header]
    old_rows: list[dict[str, str]] = []
    if path.exists() and path.stat().st_size > 0:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            old_header = list(reader.fieldnames or [])
            if old_header != header:
                old_rows = list(reader)
        if old_header == header:
            with path.open("a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=header)
                w.writerows({k: _cell(r.get(k)) for k in header} for r in rows)
            return path
        header = old_header + [k for k in header if k not in old_header]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows({k: r.get(k, "") for k in header} for r in old_rows)
        w.writerows({k: _cell(r.get(k)) for k in header} for r in rows)
    tmp.replace(path)
    return path


def read_csv(path: Path | str) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def fmt(v: Any) -> str:
    """Human formatting for tables: 3 significant figures, thousands grouped, NaN/None as '-'."""
    if v is None or v == "" or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.0f}"
        if a >= 1e-3 or a == 0:
            return f"{v:.3g}"
        return f"{v:.2e}"
    return str(v)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
                   headers: Sequence[str] | None = None) -> str:
    headers = list(headers or columns)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines)


def text_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
               headers: Sequence[str] | None = None) -> str:
    """Fixed-width table for the console (the device tool returns the end of stdout)."""
    headers = list(headers or columns)
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def provenance_markdown(prov: Mapping[str, Any], peaks: Peaks | None) -> str:
    parts = [
        f"- GPU: **{prov.get('gpu', '?')}**"
        + (f" ({prov['sm_count']} SMs, {prov['gpu_mem_gb']} GB)" if "sm_count" in prov else ""),
        f"- torch {prov.get('torch')}, triton {prov.get('triton')}, CUDA {prov.get('cuda') or '-'}, "
        f"driver {prov.get('driver') or '-'}, Python {prov.get('python')}",
        f"- git {prov.get('git_sha')}" + (" (uncommitted changes)" if prov.get("git_dirty") == "yes" else ""),
        f"- run {prov.get('timestamp')}",
    ]
    if peaks is not None:
        parts.append(
            f"- ceilings measured in this run: copy {peaks.copy_gbps:,.0f} GB/s (read+write, "
            f"{peaks.copy_bytes / 2**20:.0f} MiB), {peaks.dtype} matmul {peaks.matmul_tflops:,.1f} TFLOP/s "
            f"(n={peaks.matmul_n}, random data)"
        )
    return "\n".join(parts)


def new_figure(nrows: int, ncols: int, *, width: float = 5.2, height: float = 3.8):
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    return fig, axes


def line_panel(ax, series: Mapping[str, Sequence[tuple[float, float]]], *, title: str, xlabel: str,
               ylabel: str, logx: bool = True, styles: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """One line per label through its (x, y) points; empty panels say so."""
    drawn = False
    for label, pts in series.items():
        pts = sorted((x, y) for x, y in pts if y is not None and not math.isnan(y))
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=label, **(styles or {}).get(label, {}))
        drawn = True
    if logx and drawn:
        ax.set_xscale("log", base=2)
        xs_all = sorted({x for pts in series.values() for x, _ in pts})
        ax.set_xticks(xs_all, [str(int(x)) for x in xs_all])
        ax.minorticks_off()
    _finish_panel(ax, drawn, title, xlabel, ylabel)


def bar_panel(ax, categories: Sequence[str], groups: Mapping[str, Sequence[float]], *, title: str,
              xlabel: str, ylabel: str) -> None:
    """Grouped bars: one group per category, one bar per label (NaN bars are left out)."""
    labels = [k for k, vals in groups.items() if any(not math.isnan(v) for v in vals)]
    drawn = bool(labels and categories)
    width = 0.8 / max(1, len(labels))
    for i, label in enumerate(labels):
        xs = [c + (i - (len(labels) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(xs, [0 if math.isnan(v) else v for v in groups[label]], width=width, label=label)
    ax.set_xticks(range(len(categories)), list(categories))
    _finish_panel(ax, drawn, title, xlabel, ylabel)


def _finish_panel(ax, drawn: bool, title: str, xlabel: str, ylabel: str) -> None:
    if drawn:
        ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="gray")


def save_figure(fig, path: Path | str, *, suptitle: str = "") -> Path:
    import matplotlib.pyplot as plt

    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "tight_layout not applied" on crowded panels
        fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
