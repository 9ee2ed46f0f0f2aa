"""Training configuration: dataclasses, presets, and the ``--section.field value`` CLI overrides.

``Config`` groups five sections, each a small dataclass validated in ``__post_init__``:

    data   DataConfig   (owned by data/)     corpus, cleaning, split, tokenizer, batching
    model  ModelConfig  (owned by models/)   architecture and kernel switches
    optim  OptimConfig  (here)               optimizer, schedule, accumulation, loss
    run    RunConfig    (here)               epochs, precision, compile, logging, checkpoints
    eval   EvalConfig   (here)               validation decoding, BLEU thresholds, early stop, test

Presets are plain functions (``tiny()``, ``s18()``, ``s16()``, ``fast()``, ``baseline()``) listed in
``PRESETS``. The command line overrides only existing fields, ``--optim.lr 3e-4`` or
``--optim.lr=3e-4``; values are parsed against the field's annotation (int, float, bool, str,
Literal, Optional, tuple) and an unknown section or field fails with the list of valid names.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from data import DataConfig
from data.declare import (
    FORMAT_KEY,
    MAX_BEAM,
    MAX_COUNT,
    MAX_DECODE_BATCH,
    MAX_LENGTH,
    MAX_THREADS,
    REPLAN,
    RESOURCE,
    SAFE,
    SEED,
    Bounds,
    Resume,
    declare,
    refused,
)
from models import ModelConfig, get_preset
from train.overrides import (
    DuplicateKeyError,
    apply_overrides,
    build_dataclass,
    require_finite,
    resolved_hints,
    unique_keys,
)
from train.runs.folder import validate_run_name

Precision = Literal["bf16", "fp16", "fp32"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
# what a resume may not change, and why (the other fields' classes are in their declarations)
OPTIMIZER_STATE = refused("the optimizer state belongs to the saved optimizer")
RNG_STATE = refused("the random state comes from the checkpoint, so a new seed would be ignored")
BEST_SO_FAR = refused("best.pt so far was chosen by the saved metric")
PRECISION = Resume("safe", "the fp16 loss scaler's state cannot move to or from another precision", ("fp16",))


@dataclass
class OptimConfig:
    # lion: lion-pytorch (seeds); adam/adamw: torch
    name: Literal["lion", "adamw", "adam"] = declare("lion", OPTIMIZER_STATE)
    # peak learning rate (OneCycle max_lr / inverse-sqrt peak)
    lr: float = declare(1e-4, REPLAN, Bounds(0, None, lo_open=True))
    # (beta1, beta2); Lion's defaults; use (0.9, 0.98) for Adam
    betas: tuple[float, float] = declare((0.9, 0.99), REPLAN, Bounds(0, 1, hi_open=True))
    eps: float = declare(1e-8, REPLAN, Bounds(0, 1, lo_open=True))  # Adam/AdamW epsilon (unused by Lion)
    # decoupled decay on weight matrices only (never biases, norms, embeddings)
    weight_decay: float = declare(1e-2, REPLAN, Bounds(0, None))
    # learning-rate schedule; cosine: linear warm-up over warmup_steps (at most the run), then half a cosine that
    # ends just above 0 at the last step
    schedule: Literal["onecycle", "inverse_sqrt", "cosine", "constant"] = declare("onecycle", REPLAN)
    # OneCycle: fraction of the steps spent warming up (seeds: ~28 %)
    pct_start: float = declare(0.28, REPLAN, Bounds(0, 1, lo_open=True, hi_open=True))
    # OneCycle: initial lr = lr / div_factor (seeds: 1e-4 -> 1e-6)
    div_factor: float = declare(100.0, REPLAN, Bounds(1, 1e12))
    # OneCycle: final lr = initial lr / final_div_factor (-> 1e-8)
    final_div_factor: float = declare(100.0, REPLAN, Bounds(1, 1e12))
    three_phase: bool = declare(False, REPLAN)  # OneCycle: symmetric warm-up/down then annihilation (S16 used True)
    anneal: Literal["linear", "cos"] = declare("linear", REPLAN)  # OneCycle anneal strategy (seeds: linear)
    # inverse_sqrt, cosine: linear warm-up steps (inverse_sqrt: then lr * sqrt(warmup / step))
    warmup_steps: int = declare(4000, REPLAN, Bounds(1, MAX_COUNT))
    # max global grad norm after unscale; None = no clipping
    grad_clip: float | None = declare(1.0, SAFE, Bounds(0, None, lo_open=True))
    # micro-batches per optimizer step (loss normalised by their real target tokens)
    accum_steps: int = declare(1, REPLAN, Bounds(1, 4096, why="micro-batches per step"))
    # training cross-entropy smoothing (seeds: 0.1); validation uses 0
    label_smoothing: float = declare(0.1, SAFE, Bounds(0, 1, hi_open=True))
    # weight EMA kept after every step (eole's average_decay, Marian's exponential-smoothing, e.g. 0.999);
    # validation, best.pt, the test and translate use the average (train/ema.py); 0: off
    ema_decay: float = declare(0.0, SAFE, Bounds(0, 1, hi_open=True), since=6)

    def __post_init__(self):
        require_finite(self, "optim")
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if self.eps <= 0:
            raise ValueError(f"optim.eps={self.eps} must be > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas={self.betas} must be two floats in [0, 1), e.g. 0.9,0.99")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay={self.weight_decay} must be >= 0")
        if not 0.0 < self.pct_start < 1.0:
            raise ValueError(f"optim.pct_start={self.pct_start} must be in (0, 1)")
        if self.div_factor < 1 or self.final_div_factor < 1:
            raise ValueError(
                f"optim.div_factor={self.div_factor} and optim.final_div_factor={self.final_div_factor} must be >= 1"
            )
        if self.warmup_steps < 1:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be >= 1")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"optim.grad_clip={self.grad_clip} must be > 0 or None (no clipping)")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"optim.ema_decay={self.ema_decay} must be in [0, 1) (0: off; e.g. 0.999)")
        if self.accum_steps < 1:
            raise ValueError(f"optim.accum_steps={self.accum_steps} must be >= 1")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"optim.label_smoothing={self.label_smoothing} must be in [0, 1)")


@dataclass
class RunConfig:
    # run folder: <out_dir>/<name>/ (metrics.jsonl, tensorboard, checkpoints, plot)
    name: str = declare("run", SAFE)
    out_dir: str = declare("runs", SAFE)  # parent folder of all runs
    epochs: int = declare(18, REPLAN, Bounds(1, 10**6))  # passes over the training split (seeds: 18)
    # stop after this many optimizer steps in total (None: epochs decide)
    max_steps: int | None = declare(None, REPLAN, Bounds(1, MAX_COUNT))
    # smoke runs: an "epoch" is the first N micro-batches of the epoch's shuffled plan (a different random
    # subset every epoch); None = the whole training split, the honest definition
    max_batches_per_epoch: int | None = declare(None, REPLAN, Bounds(1, MAX_COUNT))
    # stop at a step boundary once this many seconds have passed since process start, then evaluate (the
    # frontier benchmark's equal-wall-time budget); the schedule is still planned for `epochs`
    max_wall_seconds: float | None = declare(None, SAFE, Bounds(0, 10**9, lo_open=True))
    # torch/numpy/python seed for init and dropout (data order has data.seed)
    seed: int = declare(0, RNG_STATE, SEED)
    device: Literal["auto", "cuda", "cpu"] = declare("auto", SAFE)  # auto: cuda when available
    # CPU runs: torch.set_num_threads(n); None = torch's default: every physical core this process may use
    # (its CPU affinity), or $OMP_NUM_THREADS when set
    cpu_threads: int | None = declare(None, SAFE, Bounds(1, MAX_THREADS, machine="cores", why=RESOURCE))
    # CPU runs: adapt the thread count while training, down to 1 while other programs use the cores (never above
    # cpu_threads; train/cpu_threads.py); false keeps it fixed
    cpu_adapt: bool = declare(True, SAFE, since=7)
    precision: Precision = declare("bf16", PRECISION)  # autocast dtype; fp16 adds a GradScaler; fp32 = no autocast
    compile: bool | None = declare(None, SAFE)  # torch.compile the training forward; None: on for CUDA, off for CPU
    # "blocks": regional compilation, one compiled code object per block type (reused by every layer and
    # shared block) plus the loss; "model": the whole loss module as one graph
    compile_scope: Literal["blocks", "model"] = declare("blocks", SAFE)
    # reduce-overhead: CUDA graphs (replays with no per-kernel host cost; needs static shapes: packed batches)
    compile_mode: CompileMode = declare("default", SAFE)
    compile_backend: str = declare("inductor", SAFE)  # torch.compile backend ("aot_eager" in CPU tests)
    # None: automatic dynamic (a dim seen changing turns symbolic: ~2 graphs for token buckets, whose
    # B, S and T all vary); False: one graph per (B, S, T), sensible only with fixed padding.
    compile_dynamic: bool | None = declare(None, SAFE)
    # the whole training step (forward, backward, clip, guard, update) as one CUDA graph per batch shape, fed
    # through static buffers (train/graph_step.py); None: on for CUDA where it applies (packed, no DDP/fp16),
    # off on the CPU; true on the CPU runs the same static-buffer step eagerly
    step_graph: bool | None = declare(None, SAFE, since=6)
    # persistent Inductor / Triton caches (a warm start compiles in seconds); they hold code, so private: ""
    # is $XDG_CACHE_HOME/fastmt/compile (else ~/.cache/fastmt/compile, mode 0700); a folder others can write is refused
    cache_dir: str = declare("", SAFE)
    # host sync: the loss and the skipped-step counters are read every N optimizer steps
    log_every: int = declare(50, SAFE, Bounds(1, MAX_COUNT))
    # skip steps with a non-finite loss or gradient, decided on the device (no sync)
    nonfinite_guard: bool = declare(True, SAFE)
    # stop (with a checkpoint) after this many non-finite steps in a row (checked at logs)
    max_nonfinite: int = declare(5, SAFE, Bounds(1, 10**6))
    # epoch checkpoints kept besides best.pt (older ones deleted)
    keep_last: int = declare(2, SAFE, Bounds(1, 10**4, why="checkpoints kept on disk"))
    # accelerator peak for MFU; None: the table in models/flops.py (none on CPU)
    peak_flops: float | None = declare(None, SAFE, Bounds(0, 1e21, lo_open=True))
    tensorboard: bool = declare(True, SAFE)  # also write TensorBoard scalars under the run folder
    progress: bool = declare(True, SAFE)  # tqdm progress bar (rank 0)
    plot: bool = declare(True, SAFE)  # write curves.png (loss and BLEU by epoch) at the end

    def __post_init__(self):
        require_finite(self, "run")
        validate_run_name(self.name)
        if self.epochs < 1:
            raise ValueError(f"run.epochs={self.epochs} must be >= 1")
        for name in ("max_steps", "max_batches_per_epoch"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"run.{name}={v} must be >= 1 or None")
        if self.max_wall_seconds is not None and self.max_wall_seconds <= 0:
            raise ValueError(f"run.max_wall_seconds={self.max_wall_seconds} must be > 0 or None")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"run.cpu_threads={self.cpu_threads} must be >= 1 or None")
        for name in ("log_every", "max_nonfinite", "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"run.{name}={getattr(self, name)} must be >= 1")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ValueError(f"run.peak_flops={self.peak_flops} must be > 0 or None")


@dataclass
class EvalConfig:
    every: int = declare(1, SAFE, Bounds(1, 10**6))  # evaluate after every N epochs (and always after the last one)
    valid_loss: bool = declare(True, SAFE)  # un-smoothed validation loss (one forward pass over the valid split)
    # decoding for validation BLEU during training (test: beam)
    decode: Literal["beam", "greedy"] = declare("beam", SAFE)
    # beam size for validation/test BLEU
    beam_size: int = declare(4, SAFE, Bounds(1, MAX_BEAM, why="hypotheses per sentence, allocated together"))
    # validation sentences decoded for BLEU/chrF, N spread evenly over the split (None: all); test: all
    max_sentences: int | None = declare(500, SAFE, Bounds(1, MAX_COUNT))
    # sentences per decoding batch
    batch_size: int = declare(128, SAFE, Bounds(1, MAX_DECODE_BATCH, why="sentences decoded at once"))
    # decoding max length = a * source length + b
    max_len_a: float = declare(1.5, SAFE, Bounds(0, 16, why="tokens decoded per source token"))
    max_len_b: int = declare(10, SAFE, Bounds(0, MAX_LENGTH))  # see max_len_a
    length_penalty: float = declare(0.6, SAFE, Bounds(0, 100))  # GNMT length penalty alpha of beam search
    # CUDA: replay each decoding step as a CUDA graph (fixed shapes; captured once)
    cuda_graphs: bool = declare(True, SAFE, since=2)
    # the objective: wall seconds from process start to the first validation BLEU >= each threshold
    bleu_thresholds: tuple[float, ...] = declare((20.0, 28.0, 35.0, 37.0, 37.6), SAFE, Bounds(0, 100))
    # early stop after this many evaluations without a new best (None: off)
    patience: int | None = declare(None, SAFE, Bounds(1, 10**6))
    # what best.pt maximises (bleu) / minimises (loss)
    best_metric: Literal["bleu", "valid_loss"] = declare("bleu", BEST_SO_FAR)
    # at the end, average the weights of the last K epoch checkpoints and keep the average as best.pt if its
    # validation BLEU beats the best single checkpoint (0: off; needs run.keep_last >= K)
    average_last: int = declare(0, SAFE, Bounds(0, 10**4), since=2)
    # score the whole test split (BLEU/chrF/loss) with best.pt's weights at the end
    test_at_end: bool = declare(True, SAFE)
    num_samples: int = declare(3, SAFE, Bounds(0, 1000))  # sample translations printed per evaluation

    def __post_init__(self):
        require_finite(self, "eval")
        for name in ("every", "beam_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"eval.{name}={getattr(self, name)} must be >= 1")
        if self.max_sentences is not None and self.max_sentences < 1:
            raise ValueError(f"eval.max_sentences={self.max_sentences} must be >= 1 or None")
        if self.average_last < 0 or self.average_last == 1:
            raise ValueError(f"eval.average_last={self.average_last} must be 0 (off) or >= 2")
        if self.patience is not None and self.patience < 1:
            raise ValueError(f"eval.patience={self.patience} must be >= 1 or None")
        if self.num_samples < 0 or self.max_len_b < 0 or self.max_len_a < 0 or self.length_penalty < 0:
            raise ValueError("eval.num_samples, max_len_a, max_len_b and length_penalty must be >= 0")
        if list(self.bleu_thresholds) != sorted(self.bleu_thresholds):
            raise ValueError(f"eval.bleu_thresholds={self.bleu_thresholds} must be increasing, e.g. 20,28,35")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)  # corpus, split, tokenizer, batching (data/)
    model: ModelConfig = field(default_factory=ModelConfig)  # architecture (models/)
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer, schedule, loss
    run: RunConfig = field(default_factory=RunConfig)  # loop, precision, compile, logging, checkpoints
    eval: EvalConfig = field(default_factory=EvalConfig)  # validation, BLEU thresholds, early stop, test

    def __post_init__(self):
        from train.fields import check_bounds, inf_ok

        # the data and model sections validate themselves; non-finite floats are refused here for them
        require_finite(self.data, "data", inf_ok(type(self)))
        require_finite(self.model, "model", inf_ok(type(self)))
        check_bounds(self)  # every field's declared bounds (data/declare.py), whatever the source of its value
        check_consistency(self)
        # activation checkpointing recomputes a block's forward inside the backward; under torch's CUDA-graph
        # trees that replay sees tensors die that the recording kept (pytorch#154306, open in 2.11-2.13): the
        # first step fails on the GPU, after the data and the compile. Refused here, before any side effect.
        if self.model.checkpointing and self.run.compile is not False and uses_cuda_graphs(self.run):
            raise ValueError(
                f"model.checkpointing=true cannot run under CUDA graphs (run.compile_mode={self.run.compile_mode!r}, "
                f"run.compile_backend={self.run.compile_backend!r}): torch's CUDA-graph trees fail on recomputed "
                f"activations (pytorch#154306); use --run.compile_mode default with it, or --model.checkpointing false")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def record(self) -> dict[str, Any]:
        """What fastmt writes of this config (config.json, a checkpoint's, --print-config): ``to_dict()`` and the
        config format it is written in (data/declare.py: field provenance)."""
        from train.fields import config_record

        return config_record(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "", base: Config | None = None) -> Config:
        """Inverse of ``to_dict`` (checkpoints, provenance, ``--config`` files); unknown keys and wrong types
        fail naming the key and ``where`` (e.g. the file). ``base``: the values of fields ``d`` leaves out
        (without it a missing section or field takes the dataclass default)."""
        at = f"{where}: " if where else ""
        if not isinstance(d, dict):
            raise TypeError(f"{at}a config is a JSON object of sections, got {type(d).__name__}")
        if FORMAT_KEY in d:  # the format it was written in (data/declare.py): checked, not a section
            from train.fields import record_format

            record_format(cls, d, where or "config")
            d = {k: v for k, v in d.items() if k != FORMAT_KEY}
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            from train.fields import did_you_mean

            hint = did_you_mean(unknown[0], names) or f"; sections are {', '.join(names)}"
            raise ValueError(f"{at}unknown section {unknown[0]!r}{hint}")
        from train.fields import field_infos

        choices: dict[str, dict[str, Any]] = {}
        for info in field_infos(cls).values():
            if info.choices is not None:
                choices.setdefault(info.section, {})[info.name] = info.choices
        sections = {}
        for f in dataclasses.fields(cls):
            section_cls = resolved_hints(cls)[f.name]
            values = d.get(f.name, {})
            if base is not None and isinstance(values, dict):
                values = {**dataclasses.asdict(getattr(base, f.name)), **values}
            sections[f.name] = build_dataclass(section_cls, values, f.name, where=where,
                                               choices=choices.get(f.name))
        try:
            return cls(**sections)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{at}{e}") from None


def positions_needed(data: DataConfig) -> int:
    """The longest sequence (tokens, padding included) the model is fed under ``data``'s batching."""
    if data.batching == "fixed":
        return data.seq_len
    if data.batching == "packed":
        return data.max_len
    return -(-data.max_len // data.pad_multiple) * data.pad_multiple


def check_layout(model: ModelConfig, data: DataConfig) -> None:
    """The model's layout reads the batches the data makes (``ValueError`` naming both fields and the fix): the
    one check of it, part of ``check_consistency`` (which ``Config.__post_init__`` and the Trainer run)."""
    if (model.layout == "packed") != (data.batching == "packed"):
        raise ValueError(
            f"model.layout={model.layout!r} and data.batching={data.batching!r} do not fit: the packed layout reads "
            f"packed token streams and only it can: set both (--data.batching packed --model.layout packed) "
            f"or neither (e.g. --data.batching token_bucket --model.layout padded)")


def check_consistency(cfg: Config) -> None:
    """Settings that are valid alone but conflict with another section's (and would only fail, or silently
    do the wrong thing, once training ran): one ``ValueError`` naming both fields and the fix."""
    d, m, r, e = cfg.data, cfg.model, cfg.run, cfg.eval
    check_layout(m, d)
    need = positions_needed(d)
    if m.max_positions < need:
        what = {"fixed": f"data.seq_len={d.seq_len}", "packed": f"data.max_len={d.max_len}"}.get(
            d.batching, f"data.max_len={d.max_len}" + (f" rounded up to data.pad_multiple={d.pad_multiple}"
                                                        if d.pad_multiple > 1 else ""))
        raise ValueError(
            f"model.max_positions={m.max_positions} is shorter than the longest sequence the data gives, {need} "
            f"({what}, batching {d.batching!r}): pass --model.max_positions {need}, or lower {what.split('=')[0]}")
    if e.average_last > r.keep_last:
        raise ValueError(f"eval.average_last={e.average_last} needs run.keep_last >= {e.average_last} (got "
                         f"{r.keep_last}): pass --run.keep_last {e.average_last}")
    if e.best_metric == "valid_loss" and not e.valid_loss:  # else no best.pt is ever written
        raise ValueError("eval.best_metric='valid_loss' needs eval.valid_loss=true (it is the metric best.pt "
                         "keeps): pass --eval.valid_loss true or --eval.best_metric bleu")


def load_config_file(path: str | Path, base: Config | None = None, log=None) -> Config:
    """The ``Config`` of a JSON file as ``--print-config`` (and each run folder's ``config.json``) writes it.
    Fields the file leaves out take ``base``'s values (the ``--preset``); without a base a hand-written file must
    give every field, and a run folder's own ``config.json`` has each field it lacks judged by its provenance
    (``train.fields.provenance``): the value the run's checkpoint records, else (a field newer than the file's
    config format) its declared default, said in one line to ``log``, else refused. Errors name the file and the
    key (``ValueError``/``TypeError``) or the line (bad JSON)."""
    from data.files import RECORD_MAX, FileRefusedError, read_text

    path = Path(path)
    try:  # the one reader: a regular file (a FIFO or /dev/zero named here is refused), at most RECORD_MAX bytes
        text = read_text(path, "--config", limit=RECORD_MAX)  # an editor's byte-order mark is not an error
    except FileNotFoundError:
        raise ValueError(f"--config {path}: no such file (write one with --print-config > {path.name})") from None
    except FileRefusedError as e:
        raise ValueError(" ".join(str(e).split())) from None
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    try:  # a key given twice is refused (JSON would keep the last silently)
        d = json.loads(text, object_pairs_hook=unique_keys(path))
    except DuplicateKeyError:
        raise
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); a config file is what "
                         f"--print-config writes") from None
    except (RecursionError, MemoryError, ValueError):  # (a number past Python's digit limit is a ValueError)
        raise ValueError(f"{path}: nested too deeply or too large to be a config (a config file is what "
                         f"--print-config writes)") from None
    if base is None and isinstance(d, dict):
        for s in dataclasses.fields(Config):  # a section that is not an object: said as such, before what it lacks
            if s.name in d and not isinstance(d[s.name], dict):
                raise ValueError(f"{path}: {s.name} must be an object of fields, got {type(d[s.name]).__name__}: "
                                 f"{d[s.name]!r}")
        missing = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
                   for f in dataclasses.fields(resolved_hints(Config)[s.name])
                   if not isinstance(d.get(s.name), dict) or f.name not in d[s.name]]
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        if missing and path.name == "config.json" and _in_run_folder(path):
            # a run's own record: each field it lacks by its provenance (train/fields.py): the value the run's
            # checkpoint records, a field newer than the file its declared default, else refused in one line
            from train.fields import provenance
            from train.runs.records import run_checkpoint_config

            d = provenance(Config, d, str(path), others=run_checkpoint_config(path.parent), log=log,
                           fix=f"add it to {path} (the value the run trained with), or add --preset P to take the "
                               f"preset's value")
        elif missing:
            raise ValueError(f"{path}: no value for {shown}: give every field (what --print-config writes) or "
                             f"add --preset P to take the preset's values for the fields the file leaves out")
    return Config.from_dict(d, where=str(path), base=base)


