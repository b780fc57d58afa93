"""Helpers for the trainer tests: build a trainer from overrides, read its weights, write user rewards."""

from __future__ import annotations

import textwrap

import pytest
import torch

from diffusion_rl.trainer.policy_gradient import PolicyGradientTrainer


@pytest.fixture
def make_trainer(make_config):
    """make_trainer(*overrides) → a PolicyGradientTrainer on make_config(*overrides)."""

    def make(*overrides: str) -> PolicyGradientTrainer:
        return PolicyGradientTrainer(make_config(*overrides))

    return make


def trained_weights(trainer) -> dict[str, torch.Tensor]:
    """A detached copy of the trained policy's weights (LoRA tensors, or the whole transformer)."""
    return trainer.engine.model.policies.trainable_state_dict()


@pytest.fixture
def weights():
    return trained_weights


@pytest.fixture
def user_reward(tmp_path):
    """user_reward(body) → a `file.py:reward` spec for `def reward(images, prompts, metadata):` + body."""
    count = 0

    def write(body: str) -> str:
        nonlocal count
        count += 1
        path = tmp_path / f"user_reward_{count}.py"
        source = "import numpy as np\n\nCALLS = [0]\n\n\ndef reward(images, prompts, metadata):\n"
        path.write_text(source + textwrap.indent(textwrap.dedent(body), "    "))
        return f"{path}:reward"

    return write
