"""The shared harness of bench/: timing, device ceilings, FLOP/byte counts, provenance, result files
(``<out>/<name>-<gpu>.{csv,md,png}``), child environments and the one deadline runner (``run_in_group``). The timing
protocol and counting conventions: bench/README.md."""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import math
import os
import platform
import re
import signal
import subprocess
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.flops import matmul_flops

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"
MODES = ("fwd", "bwd", "fwd+bwd")
# FLOPs of backward and forward+backward relative to forward (FlashAttention-2's convention:
# the forward does 2 matrix products, the backward 5 -- one of them recomputing S = QK^T).
ATTENTION_MODE_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
QUANTILES = (0.5, 0.2, 0.8)  # median, p20, p80

Row = dict[str, Any]


# -- Timing ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median and the 20th / 80th percentiles."""

    ms: float
    p20: float
    p80: float


def bench(fn: Callable[[], Any], *, device: torch.device | str = "cuda", warmup_ms: float = 25.0,
          rep_ms: float = 100.0, grad_to_none: Sequence[torch.Tensor] | None = None) -> Timing:
    """Time ``fn()``; ``grad_to_none`` tensors get ``.grad = None`` before every timed repetition.

    CUDA: ``triton.testing.do_bench`` (the protocol is in bench/README.md); CPU: the same protocol with
    ``time.perf_counter`` (``repeat``, 3 to 1000 repetitions)."""
    grads = list(grad_to_none or ())
    if torch.device(device).type == "cuda":
        import triton.testing

        ms, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grads,
                                               quantiles=list(QUANTILES))
        return Timing(float(ms), float(p20), float(p80))

    def once() -> float:
        for t in grads:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return repeat(once, warmup_ms=warmup_ms, rep_ms=rep_ms)


def repeat(once: Callable[[], float], *, warmup_ms: float, rep_ms: float, min_reps: int = 3,
           max_reps: int = 1000) -> Timing:
    """Quantiles of ``once()``, which times one call itself (ms): a first call (compilation, allocation)
    and an estimate untimed, ``warmup_ms`` of warm-up, then ``rep_ms`` worth of calls."""
    once()
    estimate = max(once(), 1e-3)
    for _ in range(min(max_reps, int(warmup_ms / estimate))):
        once()
    times = [once() for _ in range(max(min_reps, min(max_reps, int(rep_ms / estimate))))]
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


def peak_memory_mb(fn: Callable[[], Any], device: torch.device | str,
                   grad_to_none: Sequence[torch.Tensor] = ()) -> float:
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


@contextlib.contextmanager
def environ(values: Mapping[str, str] = {}, **more: str) -> Iterator[None]:  # noqa: B006 - read only
    """``values`` and ``more`` set in ``os.environ`` for the block; those keys (only) restored after."""
    values = {**values, **more}
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.update({k: v for k, v in old.items() if v is not None})
        for k in (k for k, v in old.items() if v is None):
            os.environ.pop(k, None)


def child_env(threads: int | None = None, **values: str) -> dict[str, str]:
    """A child process's environment: this one's, OpenMP and MKL pinned to ``threads`` (their pools read them at
    start), ``values`` set."""
    pinned = {} if threads is None else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    return {**os.environ, **pinned, **values}