def _in_run_folder(path: Path) -> bool:
    """``path`` is the ``config.json`` of a folder that looks like a fastmt run: a run marker, metrics or checkpoints
    beside it (judged by name only: whether the folder is a run fastmt may write, and whether its marker is sound, is
    decided later, by the run folder's own checks; a missing field is only judged by its provenance here)."""
    return any(os.path.lexists(path.parent / name) for name in ("run.json", "metrics.jsonl", "checkpoints"))


# torch.compile modes that replay compiled regions as CUDA graphs (torch._inductor.list_mode_options(mode) sets
# "triton.cudagraphs"; tests/train/test_cuda_graph_config.py checks this against the installed torch)
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def uses_cuda_graphs(run: RunConfig) -> bool:
    """Whether ``run``'s compile settings (when compiling on CUDA) replay compiled regions as CUDA graphs."""
    if run.compile_backend == "cudagraphs":  # torch's CUDA-graph-trees backend without Inductor
        return True
    return run.compile_backend == "inductor" and run.compile_mode in CUDA_GRAPH_MODES


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------


def _replace(obj, **changes):
    """``dataclasses.replace`` that names the class when a preset sets a field that does not exist."""
    names = {f.name for f in dataclasses.fields(obj)}
    bad = sorted(set(changes) - names)
    if bad:
        raise AttributeError(f"{type(obj).__name__} has no field(s) {bad}; valid: {sorted(names)}")
    return dataclasses.replace(obj, **changes)


