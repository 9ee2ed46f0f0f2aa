"""Decoding text with a model: the batched beam-search / greedy ``translate`` behind validation BLEU, the test split,
``fastmt translate`` and ``fastmt evaluate``; ``Decoding``, the one definition of a command's decoding options, whose
defaults are a checkpoint's own ``eval`` settings and its ``run.precision`` (``DECODING_DEFAULTS`` for a checkpoint
without them): translating or scoring with a run's ``best.pt`` reproduces what the run reported.

Sources are tokenised once: ``encode_sources`` gives the encoder inputs (cut to the model's positions, + EOS) and,
when asked, the sentences it cut; ``translate`` takes those inputs as they are.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from train import cpu_threads

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Decoding:
    """How a command decodes: beam search (``beam_size`` 1 = greedy) and the length limit
    ``floor(max_len_a * source tokens + max_len_b)``, in batches under an autocast ``precision``."""

    beam_size: int  # hypotheses kept per sentence (1: greedy)
    length_penalty: float  # GNMT length penalty alpha of beam search
    max_len_a: float  # generated tokens <= max_len_a * source tokens (incl. EOS) + max_len_b
    max_len_b: int  # see max_len_a
    batch_size: int  # sentences per decoding batch
    precision: str  # autocast dtype while decoding: fp32 (none), bf16 or fp16

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self, precision: bool = True) -> str:
        """One line of the settings (``precision``: with the autocast precision, fastmt's own decoding's)."""
        return (f"beam {self.beam_size}, length penalty {self.length_penalty:g}, max length {self.max_len_a:g} x "
                f"source + {self.max_len_b}, batch {self.batch_size}" + (f", {self.precision}" if precision else ""))


# what a checkpoint without these config fields gets (train.config.EvalConfig's and RunConfig's defaults)
DECODING_DEFAULTS = {"beam_size": 4, "length_penalty": 0.6, "max_len_a": 1.5, "max_len_b": 10, "batch_size": 128,
             "precision": "fp32"}


def configure_cpu(device: torch.device, config: dict[str, Any], where: str = "the model's run config") -> None:
    """On the CPU, set up as the checkpoint's run was: denormals flushed (3x slower eager steps otherwise)
    and ``run.cpu_threads`` threads when it set them (on the shared 2-core machine, load average 3-4, decoding
    the tiny preset's 427-sentence test split of the stand-in corpus took 2.7 s on 1 thread, 29.5 s on 2)."""
    if device.type != "cpu":
        return
    from train import flush_denormals
    from train.bounds import bounded, machine_capped
    from train.errors import UserError

    flush_denormals()
    try:  # a value from a file: typed and bounded as the field is, then capped by this machine's cores
        run = config.get("run") or {}
        threads = bounded("run.cpu_threads", run.get("cpu_threads") if isinstance(run, dict) else run, where,
                          int | None)
    except ValueError as e:
        raise UserError(str(e)) from None
    if threads is not None:
        torch.set_num_threads(machine_capped("run.cpu_threads", threads))


def autocast_for(device: torch.device, precision: str):
    """The autocast context the Trainer builds for ``run.precision`` (re-enterable)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def translate_lines(model, tok, lines: list[str | None], device: torch.device, d: Decoding,
                    cuda_graph: bool = False) -> list[str]:
    """One output line per entry of ``lines``: "" for a blank line or None (an unreadable input line),
    else the translation with any line break in it printed as a space (so output line k answers input k)."""
    todo = [k for k, line in enumerate(lines) if line is not None and line.strip()]
    if hasattr(model, "translate_texts"):  # an exported CTranslate2 model (train/export/engine.py)
        hyps = model.translate_texts([lines[k] for k in todo], d)
    else:
        hyps = translate(model, tok, [lines[k] for k in todo], device, beam_size=d.beam_size,
                         batch_size=d.batch_size, max_len_ratio=d.max_len_a, max_len_extra=d.max_len_b,
                         length_penalty=d.length_penalty, autocast=autocast_for(device, d.precision),
                         cuda_graph=cuda_graph and device.type == "cuda")
    out = [""] * len(lines)
    for k, h in zip(todo, hyps):
        out[k] = " ".join(h.splitlines())  # a decoded line break would shift every later line
    return out


DECODE_MODES = ("beam", "greedy")


# source widths a batch is padded to (8 and 12 times powers of two): a validation set meets a handful
_SRC_WIDTHS = sorted({8 << k for k in range(16)} | {12 << k for k in range(16)})


_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {settings: Decoder}


def _src_width(longest: int, max_positions: int) -> int:
    return min(next(w for w in _SRC_WIDTHS if w >= longest), max_positions)


def _decoder(model, tokenizer, decode: str, beam_size: int, length_penalty: float, max_len_ratio: float,
             max_len_extra: int, cuda_graph: bool, keep: bool):
    """A Decoder for these settings; with ``keep`` the model's one for them, kept between calls: its
    per-shape buffers and CUDA graphs are built at the first evaluation and reused at the next ones."""
    from models.decoding import Decoder

    def make():
        return Decoder(model, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                       beam_size=beam_size if decode == "beam" else None, length_penalty=length_penalty,
                       max_len_ratio=max_len_ratio, max_len_extra=max_len_extra, cuda_graph=cuda_graph)

    if not keep:
        return make()
    key = (decode, beam_size if decode == "beam" else None, length_penalty, max_len_ratio, max_len_extra, cuda_graph,
           tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    per_model = _decoders.setdefault(model, {})
    if key not in per_model:
        per_model[key] = make()
    return per_model[key]


def translate(model, tokenizer, sentences: list[str], device: torch.device, *, beam_size: int = 4,
              batch_size: int = 64, max_len_ratio: float = 1.5, max_len_extra: int = 10, autocast=None,
              length_penalty: float = 0.6, decode: str = "beam", fixed_shapes: bool | None = None,
              cuda_graph: bool | None = None, stats=None, encoded: list[np.ndarray] | None = None) -> list[str]:
    """Translations of ``sentences`` by beam search (``decode="beam"``) or greedy decoding, batched
    longest first.

    ``fixed_shapes`` (None: on for CUDA devices) gives every batch one of a handful of shapes:
    ``batch_size`` rows (the last batch padded with inactive rows; fewer sentences than that: the
    next power of two, if smaller) and sources padded to the next of 8, 12, 16, 24, 32, 48, ... tokens, so that
    kernels tune, and the decoders allocate and capture, once per shape, and the model's decoder is
    kept between calls. Off, each batch is as small as its sentences allow (on the CPU, padding
    only costs). ``cuda_graph`` (None: on for CUDA devices; needs ``fixed_shapes``) replays each
    decoding step from a CUDA graph. ``stats``: a ``models.decoding.DecodeStats`` that this call's
    batches, steps and host syncs are added to. ``encoded``: the sentences' encoder inputs when the caller
    has them (``encode_sources`` with this model's positions): they are not tokenised again.
    """
    if decode not in DECODE_MODES:
        raise ValueError(f"translate: decode={decode!r} must be one of {DECODE_MODES}")
    if beam_size < 1 or batch_size < 1:
        raise ValueError(f"translate: beam_size={beam_size} and batch_size={batch_size} must be >= 1")
    fixed_shapes = device.type == "cuda" if fixed_shapes is None else fixed_shapes
    cuda_graph = fixed_shapes and device.type == "cuda" if cuda_graph is None else cuda_graph
    if cuda_graph and not fixed_shapes:
        raise ValueError("translate: cuda_graph=True needs fixed_shapes=True (one graph per batch shape)")
    if not sentences:
        return []
    max_src = model.cfg.max_positions
    if encoded is None:
        encoded = encode_sources(tokenizer, sentences, max_src)
    elif len(encoded) != len(sentences):
        raise ValueError(f"translate: {len(encoded)} encoded sources for {len(sentences)} sentences")
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    rows = min(batch_size, 1 << (len(order) - 1).bit_length())  # fewer sentences: a power of two
    decoder = _decoder(model, tokenizer, decode, beam_size, length_penalty, max_len_ratio, max_len_extra,
                       cuda_graph, keep=fixed_shapes)
    from models.decoding import Batch

    out: list[str | None] = [None] * len(sentences)
    ctx = autocast if autocast is not None else torch.autocast(device.type, enabled=False)
    batches, members = [], []
    for start in range(0, len(order), rows):
        cpu_threads.poll()  # a training's CPU thread adapter, between decoding batches (train/cpu_threads.py)
        idx = order[start : start + rows]
        lens = [len(encoded[i]) for i in idx]
        n_rows, width = (rows, _src_width(max(lens), max_src)) if fixed_shapes else (len(idx), max(lens))
        src = torch.full((n_rows, width), tokenizer.pad_id, dtype=torch.int32)
        src[len(idx) :, 0] = tokenizer.eos_id  # padding rows: an empty source, decoded to nothing
        for row, i in enumerate(idx):
            src[row, : lens[row]] = torch.from_numpy(encoded[i])
        host_lengths = lens + [1] * (n_rows - len(idx))
        src_lengths = torch.tensor(host_lengths, dtype=torch.int32)
        active = torch.arange(n_rows) < len(idx)
        batches.append(Batch(src.to(device, non_blocking=True), src_lengths.to(device, non_blocking=True),
                             active.to(device, non_blocking=True), host_lengths))
        members.append(idx)
    with ctx:  # the eager decoder overlaps a batch's last sentences with the next batch; the static one does not
        answers = decoder.decode_batches(batches, stats=stats)
    for idx, hyps in zip(members, answers):
        for i, text in zip(idx, tokenizer.decode(hyps[: len(idx)])):
            out[i] = text
    return out  # type: ignore[return-value]


def encode_sources(tokenizer, sentences: list[str], max_positions: int,
                   cut: list[tuple[int, int]] | None = None) -> list[np.ndarray]:
    """Encoder inputs: each sentence's subwords, cut to ``max_positions - 1``, + EOS (as in training).
    ``cut``: a list that gets ``overlong``'s (index, tokens incl. EOS) of each sentence cut, from this one
    tokenisation."""
    eos = np.int32(tokenizer.eos_id)
    out = []
    for i, ids in enumerate(tokenizer.encode(sentences)):
        if cut is not None and len(ids) + 1 > max_positions:
            cut.append((i, len(ids) + 1))
        out.append(np.append(ids[: max_positions - 1], eos))
    return out


def overlong(tokenizer, sentences: list[str], max_positions: int) -> list[tuple[int, int]]:
    """(index, tokens incl. EOS) of each sentence longer than ``max_positions``: the encoder reads only its
    first ``max_positions - 1`` tokens + EOS (``encode_sources`` cuts the rest)."""
    lengths = [len(ids) + 1 for ids in tokenizer.encode(sentences)]
    return [(i, n) for i, n in enumerate(lengths) if n > max_positions]