def short_error(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters (for a row's ``error`` column)."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:limit]


def sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                is_causal: bool = False) -> str:
    """The kernel SDPA's own dispatcher picks for these inputs, e.g. 'EFFICIENT_ATTENTION' (a private torch
    helper: 'unknown (<error>)' when it fails)."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(int(torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal))).name
    except Exception as e:  # noqa: BLE001 - report, do not fail the row
        return f"unknown ({type(e).__name__})"


def dynamo_counters() -> dict[str, Any]:
    """Graphs and graph breaks counted by dynamo since the last ``counters.clear()``, with the reasons."""
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    return {"graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": int(sum(breaks.values())),
            "reasons": [" ".join(k.split())[:300] + f" (x{v})" for k, v in breaks.items()]}


# -- Device ceilings, measured in the same run -----------------------------------------------------
@dataclass(frozen=True)
class Peaks:
    copy_gbps: float  # device-to-device copy, bytes read + bytes written
    matmul_tflops: float  # random (n x n) @ (n x n) in `dtype`
    copy_bytes: int  # size of the copied buffer
    matmul_n: int
    dtype: str

    def as_row(self) -> Row:
        return {"peak_gbps": self.copy_gbps, "peak_tflops": self.matmul_tflops}


def measure_peaks(device: torch.device | str, *, dtype: torch.dtype = torch.bfloat16, copy_bytes: int | None = None,
                  matmul_n: int | None = None, warmup_ms: float = 25.0, rep_ms: float = 100.0) -> Peaks:
    """Copy bandwidth and matmul rate of ``device`` (defaults: 1 GiB and n=8192 on CUDA; small on CPU);
    the matmul is ``models.flops.matmul_flops``, the measurement MFU falls back on, timed with ``bench``."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    copy_bytes = copy_bytes or (2**30 if on_cuda else 16 * 2**20)
    matmul_n = matmul_n or (8192 if on_cuda else 256)
    src = torch.randint(0, 255, (copy_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = bench(lambda: dst.copy_(src), device=device, warmup_ms=warmup_ms, rep_ms=rep_ms)
    matmul = matmul_flops(device, dtype, n=matmul_n, timer=lambda fn: bench(
        fn, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms).ms)
    return Peaks(copy_gbps=gbps(2 * copy_bytes, t_copy.ms), matmul_tflops=matmul / 1e12, copy_bytes=copy_bytes,
                 matmul_n=matmul_n, dtype=str(dtype).removeprefix("torch."))


# -- Counting: FLOPs and bytes ---------------------------------------------------------------------
def _as_list(x: int | Sequence[int] | torch.Tensor) -> list[int]:
    return [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else [x] if isinstance(x, int) else x)]


def attention_flops(q_lengths: int | Sequence[int] | torch.Tensor, k_lengths: int | Sequence[int] | torch.Tensor,
                    n_heads: int, head_dim: int, *, causal: bool, mode: str = "fwd") -> float:
    """FLOPs of attention on real positions (FlashAttention-2's convention, bench/README.md).

    ``q_lengths``/``k_lengths``: one length per sequence (an int means one sequence).
    Forward = 4 * H * D * sum_b(Lq_b * Lk_b), / 2 when causal; bwd 2.5x, fwd+bwd 3.5x."""
    if mode not in ATTENTION_MODE_FACTOR:
        raise ValueError(f"mode={mode!r} is not one of {tuple(ATTENTION_MODE_FACTOR)}")
    lq, lk = _as_list(q_lengths), _as_list(k_lengths)
    if len(lq) != len(lk):
        raise ValueError(f"{len(lq)} query lengths but {len(lk)} key lengths")
    pairs = sum(a * b for a, b in zip(lq, lk))
    fwd = 4.0 * n_heads * head_dim * pairs / (2 if causal else 1)
    return fwd * ATTENTION_MODE_FACTOR[mode]


def layer_norm_bytes(rows: int, width: int, *, mode: str = "fwd", elem_bytes: int = 2, param_bytes: int | None = None,
                     residual: bool = True, bias: bool = True) -> int:
    """Fewest bytes fused ``y = act(LayerNorm(x + r) * w + b)`` (returning ``s = x + r``) must move.

    fwd: read x (and r), w (and b); write y (and s).
    bwd: read dy (and ds, the gradient arriving at s from the residual stream), s (x when there is
         no residual), w (and b, needed for the activation's derivative); write dx -- one tensor, it
         is also d(residual) -- and dw (and db).
    fwd+bwd: the sum. Mean and rstd (8 bytes per row) are not counted: a kernel may recompute them."""
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


# -- Provenance ------------------------------------------------------------------------------------
_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro", "amd", "instinct", "radeon", "intel"}
_MEMORY_WORDS = re.compile(r"^(\d+gb|hbm\d*e?|gddr\d*x?|sxm\d*)$")


def gpu_slug(name: str) -> str:
    """A file-name slug of a device name: 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200',
    'NVIDIA H100 PCIe' -> 'h100-pcie', 'NVIDIA GeForce RTX 4090' -> 'rtx-4090', 'cpu' -> 'cpu'."""
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    words = [w for w in words if w not in _VENDOR_WORDS and not _MEMORY_WORDS.match(w)]
    return "-".join(words) or "gpu"


def _nvidia_driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0] if out.strip() else ""
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def provenance(device: torch.device | str) -> Row:
    """Columns every result row carries: when, where, with what. Versions and the git sha are the
    training runs' own (``train.runs.metrics``), so a result and a run name a checkout the same way."""
    from train.runs.metrics import environment, git_sha

    device = torch.device(device)
    cuda = device.type == "cuda"
    env, sha, name = environment(), git_sha() or "unknown", torch.cuda.get_device_name(device) if cuda else "cpu"
    row: Row = {"timestamp": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "gpu": name,
                "gpu_slug": gpu_slug(name), "torch": env["torch"], "triton": env["triton"] or "",
                "cuda": env["cuda"] or "", "driver": _nvidia_driver() if cuda else "", "python": env["python"],
                "git_sha": sha.removesuffix("-dirty"),
                "git_dirty": "yes" if sha.endswith("-dirty") else ("" if sha == "unknown" else "no")}
    if cuda:
        props = torch.cuda.get_device_properties(device)
        row["sm_count"] = props.multi_processor_count
        row["gpu_mem_gb"] = round(props.total_memory / 1e9, 1)
    return row


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else ``platform.processor()``, else 'unknown CPU'."""
    from data.files import read_text

    try:
        for line in read_text("/proc/cpuinfo", "CPU description", limit=64 * 2**20).splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, ValueError):
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    """'<CPU>, <n> cores, <m> GiB': the host of a CPU measurement (cores: the ones this process may use)."""
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    return f"{cpu_name()}, {len(os.sched_getaffinity(0))} cores, {mem:.0f} GiB"


def code_sha(repo: Path | str, scope: str = ".") -> str:
    """``<short sha>`` of the checkout at ``repo``, ``+dirty`` when tracked or new files under ``scope`` changed;
    'unknown' without git (a tree exported with ``git archive``)."""
    try:
        sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", scope],
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


PROVENANCE_COLUMNS = ("gpu", "gpu_slug", "torch", "triton", "cuda", "driver", "python", "git_sha", "git_dirty")


# -- Writers: CSV (appended), markdown, console table, plots ---------------------------------------
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
    older rows keep their values under new columns (empty where they had none)."""
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


def read_csv(path: Path | str, columns: Sequence[str] | None = None) -> list[dict[str, str]]:
    """The rows of a CSV (``[]`` when there is none); given ``columns``, every row has exactly those keys (a row
    written before a column existed: "")."""
    if not Path(path).is_file():
        return []
    with Path(path).open(newline="") as f:
        rows = list(csv.DictReader(f))
    return rows if columns is None else [{k: r.get(k) or "" for k in columns} for r in rows]


def write_results(out: Path, name: str, slug: str, rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
                  markdown: str | Callable[[list], str], plot: Callable[[list, Path], Path] | None = None, *,
                  keep: str | None = None) -> dict[str, Path]:
    """``<out>/<name>-<slug>.csv`` rewritten with ``rows`` (one table per device: the latest run; git keeps
    the history), the ``.md`` holding ``markdown`` (or ``markdown(rows)``) and, given ``plot(rows, path)``, the
    ``.png``. ``keep``: a column; the file's earlier rows whose value there no new row has come first (the
    contestants or settings not run now)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: result_path(out, name, slug, ext) for ext in ("csv", "md")}
    if keep is not None:
        mine = {str(r[keep]) for r in rows}
        rows = [r for r in read_csv(paths["csv"]) if r.get(keep) not in mine] + list(rows)
    paths["csv"].unlink(missing_ok=True)
    append_csv(paths["csv"], rows, columns)
    paths["md"].write_text(markdown if isinstance(markdown, str) else markdown(rows))
    if plot is not None:
        paths["png"] = plot(rows, result_path(out, name, slug, "png"))
    return paths


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


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str], headers: Sequence[str] | None = None,
                   *, right: Sequence[str] = (), cell: Callable[[Any], str] = fmt) -> str:
    """A markdown table of ``rows``' ``columns`` (``headers``: their titles), each value through ``cell``
    (``fmt``: 3 significant figures, '-' for none); the columns in ``right`` right-aligned."""
    headers = list(headers or columns)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if c in right else "---" for c in columns) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c)).replace("|", "\\|") for c in columns) + " |")
    return "\n".join(lines)


def tail(path: Path | str, lines: int = 3, width: int = 240) -> str:
    """The last ``lines`` lines of a log (where a traceback names its error), each cut to ``width`` characters,
    joined by ' | '; '' when it cannot be read."""
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line[:width] for line in text[-lines:])


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
               ylabel: str, logx: bool = True) -> None:
    """One line per label through its (x, y) points; empty panels say so."""
    drawn = False
    for label, pts in series.items():
        pts = sorted((x, y) for x, y in pts if y is not None and not math.isnan(y))
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=label)
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


# -- Running a child under a deadline ------------------------------------------------------------------------
def kill_group(pgid: int, grace_s: float = 5.0) -> None:
    """End a contestant's process group: TERM, then KILL after ``grace_s`` for whatever still runs (the
    contestant's own children included: data workers, compile workers, a stray ``sleep``)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)


def run_in_group(cmd: list[str], log_path: Path, *, timeout_s: float, env: dict[str, str], cwd=None,
                 append: bool = False, tail_lines: int = 3, check: bool = True, grace_s: float = 2.0) -> int:
    """Run ``cmd`` in its own process group, stdout and stderr to ``log_path``; past ``timeout_s`` the whole group
    is killed (``kill_group``) and ``TimeoutError`` raised, an interrupt kills it too; any non-zero exit raises
    ``RuntimeError`` with the log's last ``tail_lines`` lines. Returns 0.

    ``check=False`` (the runbook's steps; stdin /dev/null): the exit status as a shell reports it (128 + N for signal
    N); past ``timeout_s`` the group gets TERM, the leader ``grace_s`` more to end, then KILL, and 124 comes back."""
    with open(log_path, "a") if append else open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                stdin=None if check else subprocess.DEVNULL)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            if not check:  # TERM to the group, the leader grace_s to end, then KILL to whatever is left
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=grace_s)
                except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
                    pass
                kill_group(proc.pid, grace_s=0.0)
                proc.wait()
                return 124
            kill_group(proc.pid, grace_s=2.0)
            proc.wait()
            raise TimeoutError(f"{Path(cmd[0]).name} ran past its {timeout_s:.0f} s deadline (killed); log "
                               f"{log_path}") from None
        except BaseException:
            kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            kill_group(proc.pid, grace_s=0.0)
    if rc != 0 and check:
        from data.files import LOG_MAX, read_bytes  # a log its own child wrote, through the safe-file layer

        text = read_bytes(log_path, "log", limit=LOG_MAX).decode(errors="replace")
        tail = " | ".join(text.strip().splitlines()[-tail_lines:])
        raise RuntimeError(f"{' '.join(cmd[:2])} exited {rc}: {tail[:600]}")
    return rc if rc >= 0 else 128 - rc