def tiny() -> Config:
    """CPU smoke run: the 2+2 x 64 model, fp32 eager, a few minutes on 2 shared cores.

    A full epoch of the stand-in corpus is ~1M tokens, so an "epoch" here is capped at 100 batches of
    <= 4096 padded tokens (a fresh random subset each epoch): ~1.5 passes over the data in all.
    """
    return Config(
        # the stand-in corpus (23k short pairs): 1000-piece BPE, pairs up to 64 tokens, no worker processes
        data=_replace(DataConfig(), vocab_size=1000, max_len=64, max_tokens=4096, pad_multiple=1,
                      valid_size=500, test_size=500, num_workers=0),
        model=get_preset("tiny"),
        optim=OptimConfig(name="adamw", lr=3e-3, betas=(0.9, 0.98), weight_decay=1e-2, pct_start=0.2),
        run=RunConfig(
            # cpu_threads stays None (every physical core): an epoch took 10.2 s with 2 threads against 13.1 s
            # with 1 on a 2-core machine (issue 23); the tests pin one thread themselves
            name="tiny", epochs=5, max_batches_per_epoch=100, precision="fp32", compile=False, log_every=10,
        ),
        eval=EvalConfig(beam_size=2, max_sentences=100, batch_size=100, num_samples=2),
    )


