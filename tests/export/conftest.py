"""The export tests' models: one tiny model trained 80 steps on the toy corpus with the default architecture
switches (once per session: an untrained model repeats one token and proves nothing), and checkpoints of other architectures made from its checkpoint with
random-init weights whose LayerNorms are perturbed (so every position and token matters)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.utils import quiet, tiny_trainer, torch_threads

BASE_MODEL = {"d_model": 64, "n_heads": 4, "d_ff": 128, "dropout": 0.0}  # ffn_norm: the default (off)
TRAIN = dict(epochs=40, max_steps=80, every=1000, keep_last=2)


@dataclasses.dataclass
class Trained:
    ckpt: Path
    run_dir: Path
    src: list[str]  # 32 test-split sources
    ref: list[str]


@pytest.fixture(scope="session")
def trained(toy_bundle, tmp_path_factory) -> Trained:
    from train.runs.report import translation_checkpoint

    tmp = tmp_path_factory.mktemp("export")
    with torch_threads(1):
        # the final test writes the run's test record (the model card's scores)
        tr = tiny_trainer(toy_bundle, tmp, name="base", model=BASE_MODEL, log=quiet, test_at_end=True, **TRAIN)
        tr.fit()
    run_dir = tmp / "runs" / "base"
    test = toy_bundle.splits["test"]
    return Trained(translation_checkpoint(run_dir), run_dir, list(test.src_text[:32]), list(test.tgt_text[:32]))


def variant_checkpoint(base: Path, out: Path, seed: int = 0, **model) -> Path:
    """``base``'s checkpoint (tokenizer, config) with the model changed by ``model`` fields and random weights:
    each LayerNorm's gain and bias perturbed and the embeddings scaled up, so the logits vary by position/token."""
    from models import ModelConfig, Transformer
    from train.runs.checkpoint import load_checkpoint

    ckpt = load_checkpoint(base)
    fields = {**ckpt["config"]["model"], **model}
    torch.manual_seed(seed)
    net = Transformer(ModelConfig(**fields))
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("ln.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith("ln.bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "pos" in name:
                p.mul_(20)
    ckpt = {**ckpt, "model": net.state_dict(), "config": {**ckpt["config"], "model": fields}}
    torch.save(ckpt, out)
    return out
