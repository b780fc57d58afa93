"""train.ema.warmup: the EMA's decay warms up as flow_grpo's EMA wrapper does (min((1 + s)/(10 + s), decay) at the
0-based optimizer step s; TDM-R1 keeps it), against a plain loop over the steps."""

import pytest
import torch

from diffusion_rl.config.train import EmaConfig, TrainConfig
from diffusion_rl.engine.optimizer import OptimizerStepper
from diffusion_rl.engine.parallel import SingleDevice


def _shadow_after(steps: int, warmup: bool, update_every: int = 1) -> tuple[list[float], list[float]]:
    """The EMA's shadow and the weights' values after each of `steps` optimizer steps on a loss whose gradient is 1."""
    weight = torch.nn.Parameter(torch.tensor([1.0]))
    train = TrainConfig(lr=0.1, weight_decay=0.0, grad_clip=0.0,
                        ema=EmaConfig(enabled=True, decay=0.9, update_every=update_every, warmup=warmup))  # fmt: skip
    stepper = OptimizerStepper([weight], train, SingleDevice())
    shadows, weights = [], []
    for _ in range(steps):
        weight.sum().backward()
        stepper.step()
        shadows.append(float(stepper.ema.shadow[0]))
        weights.append(float(weight.detach()))
    return shadows, weights


@pytest.mark.parametrize("update_every", [1, 2])
def test_the_decay_warms_up_as_flow_grpos(update_every):
    shadows, weights = _shadow_after(12, warmup=True, update_every=update_every)
    expected, shadow = [], 1.0
    for s, w in enumerate(weights):  # s: the 0-based optimizer step, as flow_grpo's optimization_step
        if (s + 1) % update_every == 0:
            decay = min((1 + s) / (10 + s), 0.9)
            shadow = decay * shadow + (1 - decay) * w
        expected.append(shadow)
    assert shadows == pytest.approx(expected, rel=1e-6)


def test_without_it_the_decay_is_constant():
    shadows, weights = _shadow_after(5, warmup=False)
    expected, shadow = [], 1.0
    for w in weights:
        shadow = 0.9 * shadow + 0.1 * w
        expected.append(shadow)
    assert shadows == pytest.approx(expected, rel=1e-6)
