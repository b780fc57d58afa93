"""The per-step code of the sampler and the policy-gradient losses never reads a tensor back to the host.

On a GPU, `.item()`, `.tolist()`, `nonzero`, `float()` or a Python `bool` of a tensor waits for every kernel queued
before it: inside the per-SDE-step code (each step of every rollout, each trained step of the update) that stalls
the stream once per call. Checks that would need one are made once where the values are made (the sigma schedule:
`check_sigmas` in the rollout; ranges: when the config loads). Here every tensor the step functions and the losses
get is a `NoHostSync` tensor, whose host reads raise, and its results stay `NoHostSync` as torch propagates the
subclass through every op.
"""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.algorithms.policy_gradient import PolicyLossInput
from diffusion_rl.config.plugins import LOSSES, STEP_TYPES
from diffusion_rl.sampling.sde import STEP_TYPE_NAMES, check_sigmas

HOST_READS = {"item", "tolist", "nonzero", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu"}


class NoHostSync(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            raise AssertionError(f"host synchronisation: Tensor.{func.__name__} in per-step code")
        return super().__torch_function__(func, types, args, kwargs or {})


def guarded(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(NoHostSync)


def test_the_guard_catches_a_host_read():
    t = guarded(torch.tensor([0.5, 0.9]))
    for read in (lambda: bool((t > 1).any()), lambda: t.max().item(), lambda: float(t[0]), lambda: t.nonzero()):
        with pytest.raises(AssertionError, match="host synchronisation"):
            read()


@pytest.mark.parametrize("name", STEP_TYPE_NAMES)
@pytest.mark.parametrize("replay", [False, True])
def test_step_functions_make_no_host_read_with_per_row_sigmas(name, replay):
    gen = torch.Generator().manual_seed(0)
    x, v, prev = (guarded(torch.randn(3, 4, 2, 2, generator=gen)) for _ in range(3))
    sigma, sigma_next = guarded(torch.tensor([1.0, 0.7, 0.4])), guarded(torch.tensor([0.8, 0.5, 0.0]))
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    kwargs = {"prev_sample": prev} if replay else {"generator": generators}
    out = STEP_TYPES.get(name)(x, v, sigma, sigma_next, 0.7, **kwargs)
    assert isinstance(out.log_prob, NoHostSync) and out.log_prob.shape == (3,)


@pytest.mark.parametrize("loss", ["flow_grpo", "grpo_guard", "flow_dppo"])
def test_policy_losses_make_no_host_read(loss):
    spec = LOSSES.get(loss)
    settings = spec.settings()
    settings.kl_beta = 0.04  # the KL term too
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4, generator=gen)
    mean = torch.randn(4, 2, 2, 2, generator=gen)
    inp = PolicyLossInput(
        log_prob=guarded((old + 0.01 * torch.randn(4, generator=gen)).requires_grad_(True)),
        old_log_prob=guarded(old),
        advantages=guarded(torch.tensor([1.0, -0.5, 2.0, 0.0])),
        mean=guarded(mean.clone().requires_grad_(True)),
        old_mean=guarded(mean + 0.01),
        ref_mean=guarded(mean - 0.01),
        std=guarded(torch.full((4,), 0.7)),
        sqrt_dt=guarded(torch.full((4,), 0.3)),
        weights=guarded(torch.ones(4)),
    )
    out = spec(inp, settings)
    assert isinstance(out.loss, NoHostSync)
    out.loss.backward()


def test_a_schedule_is_checked_once_where_it_is_made():
    check_sigmas(torch.tensor([1.0, 0.6, 0.2, 0.0]), "sde")
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        check_sigmas(torch.tensor([1.0, 0.6, 0.6, 0.0]), "sde")
    with pytest.raises(ValueError, match="sigma_next must be >= 0"):
        check_sigmas([1.0, 0.5, -0.1], "cps")
    with pytest.raises(ValueError, match="sigma <= 1"):
        check_sigmas([1.2, 0.5, 0.0], "sde")
    check_sigmas([1.2, 0.5, 0.0], "cps")  # only the sde step needs sigma <= 1
