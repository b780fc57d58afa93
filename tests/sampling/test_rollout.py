"""The sampler loop on the tiny SD3 model: trajectory layout, seeding, batch invariance, log-prob recomputation."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.models.loader import load_model
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, recompute_step, rollout
from diffusion_rl.sampling.window import SdeWindow, default_window

STEPS = 4
SETTINGS = SamplerSettings(num_steps=STEPS, guidance=4.5, height=32, width=32, sde_type="sde", noise_level=0.7)
PROMPTS = ["a red cube", "a blue ball", "a red cube", "green grass"]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16, lora=LoraConfig(enabled=False))
    return load_model(cfg)


@pytest.fixture(scope="module")
def cond(model):
    return model.encode_prompts(PROMPTS)


def _ids(n: int):
    return anonymous_ids(PROMPTS[:n])


def _run(model, cond, window, init_seeds=(10, 11, 12, 13), noise_seeds=(20, 21, 22, 23), settings=SETTINGS):
    n = len(init_seeds)
    return rollout(
        model, cond[:n], settings, window, init_seeds=list(init_seeds), noise_seeds=list(noise_seeds), ids=_ids(n)
    )


@pytest.fixture(scope="module")
def traj(model, cond):
    """The default window (every step but the last is SDE) over the 4 prompts."""
    return _run(model, cond, default_window(STEPS))


def test_trajectory_shapes_for_the_default_window(model, traj):
    batch, width = len(PROMPTS), STEPS - 1
    latent = model.latent_shape(32, 32)
    assert latent == (4, 8, 8)
    expected = {
        "latents": (batch, width + 1, *latent),
        "log_probs": (batch, width),
        "means": (batch, width, *latent),
        "stds": (batch, width),
        "sigmas": (batch, width),
        "sigmas_next": (batch, width),
        "step_index": (batch, width),
        "final_latents": (batch, *latent),
        "images": (batch, 32, 32, 3),
    }
    assert {k: tuple(getattr(traj, k).shape) for k in expected} == expected
    assert traj.window_size == width
    assert traj.images.dtype == torch.uint8
    fields = ("latents", "log_probs", "means", "sigmas", "final_latents")
    assert all(getattr(traj, k).dtype == torch.float32 for k in fields)
    assert traj.step_index[0].tolist() == [0, 1, 2]
    schedule = model.sigma_schedule(STEPS, 32, 32)
    assert torch.equal(traj.sigmas[0], schedule[:width])
    assert torch.equal(traj.sigmas_next[0], schedule[1 : width + 1])
    assert torch.isfinite(traj.log_probs).all() and (traj.stds > 0).all()


def test_trajectory_of_a_window_of_two_starting_at_one(model, cond):
    traj = _run(model, cond, SdeWindow(start=1, size=2))
    batch, latent = len(PROMPTS), model.latent_shape(32, 32)
    assert traj.latents.shape == (batch, 3, *latent)
    assert traj.means.shape == (batch, 2, *latent)
    for key in ("log_probs", "stds", "sigmas", "sigmas_next", "step_index"):
        assert getattr(traj, key).shape == (batch, 2), key
    assert traj.step_index[0].tolist() == [1, 2]
    schedule = model.sigma_schedule(STEPS, 32, 32)
    assert traj.sigmas[0].tolist() == schedule[1:3].tolist()
    # after the window, the last step is a plain Euler step from the window's last latents
    x, sigma, sigma_next = traj.latents[:, -1], schedule[3].item(), schedule[4].item()
    v = model.velocity(x, sigma, cond, SETTINGS.guidance)
    assert torch.allclose(traj.final_latents, x + (sigma_next - sigma) * v, atol=1e-5)


def test_rollout_is_deterministic_for_the_same_seeds(model, cond, traj):
    again = _run(model, cond, default_window(STEPS))
    for key in ("final_latents", "images", "latents", "log_probs", "means", "stds", "sigmas", "sigmas_next"):
        assert torch.equal(getattr(again, key), getattr(traj, key)), key


def test_samples_draw_different_noise(model, cond):
    # one prompt, one initial noise, two SDE noise seeds: the samples share x_1 and part from the first step
    same_prompt = cond[[0, 0]]
    traj = rollout(
        model, same_prompt, SETTINGS, default_window(STEPS), init_seeds=[5, 5], noise_seeds=[1, 2], ids=_ids(2)
    )
    assert torch.equal(traj.latents[0, 0], traj.latents[1, 0])
    assert not torch.allclose(traj.latents[0, 1], traj.latents[1, 1], atol=1e-3)
    # different init seeds give different x_1
    traj = rollout(
        model, same_prompt, SETTINGS, default_window(STEPS), init_seeds=[5, 6], noise_seeds=[1, 1], ids=_ids(2)
    )
    assert not torch.allclose(traj.latents[0, 0], traj.latents[1, 0], atol=1e-3)


def test_initial_latents_depend_on_the_init_seed_only(model, cond, traj):
    # sharing the initial noise across a group is done by giving its samples the same init seed
    other = _run(model, cond, default_window(STEPS), noise_seeds=(30, 31, 32, 33))
    assert torch.equal(other.latents[:, 0], traj.latents[:, 0])
    assert torch.equal(traj.latents[:, 0], initial_noise(model, SETTINGS, [10, 11, 12, 13]))


def test_only_window_steps_are_stochastic(model, cond):
    window = SdeWindow(start=1, size=2)  # steps 1 and 2 of 0..3
    a = _run(model, cond, window, noise_seeds=(20, 21, 22, 23))
    b = _run(model, cond, window, noise_seeds=(40, 41, 42, 43))
    assert torch.equal(a.latents[:, 0], b.latents[:, 0])  # x before step 1: ODE step 0 draws nothing
    assert torch.equal(a.means[:, 0], b.means[:, 0])
    assert not torch.allclose(a.latents[:, 1], b.latents[:, 1], atol=1e-3)
    assert not torch.allclose(a.final_latents, b.final_latents, atol=1e-3)


def test_a_sample_does_not_depend_on_its_batch(model, cond, traj):
    for i in range(len(PROMPTS)):
        window = default_window(STEPS)
        alone = rollout(
            model, cond[i : i + 1], SETTINGS, window, init_seeds=[10 + i], noise_seeds=[20 + i], ids=_ids(1)
        )
        for key in ("final_latents", "log_probs", "latents", "means"):
            assert torch.allclose(getattr(alone, key)[0], getattr(traj, key)[i], atol=1e-5), (i, key)
        # uint8 images: a float difference in the last bits may flip one rounding
        diff = (alone.images[0].int() - traj.images[i].int()).abs().max().item()
        assert diff <= 1, (i, diff)


def test_recompute_step_reproduces_the_rollout_log_probs(model, cond, traj):
    for j in range(traj.window_size):
        with torch.no_grad():
            x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
            out = recompute_step(model, x, x_next, traj.sigmas[:, j], traj.sigmas_next[:, j], cond, SETTINGS)
        assert (out.log_prob - traj.log_probs[:, j]).abs().max().item() <= 1e-6, j
        assert torch.allclose(out.mean, traj.means[:, j], atol=1e-6)
        assert torch.equal(out.prev_sample, traj.latents[:, j + 1])


def test_rollout_without_a_window_is_the_euler_ode(model, cond):
    traj = _run(model, cond, None)
    assert traj.window_size == 0 and traj.log_probs is None and traj.latents is None
    assert traj.images.shape == (len(PROMPTS), 32, 32, 3)
    # the flow ODE by hand: x ← x + (σ_next − σ)·v from x_1
    schedule = model.sigma_schedule(STEPS, 32, 32).tolist()
    x = initial_noise(model, SETTINGS, [10, 11, 12, 13])
    for sigma, sigma_next in zip(schedule[:-1], schedule[1:]):
        x = x + (sigma_next - sigma) * model.velocity(x, sigma, cond, SETTINGS.guidance)
    assert torch.allclose(traj.final_latents, x, atol=1e-5)
    assert torch.equal(traj.images, model.decode(x))


def test_rollout_rejects_mismatched_batch_sizes(model, cond):
    with pytest.raises(ValueError, match="seeds"):
        rollout(model, cond, SETTINGS, None, init_seeds=[1, 2], noise_seeds=[1, 2], ids=_ids(2))


@pytest.mark.parametrize("steps", [1, 4, 10])
def test_sigma_schedule_runs_from_one_to_zero(model, steps):
    sigmas = model.sigma_schedule(steps, 32, 32)
    assert sigmas.shape == (steps + 1,) and sigmas.dtype == torch.float32
    assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
    assert (sigmas[1:] < sigmas[:-1]).all()


def test_encode_prompts_needs_one_negative_per_prompt(model):
    with pytest.raises(ValueError, match="1 negative prompts for 2 prompts"):
        model.encode_prompts(["a", "b"], ["ugly"])


def test_encode_prompts_pairs_each_prompt_with_its_negative(model, cond):
    mixed = model.encode_prompts(["a red cube", "a red cube"], ["", "blurry"])
    assert torch.equal(mixed["prompt_embeds"][0], mixed["prompt_embeds"][1])
    assert torch.equal(mixed["negative_prompt_embeds"][0], cond["negative_prompt_embeds"][0])
    assert not torch.allclose(mixed["negative_prompt_embeds"][0], mixed["negative_prompt_embeds"][1])


def test_guidance_combines_separate_cond_and_uncond_forwards(model, cond):
    latents = initial_noise(model, SETTINGS, [1, 2, 3, 4])
    swapped = TensorDict(
        {
            "prompt_embeds": cond["negative_prompt_embeds"],
            "pooled_prompt_embeds": cond["negative_pooled_prompt_embeds"],
            "negative_prompt_embeds": cond["prompt_embeds"],
            "negative_pooled_prompt_embeds": cond["pooled_prompt_embeds"],
        },
        batch_size=cond.batch_size,
    )
    sigma = torch.tensor([0.9, 0.7, 0.5, 0.3])
    v_cond = model.velocity(latents, sigma, cond, 1.0)
    v_uncond = model.velocity(latents, sigma, swapped, 1.0)
    assert not torch.allclose(v_cond, v_uncond, atol=1e-4)  # the prompt matters
    for g in (2.0, 4.5):
        expected = v_uncond + g * (v_cond - v_uncond)
        assert torch.allclose(model.velocity(latents, sigma, cond, g), expected, atol=1e-5), g
    assert model.velocity(latents, sigma, cond, 1.0).dtype == torch.float32
