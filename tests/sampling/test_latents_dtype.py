"""sampling.latents_dtype: the window's latents and means stored in bf16/fp16 (half the bytes), log-probs in fp32,
and the update's recomputation replaying the rollout's log-probs as with fp32 storage (flat and tree rollouts)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.models.loader import load_model
from diffusion_rl.sampling.rollout import SamplerSettings, recompute_step, training_rollout
from diffusion_rl.sampling.trajectory import SampleIds
from diffusion_rl.sampling.tree import TreeSpec
from diffusion_rl.sampling.window import default_window

STEPS = 4
FLAT = SamplerSettings(num_steps=STEPS, guidance=4.5, height=32, width=32, sde_type="sde", noise_level=0.7)
TREE = dataclasses.replace(FLAT, tree=TreeSpec(branch_at=(0, 2), branching=(2, 2)))
PROMPTS = ["a red cube"] * 4 + ["a blue ball"] * 4


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16, lora=LoraConfig(enabled=False))
    return load_model(cfg)


def _roll(model, settings, dtype="fp32"):
    rows = torch.arange(len(PROMPTS))
    ids = SampleIds(sample_index=rows, group_index=rows // 4, prompt=list(PROMPTS),
                    policy_version=torch.zeros_like(rows), batch_size=[len(rows)])  # fmt: skip
    settings = dataclasses.replace(settings, latents_dtype=dtype)
    return training_rollout(model, settings, PROMPTS, [None] * len(PROMPTS), ids, 1, default_window(STEPS), seed=3,
                            share_initial_noise=False)  # fmt: skip


def _stored_bytes(traj) -> int:
    return sum(t.numel() * t.element_size() for t in (traj.latents, traj.means))


def _replay_gap(model, traj, settings) -> float:
    """max |recomputed − recorded| log-prob over the window, recomputed from the stored latents."""
    gaps = []
    for j in range(traj.window_size):
        with torch.no_grad():
            out = recompute_step(model, traj.latents[:, j], traj.latents[:, j + 1], traj.sigmas[:, j],
                                 traj.sigmas_next[:, j], traj.cond, settings)  # fmt: skip
        gaps.append(float((out.log_prob - traj.log_probs[:, j]).abs().max()))
    return max(gaps)


@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
@pytest.mark.parametrize("settings", [FLAT, TREE], ids=["flat", "tree"])
def test_half_storage_halves_the_stored_window_and_replays_the_log_probs(model, settings, dtype, torch_dtype):
    full, half = _roll(model, settings), _roll(model, settings, dtype)
    assert half.latents.dtype == half.means.dtype == torch_dtype
    assert all(getattr(half, k).dtype == torch.float32 for k in ("log_probs", "stds", "final_latents"))
    assert _stored_bytes(half) * 2 == _stored_bytes(full)
    # the recorded log-prob is that of the stored (rounded) sample: the update replays it as with fp32 storage
    assert _replay_gap(model, half, settings) <= 1e-6
    # the samples differ from fp32 storage's only by the rounding inside the window
    assert (half.final_latents - full.final_latents).abs().max() < 0.05
    assert (half.log_probs - full.log_probs).abs().max() < 0.05


def test_rounding_only_what_is_stored_would_break_the_on_policy_replay(model):
    # the alternative design (round the fp32 rollout after sampling): the recomputation sees other inputs than the
    # rollout did, so its log-probs no longer replay the recorded ones
    full = _roll(model, FLAT)
    cast = full.clone()
    cast.latents = full.latents.to(torch.bfloat16)
    assert _replay_gap(model, full, FLAT) <= 1e-6
    assert _replay_gap(model, cast, FLAT) > 1e-4


def test_an_unknown_latents_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown latents dtype 'fp8'; known: fp32, bf16, fp16"):
        dataclasses.replace(FLAT, latents_dtype="fp8")
