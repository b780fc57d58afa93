"""FLUX.1 (dev and schnell): T5 + CLIP-pooled conditioning, 2×2-packed latents, resolution-dependent shift.

FLUX.1-dev is guidance-distilled: the guidance scale enters the transformer as an embedding, so every step is
one forward pass and negative prompts play no part. FLUX.1-schnell has no guidance embedding; for it (and any
FLUX transformer without one) `guidance > 1` means ordinary classifier-free guidance with the negative prompts,
in one batched forward over [negative; positive].

Time units: `FluxTransformer2DModel` takes `timestep` = σ and multiplies it by 1000 itself (as it does the
guidance scale), so σ goes in unchanged.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from diffusion_rl.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    as_sigma_batch,
    images_to_uint8,
    on_meta,
    refuse_condition_images,
    uint8_to_images,
)
from diffusion_rl.models.guidance import guided
from diffusion_rl.models.packed import (
    PackedLatentModel,
    latent_image_ids,
    pack_latents,
    tokens_of,
    unpack_latents,
)
from diffusion_rl.models.registry import ModelFamily, register_family

# Attention of both streams (the single blocks' to_q/k/v match too), the double blocks' feed-forwards and the
# single blocks' MLP input. Not `proj_out`: the name also matches the model's final output layer.
FLUX_LORA_TARGETS = (
    *JOINT_ATTENTION_LORA_TARGETS,
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "proj_mlp",
)

MAX_T5_TOKENS = 512  # the pipeline refuses longer text


class FluxModel(PackedLatentModel):
    frozen_components = ("text_encoder", "text_encoder_2", "vae")

    def configure(self) -> None:
        self.max_sequence_length = min(self.max_sequence_length, MAX_T5_TOKENS)
        config = self.pipeline.transformer.config
        # dev: guidance is an input of the network; schnell: none, so guidance > 1 is real CFG
        self.guidance_embeds = bool(config.guidance_embeds)
        self.latent_channels = config.in_channels // 4
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)

    def pipeline_call_settings(self, guidance: float, low_noise: float | None) -> dict:
        """dev: the embedded scale is the pipeline's guidance_scale; without the embedding (schnell) our guidance is
        classifier-free, the pipeline's true_cfg_scale (its guidance_scale goes unused there)."""
        if self.guidance_embeds:
            return super().pipeline_call_settings(guidance, low_noise)
        return {"true_cfg_scale": guidance, "max_sequence_length": self.max_sequence_length}

    # -- conditioning -----------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], negative: list[str] | None = None, images=None) -> TensorDict:
        refuse_condition_images(self.family, images)
        # negatives only matter for true CFG, which a guidance-distilled model never runs
        if not self.guidance_embeds and negative is None:
            negative = [""] * len(prompts)
        return self.text_conditioning(prompts, None if self.guidance_embeds else negative)

    def _encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.pipeline.encode_prompt(
            prompt=texts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    @classmethod
    def text_shapes(cls, arch, max_sequence_length: int, prompt_tokens: int) -> dict[str, tuple[int, ...]]:
        """T5's tokens (padded to max_sequence_length) and CLIP-L's pooled output."""
        c = arch.transformer_config
        return {"prompt_embeds": (max_sequence_length, c["joint_attention_dim"]),
                "pooled_prompt_embeds": (c["pooled_projection_dim"],)}  # fmt: skip

    # -- the network ------------------------------------------------------------------------------------------
    @classmethod
    def meta_inputs(cls, config: dict, batch: int, latent: tuple[int, int, int], text: int, dtype,
                    sources: int = 0, source_latent: tuple[int, int, int] | None = None) -> dict:  # fmt: skip
        _, h, w = latent
        _, sh, sw = source_latent or latent
        tokens = (h // 2) * (w // 2) + sources * (sh // 2) * (sw // 2)  # packed 2×2 patches; Kontext's source after
        t = torch.ones(batch, device="meta")
        inputs = dict(hidden_states=on_meta(batch, tokens, config["in_channels"], dtype=dtype), timestep=t,
                      encoder_hidden_states=on_meta(batch, text, config["joint_attention_dim"], dtype=dtype),
                      pooled_projections=on_meta(batch, config["pooled_projection_dim"], dtype=dtype),
                      txt_ids=on_meta(text, 3), img_ids=on_meta(tokens, 3), return_dict=False)  # fmt: skip
        if config.get("guidance_embeds"):
            inputs["guidance"] = t
        return inputs

    def velocity(self, latents, sigma, cond: TensorDict, guidance: float) -> torch.Tensor:
        B, h, w, K = latents.shape
        x, ids = tokens_of(latents), latent_image_ids(h, w, latents.device)
        sources = cond.get("image_latents", None)  # [B, k, h', w', K]: FLUX.1 Kontext's condition image
        if sources is not None:  # its tokens follow the generated ones, their ids' first coordinate 1 instead of 0
            x = torch.cat([x, sources.reshape(B, -1, K).to(x.dtype)], dim=1)
            source_ids = latent_image_ids(sources.shape[2], sources.shape[3], latents.device)
            source_ids[:, 0] = 1
            ids = torch.cat([ids, source_ids.repeat(sources.shape[1], 1)])
        x = x.to(self.dtype)
        sigma_B = as_sigma_batch(sigma, B, latents.device)
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        true_cfg = not self.guidance_embeds and guidance > 1.0
        if true_cfg:  # one forward over [uncond; cond]
            x, sigma_B = torch.cat([x, x]), torch.cat([sigma_B, sigma_B])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
        guidance_B = self.guidance_input(guidance, x.shape[0], latents.device)
        v = self.policies.module(
            hidden_states=x,
            timestep=sigma_B,  # σ: the network scales it by 1000
            guidance=guidance_B,
            pooled_projections=pooled,
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=latents.device),
            img_ids=ids,
            return_dict=False,
        )[0][:, : h * w].float()  # the generated tokens' velocity (condition tokens are inputs only)
        if true_cfg:
            v = guided(*v.chunk(2), guidance)
        return v.reshape(B, h, w, K)

    # -- pixels ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        z = unpack_latents(latents).to(self.vae.dtype) / config.scaling_factor + config.shift_factor
        return images_to_uint8(self.vae.decode(z, return_dict=False)[0])

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        pixels = uint8_to_images(images).to(self.device, self.vae.dtype)
        z = self.vae.encode(pixels).latent_dist.mode()
        return pack_latents((z - config.shift_factor) * config.scaling_factor).float()


register_family(
    ModelFamily(
        name="flux",
        pipeline="FluxPipeline",
        adapter=FluxModel,
        tiny="diffusion_rl.models.tiny.flux",
        lora_targets=FLUX_LORA_TARGETS,
    )
)
