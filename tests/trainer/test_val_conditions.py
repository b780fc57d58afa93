"""Validation rows without the condition images the training rows carry: one warning before step 0, and a reward
that needs the images and fails there names the validation batch (not as if the training data had lost them)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from diffusion_rl.rewards import RewardFailure

ROOT = Path(__file__).resolve().parents[2]
EDITS = ROOT / "configs/prompts/shapes_edits"


def test_validation_prompts_without_the_training_rows_images_warn_once_then_fail_naming_the_validation_batch(
    make_trainer, flux_kontext_model_dir, caplog
):
    val = ROOT / "configs/prompts/val.txt"  # plain prompts: no condition images
    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(f"model.path={flux_kontext_model_dir}", f"data.train={EDITS / 'train.jsonl'}",
                               f"val.prompts={val}", "rewards.0.name=source_preservation", "val.before_train=true",
                               "train.total_steps=1")  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "condition image" in r.getMessage()]
    assert len(warned) == 1 and "rows carry 1 condition image(s) each" in warned[0] and f"({val}) rows 0" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(RewardFailure) as failure:
        trainer.train()  # validation before step 1 scores without sources
    assert str(failure.value).startswith(f"every sample of the validation batch (val.prompts: {val}) failed")
    assert any("samples of the validation batch" in r.getMessage() for r in caplog.records)
    assert not any("rows carry" in r.getMessage() for r in caplog.records)  # the start-up warning: once


def test_validation_rows_with_the_same_images_do_not_warn(make_trainer, flux_kontext_model_dir, caplog):
    with caplog.at_level(logging.WARNING):
        make_trainer(f"model.path={flux_kontext_model_dir}", f"data.train={EDITS / 'train.jsonl'}",
                     f"val.prompts={EDITS / 'train.jsonl'}", "rewards.0.name=source_preservation")  # fmt: skip
    assert not any("condition image" in r.getMessage() for r in caplog.records)
