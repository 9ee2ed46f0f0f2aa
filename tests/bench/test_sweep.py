"""bench/sweep.py: the settings are real CLI overrides, and the default-optimiser rule reads the table right."""

from __future__ import annotations

import pytest

from bench import sweep as S
from train.cli.flags import resolve_config


def test_every_setting_is_a_valid_command_line():
    """Each setting's overrides parse against the real config (a typo would only fail on the GPU)."""
    for c in S.SETTINGS.values():
        cfg, _ = resolve_config(list(c.args)[1:] + ["--preset", "fast"], log=lambda *a: None)
        assert cfg.optim.name == S.family(c.name)
    lions = [n for n in S.SETTINGS if S.family(n) == "lion"]
    adamws = [n for n in S.SETTINGS if S.family(n) == "adamw"]
    assert len(lions) >= 6 and len(adamws) >= 6


def _summary(lion: float, adamw: float) -> list[dict]:
    return [{"contestant": "lion-a", "best_bleu": lion}, {"contestant": "lion-b", "best_bleu": lion - 3},
            {"contestant": "adamw-a", "best_bleu": adamw}, {"contestant": "adamw-b", "best_bleu": None}]


@pytest.mark.parametrize("lion, adamw, verdict", [(37.0, 37.2, "Lion stays"), (37.0, 37.3, "Lion stays"),
                                                  (35.6, 37.0, "AdamW is the default"), (38.0, 37.0, "Lion stays")])
def test_decision_rule(lion, adamw, verdict):
    text = S.decision(_summary(lion, adamw))
    assert verdict in text and "lion-a" in text and "adamw-a" in text


def test_decision_needs_both_families():
    assert S.decision([{"contestant": "adamw-a", "best_bleu": 30.0}]).startswith("not decided")
