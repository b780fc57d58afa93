"""Every family through the same path: tiny model saved → loaded via model.path → sampled → one Flow-GRPO update."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.models.policies import DEFAULT
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, recompute_step, rollout
from diffusion_rl.sampling.window import default_window

FAMILIES = ["sd3", "flux", "flux_schnell", "flux2", "qwen_image", "z_image", "wan", "wan_ti2v"]
FAMILY_OF = {"sd3": "sd3", "flux": "flux", "flux_schnell": "flux", "flux2": "flux2", "qwen_image": "qwen_image",
             "z_image": "z_image", "wan": "wan", "wan_ti2v": "wan"}  # fmt: skip
FRAMES = {"wan": 5, "wan_ti2v": 5}  # the video families sample 5 frames (2 latent frames); images 1
GUIDANCE = 4.0  # CFG for sd3, schnell, qwen_image, z_image, wan; the guidance embedding for flux (dev); klein: ignored


@pytest.mark.parametrize("name", FAMILIES)
def test_family_is_detected_from_model_index_and_samples_2_steps(family_dirs, load, name):
    model = load(family_dirs[name])
    assert model.family == FAMILY_OF[name]
    frames = FRAMES.get(name, 1)
    settings = SamplerSettings(num_steps=2, guidance=GUIDANCE, height=32, width=32, frames=frames)
    cond = model.encode_prompts(["a red apple", "a lighthouse"], ["", "blurry"])
    with torch.no_grad():
        traj = rollout(
            model, cond, settings, None, init_seeds=[1, 2], noise_seeds=[1, 2], ids=anonymous_ids(["a", "b"])
        )
    video = (frames,) if model.video else ()
    assert traj.images.dtype == torch.uint8 and traj.images.shape == (2, *video, 32, 32, 3)
    assert traj.final_latents.shape == (2, *model.latent_shape(32, 32, frames))
    assert traj.final_latents.dtype == torch.float32
    assert traj.images.float().std() > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_rollout_log_probs_are_reproduced_by_recomputation(family_dirs, load, name):
    model = load(family_dirs[name], lora=True)
    settings = SamplerSettings(num_steps=4, guidance=GUIDANCE, height=32, width=32, sde_type="sde", noise_level=0.7,
                               frames=FRAMES.get(name, 1))  # fmt: skip
    prompts = ["a red apple", "a red apple", "a lighthouse at dusk on a rocky coast", "a cat"]
    cond = model.encode_prompts(prompts, ["", "", "blurry", ""])
    with torch.no_grad():
        ids = anonymous_ids(prompts)
        traj = rollout(model, cond, settings, default_window(4), init_seeds=[1, 2, 3, 4], noise_seeds=[5, 6, 7, 8],
                       ids=ids)  # fmt: skip
        assert traj.window_size == 3
        for j in range(traj.window_size):
            whole = _recompute(model, traj, j, settings)
            assert (whole.log_prob - traj.log_probs[:, j]).abs().max() <= 1e-6
            assert (whole.mean - traj.means[:, j]).abs().max() <= 1e-6
            for rows in (torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([3, 1])):  # micro-batches
                part = _recompute(model, traj[rows], j, settings)
                assert (part.log_prob - traj.log_probs[rows, j]).abs().max() <= 1e-6


def _recompute(model, traj, j, settings):
    x, x_next = traj.latents[:, j], traj.latents[:, j + 1]
    return recompute_step(model, x, x_next, traj.sigmas[:, j], traj.sigmas_next[:, j], traj.cond, settings)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_one_flow_grpo_update_moves_the_trained_weights_only(family_dirs, load, train_model, velocity_of, name, lora):
    trainer = train_model(
        family_dirs[name],
        f"model.lora.enabled={str(lora).lower()}",
        "model.lora.rank=4",
        f"sampling.guidance={GUIDANCE}",
        f"sampling.num_frames={FRAMES.get(name, 1)}",
        "train.total_steps=1",
        "algorithm.flow_grpo.kl_beta=0.04",
        "train.lr=1e-2",
    )
    model = trainer.engine.model
    named = dict(model.policies.trained.named_parameters())
    trained_before = {n: p.detach().clone() for n, p in named.items() if p.requires_grad}
    frozen_before = {n: p.detach().clone() for n, p in named.items() if not p.requires_grad}
    encoders = {n: m for n, m in model.pipeline.components.items() if isinstance(m, torch.nn.Module)}
    encoders.pop("transformer")
    encoder_before = {n: [p.detach().clone() for p in m.parameters()] for n, m in encoders.items()}
    grads_seen = set()
    for n, p in named.items():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p, n=n: grads_seen.add(n) if p.grad.abs().max() > 0 else None)

    rows = trainer.train()
    assert rows[0]["train/optimizer_steps"] == 1

    assert (lora and frozen_before) or (not lora and not frozen_before)
    moved = [n for n in grads_seen if not torch.equal(named[n], trained_before[n])]
    assert grads_seen and sorted(moved) == sorted(grads_seen), "a parameter with a gradient did not move"
    # Trained parameters with no (or a zero) gradient are left alone by AdamW: LoRA A's on the first step (B = 0
    # blocks their gradient) and what never reaches the image (the last block's text-stream outputs of SD3 and
    # Qwen-Image).
    for n, before in frozen_before.items():
        assert torch.equal(named[n], before), f"frozen {n} changed"
    for component, before in encoder_before.items():
        assert all(torch.equal(p, b) for p, b in zip(encoders[component].parameters(), before)), component

    base = load(family_dirs[name])
    v_base = velocity_of(base, GUIDANCE)
    with model.reference():
        assert torch.equal(velocity_of(model, GUIDANCE), v_base)  # the reference is the base model, bit for bit
    assert (velocity_of(model, GUIDANCE) - v_base).abs().max() > 1e-6


@pytest.mark.parametrize("name", ["flux", "flux2", "qwen_image", "z_image", "wan"])
def test_gradient_checkpointing_gives_the_same_gradients(family_dirs, load, name):
    grads = []
    for checkpointing in (False, True):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # peft draws LoRA A from the global generator: the same A for both models
            model = load(family_dirs[name], lora=True, gradient_checkpointing=checkpointing)
        assert model.policies.trained.base_model.model.gradient_checkpointing is checkpointing
        model.policies.trained.train()  # checkpointing only recomputes in training mode
        with torch.no_grad():  # a non-zero LoRA B so that every LoRA tensor gets a gradient
            for n, p in model.policies.trained.named_parameters():
                if "lora_B" in n:
                    p.fill_(0.01)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn((2, *model.latent_shape(32, 32)), generator=generator)
        cond = model.encode_prompts(["a red cube", "a blue ball"], ["", "blurry"])
        model.velocity(x, 0.7, cond, GUIDANCE).square().mean().backward()
        grads.append([p.grad.clone() for p in model.trainable_parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["flux", "flux2", "qwen_image", "z_image", "wan"])
def test_bf16_weights_give_fp32_velocities_and_fp32_lora(family_dirs, load, name):
    model = load(family_dirs[name], lora=True, dtype="bf16")
    for component in (model.pipeline.transformer, model.pipeline.text_encoder):  # (Wan keeps its norms in fp32)
        assert max(component.parameters(), key=lambda p: p.numel()).dtype == torch.bfloat16
    assert {p.dtype for p in model.trainable_parameters()} == {torch.float32}  # peft keeps the adapter in fp32
    cond = model.encode_prompts(["a red cube"])
    assert cond["prompt_embeds"].dtype == torch.bfloat16
    v = model.velocity(torch.randn(1, *model.latent_shape(32, 32)), 0.5, cond, GUIDANCE)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


@pytest.mark.parametrize("name", ["flux", "flux_schnell", "flux2", "qwen_image", "wan"])
def test_each_distinct_prompt_is_encoded_once(family_dirs, load, name):
    model = load(family_dirs[name])
    seen = []
    encode = model.pipeline.encode_prompt

    def spy(prompt, **kwargs):
        seen.append(list(prompt))
        return encode(prompt=prompt, **kwargs)

    model.pipeline.encode_prompt = spy
    cond = model.encode_prompts(["a cat", "a cat", "a dog", "a cat"], ["", "", "", "blurry"])
    uses_negatives = name not in ("flux", "flux2")  # FLUX.1-dev: a guidance embedding; klein: CFG-free
    expected = ["a cat", "a dog", "", "blurry"] if uses_negatives else ["a cat", "a dog"]
    assert len(seen) == 1 and sorted(seen[0]) == sorted(expected)
    embeds = cond["prompt_embeds"]
    assert torch.equal(embeds[0], embeds[1]) and torch.equal(embeds[0], embeds[3])
    assert not torch.equal(embeds[0], embeds[2])
    assert ("negative_prompt_embeds" in cond) == uses_negatives
    if uses_negatives:
        negative = cond["negative_prompt_embeds"]
        assert torch.equal(negative[0], negative[2]) and not torch.equal(negative[0], negative[3])
    alone = model.encode_prompts(["a dog"], ["blurry"])  # the same numbers as when encoded in a batch
    assert torch.allclose(embeds[2].float(), alone["prompt_embeds"][0].float(), atol=1e-5)


@pytest.mark.parametrize("name", ["flux", "qwen_image"])
def test_user_lora_targets_replace_the_preset(family_dirs, name):
    from diffusion_rl.config.model import LoraConfig, ModelConfig
    from diffusion_rl.errors import UserError
    from diffusion_rl.models.loader import load_model

    lora = LoraConfig(enabled=True, rank=2, alpha=4, target_modules=["attn.to_q"])
    model = load_model(ModelConfig(path=str(family_dirs[name]), device="cpu", max_sequence_length=16, lora=lora))
    names = [n for n, p in model.policies.trained.named_parameters() if p.requires_grad]
    assert names and all(".attn.to_q.lora_" in n and f".{DEFAULT}." in n for n in names)
    bad = LoraConfig(enabled=True, rank=2, alpha=4, target_modules=["no_such_layer"])
    with pytest.raises(UserError, match="model.lora.target_modules"):
        load_model(ModelConfig(path=str(family_dirs[name]), device="cpu", max_sequence_length=16, lora=bad))


def test_family_presets_cover_both_streams_and_their_mlps(family_dirs, load):
    flux = {n for n, p in load(family_dirs["flux"], lora=True).policies.trained.named_parameters() if p.requires_grad}
    for part in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj", "ff_context.net.2",
                 "single_transformer_blocks.0.attn.to_v", "single_transformer_blocks.0.proj_mlp"):  # fmt: skip
        assert any(part in n for n in flux), part
    assert not any(n.startswith("base_model.model.proj_out") for n in flux)  # the output layer stays frozen
    qwen = load(family_dirs["qwen_image"], lora=True).policies.trained.named_parameters()
    qwen = {n for n, p in qwen if p.requires_grad}
    for part in ("attn.to_q", "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "txt_mlp.net.2"):
        assert any(part in n for n in qwen), part


def test_explicit_family_that_disagrees_with_model_index_is_an_error(flux_model_dir):
    from diffusion_rl.config.model import ModelConfig
    from diffusion_rl.errors import UserError
    from diffusion_rl.models.loader import load_model

    with pytest.raises(UserError, match="model.family=qwen_image .* holds a flux pipeline"):
        load_model(ModelConfig(path=str(flux_model_dir), family="qwen_image", device="cpu"))
    assert load_model(ModelConfig(path=str(flux_model_dir), family="flux", device="cpu")).family == "flux"
