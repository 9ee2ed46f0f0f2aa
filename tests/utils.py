"""Helpers shared by the test packages (the fixtures are in tests/conftest.py).

- Tiny training runs on the product's one toy data setting (``data.config.toy``) and its tiny preset
  (``train.config.tiny``), and the Trainer pieces the train tests share.
- Batches shaped like ``data.Batch`` (padded and packed) from random tokens, small models, and the
  comparisons of logits, gradients, parameters and decoded hypotheses.
- Instruments that count host read-backs and aten ops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from data import DataConfig
from data.config import toy
from data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from models import ModelConfig, Transformer
from train.config import Config, EvalConfig, tiny
from train.loop import Trainer

PAD, UNK, BOS, EOS = PAD_ID, UNK_ID, BOS_ID, EOS_ID  # the tokenizer's special ids
VOCAB = 40  # vocabulary of the random-token batches and small models


def quiet(*_args) -> None:
    """A ``log=`` that drops every message."""


def without_warnings(err: str) -> str:
    """``err`` less its ``warning: ...`` lines: what a test of a one-line error asserts on. A busy machine (load
    above the cores) or a GPU preset on a CPU adds warnings before any setup error, so a test that reads the first
    line of stderr fails on a shared machine."""
    return "".join(line for line in err.splitlines(keepends=True) if not line.startswith("warning: "))


@contextlib.contextmanager
def torch_threads(n: int = 1):
    """``torch.set_num_threads(n)`` inside the block, the previous setting after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------
# Tiny training runs on the toy data
# ----------------------------------------------------------------------------------------------
def toy_data(tmp: Path, **changes) -> DataConfig:
    """The product's toy data setting, its cache (tokenizer, arrays, the generated corpus) under ``tmp``."""
    return toy(**{"cache_dir": str(Path(tmp) / "cache"), **changes})


TINY_MODEL = dict(d_model=32, n_heads=2, d_ff=64, max_positions=64)  # the tiny preset's model, smaller


def tiny_config(tmp: Path, *, name: str = "t", model: dict | None = None, optim: dict | None = None,
                data: dict | None = None, **changes) -> Config:
    """The tiny preset on the toy data with a 2+2 x 32 model, two whole epochs, quiet (no progress bar,
    TensorBoard or plot), 16 sentences decoded per evaluation, no test split, every output under ``tmp``.
    ``model``/``optim``/``data``: fields of those sections; ``changes``: RunConfig or EvalConfig fields."""
    base = tiny()
    eval_fields = {f.name for f in dataclasses.fields(EvalConfig)}
    run = dict(name=name, out_dir=str(Path(tmp) / "runs"), epochs=2, max_batches_per_epoch=None, log_every=5,
               progress=False, tensorboard=False, plot=False)
    ev = dict(max_sentences=16, num_samples=0, test_at_end=False)
    run.update({k: v for k, v in changes.items() if k not in eval_fields})
    ev.update({k: v for k, v in changes.items() if k in eval_fields})
    return Config(
        data=toy_data(tmp, **(data or {})),
        model=dataclasses.replace(base.model, **{**TINY_MODEL, **(model or {})}),
        optim=dataclasses.replace(base.optim, **(optim or {})),
        run=dataclasses.replace(base.run, **run),
        eval=dataclasses.replace(base.eval, **ev),
    )


def tiny_trainer(bundle, tmp: Path, *, cls: type[Trainer] = Trainer, resume=None, log=quiet,
                 **changes) -> Trainer:
    """``cls`` on ``tiny_config(tmp, **changes)``: it reads ``bundle`` where the data settings are the
    bundle's (the cache folder aside), else it builds its own data."""
    cfg = tiny_config(tmp, **changes)
    same = dataclasses.replace(cfg.data, cache_dir=bundle.cfg.cache_dir) == bundle.cfg
    return cls(cfg, data=bundle if same else None, resume=resume, log=log)


