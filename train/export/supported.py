"""What each export target can represent, in one table: every ModelConfig field, per target, is

- a set of the values the target holds exactly (tests/export/test_equivalence.py exports each and compares
  log-probs and tokens with fastmt's),
- ``ANY``: every valid value exports as it is (a width, a count, the vocabulary), or
- ``TRAINING_ONLY``: how fastmt trains or runs the model; the exported weights and outputs are the same for
  every value (the attention backend, fused or PyTorch norm, the batch layout, dropout, checkpointing).

``refuse_unsupported(target, cfg, what)`` checks a model config against the table before anything is written and
refuses, in one line naming the field, its value and the supported values, a value outside its set and any field
the table does not classify (a field added to ModelConfig is refused until someone states what the exporters make
of it; tests/export/test_supported.py fails meanwhile).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from train.errors import UserError

ANY = "any value"  # the exported model holds the value as it is
TRAINING_ONLY = "training-only"  # does not change the exported model
NAMES = {"ct2": "CTranslate2", "hf": "Hugging Face"}

_BOTH: dict[str, Any] = {
    "vocab_size": ANY, "d_model": ANY, "n_heads": ANY, "d_ff": ANY, "enc_layers": ANY, "dec_layers": ANY,
    "max_positions": ANY,
    # shared blocks are unrolled: each applied layer gets its block's weights
    "enc_unique": ANY, "dec_unique": ANY, "sharing": ANY,
    "pad_id": {0},  # both targets name id 0 as <pad> (HF's pad_token_id, suppressed tokens; CTranslate2's "<pad>")
    "positions": {"sinusoidal", "learned"},  # the table itself is exported
    "tie_embeddings": {True, False},
    "activation": {"relu", "gelu", "gelu_tanh"},
    "norm_kind": {"layernorm"},  # Pegasus and CTranslate2's Transformer have LayerNorms only
    "dropout": TRAINING_ONLY, "attn_backend": TRAINING_ONLY, "norm": TRAINING_ONLY, "layout": TRAINING_ONLY,
    "checkpointing": TRAINING_ONLY,
}

# target -> ModelConfig field -> the values it exports (a set), ANY or TRAINING_ONLY
SUPPORTED: dict[str, dict[str, Any]] = {
    "ct2": {**_BOTH, "ffn_norm": {False}},  # CTranslate2's Transformer has no mid-FFN LayerNorm
    "hf": {**_BOTH, "ffn_norm": {False, True}},  # True: modeling_fastmt.py's Pegasus subclass (trust_remote_code)
}

# how to get an exportable model, where a field's refusal has more to say than the supported values
_PAD = ("the tokenizer decides it: both targets name id 0 <pad>, as fastmt's own SentencePiece training does; train "
        "with a tokenizer fastmt made")
FIXES = {("ct2", "ffn_norm"): "train an exportable model with --model.ffn_norm false (or export it with --to hf, "
                               "which ships a subclass for it)",
         ("ct2", "pad_id"): _PAD, ("hf", "pad_id"): _PAD}
UNCLASSIFIED = "nothing: the exporters do not classify this field"


def _holds(allowed: set, value: Any) -> bool:
    """``value`` in ``allowed`` by type and value (True is not 1, 0 is not False)."""
    return any(type(value) is type(a) and value == a for a in allowed)


def unsupported(target: str, cfg) -> list[tuple[str, Any, str]]:
    """(field, value, what the target supports) of each field of ``cfg`` the ``target`` cannot represent."""
    table = SUPPORTED[target]
    out = []
    for f in dataclasses.fields(cfg):
        value, allowed = getattr(cfg, f.name), table.get(f.name)
        if allowed is None:
            out.append((f.name, value, UNCLASSIFIED))
        elif isinstance(allowed, (set, frozenset)) and not _holds(allowed, value):
            out.append((f.name, value, " or ".join(sorted(map(repr, allowed)))))
    return out


def refuse_unsupported(target: str, cfg, what: str) -> None:
    """A ``UserError`` (one line) naming the first field of ``cfg`` that ``target`` cannot represent, its value and
    the supported values; ``what``: the checkpoint, for the message."""
    problems = unsupported(target, cfg)
    if not problems:
        return
    name, value, allowed = problems[0]
    others = [t for t in SUPPORTED if t != target and not any(p[0] == name for p in unsupported(t, cfg))]
    if allowed == UNCLASSIFIED:
        fix = "train/export/supported.py must state what the exporters make of it before a model with it exports"
    else:
        fix = FIXES.get((target, name)) or (f"export it with --to {others[0]}, which supports it, or train with "
                                            f"another --model.{name}" if others else f"train with another --model.{name}")
    more = f" (and {len(problems) - 1} more field(s): {', '.join(p[0] for p in problems[1:])})" if problems[1:] else ""
    raise UserError(f"--to {target}: {what} has model.{name}={value!r}, which {NAMES[target]} export cannot "
                    f"represent (it supports {allowed}){more}; {fix}")
