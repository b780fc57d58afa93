"""The forward-process losses (DiffusionNFT, AWM, Diffusion-DPO, DGPO) train the conditional velocity: guidance 1 where
guidance is classifier-free (tiny SD3, tiny FLUX.1-schnell: 1 would otherwise mean a second, unconditional row),
the sampled scale where the model embeds it (tiny FLUX.1-dev: guidance 1 there is another function than the one
sampled) — for the trained policy and for every frozen one (old, EMA, reference) alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusion_rl.algorithms.base import make_algorithm
from diffusion_rl.config import load as load_config
from diffusion_rl.models.policies import DEFAULT

ROOT = Path(__file__).resolve().parents[2]
SAMPLED = 3.5


def guidance_seen(model) -> list:
    """The guidance scale of every velocity call `model` makes from now on, in order."""
    seen, velocity = [], model.velocity

    def spy(latents, sigma, cond, guidance):
        seen.append(guidance)
        return velocity(latents, sigma, cond, guidance)

    model.velocity = spy
    return seen


@pytest.mark.parametrize("loss", ["nft", "awm", "dpo", "dgpo"])
@pytest.mark.parametrize(
    ("model_dir", "trained"), [("flux_model_dir", SAMPLED), ("tiny_model_dir", 1.0), ("flux_schnell_model_dir", 1.0)]
)
def test_forward_process_velocities_run_at_the_conditional_guidance(load, request, loss, model_dir, trained):
    config = load_config(ROOT / "configs" / f"quickstart_{loss}.yaml", [f"sampling.guidance={SAMPLED}"])
    algorithm = make_algorithm(config)
    model = load(request.getfixturevalue(model_dir), lora=True)
    algorithm.attach(model)
    seen = guidance_seen(model)
    x_t = torch.randn((2, *model.latent_shape(32, 32)), generator=torch.Generator().manual_seed(0))
    t_B = torch.tensor([0.3, 0.7])
    cond = model.encode_prompts(["a red cube", "a blue ball"], ["blurry", "blurry"])
    v = algorithm.velocity(x_t, t_B, cond)
    frozen = ["reference", *(name for name in model.policies.names() if name != DEFAULT)]
    for policy in frozen:
        algorithm.velocity_of(policy, x_t, t_B, cond)
    assert seen == [trained] * (1 + len(frozen))
    assert v.shape == x_t.shape and model.forwards_per_evaluation(SAMPLED) == (2 if trained == 1.0 else 1)


def test_dgpo_reference_guidance_runs_the_reference_guided(load, tiny_model_dir):
    """algorithm.dgpo.reference_guidance: the reference's velocity at that CFG scale (DGPO's kl_cfg), the policy's and
    `old`'s conditional."""
    overrides = ["sampling.guidance=1", "algorithm.dgpo.reference_guidance=4.5"]
    algorithm = make_algorithm(load_config(ROOT / "configs/quickstart_dgpo.yaml", overrides))
    model = load(tiny_model_dir, lora=True)
    algorithm.attach(model)
    seen = guidance_seen(model)
    x_t = torch.randn((2, *model.latent_shape(32, 32)), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red cube", "a blue ball"])
    algorithm.reference_velocity(x_t, torch.tensor([0.3, 0.7]), cond, algorithm.settings.reference_guidance)
    algorithm.velocity_of("old", x_t, torch.tensor([0.3, 0.7]), cond)
    assert seen == [4.5, 1.0]