def s18() -> Config:
    """The S18 seed's model and optimiser (6+6, d_model 512, Lion 1e-4 OneCycle), on our data path."""
    return Config(
        data=DataConfig(),
        model=get_preset("s18"),
        optim=OptimConfig(name="lion", lr=1e-4, weight_decay=1e-2, pct_start=0.28),
        run=RunConfig(name="s18", epochs=18, precision="bf16"),
    )


def s16() -> Config:
    """The S16 seed's shared model (3+3 unique blocks, cycle_rev, d_ff 128), three-phase OneCycle."""
    return Config(
        data=DataConfig(),
        model=get_preset("s16"),
        optim=OptimConfig(name="lion", lr=1e-4, weight_decay=1e-2, pct_start=0.1, three_phase=True),
        run=RunConfig(name="s16", epochs=18, precision="bf16"),
    )


def fast() -> Config:
    """The default on one GPU: the fastest measured route to validation BLEU (wall time, not tokens/s).

    bf16; packed token streams of 4,096 tokens (one static shape: one compiled graph per region and
    CUDA graphs); varlen Triton attention and fused norms; whole-model compilation with persistent caches, the
    whole step one CUDA graph (run.step_graph);
    AdamW 5e-4 (betas 0.9/0.98, weight decay 0.01) with OneCycle warm-up 10 %. On an H100 (stand-in
    corpus, 2026-11-23, ../shared/gpu/PEERS.md) this recipe reached valid BLEU 37.0 where Lion 1e-4
    peaked at 35.6 and Lion 3e-4 at 16k-token batches at 4.3: the optimiser recipe, not the kernels,
    decided quality. Lion stays one switch away: --optim.name lion --optim.lr 1e-4 --optim.weight_decay 0.1.
    """
    return Config(
        data=_replace(DataConfig(), batching="packed", max_tokens=4096, num_workers=2),
        model=_replace(get_preset("s18"), attn_backend="auto", norm="fused", layout="packed"),
        optim=OptimConfig(name="adamw", lr=5e-4, betas=(0.9, 0.98), weight_decay=0.01, pct_start=0.1),
        # one compiled region for the whole model + loss: the step graph's forward (train/graph_step.py; the CPU
        # audit, bench/step.py: 3 regions a step against 11 with "blocks"); reduce-overhead where it falls back
        run=RunConfig(name="fast", epochs=18, precision="bf16", compile=True, compile_scope="model",
                      compile_mode="reduce-overhead"),
        eval=EvalConfig(),
    )


def baseline() -> Config:
    """Seed-faithful rung 0 of the ladder: fp32, fixed padding to 350, eager, Adam 1e-4, plain PyTorch."""
    return Config(
        data=_replace(DataConfig(), batching="fixed", seq_len=350, batch_size=32, max_len=350,
                      max_tokens=32 * 2 * 350),
        model=_replace(get_preset("s18"), attn_backend="reference", norm="torch", layout="padded"),
        optim=OptimConfig(name="adam", lr=1e-4, betas=(0.9, 0.98), weight_decay=0.0, grad_clip=None),
        run=RunConfig(name="baseline", epochs=18, precision="fp32", compile=False),
    )


PRESETS = {"tiny": tiny, "s18": s18, "s16": s16, "fast": fast, "baseline": baseline}


__all__ = ["Config", "OptimConfig", "RunConfig", "EvalConfig", "PRESETS", "get_config", "apply_overrides",
           "load_config_file", "check_consistency", "check_layout"]


def get_config(preset: str) -> Config:
    """The preset's Config; an unknown name lists the valid ones."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]()

