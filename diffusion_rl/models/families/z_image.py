"""Z-Image and Z-Image-Turbo: a Qwen3 text encoder, a single-stream transformer, the FLUX.1 VAE, a fixed shift.

Text: the pipeline wraps each prompt in the tokenizer's chat template (thinking enabled: nothing after the
assistant's turn starts), pads to `max_sequence_length`, runs Qwen3 and keeps the second-to-last hidden states of
the non-padding tokens, so prompts give embeddings of different lengths; the transformer takes them as a list.
We keep them padded to `max_sequence_length` with a mask (a fixed width, so conditionings of separate chunks of
a batch concatenate) and hand the transformer each row's valid tokens, as the pipeline does.

Latents: [C, H/8, W/8] unpacked, as SD3's (the transformer patchifies 2×2 itself, taking a list of [C, 1, H, W]);
the VAE is FLUX.1's AutoencoderKL with its scaling and shift factors, so latents, sizes and the VAE are SD3's.

Time and sign: the transformer takes t = 1 − σ (scaled by its `t_scale` 1000 inside) and predicts the
direction from noise to data; the pipeline negates it before the Euler step x ← x + (σ' − σ)·v, so our velocity
(noise minus data, as every family's) is minus the transformer's output.

Guidance: the pipeline's `guidance_scale` g gives c + g·(c − u); ours is u + s·(c − u) like every family's, so
s = g + 1: guidance ≤ 1 is the CFG-free sampling Z-Image-Turbo is distilled for (the pipeline's g = 0).
The pipeline's optional `cfg_normalization` and `cfg_truncation` are off by default and not supported here.

Text length: the transformer's RoPE gives the caption positions 1…L' on its first axis (L' the caption's length padded
to a multiple of 32) and the image the next, all below `axes_lens[0]` (1536 in Z-Image): `model.max_sequence_length`
above `max_text_tokens` (1504 there) is refused when the model loads (the pipeline would fail inside the RoPE on the
first prompt that long).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from diffusion_rl.errors import UserError
from diffusion_rl.models.base import as_sigma_batch, on_meta
from diffusion_rl.models.families.sd3 import SD3Model
from diffusion_rl.models.guidance import guided
from diffusion_rl.models.packed import packed_sigma_schedule
from diffusion_rl.models.registry import ModelFamily, register_family

# every linear layer of the single-stream blocks: attention and the SwiGLU feed-forward
Z_IMAGE_LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")  # fmt: skip


def max_text_tokens(transformer_config) -> int:
    """The most caption tokens a ZImageTransformer2DModel of `transformer_config` takes: its caption, padded to a
    multiple of SEQ_MULTI_OF (32), at positions 1…L' of the RoPE's first axis and the image at L' + 1, below
    axes_lens[0] positions (diffusers 0.42.1's patchify_and_embed)."""
    from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF

    room = int(transformer_config["axes_lens"][0]) - 2
    return room - room % SEQ_MULTI_OF


class ZImageModel(SD3Model):
    frozen_components = ("text_encoder", "vae")

    def configure(self) -> None:
        super().configure()
        config = self.pipeline.transformer.config
        if self.max_sequence_length > max_text_tokens(config):
            raise UserError(
                f"model.max_sequence_length: at most {max_text_tokens(config)} for this Z-Image transformer (its "
                f"RoPE's first axis holds {config['axes_lens'][0]} positions: the caption's, padded to a multiple of "
                f"32, then the image's), got {self.max_sequence_length}"
            )

    # -- conditioning -----------------------------------------------------------------------------------------
    def _encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        # a copy: the pipeline writes the chat-templated prompts back into the list it is given
        rows, _ = self.pipeline.encode_prompt(list(texts), device=self.device, do_classifier_free_guidance=False,
                                              max_sequence_length=self.max_sequence_length)  # fmt: skip
        embeds = rows[0].new_zeros(len(rows), self.max_sequence_length, rows[0].shape[-1])
        mask = torch.zeros(len(rows), self.max_sequence_length, dtype=torch.bool, device=embeds.device)
        for i, row in enumerate(rows):  # the pipeline cut each row at max_sequence_length tokens
            embeds[i, : len(row)], mask[i, : len(row)] = row, True
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def pipeline_call_settings(self, guidance: float, low_noise: float | None) -> dict:
        """The pipeline's guidance_scale g is our s − 1 (its c + g·(c − u) against our u + s·(c − u))."""
        return {**super().pipeline_call_settings(guidance, low_noise), "guidance_scale": guidance - 1.0}

    # -- the network ------------------------------------------------------------------------------------------
    def velocity(self, latents, sigma, cond: TensorDict, guidance: float) -> torch.Tensor:
        B = latents.shape[0]
        x = list(latents.to(self.dtype)[:, :, None].unbind(0))  # [C, 1, H, W] each
        t = 1.0 - as_sigma_batch(sigma, B, latents.device)
        texts = _rows(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        cfg = guidance > 1.0
        if cfg:  # one forward over [cond; uncond], the pipeline's order
            x, t = x + x, torch.cat([t, t])
            texts += _rows(cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"])
        out = self.policies.module(x, t, texts, return_dict=False)[0]
        v = -torch.stack([o.float() for o in out])[:, :, 0]
        if cfg:
            v_cond, v_uncond = v.chunk(2)
            v = guided(v_uncond, v_cond, guidance)
        return v

    def _build_sigma_schedule(self, num_steps: int, height: int, width: int, frames: int) -> torch.Tensor:
        _, h, w = self.latent_shape(height, width, frames)
        return packed_sigma_schedule(self.fresh_scheduler(), num_steps, (h // 2) * (w // 2))

    # -- what estimate counts ----------------------------------------------------------------------------------
    @classmethod
    def text_tokens(cls, arch, max_sequence_length: int, prompt_tokens: int) -> int:
        return min(prompt_tokens, max_sequence_length)  # padding is cut; the template's few tokens are left out

    @classmethod
    def text_shapes(cls, arch, max_sequence_length: int, prompt_tokens: int) -> dict[str, tuple[int, ...]]:
        """Qwen3's hidden states of each text padded to max_sequence_length, and their mask."""
        length = max_sequence_length
        return {"prompt_embeds": (length, arch.transformer_config["cap_feat_dim"]), "prompt_embeds_mask": (length,)}

    @classmethod
    def meta_inputs(cls, config: dict, batch: int, latent: tuple[int, int, int], text: int, dtype) -> dict:
        _, h, w = latent
        return dict(x=[on_meta(config["in_channels"], 1, h, w, dtype=dtype) for _ in range(batch)],
                    t=torch.ones(batch, device="meta"),
                    cap_feats=[on_meta(text, config["cap_feat_dim"], dtype=dtype) for _ in range(batch)],
                    return_dict=False)  # fmt: skip

    @classmethod
    def meta_latents(cls, inputs: dict) -> list[torch.Tensor]:
        return list(inputs["x"])  # one [C, F, H, W] latent per row

    @classmethod
    def meta_token_shape(cls, inputs: dict) -> tuple[tuple[int, ...], int]:
        return (1, *inputs["x"][0].shape), inputs["cap_feats"][0].shape[0]  # one caption [L, D] per row

    @classmethod
    def meta_output(cls, out) -> torch.Tensor:
        return torch.stack(out)  # a list of rows


def _rows(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each row's valid text tokens, as the pipeline hands them to the transformer."""
    return [e[m] for e, m in zip(embeds, mask.bool(), strict=True)]


register_family(
    ModelFamily(
        name="z_image",
        pipeline="ZImagePipeline",
        adapter=ZImageModel,
        tiny="diffusion_rl.models.tiny.z_image",
        lora_targets=Z_IMAGE_LORA_TARGETS,
    )
)
