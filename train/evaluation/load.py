"""A model and tokenizer rebuilt from a checkpoint for decoding (``fastmt translate``, ``evaluate``, ``export``):
``checkpoint_file`` (what ``--ckpt`` names: a file, a run folder's ``best.pt``, an exported CTranslate2 folder),
``load_for_inference`` (the model in eval mode, its tokenizer and the checkpoint dict; a file that is not one is a
``UserError`` naming it, raised before the model is allocated) and ``check_model_config``.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from train.errors import UserError


def checkpoint_file(ckpt: str) -> str:
    """``--ckpt``: a checkpoint file, or a run folder / its checkpoints folder (its ``best.pt``)."""
    from train.export.engine import is_ct2_dir

    path = Path(ckpt)
    if path.is_file() or is_ct2_dir(path):  # a checkpoint, or a folder of fastmt export --to ct2
        return ckpt
    if path.is_dir():
        for best in (path / "checkpoints" / "best.pt", path / "best.pt"):
            for part in (best.parent, best):  # what fastmt picks inside the folder you named: never through a link
                if part != path and part.is_symlink():
                    raise UserError(f"--ckpt {ckpt!r}: {part} is a symbolic link (to {os.readlink(part)}): fastmt "
                                    f"follows no link inside the run folder; name the checkpoint file itself")
            if best.is_file():
                return str(best)
        raise UserError(f"--ckpt {ckpt!r} is a folder without a best.pt (nor checkpoints/best.pt): give a checkpoint "
                        f"file, e.g. {ckpt.rstrip('/')}/checkpoints/step-<N>.pt")
    if path.exists():  # a FIFO, a device, a socket: never opened
        raise UserError(f"--ckpt {ckpt!r} is not a regular file (a FIFO, device or socket): give a checkpoint file")
    raise UserError(f"--ckpt {ckpt!r}: no such file (look under runs/<name>/checkpoints/)")


EXTRA_BUFFER_BYTES = 256 * 2**20  # memory a model may allocate beyond its stored tensors (position tables)


def check_model_config(cfg, state: dict[str, Any], path) -> int:
    """Refuse (``UserError``) a checkpoint whose model config does not describe exactly the tensors it stores,
    before any memory is allocated: the model is built on the ``meta`` device (shapes only), its parameter
    count and shapes compared with the file's. A few-KB file with a forged config (d_model 10^6) would
    otherwise make ``translate`` allocate the model it describes. Returns the parameter count."""
    model = _meta_model(cfg, path)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    stored = {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}
    n_cfg, n_file = sum(math.prod(s) for s in expected.values()), sum(math.prod(s) for s in stored.values())
    if expected != stored or len(stored) != len(state):
        diff = sorted(set(expected) ^ set(stored)) or [k for k in expected if expected[k] != stored.get(k)]
        first = diff[0] if diff else next(k for k in state if k not in stored)
        raise UserError(f"{path}: its model config (d_model {cfg.d_model}, {cfg.enc_layers}+{cfg.dec_layers} layers, "
                        f"vocab {cfg.vocab_size}) makes {n_cfg:,} parameters in {len(expected)} tensors, but the file "
                        f"stores {n_file:,} in {len(state)} (first difference: {first!r}: config "
                        f"{expected.get(first)}, file {stored.get(first, type(state.get(first)).__name__)}): a damaged "
                        f"or forged checkpoint; nothing was built")
    extra = sum(b.numel() * b.element_size() for k, b in model.named_buffers() if k not in expected)
    if extra > EXTRA_BUFFER_BYTES:
        raise UserError(f"{path}: its model config needs {extra / 2**20:,.0f} MB of tables beyond its stored weights "
                        f"(max_positions {cfg.max_positions}): a damaged or forged checkpoint; nothing was built")
    return n_cfg


def _meta_model(cfg, where):
    """``Transformer(cfg)`` on the meta device (shapes, no memory), its layer counts bounded first."""
    from data.declare import MAX_LAYERS
    from models import Transformer

    layers = max(n for n in (cfg.enc_layers, cfg.dec_layers, cfg.enc_unique, cfg.dec_unique) if n is not None)
    if layers > MAX_LAYERS:
        raise UserError(f"{where}: its model config asks for {layers:,} layers (at most {MAX_LAYERS}): a damaged or "
                        f"forged config; nothing was built")
    with torch.device("meta"):
        return Transformer(cfg)


def device_memory(device: torch.device) -> int:
    """Bytes of memory ``device`` has (a CUDA device's total; the CPU's physical memory)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


TRAINING_BYTES_PER_PARAM = 16  # fp32 weights, gradients and two optimizer states (Adam, AdamW; Lion keeps one)


def check_model_memory(cfg, device: torch.device, *, training: bool, where) -> int:
    """Refuse (``UserError``) a model config whose parameters and tables alone (weights, and for ``training`` their
    gradients and optimizer states) exceed ``device``'s memory, before anything is allocated: the model is built on
    the meta device. Returns the parameter count."""
    model = _meta_model(cfg, where)
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    need = params * (TRAINING_BYTES_PER_PARAM if training else 4) + buffers
    have = device_memory(device)
    if need > have:
        raise UserError(f"{where}: d_model {cfg.d_model}, {cfg.enc_layers}+{cfg.dec_layers} layers, d_ff {cfg.d_ff}, "
                        f"vocab {cfg.vocab_size}, {cfg.max_positions} positions make {params:,} parameters, which "
                        f"need {need / 2**30:,.1f} GB {'to train' if training else ''}; {device} has "
                        f"{have / 2**30:,.1f} GB. Nothing was allocated: choose a smaller model")
    return params


