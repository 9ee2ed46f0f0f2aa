"""Compile fastmt's Triton kernels ahead of time for a GPU that is not here, and count the compile units.

Replays a runbook step's launches (``--plan train|kernel-test``) on CPU tensors with Triton's driver replaced by
a compile-only one for ``--arch`` (90: H100/H200): each launch compiles into ``TRITON_CACHE_DIR`` under the key
the GPU run would use, nothing runs. ``--out`` also writes ``AOT-KEYS.json`` (what Triton's cache key depends
on); ``--check`` exits 1 naming every key that differs here. Run with the interpreter off:
``python -m bench.aot --plan train --out DIR``. Details: bench/README.md ("Compile budgets", "Payload").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    print("error: bench.aot compiles for a GPU: run it with TRITON_INTERPRET unset", file=sys.stderr)
    raise SystemExit(2)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.compiler  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from bench import harness as H  # noqa: E402
from kernels.tuning import CompileOnlyDriver  # noqa: E402


class Units:
    """What one plan compiled: one entry per Triton cache key (a compile unit)."""

    def __init__(self):
        self.units: list[dict] = []

    def record(self, src, options: dict | None, seconds: float, hit: bool) -> None:
        names = src.fn.arg_names
        constexprs = {names[k[0]]: getattr(v, "value", v) for k, v in src.constants.items()
                      if isinstance(k, tuple) and len(k) == 1 and names[k[0]].isupper()}
        opts = {k: (options or {}).get(k) for k in ("num_warps", "num_stages")}
        self.units.append({"kernel": src.name, "seconds": round(seconds, 3), "cache_hit": hit,
                           "constexprs": {k: str(v) for k, v in constexprs.items()}, **opts})

    def by_kernel(self) -> Counter:
        return Counter(u["kernel"] for u in self.units)

    def seconds(self) -> float:
        return sum(u["seconds"] for u in self.units)


_RECORDING: list[Units] = []  # the innermost compile_only block's record
_HITS: list[bool] = []  # Triton's compilation listener: whether the last compile came from the disk cache


def _listener(*, cache_hit, **_kwargs):
    _HITS.append(cache_hit)


def _recording_compile(real):
    """``triton.compiler.compile``, timed into the active record. A JIT function binds the compile function
    once (its first launch), so this wrapper reads the record at call time rather than closing over one."""

    def compile_(src, target=None, options=None, _env_vars=None):
        t0 = time.perf_counter()
        kernel = real(src, target=target, options=options, _env_vars=_env_vars)
        if _RECORDING:
            _RECORDING[-1].record(src, options, time.perf_counter() - t0, hit=bool(_HITS and _HITS.pop()))
        return kernel

    compile_.recording = True
    return compile_


@contextlib.contextmanager
def compile_only(arch: int = 90, units: Units | None = None):
    """Inside the block every Triton launch compiles for ``arch`` (into TRITON_CACHE_DIR) and launches
    nothing; ``units`` records each compile (cache key) with its seconds."""
    from kernels import _utils

    units = units if units is not None else Units()
    if not getattr(triton.compiler.compile, "recording", False):
        triton.compiler.compile = _recording_compile(triton.compiler.compile)
    real_run = JITFunction.run

    def compile_not_launch(self, *args, grid, warmup, **kwargs):
        return real_run(self, *args, grid=grid, warmup=True, **kwargs)

    previous = driver._active  # None until something asked (a CPU machine has no driver to default to)
    previous_listener = triton.knobs.compilation.listener
    triton.knobs.compilation.listener = _listener
    driver.set_active(CompileOnlyDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.run = compile_not_launch
    _RECORDING.append(units)
    _utils._ARCH.append(arch)  # the pinned configs of the target GPU (kernels/pinned.py)
    try:
        with rebound(_utils.triton_usable, lambda t: True):  # CPU tensors pass the launchers' device checks
            yield units
    finally:
        _utils._ARCH.pop()
        _RECORDING.pop()
        driver._active = previous
        triton.knobs.compilation.listener = previous_listener
        JITFunction.run = real_run


def kernel_modules() -> list:
    """Every module of the ``kernels`` package, imported (so that each has bound what it imports)."""
    import importlib
    import pkgutil

    import kernels

    return [kernels] + [importlib.import_module(f"kernels.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]


@contextlib.contextmanager
def rebound(original, replacement):
    """``replacement`` in place of ``original`` in every kernels module that binds it (``_utils`` and each
    ``from kernels._utils import ...``), restored on exit: patching ``_utils`` alone worked only by the
    order in which modules were imported."""
    patched = [(m, name) for m in kernel_modules() for name, value in list(vars(m).items()) if value is original]
    for m, name in patched:
        setattr(m, name, replacement)
    try:
        yield patched
    finally:
        for m, name in patched:
            setattr(m, name, original)


# ----------------------------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------------------------
def plan_train(*, autotune: bool = True, preset: str = "fast") -> None:
    """The preset's first training step on CPU tensors (bf16 autocast, forward + backward). ``autotune``: what the
    first launch of each key compiles on the GPU (its pinned config, else every pruned config); else the first
    pruned config (``FASTMT_AUTOTUNE=0``)."""
    with _all_configs(autotune):
        _train_step(preset)


def _train_step(preset: str) -> None:
    """One forward + backward of ``preset``'s model (our kernels) on a packed batch of its capacity."""
    import dataclasses

    from models import Transformer
    from train.config import get_config

    cfg = get_config(preset)
    model_cfg = dataclasses.replace(cfg.model, attn_backend="triton", dropout=0.0)
    model = Transformer(model_cfg)
    batch = _packed_like(cfg.data.max_tokens // 2, cfg.data.max_len, model_cfg.vocab_size)  # a side's share
    with H.environ(FASTMT_NORM_BACKEND="triton"), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model(**{k: v for k, v in batch.items() if k not in ("tgt_out", "real_pairs")}, return_hidden=True)
        hidden.float().sum().backward()


PIN_PRESETS = ("fast",)  # the presets whose first step runs our kernels on the GPU (s18/s16 keep autotuning)
MEAN_BUCKETS = (8, 16, 32, 64, 128, 256)  # every mean-segment-length bucket of the stream kernels' key (data-made)


def pin_table(arch: int = 90, presets: tuple[str, ...] = PIN_PRESETS) -> dict:
    """{kernel name: {launch key text: config}} for every launch of each preset's first training step (on CPU
    tensors under ``compile_only``, nothing compiled): the first config the kernel's pruner keeps, marked
    "unmeasured" (no GPU run recorded its tuning yet). The stream attention kernels get every mean-length bucket:
    the corpus decides which one a run meets."""
    from kernels import _utils

    table: dict[str, dict[str, dict]] = {}

    def record(kernel, grid, key, *args, **kwargs):
        first = _utils.pruned_configs(kernel, args, kwargs)[0]
        name = kernel.base_fn.__name__
        keys = [(*key[:2], m, *key[3:]) for m in MEAN_BUCKETS] if name.startswith("_stream_attention") else [key]
        for k in keys:
            table.setdefault(name, {})[_utils.key_text(k)] = {
                "kwargs": dict(first.kwargs), "num_warps": first.num_warps, "num_stages": first.num_stages,
                "source": "unmeasured"}

    for preset in presets:
        with compile_only(arch), rebound(_utils.launch, record):
            _train_step(preset)
    return {name: dict(sorted(keys.items())) for name, keys in sorted(table.items())}


_PIN_HEADER = '''"""Pinned autotune configs: per GPU architecture (compute capability x10), kernel and launch key
(``kernels._utils.key_text``), the config a first launch takes without timing any (``kernels._utils.launch``;
``FASTMT_AUTOTUNE=full`` ignores them, ``FASTMT_AUTOTUNE=0`` takes the pruner's first config everywhere).

Generated by ``python -m bench.aot --pin-table kernels/pinned.py`` from the launches of the first training step of
the presets {presets}. "source": where a value comes from. "unmeasured": the config the kernel's pruner puts first
(what ``FASTMT_AUTOTUNE=0`` takes), not a timing; no GPU run has recorded its tuning yet. To measure: a GPU run
with ``FASTMT_AUTOTUNE=full``, then copy ``kernels._utils.TUNING_LOG``'s "best" per key here, with its run in "source".
"""

'''


def write_pin_table(path: Path, arch: int = 90) -> dict:
    """Write kernels/pinned.py: ``pin_table(arch)`` as a Python literal (review the diff; keep measured rows)."""
    table = pin_table(arch)
    header = _PIN_HEADER.format(presets=list(PIN_PRESETS))
    lines = ["PINNED = {  # arch -> kernel -> launch key -> config", f"    {arch}: {{"]
    for name, keys in table.items():
        lines.append(f"        {name!r}: {{")
        lines += [f"            {key!r}: {json.dumps(entry)}," for key, entry in keys.items()]
        lines.append("        },")
    body = "\n".join(lines + ["    },", "}", ""])
    path.write_text(header + body)
    return table


def _packed_like(capacity: int, max_len: int, vocab: int) -> dict:
    """A packed batch of ``capacity`` tokens per side (docs/ARCHITECTURE.md "Packed batches") with segments of the
    corpus's mean length (~16): (1, C) streams, real segments, then empty slots, then the tail padding cut into
    dummy segments of ``max_len``; positions inside each segment, 0 on the tail."""
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(4, 30, (capacity // 16,), generator=gen).tolist()
    while sum(lens) > capacity - max_len:
        lens.pop()
    slots, tail = len(lens) + -(-capacity // max_len) + 1, capacity - sum(lens)
    n_dummy = -(-tail // max_len)
    seg = torch.tensor(lens + [0] * (slots - len(lens) - n_dummy) + [max_len] * (n_dummy - 1)
                       + [tail - (n_dummy - 1) * max_len], dtype=torch.int32)
    pos = torch.cat([torch.arange(int(n), dtype=torch.int32) for n in seg])
    pos[sum(lens):] = 0
    batch = {"real_pairs": len(lens), "max_src_len": max_len, "max_tgt_len": max_len}
    for side, keys in (("src", ("src",)), ("tgt", ("tgt_in", "tgt_out"))):
        for key in keys:
            batch[key] = torch.zeros(1, capacity, dtype=torch.int32)
            batch[key][0, : sum(lens)] = torch.randint(4, vocab, (sum(lens),), generator=gen, dtype=torch.int32)
        batch.update({f"{side}_lengths": seg, f"cu_seqlens_{side}": torch.nn.functional.pad(
            seg.cumsum(0, dtype=torch.int32), (1, 0)), f"{side}_pos": pos[None]})
    return batch


def plan_kernel_test() -> None:
    """The launches of tests/kernels' CUDA grids (``make kernel-test`` on a GPU, slow ones left out), from the
    shapes the ops declare (``KernelOp.shapes``): the first fitting config per launch (``FASTMT_AUTOTUNE=0``, the
    tests' policy), every config in the tests that walk them, every pruned config in the ones that autotune."""
    import math

    import kernels.packed_attention as pa
    import kernels.sequence_attention as sa
    from kernels.flash_attention import SEQUENCE_ATTENTION_OP, STREAM_ATTENTION_OP
    from kernels.layernorm import LAYER_NORM_OP, layer_norm, layer_norm_bwd, layer_norm_fwd
    from kernels.lion import lion_step_triton

    seq, stream = SEQUENCE_ATTENTION_OP.shapes, STREAM_ATTENTION_OP.shapes

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)

    def padded(shape, D, dtype, causal, ragged):
        B, H, Tq, Tk = seq["padded"][shape]
        q, k, v, do = (torch.empty(B, H, T, D, dtype=dtype) for T in (Tq, Tk, Tk, Tq))
        ql = torch.full((B,), Tq, dtype=torch.int32)
        kl = torch.full((B,), Tk, dtype=torch.int32)
        out, lse = sa.sequence_attention_fwd(q, k, v, ql, kl, Tq, Tk, causal, 1 / math.sqrt(D))
        sa.sequence_attention_bwd(do, q, k, v, out, lse, ql, kl, Tq, Tk, causal, 1 / math.sqrt(D))

    def varlen(lq, lk, H, D, dtype, causal, tiling):
        cu_q, cu_k = cu(lq), cu(lk)
        q, do = (torch.empty(sum(lq), H, D, dtype=dtype) for _ in range(2))
        k, v = (torch.empty(sum(lk), H, D, dtype=dtype) for _ in range(2))
        scale = 1 / math.sqrt(D)
        if tiling == "sequence":
            out, lse = sa.sequence_attention_fwd(q, k, v, cu_q, cu_k, max(lq), max(lk), causal, scale)
            sa.sequence_attention_bwd(do, q, k, v, out, lse, cu_q, cu_k, max(lq), max(lk), causal, scale)
        else:
            seg_q, seg_k = pa.segment_ids(cu_q, sum(lq)), pa.segment_ids(cu_k, sum(lk))
            out, lse = pa.stream_attention_fwd(q, k, v, cu_q, cu_k, seg_q, causal, scale)
            pa.stream_attention_bwd(do, q, k, v, out, lse, cu_q, cu_k, seg_q, seg_k, causal, scale)

    def packed(kind, D, dtype, seed=0):
        layout = stream["packed_layout"]
        src, tgt = pa.packed_layout(torch.Generator().manual_seed(seed), layout["capacity"], layout["slots"],
                                    layout["max_len"], mean=layout["mean"], p99=layout["p99"])
        lq, lk, causal = {"encoder-self": (src, src, False), "decoder-causal": (tgt, tgt, True),
                          "cross": (tgt, src, False)}[kind]
        varlen(lq, lk, 8, D, dtype, causal, "stream")

    def autotuned(module):  # the module's autotuned kernels (a Triton Autotuner keeps its ``configs``)
        return [v for n, v in sorted(vars(module).items()) if n.startswith("_") and hasattr(v, "configs")
                and hasattr(v, "base_fn")]

    with H.environ(FASTMT_AUTOTUNE="0"):
        for case in seq["cover"]:  # test_gpu_grid_padded
            padded(*case)
        for tiling in ("sequence", "stream"):  # test_gpu_grid_varlen
            for lengths, D, dtype, causal in seq["varlen_cover"]:
                varlen(*seq["varlen"][lengths], 4, D, dtype, causal, tiling)
        for case in stream["packed"]:  # test_gpu_packed_batches
            packed(*case)
        for module, case in ((sa, lambda: padded("B2-H4-Tq300-Tk77", 64, torch.bfloat16, True, True)),
                             (pa, lambda: packed("decoder-causal", 64, torch.bfloat16, 2))):
            kernels = autotuned(module)  # test_gpu_every_config_is_correct: each config alone
            saved = [k.configs for k in kernels]
            try:
                for index in range(max(len(c) for c in saved)):
                    for k, c in zip(kernels, saved):
                        k.configs = [c[min(index, len(c) - 1)]]
                    case()
            finally:
                for k, c in zip(kernels, saved):
                    k.configs = c
        fast = set(LAYER_NORM_OP.shapes["fast"])
        for dtype, N, residual, bias, act in LAYER_NORM_OP.shapes["full"]:  # test_layernorm's test_gpu_grid (fast)
            if (dtype, N, residual, bias, act) in fast:
                rows = max(3, 2**17 // N) + 1
                x, r = (torch.empty(rows, N, dtype=dtype, requires_grad=True) if t else None for t in (1, residual))
                w, b = (torch.empty(N, dtype=dtype, requires_grad=True) if t else None for t in (1, bias))
                y, s = layer_norm(x, w, b, r, activation=act, return_residual=True, backend="triton")
                torch.autograd.backward([y, s] if residual else [y], [torch.empty_like(y)] * (1 + residual))
        for rows, N, x_dtype, r_dtype in LAYER_NORM_OP.shapes["mixed_residual"]:
            x, r = torch.empty(rows, N, dtype=x_dtype), torch.empty(rows, N, dtype=r_dtype)
            w, b = torch.empty(N), torch.empty(N)
            y, s, stats = layer_norm_fwd(x, w, b, r, 1e-5, "gelu")
            layer_norm_bwd(y, s, s, w, b, stats, "gelu")
        for n in (1, 4, 1000, 1024, 1500, 2049, 3001):  # test_lion's sizes (off and on every block)
            for grad_dtype in (torch.float32, torch.bfloat16, torch.float16):
                for lr, lr_t in ((1e-3, None), (0.0, torch.tensor(1e-3))):
                    for flag in (None, torch.tensor(0.0), torch.tensor(False)):
                        p = torch.empty(n)
                        lion_step_triton(p, torch.empty(n, dtype=grad_dtype), torch.empty(n), lr, lr_t,
                                         0.9, 0.99, 0.1, flag)
    with H.environ(FASTMT_AUTOTUNE="full"), _all_configs(True):  # test_gpu_autotuned_matches (both tilings): the
        # autotuner times every pruned config, pinned keys too
        padded("B2-H4-Tq300-Tk77", 64, torch.bfloat16, True, True)
        packed("decoder-causal", 64, torch.bfloat16, 3)
    with H.environ(FASTMT_AUTOTUNE="0", TRITON_INTERPRET="0"):
        run_selected_tests()


# the runbook's kernel-test selection (bench/packets.py; tests/bench/test_gpu_run.py checks they agree)
def kernel_test_selection() -> tuple[str, ...]:
    from bench.packets import kernel_test_files

    return (*kernel_test_files(), "-m", "not slow")


class _TestsAsPlan:
    """pytest plugin: the kernel-test step's tests on CPU tensors under ``compile_only``, skips lifted (outcomes
    mean nothing). Left out: tests marked ``gpu`` (the grids above stand for them), tests that start a subprocess
    or torch.compile (same launches, minutes of CPU work)."""

    def __init__(self):
        self.ran = 0

    def pytest_collection_modifyitems(self, items):
        import inspect

        kept = []
        for item in items:
            try:
                source = inspect.getsource(item.function)
            except (OSError, TypeError, AttributeError):
                source = ""
            if item.get_closest_marker("gpu") is not None or "subprocess" in source or "torch.compile" in source:
                continue
            for node in item.listchain():
                node.own_markers[:] = [m for m in node.own_markers if m.name not in ("skip", "skipif")]
            kept.append(item)
        items[:] = kept

    def pytest_runtest_logreport(self, report):
        self.ran += report.when == "call"


def run_selected_tests() -> None:
    """Run the runbook's kernel-test selection in this process (inside ``compile_only``)."""
    import pytest

    plugin = _TestsAsPlan()
    pytest.main([*kernel_test_selection(), "-q", "--tb=no", "-rN", "--no-header", "-p", "no:cacheprovider",
                 "-o", "addopts=", "-W", "ignore"], plugins=[plugin])
    print(f"kernel-test: {plugin.ran} tests of the selection replayed for their launches (their outcomes mean "
          f"nothing here: no kernel ran)", flush=True)


PLANS = {"train": plan_train, "kernel-test": plan_kernel_test}


@contextlib.contextmanager
def _all_configs(enabled: bool):
    """``kernels._utils.launch`` compiling what a GPU's first launch of the key compiles: the pinned config
    (kernels/pinned.py), else every config the kernel's pruner keeps (what the Autotuner compiles when it times
    them; all of them with ``FASTMT_AUTOTUNE=full``); off: the first one (``FASTMT_AUTOTUNE=0``)."""
    from kernels import _utils

    if not enabled:
        with H.environ(FASTMT_AUTOTUNE="0"):
            yield
        return
    def every_config(kernel, grid, key, *args, **kwargs):
        policy = os.environ.get(_utils.AUTOTUNE_ENV, "1").strip()
        for meta in _utils._configs_to_compile(kernel, key, policy, args, kwargs):
            kernel.fn.run(*args, grid=grid(meta), warmup=True, **kwargs, **meta)

    with rebound(_utils.launch, every_config):
        yield


def kernels_sha256() -> str:
    """A hash of ``kernels/*.py`` (names and contents): Triton's key hashes each kernel's source and line
    numbers, so any edit there turns every cached entry into a miss."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted((Path(__file__).resolve().parents[1] / "kernels").glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_keys(arch: int) -> dict:
    """What decides whether a GPU run hits this cache (``CHECKED_KEYS``), and the commit it was built at."""
    import hashlib

    from triton.compiler import make_backend
    from triton.runtime.cache import triton_key

    from train.runs.metrics import git_sha

    return {"triton": triton.__version__, "triton_key_sha256": hashlib.sha256(triton_key().encode()).hexdigest(),
            "backend": make_backend(GPUTarget("cuda", arch, 32)).hash(), "kernels_sha256": kernels_sha256(),
            "git_sha": git_sha(), "python": sys.version.split()[0], "torch": torch.__version__, "arch": arch}


# what Triton's cache key depends on: the triton build, ptxas and the backend, the target, the kernels' source.
# The git sha is not among them: a commit that changes no kernel leaves every entry valid (it is reported only).
CHECKED_KEYS = ("triton", "triton_key_sha256", "backend", "arch", "kernels_sha256")


def check(built: dict, here: dict) -> tuple[int, str]:
    """(exit status, one line): 0 when every key in ``CHECKED_KEYS`` matches, else 1 naming each difference."""
    differ = [f"{k} {str(built.get(k))[:12]} here {str(here.get(k))[:12]}" for k in CHECKED_KEYS
              if built.get(k) != here.get(k)]
    commits = ("" if built.get("git_sha") == here.get("git_sha") else
               f" (built at commit {str(built.get('git_sha'))[:12]}, this is {str(here.get('git_sha'))[:12]}: the "
               f"kernels' source is the same)")
    if not differ:
        return 0, ("keys match (triton build, ptxas, target, kernels' source): the steps should compile none of the "
                   "carried kernels" + commits)
    return 1, (f"KEYS DIFFER ({'; '.join(differ)}; built with python {built.get('python')}, this is "
               f"{here.get('python')}): the cache is stale or foreign, every kernel compiles here; rebuild with "
               f"`make gpu-wheels` at this commit")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.aot", description=__doc__.split("\n")[0])
    p.add_argument("--plan", choices=sorted(PLANS), action="append")
    p.add_argument("--check", metavar="AOT-KEYS.json", help="say whether a cache built elsewhere matches this machine")
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    p.add_argument("--out", help="cache directory to fill (TRITON_CACHE_DIR); default: a temporary one")
    p.add_argument("--json", help="write the units per plan here")
    p.add_argument("--pin-table", metavar="PATH", help="write the pinned-config table (kernels/pinned.py) and exit")
    args = p.parse_args(argv)
    if args.pin_table:
        table = write_pin_table(Path(args.pin_table), args.arch)
        print(f"{args.pin_table}: {sum(map(len, table.values()))} pinned keys for sm_{args.arch}: "
              f"{ {k: len(v) for k, v in table.items()} }")
        return 0
    if args.check:
        try:
            built = json.loads(Path(args.check).read_text())
        except (OSError, ValueError) as e:
            print(f"no usable cache keys in {args.check} ({e.__class__.__name__}: {e}); rebuild with "
                  f"`GPU_AOT=1 make gpu-wheels`: every kernel compiles here")
            return 2
        status, line = check(built, cache_keys(args.arch))
        print(line)
        return status
    if not args.plan:
        p.error("give --plan (or --check)")
    import tempfile

    out = Path(args.out or tempfile.mkdtemp(prefix="fastmt-aot-"))
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(out)
    report = {"keys": cache_keys(args.arch), "plans": {}}
    for name in args.plan:
        with compile_only(args.arch) as units:
            t0 = time.perf_counter()
            PLANS[name]()
            wall = time.perf_counter() - t0
        report["plans"][name] = {"units": len(units.units), "compile_seconds": round(units.seconds(), 1),
                                 "cache_hits": sum(u["cache_hit"] for u in units.units),
                                 "wall_seconds": round(wall, 1), "by_kernel": dict(units.by_kernel()),
                                 "detail": units.units}
        print(f"{name}: {len(units.units)} compile units ({sum(u['cache_hit'] for u in units.units)} from the "
              f"cache), {units.seconds():.1f} s compiling "
              f"({wall:.1f} s wall) for sm_{args.arch}: {dict(units.by_kernel())}", flush=True)
    (out / "AOT-KEYS.json").write_text(json.dumps(report["keys"], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"cache: {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
