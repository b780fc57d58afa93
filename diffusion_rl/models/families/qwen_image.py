"""Qwen-Image: a Qwen2.5-VL text encoder, AutoencoderKLQwenImage, 2×2-packed latents, true CFG with norm rescale.

Text: the pipeline wraps each prompt in its chat template, runs the VL model and keeps the last hidden states of
the prompt's own tokens, so prompts give embeddings of different lengths. We pad every prompt to
`max_sequence_length` with a mask (a fixed width, so conditionings of separate chunks of a batch concatenate),
and cut the all-padding tail of a batch off before each forward pass (masked keys weigh nothing in attention).

Guidance: true CFG in one batched forward over [negative; positive], then the combined velocity rescaled, token
by token, to the norm of the conditional one over the channel dimension, as QwenImagePipeline does.

Time units: `QwenImageTransformer2DModel` takes `timestep` = σ and scales it by 1000 in its time projection,
so σ goes in unchanged.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from diffusion_rl.errors import UserError
from diffusion_rl.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    as_sigma_batch,
    images_to_uint8,
    on_meta,
    uint8_to_images,
    video_vae_stats,
)
from diffusion_rl.models.guidance import guided
from diffusion_rl.models.packed import PackedLatentModel, pack_latents, tokens_of, unpack_latents
from diffusion_rl.models.registry import ModelFamily, register_family

# verl-omni's Qwen-Image LoRA targets: attention of both streams and both streams' MLPs
QWEN_IMAGE_LORA_TARGETS = (
    *JOINT_ATTENTION_LORA_TARGETS,
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)

MAX_TEXT_TOKENS = 1024  # the pipeline's limit


def norm_rescaled_cfg(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """u + s·(c − u), rescaled along the last dimension to the norm of c (each token keeps c's magnitude)."""
    combined = guided(v_uncond, v_cond, scale)
    return combined * (v_cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


class QwenImageModel(PackedLatentModel):
    frozen_components = ("text_encoder", "vae")

    def configure(self) -> None:
        if self.pipeline.transformer.config.get("guidance_embeds"):  # the pipeline would pass its guidance_scale
            raise UserError(
                "this Qwen-Image checkpoint's transformer/config.json sets guidance_embeds: true: a guidance-distilled "
                "Qwen-Image is not supported here (no released one is)"
            )
        self.max_sequence_length = min(self.max_sequence_length, MAX_TEXT_TOKENS)
        self.latent_channels = self.pipeline.transformer.config.in_channels // 4
        self.vae_scale = 2 ** len(self.vae.temperal_downsample)

    # -- conditioning -----------------------------------------------------------------------------------------
    def _encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipeline.encode_prompt(
            prompt=texts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        padded, padded_mask = self.pad_text(embeds, mask)
        return {"prompt_embeds": padded, "prompt_embeds_mask": padded_mask}

    def pad_text(self, embeds: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Text embeddings [N, L, D] (mask [N, L] or None: all valid) padded to max_sequence_length: (embeds in the
        model's dtype, zero at padding as the pipeline makes them; bool mask)."""
        N, length, D = embeds.shape
        if length > self.max_sequence_length:
            raise UserError(
                f"a prompt is {length} tokens long (with its condition images' tokens, for an edit), more than "
                f"model.max_sequence_length={self.max_sequence_length}: raise it (at most {MAX_TEXT_TOKENS})"
            )
        mask = torch.ones(N, length, dtype=torch.bool, device=embeds.device) if mask is None else mask.bool()
        padded = embeds.new_zeros(N, self.max_sequence_length, D).to(self.dtype)
        padded[:, :length] = embeds.to(self.dtype) * mask[..., None]
        padded_mask = mask.new_zeros(N, self.max_sequence_length)
        padded_mask[:, :length] = mask
        return padded, padded_mask

    def text_cond(
        self, embeds: torch.Tensor, mask: torch.Tensor, prompt_idx: torch.Tensor, negative_idx: torch.Tensor
    ) -> TensorDict:
        """The batch's conditioning: row i takes text prompt_idx[i] and negative negative_idx[i] of the encoded."""
        prompt_idx, negative_idx = prompt_idx.to(embeds.device), negative_idx.to(embeds.device)
        return TensorDict(
            {
                "prompt_embeds": embeds[prompt_idx],
                "prompt_embeds_mask": mask[prompt_idx],
                "negative_prompt_embeds": embeds[negative_idx],
                "negative_prompt_embeds_mask": mask[negative_idx],
            },
            batch_size=[len(prompt_idx)],
            device=self.device,
        )

    def pipeline_call_settings(self, guidance: float, low_noise: float | None) -> dict:
        """The pipeline's classifier-free (norm-rescaled) guidance is its true_cfg_scale (default 4); its
        guidance_scale is for guidance-distilled checkpoints only."""
        return {"true_cfg_scale": guidance, "max_sequence_length": self.max_sequence_length}

    # -- the network ------------------------------------------------------------------------------------------
    def velocity(self, latents, sigma, cond: TensorDict, guidance: float) -> torch.Tensor:
        B, h, w, K = latents.shape
        x = tokens_of(latents)
        shapes = [(1, h, w)]
        sources = cond.get("image_latents", None)  # [B, k, h', w', K]: an edit's condition images
        if sources is not None:  # their tokens follow the generated ones
            x = torch.cat([x, sources.reshape(B, -1, K).to(x.dtype)], dim=1)
            shapes += [(1, sources.shape[2], sources.shape[3])] * sources.shape[1]
        x = x.to(self.dtype)
        sigma_B = as_sigma_batch(sigma, B, latents.device)
        embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
        true_cfg = guidance > 1.0
        if true_cfg:  # one forward over [uncond; cond]
            x, sigma_B = torch.cat([x, x]), torch.cat([sigma_B, sigma_B])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            mask = torch.cat([cond["negative_prompt_embeds_mask"], mask])
        used = mask.any(dim=0).nonzero()
        length = int(used.max()) + 1 if len(used) else mask.shape[1]  # cut the columns that pad every row
        v = self.policies.module(
            hidden_states=x,
            timestep=sigma_B,  # σ: the network scales it by 1000
            encoder_hidden_states=embeds[:, :length],
            encoder_hidden_states_mask=mask[:, :length],
            img_shapes=[shapes] * x.shape[0],
            return_dict=False,
        )[0][:, : h * w].float()  # the generated tokens' velocity (an edit's condition tokens are inputs only)
        if true_cfg:
            v_uncond, v_cond = v.chunk(2)
            v = norm_rescaled_cfg(v_uncond, v_cond, guidance)
        return v.reshape(B, h, w, K)

    # -- what estimate counts ----------------------------------------------------------------------------------
    @classmethod
    def text_tokens(cls, arch, max_sequence_length: int, prompt_tokens: int) -> int:
        return min(prompt_tokens, max_sequence_length)  # the template is cut, and so are the padding columns

    @classmethod
    def text_shapes(cls, arch, max_sequence_length: int, prompt_tokens: int) -> dict[str, tuple[int, ...]]:
        """Qwen2.5-VL's last hidden states padded to max_sequence_length, and their mask."""
        length, width = max_sequence_length, arch.transformer_config["joint_attention_dim"]
        return {"prompt_embeds": (length, width), "prompt_embeds_mask": (length,)}

    @classmethod
    def meta_inputs(cls, config: dict, batch: int, latent: tuple[int, int, int], text: int, dtype,
                    sources: int = 0, source_latent: tuple[int, int, int] | None = None) -> dict:  # fmt: skip
        _, h, w = latent
        _, sh, sw = source_latent or latent
        grids = [(1, h // 2, w // 2)] + [(1, sh // 2, sw // 2)] * sources  # an edit's source images after the latents
        tokens = sum(f * gh * gw for f, gh, gw in grids)
        return dict(hidden_states=on_meta(batch, tokens, config["in_channels"], dtype=dtype),
                    timestep=torch.ones(batch, device="meta"),
                    encoder_hidden_states=on_meta(batch, text, config["joint_attention_dim"], dtype=dtype),
                    encoder_hidden_states_mask=on_meta(batch, text, dtype=torch.bool),
                    img_shapes=[grids] * batch, return_dict=False)  # fmt: skip

    # -- pixels (the VAE is a video VAE run on one frame) --------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = video_vae_stats(self.vae, self.vae.dtype)
        z = unpack_latents(latents).to(self.vae.device, self.vae.dtype)[:, :, None] * std + mean
        return images_to_uint8(self.vae.decode(z, return_dict=False)[0][:, :, 0])

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        mean, std = video_vae_stats(self.vae, self.vae.dtype)
        pixels = uint8_to_images(images).to(self.vae.device, self.vae.dtype)[:, :, None]
        z = (self.vae.encode(pixels).latent_dist.mode() - mean) / std
        return pack_latents(z[:, :, 0]).float()


register_family(
    ModelFamily(
        name="qwen_image",
        pipeline="QwenImagePipeline",
        adapter=QwenImageModel,
        tiny="diffusion_rl.models.tiny.qwen_image",
        lora_targets=QWEN_IMAGE_LORA_TARGETS,
    )
)
