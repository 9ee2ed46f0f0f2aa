"""Remote code of a fastmt model exported with ``model.ffn_norm`` (``fastmt export --to hf``): stock Pegasus with
fastmt's mid-FFN LayerNorm, ``fc2(act(LN(fc1(x))))``, in every layer. This file is copied into the exported folder
as ``modeling_fastmt.py``; load it with ``AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)``.
The folder's ``model_type`` is ``fastmt_pegasus`` (this file's config class), not ``pegasus``: without
``trust_remote_code`` transformers refuses it, naming the flag, instead of building a stock Pegasus that would drop
the mid-FFN LayerNorms and translate differently. It imports only torch and transformers."""

from __future__ import annotations

from torch import nn
from transformers import PegasusConfig, PegasusForConditionalGeneration
from transformers.activations import ACT2FN


class FastmtPegasusConfig(PegasusConfig):
    """Pegasus's config under fastmt's own model type (``fastmt_ffn_norm``: the mid-FFN LayerNorm is there)."""

    model_type = "fastmt_pegasus"


class FastmtNormAct(nn.Module):
    """``act(LayerNorm(x))``: fastmt's FFN middle with ``ffn_norm`` (what replaces a Pegasus layer's activation)."""

    def __init__(self, dim: int, activation: str):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.act = ACT2FN[activation]

    def forward(self, x):
        return self.act(self.ln(x))


class FastmtPegasusForConditionalGeneration(PegasusForConditionalGeneration):
    """Pegasus whose layers apply ``LayerNorm -> activation`` between fc1 and fc2 when ``config.fastmt_ffn_norm``."""

    config_class = FastmtPegasusConfig

    def __init__(self, config):
        super().__init__(config)
        if getattr(config, "fastmt_ffn_norm", False):
            for layers, dim in ((self.model.encoder.layers, config.encoder_ffn_dim),
                                (self.model.decoder.layers, config.decoder_ffn_dim)):
                for layer in layers:
                    layer.activation_fn = FastmtNormAct(dim, config.activation_function)