def signal_after_step(tr: Trainer, at: int, sig: int) -> None:
    """``tr.train_step`` sends ``sig`` to this process once optimizer step ``at`` is done, as Ctrl-C, SLURM or
    ``timeout`` would in the middle of a run."""
    step = tr.train_step

    def stepped(batches):
        loss = step(batches)
        if tr.step == at:
            os.kill(os.getpid(), sig)
        return loss

    tr.train_step = stepped


class RecordingTrainer(Trainer):
    """A Trainer that keeps every step's loss as a float in ``losses``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def train_step(self, batches):
        loss = super().train_step(batches)
        self.losses.append(loss.item())
        return loss


def first_batches(trainer: Trainer, n: int) -> list:
    """The first ``n`` training batches of epoch 0, as the trainer's loader yields them."""
    it = iter(trainer.data.loader("train", epoch=0))
    return [next(it) for _ in range(n)]


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The rows of ``run_dir``'s metrics.jsonl (those of ``kind`` only, if given)."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


# ----------------------------------------------------------------------------------------------
# Batches from random tokens (pad 0, BOS 2, EOS 3)
# ----------------------------------------------------------------------------------------------
def make_batch(src_lengths: list[int], tgt_lengths: list[int], vocab: int, seed: int = 0) -> dict:
    """src = tokens + EOS; tgt_in = BOS + tokens; tgt_out = tokens + EOS; pad 0; widths = max lengths."""
    g = torch.Generator().manual_seed(seed)
    B, S, T = len(src_lengths), max(src_lengths), max(tgt_lengths)
    src = torch.zeros(B, S, dtype=torch.int32)
    tgt_in = torch.zeros(B, T, dtype=torch.int32)
    tgt_out = torch.zeros(B, T, dtype=torch.int32)
    for b, (ls, lt) in enumerate(zip(src_lengths, tgt_lengths)):
        src[b, : ls - 1] = torch.randint(4, vocab, (ls - 1,), generator=g, dtype=torch.int32)
        src[b, ls - 1] = EOS
        words = torch.randint(4, vocab, (lt - 1,), generator=g, dtype=torch.int32)
        tgt_in[b, 0], tgt_in[b, 1:lt] = BOS, words
        tgt_out[b, : lt - 1], tgt_out[b, lt - 1] = words, EOS
    sl = torch.tensor(src_lengths, dtype=torch.int32)
    tl = torch.tensor(tgt_lengths, dtype=torch.int32)
    return dict(src=src, tgt_in=tgt_in, tgt_out=tgt_out, src_lengths=sl, tgt_lengths=tl,
                cu_seqlens_src=F.pad(sl.cumsum(0, dtype=torch.int32), (1, 0)),
                cu_seqlens_tgt=F.pad(tl.cumsum(0, dtype=torch.int32), (1, 0)),
                max_src_len=S, max_tgt_len=T)


