"""TempFlow-GRPO's trajectory branching on the flat sampler, on the tiny SD3 model: with share_initial_noise and
an SDE window of one step, a group shares its ODE prefix exactly and its branches part at the window's step."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.models.loader import load_model
from diffusion_rl.sampling.rollout import SamplerSettings, training_rollout
from diffusion_rl.sampling.trajectory import SampleIds
from diffusion_rl.sampling.window import SdeWindow

STEPS = 4
SETTINGS = SamplerSettings(num_steps=STEPS, guidance=4.5, height=32, width=32, sde_type="sde", noise_level=0.7)
PROMPTS = ["a red cube"] * 3 + ["green grass"] * 3  # two groups of 3


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16, lora=LoraConfig(enabled=False))
    return load_model(cfg)


def _ids():
    rows = torch.arange(6)
    return SampleIds(sample_index=rows, group_index=rows // 3, prompt=list(PROMPTS),
                     policy_version=torch.zeros_like(rows), batch_size=[6])  # fmt: skip


def _branch(model, k: int, share: bool = True):
    window = SdeWindow(start=k, size=1)
    return training_rollout(model, SETTINGS, PROMPTS, [None] * 6, _ids(), 3, window, seed=0, share_initial_noise=share)


@pytest.mark.parametrize("k", [0, 2])
def test_a_group_shares_its_prefix_exactly_and_branches_after_the_step(model, k):
    traj = _branch(model, k)
    x_k, x_next = traj.latents[:, 0], traj.latents[:, 1]  # the window's start and the branch's next latent
    for g in (slice(0, 3), slice(3, 6)):
        rows_k = x_k[g]
        assert all(torch.equal(rows_k[0], r) for r in rows_k[1:]), f"prefix differs within group at step {k}"
        nxt, final = x_next[g], traj.final_latents[g]
        for a in range(3):
            for b in range(a + 1, 3):
                assert (nxt[a] - nxt[b]).abs().max() > 1e-3, "branches did not part at the SDE step"
                assert (final[a] - final[b]).abs().max() > 1e-3, "branches met again after the ODE suffix"
    # the two groups' prefixes differ (their own noise, their own prompt)
    assert not torch.equal(x_k[0], x_k[3])
    assert traj.step_index[:, 0].tolist() == [k] * 6


def test_without_shared_noise_the_prefixes_differ(model):
    traj = _branch(model, 2, share=False)
    assert not torch.equal(traj.latents[0, 0], traj.latents[1, 0])


def test_the_branches_differ_only_by_the_noise_of_the_one_sde_step(model):
    # the same rows again give bit-identical trajectories: nothing but the seeded SDE noise separates branches
    a, b = _branch(model, 1), _branch(model, 1)
    assert torch.equal(a.final_latents, b.final_latents)
    assert torch.equal(a.latents, b.latents)
