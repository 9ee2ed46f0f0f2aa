"""One declaration per config field: its default, numeric bounds and resume class, beside its type and comment.

Every field of the config dataclasses (``data/config.py``, ``models/config.py``, ``train/config.py``) is written

    max_len: int = declare(256, EPOCH, Bounds(2, MAX_LENGTH))  # drop train pairs with either side longer than this

- the **type** is the annotation; a closed set of strings is a ``Literal`` (its choices);
- the **help** is the field's own comment (the trailing one, else the comment lines right above it);
- the **bounds** (`Bounds`) are checked for every source of a value: the command line, ``--config``, a run's
  ``config.json``, a checkpoint, an export's record;
- the **resume class** (`Resume`) says whether a run continued from a checkpoint may change the field: `SAFE`
  (applied from the next step), `REPLAN` (the optimizer's groups rewritten, the schedule re-planned), `EPOCH`
  (the batch plan: re-planned at an epoch boundary, refused mid-epoch), `DERIVED` (set from the tokenizer,
  never compared) or `refused(why)`;
- ``was=``: the default before it changed, for a field whose default changed (a run that holds the old value
  keeps it when continued, ``train/runs/start.py``);
- ``since=``: the config format (`CONFIG_FORMAT`) the field appeared in (1: it was there from the start).

``train/fields.py`` (``--help-fields``, ``BOUNDS``, choices), ``train/runs/resume.py`` (what a resume may change)
and the tests read these declarations; nothing else lists fields.

**Field provenance.** Every config a run writes (its ``config.json``, each checkpoint's ``config``, ``--print-config``)
records the format it was written in (``"format": CONFIG_FORMAT``, beside the sections). A record that lacks a field
is judged by that format (``train/fields.py: provenance``, one reader for train, translate, evaluate and export):
a field newer than the record (``since`` > its format) did not exist when it was written and takes its declared
default, said in one line; a field that existed then is taken from another record of the same run (the checkpoint
for its ``config.json``, the ``config.json`` for its checkpoint) and is otherwise refused in one line naming the
file and the field. Files written before formats were recorded (fastmt up to e40d846) carry none: their format is
the newest ``since`` among the fields they hold (`FORMATS` says what each format added).

Stdlib only, and in ``data/``: the lowest package the three config modules share (``models/`` and ``data/`` import
nothing from ``train/``, tests/test_imports.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

_MISSING = dataclasses.MISSING
KEY = "fastmt"  # the dataclass field metadata key of a declaration

# The config format: bump it when a field is added, and declare the new field with ``since=`` the new number.
CONFIG_FORMAT = 7
FORMAT_KEY = "format"  # the key of a config record (beside its sections) that holds the format it was written in
FORMATS = {  # what each format added (formats 1-4 are those of fastmt before formats were recorded, by date)
    1: "the fields of fastmt at 57e30c7 (2026-11-23): the oldest run folders fastmt reads",
    2: "eval.cuda_graphs, eval.average_last (2026-11-23)",
    3: "data.build_workers, data.split_grouping, data.spm_sample_pairs, data.valid_files, data.test_files (2026-11-24)",
    4: "model.norm_kind (2026-11-27)",
    5: "no field: the first format recorded in the files themselves",
    6: "run.step_graph, optim.ema_decay (2026-11-28)",
    7: "run.cpu_adapt (2026-11-28)",
}


@dataclasses.dataclass(frozen=True)
class Bounds:
    lo: float | None = None  # smallest value allowed (None: no lower bound)
    hi: float | None = None  # largest value allowed (None: no upper bound)
    lo_open: bool = False  # the value must be > lo (not >= lo)
    hi_open: bool = False  # the value must be < hi
    # a resource the machine limits: "cores" = also at most the cores this process may use, applied where the value
    # is used (`machine_capped`: a checkpoint written on a larger machine still loads here)
    machine: str | None = None
    why: str = ""  # what the upper bound protects, said when a value is refused
    inf_ok: str = ""  # a float field where an infinite value has this meaning (else inf is refused as NaN is)

    def problem(self, v: float) -> str | None:
        """Why ``v`` is out of range (None: in range)."""
        if self.lo is not None and (v < self.lo or self.lo_open and v == self.lo):
            return f"must be {'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None and (v > self.hi or self.hi_open and v == self.hi):
            return f"must be {'<' if self.hi_open else '<='} {self.hi:g}" + (f" ({self.why})" if self.why else "")
        return None

    def text(self) -> str:
        """The range as ``--help-fields`` shows it, e.g. ``[1, 64]``, ``(0, 1)``, ``>= 0``."""
        if self.lo is not None and self.hi is not None:
            return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'<' if self.hi_open else '<='} {self.hi:g}" if self.hi is not None else ""


MAX_THREADS = 1024  # threads a run or a decoding may ask for (and never more than the machine's cores)
MAX_WORKERS = 64  # DataLoader worker processes (each a forked copy of the process)
MAX_BUILD_WORKERS = 256  # processes of a cold data build
MAX_LAYERS = 1024  # applied layers per stack: far above any model fastmt trains
MAX_BEAM = 64  # decoding beam
MAX_DECODE_BATCH = 4096  # sentences per decoding batch
MAX_HYPOTHESES = 8192  # beam x decoding batch: hypotheses decoded at once (their logits are allocated together)
MAX_LENGTH = 2**16  # tokens of a sequence (max_len, seq_len, a decoding's length bonus)
MAX_POSITIONS = 2**20  # the model's position table
MAX_VOCAB = 2**20  # SentencePiece pieces
MAX_WIDTH = 2**16  # d_model
MAX_FF = 2**18  # d_ff
MAX_BATCH_TOKENS = 2**22  # a batch's token budget
MAX_COUNT = 10**12  # steps, rows, sentences
SEED = Bounds(-(2**63), 2**64 - 1, why="a 64-bit seed")
RESOURCE = "a resource of this machine"


@dataclasses.dataclass(frozen=True)
class Resume:
    """Whether a run continued from a checkpoint (``--resume``) may change a field, and how."""

    kind: str  # "safe" | "replan" | "epoch" | "derived" | "refuse"
    why: str = ""  # refuse: why the change cannot be applied (said with the refusal)
    # safe fields refused only when the old or the new value is one of these (run.precision: fp16's loss scaler)
    refuse_values: tuple[Any, ...] = ()

    def classify(self, old: Any, new: Any, *, epoch_boundary: bool) -> str:
        """"safe", "replan" or "refuse" for a change from ``old`` to ``new``."""
        if self.kind == "safe":
            return "refuse" if any(v in self.refuse_values for v in (old, new)) else "safe"
        if self.kind == "replan" or (self.kind == "epoch" and epoch_boundary):
            return "replan"
        return "refuse"


KINDS = ("safe", "replan", "epoch", "derived", "refuse")
SAFE = Resume("safe")  # applied from the next step or evaluation on; listed in the log and the resume record
REPLAN = Resume("replan")  # the optimizer's groups rewritten and the schedule re-planned from the current step
EPOCH = Resume("epoch", "the checkpoint is mid-epoch: the position indexes this batch plan")  # re-planned at an epoch boundary
DERIVED = Resume("derived")  # set from the tokenizer, never by the user: not compared
ARCH = Resume("refuse", "the weights have this architecture")


def refused(why: str) -> Resume:
    """A field a resume may not change, and why (said with the refusal)."""
    return Resume("refuse", why)


@dataclasses.dataclass(frozen=True)
class Declaration:
    resume: Resume
    bounds: Bounds | None = None
    was: tuple[Any, ...] = ()  # (the default before it changed,) for a field whose default changed; else ()
    since: int = 1  # the config format the field appeared in (`CONFIG_FORMAT`, `FORMATS`)


def declare(default: Any = _MISSING, resume: Resume | None = None, bounds: Bounds | None = None, *,
            factory: Callable[[], Any] | None = None, was: Any = _MISSING, since: int = 1) -> Any:
    """A dataclass field with its default (or ``factory``), its resume class, its bounds and the config format it
    appeared in (module docstring)."""
    if not isinstance(resume, Resume):
        raise TypeError(f"declare: every field needs its resume class (SAFE, REPLAN, EPOCH, DERIVED, refused(why)), "
                        f"got {resume!r}")
    if not (type(since) is int and 1 <= since <= CONFIG_FORMAT):
        raise TypeError(f"declare: since={since!r} must be a config format 1..{CONFIG_FORMAT} (a new field: bump "
                        f"data.declare.CONFIG_FORMAT and declare since= the new number)")
    meta = {KEY: Declaration(resume, bounds, () if was is _MISSING else (was,), since)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def declaration(f: dataclasses.Field) -> Declaration | None:
    """The declaration of a dataclass field (None: a field written without `declare`)."""
    return f.metadata.get(KEY)


def default_of(f: dataclasses.Field) -> Any:
    """A field's declared default (its factory called)."""
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return _MISSING
