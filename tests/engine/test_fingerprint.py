"""Weights that really change (engine/fingerprint.py): the fingerprint's numbers, an optimizer step that leaves the
weights as they were, and a rollout actor's load of pushed weights that does not reach its sampling policy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.engine.fingerprint import fingerprint
from diffusion_rl.engine.optimizer import OptimizerStepper
from diffusion_rl.engine.parallel import SingleDevice
from diffusion_rl.engine.weight_sync import WeightReceiver
from diffusion_rl.errors import WeightsUnchanged


def test_the_fingerprint_is_three_sums_over_every_entry():
    a = torch.tensor([[1.0, -2.0], [3.0, 0.5]])
    b = torch.tensor([4.0, -1.0, 2.0])
    # by hand: entries of a flattened 1, −2, 3, 0.5; of b 4, −1, 2 (each tensor's own positions for the signs)
    total = 1 - 2 + 3 + 0.5 + 4 - 1 + 2
    alternating = (1 + 2 + 3 - 0.5) + (4 + 1 + 2)
    squares = 1 + 4 + 9 + 0.25 + 16 + 1 + 4
    assert fingerprint([a, b]) == (total, alternating, squares)
    assert fingerprint([a], reduce=lambda v: 2 * v) == (2.5 * 2, 5.5 * 2, 14.25 * 2)  # the workers' sum, here ×2


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.view(-1)[7].add_(1e-6),  # one entry by a few float32 ulps of 1
        lambda t: t.add_(1e-5),  # every entry alike: the alternating sum of an even count cancels, Σ t does not
        lambda t: t.view(-1)[0:2].copy_(t.view(-1)[0:2].flip(0)),  # two neighbours swapped
    ],
)
def test_any_small_change_changes_it(change):
    torch.manual_seed(0)
    t = torch.randn(64, 64)
    before = fingerprint([t])
    change(t)
    assert fingerprint([t]) != before


def _stepper(lr=1e-3):
    param = torch.nn.Parameter(torch.randn(16, 16))
    train = SimpleNamespace(
        lr=lr,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        adam_eps=1e-8,
        warmup_steps=0,
        grad_clip=1.0,
        max_consecutive_skips=3,
        ema=SimpleNamespace(enabled=False),
        fused_adamw="auto",
    )
    return param, OptimizerStepper([param], train, SingleDevice())


def test_an_optimizer_step_that_changes_nothing_stops_the_run():
    param, stepper = _stepper()
    param.grad = torch.ones_like(param)
    stepper.step()  # a real step moves the weights: fine
    param.grad = torch.ones_like(param)
    stepper.optimizer.step = lambda: None  # an update that does not reach the weights
    with pytest.raises(WeightsUnchanged, match=r"optimizer step 2 left every trained weight exactly as it was"):
        stepper.step()


def test_a_step_without_gradient_or_rate_may_leave_the_weights():
    param, stepper = _stepper()
    param.grad = torch.zeros_like(param)  # every group had equal rewards: no advantage, no gradient
    stepper.step()
    param, stepper = _stepper(lr=0.0)
    param.grad = torch.ones_like(param)
    stepper.step()


class Policies:
    """A sampling policy's tensors, and a load that works or (broken) does nothing."""

    def __init__(self, broken: bool):
        self.weights = {"a": torch.zeros(4, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
        self.broken = broken

    def tensors_of(self, name):
        return self.weights

    def load_state_dict_of(self, name, tensors):
        if not self.broken:
            for n, t in self.weights.items():
                t.copy_(tensors[n])


def _actor(broken: bool) -> WeightReceiver:
    actor = WeightReceiver()
    actor.model, actor.version = SimpleNamespace(policies=Policies(broken)), None
    return actor


def test_pushed_weights_that_do_not_reach_the_sampling_policy_stop_the_run():
    pushed = {"a": torch.ones(4, 4), "b": torch.full((3,), 2.0)}
    actor = _actor(broken=False)
    actor._take(pushed, 1)
    actor.apply_pushed_weights()
    assert actor.version == 1 and actor.model.policies.weights["a"].sum() == 16
    actor = _actor(broken=True)
    actor._take(pushed, 1)
    with pytest.raises(WeightsUnchanged, match="the weights of version 1 did not reach this rollout actor"):
        actor.apply_pushed_weights()


def test_a_push_of_the_weights_it_already_holds_may_change_nothing():
    actor = _actor(broken=True)
    # the same weights again, and a change below bf16's resolution at 1 (2⁻⁷) in "b": in the actor's dtypes nothing
    # differs
    actor._take({"a": torch.zeros(4, 4), "b": torch.full((3,), 1.0001)}, 2)
    actor.apply_pushed_weights()
    assert actor.version == 2
