"""The per-step code of the sampler and the policy-gradient loss never reads a tensor back to the host.

On a GPU, `.item()`, `.tolist()`, `nonzero`, `float()` or a Python `bool` of a tensor waits for every kernel queued
before it: inside the per-SDE-step code (each step of every rollout, each trained step of the update) that stalls
the stream once per call. Checks that would need one are made once where the values are made (the sigma schedule:
`check_sigmas` in the rollout; ranges: when the config loads); metrics stay tensors until the update loop reduces
them. `HostReads` (utils/host_sync.py), a TorchFunctionMode, sees those calls on the CPU; here it is active over a
whole training step but counts only what runs inside the hot path's regions.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from diffusion_rl.algorithms.base import minibatch_rows
from diffusion_rl.algorithms.hot_path import hot_path
from diffusion_rl.algorithms.policy_gradient import PolicyLossInput
from diffusion_rl.config.plugins import LOSSES, STEP_TYPES
from diffusion_rl.sampling import sde
from diffusion_rl.sampling.rollout import rollout
from diffusion_rl.sampling.sde import STEP_TYPE_NAMES, check_sigmas
from diffusion_rl.trainer import make_trainer
from diffusion_rl.utils.host_sync import HostReads, HostSyncError, Region

HOT = hot_path()


def syncing(t: torch.Tensor, kind: str):
    """A deliberately syncing function: one host read of each kind."""
    reads = {
        "item": lambda: t.max().item(),
        "tolist": lambda: t.tolist(),
        "nonzero": lambda: t.nonzero(),
        "torch.nonzero": lambda: torch.nonzero(t),
        "mask": lambda: t[t > 0.6],
        "cpu": lambda: (t * 2).cpu(),
        "numpy": lambda: np.asarray((t * 2).numpy()),
        "bool": lambda: bool((t > 1).any()),
        "int": lambda: int(t[0]),
        "float": lambda: float(t[0]),
        "host data": lambda: t + torch.as_tensor(0.5, device=t.device),
    }
    return reads[kind]()


@pytest.mark.parametrize("kind", ["item", "tolist", "nonzero", "torch.nonzero", "mask", "cpu", "numpy", "bool", "int",
                                  "float", "host data"])  # fmt: skip
def test_the_guard_raises_at_each_kind_of_host_read_naming_its_site(kind):
    t = torch.tensor([0.5, 0.9])
    with HostReads(within=(Region.of(syncing),), raising=True), pytest.raises(HostSyncError) as caught:
        syncing(t, kind)
    assert "test_no_host_sync.py:" in str(caught.value) and "(<lambda>)" in str(caught.value)
    with HostReads(within=(Region.of(check_sigmas),)) as outside:
        syncing(t, kind)  # the same read outside the regions counts not
    assert outside.seen == []


def test_the_guard_finds_a_host_read_deep_inside_a_step_function(monkeypatch):
    row_mean = sde._row_mean
    monkeypatch.setattr(sde, "_row_mean", lambda value: row_mean(value) + 0 * value.sum().item())
    x = torch.randn(2, 3)
    with HostReads(within=HOT, raising=True), pytest.raises(HostSyncError, match=r"item at .*test_no_host_sync"):
        STEP_TYPES.get("sde")(x, x, 0.8, 0.6, 0.7, prev_sample=x)


@pytest.mark.parametrize("name", STEP_TYPE_NAMES)
@pytest.mark.parametrize("replay", [False, True])
def test_step_functions_make_no_host_read(name, replay):
    gen = torch.Generator().manual_seed(0)
    x, v, prev = (torch.randn(3, 4, 2, 2, generator=gen) for _ in range(3))
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    kwargs = {"prev_sample": prev} if replay else {"generator": generators}
    sigma, sigma_next = torch.tensor([1.0, 0.7, 0.4]), torch.tensor([0.8, 0.5, 0.0])
    with HostReads(raising=True):
        per_row = STEP_TYPES.get(name)(x, v, sigma, sigma_next, 0.7, **kwargs)  # as the update replays a step
        floats = STEP_TYPES.get(name)(x, v, 0.7, 0.5, 0.7, **kwargs)  # as the rollout takes one
    assert per_row.log_prob.shape == floats.log_prob.shape == (3,)


@pytest.mark.parametrize("loss", ["flow_grpo", "grpo_guard", "flow_dppo", "tempflow_grpo", "gardo"])
def test_policy_losses_make_no_host_read(loss):
    spec = LOSSES.get(loss)
    settings = spec.settings()
    settings.kl_beta = 0.04  # the KL term too
    gen = torch.Generator().manual_seed(1)
    old = torch.randn(4, generator=gen)
    mean = torch.randn(4, 2, 2, 2, generator=gen)
    inp = PolicyLossInput(
        log_prob=(old + 0.01 * torch.randn(4, generator=gen)).requires_grad_(True),
        old_log_prob=old,
        advantages=torch.tensor([1.0, -0.5, 2.0, 0.0]),
        mean=mean.clone().requires_grad_(True),
        old_mean=mean + 0.01,
        ref_mean=mean - 0.01,
        std=torch.full((4,), 0.7),
        sqrt_dt=torch.full((4,), 0.3),
        weights=torch.ones(4),
    )
    with HostReads(raising=True):
        out = spec(inp, settings)
        out.loss.backward()


STEPS = {
    "flow_grpo": ("algorithm.flow_grpo.kl_beta=0.01",),
    "tree": ("algorithm.flow_grpo.kl_beta=0.01", "sampling.tree.branch_at=[1]", "sampling.tree.branching=2"),
    "gardo": ("algorithm.loss=gardo", "algorithm.gardo.kl_beta=0.01"),  # its gated KL and the sums it keeps
    "flash_grpo": (
        "algorithm.loss=flash_grpo",
        "sampling.window.kind=random",
        "sampling.window.size=1",
        "sampling.window.lo=0",
        "sampling.window.hi=2",
    ),
    "grpo_guard": ("algorithm.loss=grpo_guard",),
}


@pytest.mark.parametrize("name", STEPS)
def test_a_training_step_makes_no_host_read_in_its_hot_path(make_config, name):
    """A whole training step (rollout, rewards, update) under the guard: the sampler's per-step loop, the step
    functions and the loss read nothing back; what runs around them (checks, seeds, metrics) may."""
    trainer = make_trainer(make_config("train.total_steps=1", *STEPS[name]))
    with HostReads(within=HOT) as hot, HostReads() as everywhere:
        metrics = trainer.train_step(0)
    assert metrics["train/logp_diff_max"] == 0.0
    assert everywhere.seen, "the guard saw nothing at all: it is not active over the step"
    assert hot.seen == [], "\n".join(map(str, hot.seen))


def test_a_schedule_is_checked_once_where_it_is_made():
    check_sigmas(torch.tensor([1.0, 0.6, 0.2, 0.0]), "sde")
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        check_sigmas(torch.tensor([1.0, 0.6, 0.6, 0.0]), "sde")
    with pytest.raises(ValueError, match="sigma_next must be >= 0"):
        check_sigmas([1.0, 0.5, -0.1], "cps")
    with pytest.raises(ValueError, match="sigma <= 1"):
        check_sigmas([1.2, 0.5, 0.0], "sde")
    check_sigmas([1.2, 0.5, 0.0], "cps")  # only the sde step needs sigma <= 1


def test_the_hot_path_is_the_rollouts_per_step_loop_not_what_runs_once():
    loop = next(r for r in HOT if r.code is inspect.unwrap(rollout).__code__)
    lines, start = inspect.getsourcelines(rollout)
    at = {key: [start + i for i, line in enumerate(lines) if key in line] for key in
          ("model.velocity(", "STEP_TYPES.get(", "check_sigmas(", "decode_in_chunks(")}  # fmt: skip
    assert all(at.values())
    assert all(loop.first <= n <= loop.last for key in ("model.velocity(", "STEP_TYPES.get(") for n in at[key])
    assert not any(loop.first <= n <= loop.last for key in ("check_sigmas(", "decode_in_chunks(") for n in at[key])


def test_the_update_indexes_its_units_with_rows_made_on_their_device(make_config, monkeypatch):
    """Rows on another device than the tensors they index are copied there per tensor, and a host-to-GPU copy waits
    (the GPU check's host_syncs found 25 such in one step, one per field of the units). The units' tensorclass has no
    device of its own, so the rows must be asked for on that of its tensors."""
    from diffusion_rl.engine import worker

    asked = []

    def rows(units, minibatches, m, device=None):
        asked.append(device)
        return minibatch_rows(units, minibatches, m, device)

    monkeypatch.setattr(worker, "minibatch_rows", rows)
    trainer = make_trainer(make_config("train.total_steps=1", "train.num_minibatches=2"))
    trainer.train_step(0)
    assert len(asked) == 2 and all(d is not None and torch.device(d) == torch.device("cpu") for d in asked), asked