def _load_ct2_hashed(path: str | Path, device: torch.device, digest):
    """``load_ct2`` of an exported folder with ``digest`` fed the bytes of its ``model.bin`` as loaded: the file is
    held open (the one reader, no link inside the folder) and hashed, CTranslate2 reads it whole, and the name must
    still be that file, unchanged (else ``UserError``: it was replaced or written while it was loaded)."""
    from data.files import CHECKPOINT_MAX, open_read
    from train.export.engine import load_ct2
    from train.runs.checkpoint import file_identity, hash_open_file

    weights = Path(path) / "model.bin"
    with open_read(weights, "exported model", limit=CHECKPOINT_MAX, inside=path) as f:
        before = hash_open_file(f, digest)
        loaded = load_ct2(path, device)
        try:
            now = file_identity(os.stat(weights))
        except OSError:
            now = None
        if file_identity(os.fstat(f.fileno())) != before or now != before:
            raise UserError(f"{weights} was replaced or written while it was loaded (another export into {path}?): "
                            f"its hash would not name what was loaded; nothing was written. Run again once it is done")
    return loaded


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def load_for_inference(ckpt_path: str | Path, device: str | torch.device = "cpu", log=None, *, digest=None):
    """(model in eval mode, tokenizer, checkpoint dict) from a training checkpoint; a file that is not one
    (missing, unreadable, without a tokenizer, asking for code, a config that disagrees with its tensors, a config
    that lacks a field it should record) raises ``UserError`` naming it, before the model is allocated. The
    checkpoint's ``config`` is returned complete (``train.runs.resume.complete_checkpoint_config``); what was taken
    for a field it lacks is said in one line to ``log`` (default: stderr). ``digest`` (a ``hashlib`` object): fed
    the bytes of the very file the weights were loaded from (the checkpoint, or an exported folder's ``model.bin``),
    through the descriptor they were read from: never a file put at the same path later."""
    from models import ModelConfig, Transformer
    from train.bounds import check_section
    from train.ema import inference_weights
    from train.export.engine import is_ct2_dir, load_ct2
    from train.preflight import tokenizer_of
    from train.runs.checkpoint import load_checkpoint
    from train.runs.resume import complete_checkpoint_config

    if is_ct2_dir(ckpt_path):  # an exported CTranslate2 folder (train/export/engine.py)
        if digest is not None:
            return _load_ct2_hashed(ckpt_path, torch.device(device), digest)
        return load_ct2(ckpt_path, torch.device(device))
    try:
        ckpt = load_checkpoint(ckpt_path, digest=digest)
    except UserError:
        raise
    except (FileNotFoundError, RuntimeError) as e:
        raise UserError(f"--ckpt: {e}") from e
    if not isinstance(ckpt.get("config"), dict) or not isinstance(ckpt.get("tokenizer") or {}, dict):
        raise UserError(f"{ckpt_path}: its config or tokenizer entry is not a record fastmt writes: a damaged or "
                        f"forged checkpoint")
    try:
        tok = tokenizer_of(ckpt, Path(ckpt_path))
    except (RuntimeError, OSError, TypeError, ValueError, AttributeError) as e:  # SentencePiece's parse error of a damaged model
        raise UserError(f"{ckpt_path}: its tokenizer does not load ({' '.join(str(e).split())[:160]}): a damaged "
                        f"or forged checkpoint") from e
    # each field the checkpoint lacks by its provenance (train/fields.py): what its run's config.json records, a field
    # newer than the checkpoint its declared default (said in one line), anything else refused in one line
    ckpt["config"] = complete_checkpoint_config(ckpt, ckpt_path, fill_new=True, log=log or _note)
    try:  # every field typed and bounded as its declaration says (train/fields.py), before the model is built
        check_section(ModelConfig, "model", ckpt["config"]["model"], f"{ckpt_path}: its model config")
        cfg = ModelConfig(**ckpt["config"]["model"])
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise UserError(f"{ckpt_path}: its model config does not build with this fastmt ({e})") from e
    if cfg.vocab_size != tok.vocab_size:
        raise UserError(f"{ckpt_path}: tokenizer mismatch: model vocab {cfg.vocab_size} != tokenizer vocab "
                        f"{tok.vocab_size} ({tok.model_file})")
    if not isinstance(ckpt["model"], dict):
        raise UserError(f"{ckpt_path}: its 'model' entry is a {type(ckpt['model']).__name__}, not a state dict")
    check_model_config(cfg, ckpt["model"], ckpt_path)
    try:
        weights = inference_weights(ckpt)  # the run's weight average when it kept one (train/ema.py)
    except ValueError as e:
        raise UserError(f"{ckpt_path}: {e}") from e
    model = Transformer(cfg).to(device)
    model.load_state_dict(weights)
    model.eval()
    return model, tok, ckpt