def _segments(real: list[int], capacity: int, slots: int, max_len: int) -> torch.Tensor:
    """(N,) int32, as data's packed collate lays them out: real lengths, empty slots, then the tail
    padding cut into dummy segments of max_len (the last one holds the remainder)."""
    tail = capacity - sum(real)
    n_dummy = -(-tail // max_len)
    assert tail >= 0 and len(real) + n_dummy <= slots and max(real) <= max_len, (real, capacity, slots,
                                                                                 max_len)
    seg = torch.zeros(slots, dtype=torch.int32)
    seg[: len(real)] = torch.tensor(real, dtype=torch.int32)
    if n_dummy:
        seg[slots - n_dummy :] = max_len
        seg[-1] = tail - (n_dummy - 1) * max_len
    return seg


def pack_batch(batch: dict, capacity: tuple[int, int], slots: int, max_len: int) -> dict:
    """The padded ``batch``'s pairs as one packed batch (docs/ARCHITECTURE.md "Packed batches"):
    (1, C) streams of the sequences back to back, pad (0) in the tail, ``slots`` segments per side
    (real, empty, dummy tail), positions inside each segment (0 on the tail), max lengths = ``max_len``.
    ``real_pairs`` (not a model input) = how many leading segments are real."""
    out = dict(real_pairs=len(batch["src_lengths"]), max_src_len=max_len, max_tgt_len=max_len)
    for side, keys, C in (("src", ("src",), capacity[0]), ("tgt", ("tgt_in", "tgt_out"), capacity[1])):
        lengths = batch[f"{side}_lengths"].tolist()
        seg = _segments(lengths, C, slots, max_len)
        cu = F.pad(seg.cumsum(0, dtype=torch.int32), (1, 0))  # (N+1,), cu[-1] == C
        pos = torch.cat([torch.arange(int(n), dtype=torch.int32) for n in seg])  # (C,)
        pos[sum(lengths):] = 0
        for key in keys:
            stream = torch.zeros(1, C, dtype=torch.int32)
            stream[0, : sum(lengths)] = torch.cat([row[:n] for row, n in zip(batch[key], lengths)])
            out[key] = stream
        out.update({f"{side}_lengths": seg, f"cu_seqlens_{side}": cu, f"{side}_pos": pos[None]})
    return out


def model_inputs(batch: dict) -> dict:
    """The keyword arguments of Transformer.forward."""
    return {k: v for k, v in batch.items() if k not in ("tgt_out", "real_pairs")}


def tgt_mask(batch: dict) -> torch.Tensor:
    """(B, T) bool: real target positions; packed (1, C_tgt): the tokens of the real segments."""
    T = batch["tgt_in"].shape[1]
    if "real_pairs" in batch:
        return torch.arange(T)[None, :] < batch["cu_seqlens_tgt"][batch["real_pairs"]]
    return torch.arange(T)[None, :] < batch["tgt_lengths"][:, None]


# ----------------------------------------------------------------------------------------------
# Small models and the comparisons the tests share
# ----------------------------------------------------------------------------------------------
def small_cfg(**kw) -> ModelConfig:
    """2+2 layers, d_model 32, 2 heads, d_ff 48, no dropout, vocabulary ``VOCAB``, 32 positions."""
    base = dict(vocab_size=VOCAB, d_model=32, n_heads=2, d_ff=48, enc_layers=2, dec_layers=2, dropout=0.0,
                max_positions=32)
    return ModelConfig(**{**base, **kw})


def build(seed: int = 0, **kw) -> Transformer:
    """``Transformer(small_cfg(**kw))`` initialised from ``seed``."""
    torch.manual_seed(seed)
    return Transformer(small_cfg(**kw))


def decoding_model(vocab: int = VOCAB, seed: int = 0, **kw) -> Transformer:
    """``build`` with untied embeddings, in eval mode: the decoding tests' model."""
    return build(seed, vocab_size=vocab, tie_embeddings=False, **kw).eval()


def build_eos(vocab: int, seed: int, eos_gain: float, **kw) -> Transformer:
    """A ``decoding_model`` whose EOS logit is scaled by ``eos_gain``: EOS is likely after some prefixes
    and unlikely after others, so beams finish at different steps and some sentences hit their limit."""
    model = decoding_model(vocab, seed, max_positions=64, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # reset_parameters draws the two embeddings in the order of a set of modules, which varies
        # between processes: redraw them in a fixed order so that each case is the same everywhere
        for emb in (model.src_embed, model.tgt_embed):
            emb.weight.copy_(torch.randn(emb.weight.shape, generator=g) * model.cfg.d_model**-0.5)
        model.lm_head.weight[EOS] *= eos_gain
    return model


def clone_as(model: Transformer, **kw) -> Transformer:
    """Same weights, other switches (layout, backend, norm: none of them changes parameter names)."""
    other = Transformer(small_cfg(**{**_fields(model.cfg), **kw}))
    other.load_state_dict(model.state_dict())
    return other


def _fields(cfg: ModelConfig) -> dict:
    """Every field of ``cfg`` but those set from the tokenizer (their declarations say which)."""
    from data.declare import declaration

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if declaration(f).resume.kind != "derived"}


def logits_and_grads(model: Transformer, batch: dict, forward=None):
    """Logits at real target positions (in sentence order, either layout) and the gradients of a CE
    loss over them, by parameter name. ``forward`` replaces ``model`` for the call (a compiled model)."""
    model.zero_grad(set_to_none=True)
    logits = (model if forward is None else forward)(**model_inputs(batch))
    mask = tgt_mask(batch)
    real = logits[mask]  # (n_real, V)
    loss = F.cross_entropy(real.float(), batch["tgt_out"][mask].long())
    loss.backward()
    return real.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_by_name(a: dict, b: dict, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """Two ``{name: tensor}`` dicts hold the same names and close tensors (the name in any failure)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def assert_same(a, b, atol=1e-5, rtol=1e-4):
    """Two ``logits_and_grads`` results agree."""
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, atol=atol, rtol=rtol)
    assert_close_by_name(ga, gb, atol=atol, rtol=rtol)


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_equal_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Bit-identical parameters, compared in order (the first differing name in the failure)."""
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n


def sequence_logprobs(model, src, src_len, seqs: list[list[int]], forbidden: list[int]) -> torch.Tensor:
    """Full-forward (uncached) log-probability of each generated sequence, ``forbidden`` ids excluded."""
    n, T = len(seqs), max(len(s) for s in seqs)
    tgt_in = torch.zeros(n, T, dtype=torch.int32)
    tgt_out = torch.zeros(n, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        tgt_in[i, : len(s)] = torch.tensor([BOS] + s[:-1])
        tgt_out[i, : len(s)] = torch.tensor(s)
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    with torch.no_grad():
        logits = model(src.expand(n, -1), tgt_in, src_len.expand(n), lens).float()
        logits[..., forbidden] = -math.inf
        logp = F.log_softmax(logits, -1)
    picked = logp.gather(-1, tgt_out[..., None])[..., 0]  # (n, T)
    return torch.where(torch.arange(T)[None] < lens[:, None], picked, 0.0).sum(1)


def gnmt_score(model, src, src_len, hyp: list[int], limit: int, length_penalty: float) -> float:
    """Full-forward score of a returned hypothesis: it ended with EOS unless it is ``limit`` long."""
    seq = hyp + ([EOS] if len(hyp) < limit else [])
    lp = sequence_logprobs(model, src, src_len, [seq], forbidden=[PAD, BOS])[0]
    return float(lp) / ((5 + len(seq)) / 6) ** length_penalty


def assert_same_hypotheses(model, batch, got, want, limits, length_penalty):
    """Equal, or (where float rounding may reorder candidates) equal scores under the full forward."""
    assert len(got) == len(want)
    for b, (g, w) in enumerate(zip(got, want)):
        if g != w:
            src, src_len = batch["src"][b : b + 1], batch["src_lengths"][b : b + 1]
            sg = gnmt_score(model, src, src_len, g, limits[b], length_penalty)
            sw = gnmt_score(model, src, src_len, w, limits[b], length_penalty)
            assert math.isclose(sg, sw, abs_tol=1e-4), (b, g, w, sg, sw)


# ----------------------------------------------------------------------------------------------
# Instruments
# ----------------------------------------------------------------------------------------------
SYNCING_ATEN = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "repeat_interleave")
READBACKS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy", "nonzero")


class _SyncingAten(TorchDispatchMode):
    def __init__(self, events: Counter):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_ATEN:
            self.events[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """Counts, while active, every Tensor method that hands a value to the host (``Tensor.<name>``
    events; on CUDA each one syncs) and, with ``aten``, the aten ops that sync a CUDA stream
    (``aten.<name>``, seen by a dispatch mode that makes every op slower)."""

    def __init__(self, aten: bool = True):
        self.events: Counter[str] = Counter()
        self._mode = _SyncingAten(self.events) if aten else None
        self._saved = {}

    def host_reads(self) -> int:
        """How many Tensor read-backs Python made (an aten op under one is not counted again)."""
        return sum(n for name, n in self.events.items() if name.startswith("Tensor."))

    def __enter__(self):
        for name in READBACKS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapped(t, *a, _name=name, _original=original, **k):
                self.events[f"Tensor.{_name}"] += 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, wrapped)
        if self._mode is not None:
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            self._mode.__exit__(*exc)
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, by overload packet (``aten.add``, ...)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))
