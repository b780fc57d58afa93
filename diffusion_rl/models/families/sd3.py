"""Stable Diffusion 3 / 3.5 (and the tiny family, which is an SD3 pipeline with random weights)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from diffusion_rl.errors import UserError
from diffusion_rl.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    FlowModel,
    as_sigma_batch,
    images_to_uint8,
    on_meta,
    single_frame,
    uint8_to_images,
)
from diffusion_rl.models.guidance import guided
from diffusion_rl.models.registry import ModelFamily, register_family

# flow_grpo's SD3 targets: every attention projection of the joint blocks, image and text streams
SD3_LORA_TARGETS = (*JOINT_ATTENTION_LORA_TARGETS,)


class SD3Model(FlowModel):
    frozen_components = ("text_encoder", "text_encoder_2", "text_encoder_3", "vae")

    def configure(self) -> None:
        if self._scheduler_config.get("use_dynamic_shifting"):  # SD3's pipeline would compute μ from the tokens
            raise UserError(
                "this SD3 checkpoint's scheduler/scheduler_config.json sets use_dynamic_shifting: true, not supported "
                "here: SD3 sampling uses the scheduler's fixed shift, as every SD3 / SD3.5 release sets"
            )
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.timestep_scale = float(self._scheduler_config.num_train_timesteps)  # SD3 timestep = 1000·σ

    def _encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        # a negative prompt goes through the same encoders as a prompt: one batch of distinct texts serves both
        embeds, _, pooled, _ = self.pipeline.encode_prompt(
            prompt=texts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def velocity(self, latents, sigma, cond: TensorDict, guidance: float) -> torch.Tensor:
        batch = latents.shape[0]
        timestep = as_sigma_batch(sigma, batch, latents.device) * self.timestep_scale
        x = latents.to(self.dtype)
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        if guidance > 1.0:  # one forward over [uncond; cond]
            x = torch.cat([x, x])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
        v = self.policies.module(
            hidden_states=x,
            timestep=timestep,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            return_dict=False,
        )[0].float()
        if guidance > 1.0:
            v = guided(*v.chunk(2), guidance)
        return v

    @classmethod
    def text_tokens(cls, arch, max_sequence_length: int, prompt_tokens: int) -> int:
        """The CLIPs' fixed positions (77 in the real ones; side by side in the channels), then T5's tokens."""
        return max((e.positions for e in arch.text_encoders if e.kind == "clip"), default=77) + max_sequence_length

    @classmethod
    def text_shapes(cls, arch, max_sequence_length: int, prompt_tokens: int) -> dict[str, tuple[int, ...]]:
        """The CLIPs' tokens (padded to T5's width), then T5's; the CLIPs' pooled outputs side by side."""
        c = arch.transformer_config
        tokens = cls.text_tokens(arch, max_sequence_length, prompt_tokens)
        pooled = c["pooled_projection_dim"]
        return {"prompt_embeds": (tokens, c["joint_attention_dim"]), "pooled_prompt_embeds": (pooled,)}

    @classmethod
    def meta_inputs(cls, config: dict, batch: int, latent: tuple[int, int, int], text: int, dtype) -> dict:
        _, h, w = latent
        return dict(hidden_states=on_meta(batch, config["in_channels"], h, w, dtype=dtype),
                    timestep=torch.ones(batch, device="meta") * 1000,
                    encoder_hidden_states=on_meta(batch, text, config["joint_attention_dim"], dtype=dtype),
                    pooled_projections=on_meta(batch, config["pooled_projection_dim"], dtype=dtype),
                    return_dict=False)  # fmt: skip

    def latent_shape(self, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        single_frame(self.family, frames)
        step = self.size_step(self.vae_scale, self.pipeline.transformer.config)
        if height % step or width % step:
            raise ValueError(f"height and width must be multiples of {step}, got {height}×{width}")
        return (self.vae.config.latent_channels, height // self.vae_scale, width // self.vae_scale)

    def _build_sigma_schedule(self, num_steps: int, height: int, width: int, frames: int) -> torch.Tensor:
        scheduler = self.fresh_scheduler()  # SD3's shift is fixed: the size plays no part
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        latents = latents.to(self.vae.dtype) / config.scaling_factor + config.shift_factor
        return images_to_uint8(self.vae.decode(latents, return_dict=False)[0])

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        pixels = uint8_to_images(images).to(self.device, self.vae.dtype)
        posterior = self.vae.encode(pixels).latent_dist
        return ((posterior.mode() - config.shift_factor) * config.scaling_factor).float()


register_family(
    ModelFamily(
        name="sd3",
        pipeline="StableDiffusion3Pipeline",
        adapter=SD3Model,
        tiny="diffusion_rl.models.tiny.sd3",
        lora_targets=SD3_LORA_TARGETS,
    )
)
