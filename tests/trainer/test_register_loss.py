"""Adding a loss is one file: its settings, its function, one registration. Here, a toy policy-gradient loss —
the plain REINFORCE-with-ratio term −A·ratio, scaled — trained for two steps from the config alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from diffusion_rl.algorithms import LOSSES, LossOutput, register_loss
from diffusion_rl.algorithms.policy_gradient import PolicyGradient, PolicyLossInput, PolicyLossSettings
from diffusion_rl.config import Config
from diffusion_rl.config_io.reference import field_help
from diffusion_rl.errors import UserError
from diffusion_rl.settings import opt


@dataclass
class ToySettings(PolicyLossSettings):
    scale: float = opt(1.0, "Multiplies the loss.")


def toy_loss(inp: PolicyLossInput, cfg) -> LossOutput:
    ratio_B = torch.exp(inp.log_prob - inp.old_log_prob)
    per_sample_B = -inp.advantages * ratio_B * cfg.scale
    if inp.weights is not None:
        per_sample_B = per_sample_B * inp.weights
    return LossOutput(per_sample_B.mean(), {"toy/ratio_mean": ratio_B.detach().mean()})


@pytest.fixture
def toy():
    register_loss("toy", settings=ToySettings, algorithm=PolicyGradient)(toy_loss)
    try:
        yield
    finally:
        LOSSES.remove("toy")


def test_a_loss_registered_in_one_place_trains_from_the_config(toy, make_trainer, weights):
    trainer = make_trainer("algorithm.loss=toy", "algorithm.toy.scale=2.0", "train.total_steps=2")
    before = weights(trainer)
    rows = trainer.train()
    assert trainer.cfg.algorithm.settings == ToySettings(scale=2.0)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/optimizer_steps"] == r["step"] for r in rows)
    assert rows[0]["toy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the rollout's own log-probs
    after = weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_its_keys_are_documented_and_checked_like_every_other(toy, make_config):
    assert field_help(Config)["algorithm.toy.scale"] == "Multiplies the loss."
    with pytest.raises(UserError, match=r"key 'algorithm.toy.scal' .*did you mean 'algorithm.toy.scale'"):
        make_config("algorithm.loss=toy", "algorithm.toy.scal=2")


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="loss 'flow_grpo' is already registered"):
        register_loss("flow_grpo", settings=ToySettings, algorithm=PolicyGradient)(toy_loss)
