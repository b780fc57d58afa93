"""FLUX.2-klein (4B, 9B; step-distilled and base) and FLUX.2-dev: a decoder's text features, 2×2-patchified latents
normalised by the VAE's batch-norm statistics, 4-axis positional ids and an empirical σ shift that depends on the
step count.

As Flux2KleinPipeline and Flux2Pipeline (FLUX.2-dev) do it:
- text: each prompt in the text encoder's chat template, padded to `max_sequence_length` tokens; the hidden states
  of three layers side by side are the transformer's text tokens (3 × the encoder width). klein: Qwen3, thinking
  off, layers 9, 18, 27; dev: Mistral-Small-3 (Mistral3ForConditionalGeneration) with the pipeline's system
  message, layers 10, 20, 30 — its PixtralProcessor is built by transformers only with torchvision, and the
  pipeline uses only its tokenizer, so the family loads that (`flux2_components`) and writes the processor's files
  back (`save_flux2_pipeline`);
- latents: the VAE latent [C, H, W] cut into 2×2 patches (channel, row, column: our packed token grid
  [H/2, W/2, 4·C]) and normalised per patch channel with the VAE's `bn` running mean and variance;
- positional ids (t, h, w, l): image tokens (0, row, column, 0), text tokens (0, 0, 0, index);
- σ: evenly spaced in [1/T, 1], shifted with μ = the pipeline's `compute_empirical_mu(tokens, T)` (exponential
  time shift); the transformer takes σ and scales it by 1000 itself;
- reference images (the pipelines' `image`: 0..N per prompt; in a dataset, a record's `images`): each VAE-encoded
  like the latents (the posterior's mode, patchified, batch-norm normalised; `image_latents` [B, k, h', w', 4·C] in
  the conditioning), their tokens after the generated ones, reference i's ids (10 + 10·i, row, column, 0); only
  the generated tokens' velocity is kept, and the σ shift follows the generated tokens alone. With true CFG both
  halves see the references. The pipeline keeps each image's own size, cut to a multiple of 16 and, above 1024²
  pixels (`REFERENCE_MAX_PIXELS`), shrunk to that area first: so is ours (`reference_pixels`). The references come
  fitted to the output's aspect ratio (data/condition_images.py): under `model.condition_size: output` at the
  output size (at most 1024² pixels: unchanged; larger outputs give fewer reference tokens than the generated image
  has), under `pipeline` at 1024² pixels (`pipeline_condition_size`: what the pipelines make of a source of at
  least that many pixels; a smaller one they keep at its own size). FLUX.2-dev's pipeline shows the images
  to its text encoder only to rewrite the prompt (`caption_upsample_temperature`, off by default): not done here;
- guidance: klein (`is_distilled`) is CFG-free, guidance is ignored as the pipeline ignores it (one forward);
  klein base runs true CFG with the negative prompts (the pipeline's negative is ""), here in one batched forward;
  dev is guidance-distilled: the scale enters the transformer's guidance embedding (scaled by 1000 inside, like
  the timestep), one forward, no negative prompt.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict

from diffusion_rl.models.base import (
    JOINT_ATTENTION_LORA_TARGETS,
    as_sigma_batch,
    images_to_uint8,
    on_meta,
    uint8_to_images,
)
from diffusion_rl.models.condition import condition_count, condition_latents
from diffusion_rl.models.guidance import guided
from diffusion_rl.models.packed import PackedLatentModel, pack_latents, tokens_of, unpack_latents
from diffusion_rl.models.registry import ModelFamily, register_family

logger = logging.getLogger(__name__)
# Flux2KleinPipeline and Flux2Pipeline (diffusers 0.42.1) shrink a reference image of more pixels than this to this
# area (aspect ratio kept) before cutting it to a multiple of 16: inline there, not a config value
REFERENCE_MAX_PIXELS = 1024 * 1024

# Both streams' attention and feed-forwards of the double blocks, and the single blocks' fused QKV+MLP input. Not
# the single blocks' `attn.to_out`: a suffix that also names the double blocks' `attn.to_out` ModuleList.
FLUX2_LORA_TARGETS = (
    *JOINT_ATTENTION_LORA_TARGETS,
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
)


@functools.cache
def warn_guidance_ignored(guidance: float) -> None:
    """Once per value: a step-distilled klein runs no CFG, whatever `sampling.guidance` says (as the pipeline)."""
    logger.warning("guidance %g is ignored: this FLUX.2-klein is step-distilled (CFG-free); set guidance 1", guidance)


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """The image tokens' positional ids [h·w, 4]: (0, row, column, 0), row-major like `tokens_of`."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    zeros = torch.zeros_like(rows)
    return torch.stack([zeros, rows, cols, zeros], dim=-1).reshape(h * w, 4).to(device)


def reference_ids(count: int, h: int, w: int, device) -> torch.Tensor:
    """The reference images' positional ids [count·h·w, 4]: reference i's tokens (10 + 10·i, row, column, 0), as the
    pipelines' `_prepare_image_ids` (its time offset `scale` 10)."""
    ids = image_ids(h, w, device).repeat(count, 1)
    ids[:, 0] = (10 + 10 * torch.arange(count, device=device)).repeat_interleave(h * w)
    return ids


def reference_pixels(image: np.ndarray, processor, multiple: int) -> np.ndarray:
    """A reference image (uint8 [H, W, 3]) as the pipelines feed it to the VAE: above REFERENCE_MAX_PIXELS pixels
    shrunk to that area by `processor` (the pipeline's Flux2ImageProcessor), cut to multiples of `multiple` and
    centre-cropped; an image of at most that many pixels whose sides are multiples of `multiple` comes back as it
    is."""
    from PIL import Image

    height, width = image.shape[:2]
    if height * width <= REFERENCE_MAX_PIXELS and not (height % multiple or width % multiple):
        return image
    picture = Image.fromarray(image)
    if height * width > REFERENCE_MAX_PIXELS:
        picture = processor._resize_to_target_area(picture, REFERENCE_MAX_PIXELS)
    h, w = picture.height // multiple * multiple, picture.width // multiple * multiple
    pixels = processor.preprocess(picture, height=h, width=w, resize_mode="crop")  # [1, 3, h, w] in [-1, 1]
    return images_to_uint8(pixels)[0].numpy()


def reference_size(height: int, width: int, grow: bool = False) -> tuple[int, int]:
    """(height, width) in pixels, multiples of 16, of a reference of height × width as the pipelines size it:
    above REFERENCE_MAX_PIXELS (with `grow`, below it too) scaled to that area, aspect kept, each side cut."""
    scale = math.sqrt(REFERENCE_MAX_PIXELS / (height * width))
    scale = scale if grow else min(1.0, scale)
    return int(height * scale) // 16 * 16, int(width * scale) // 16 * 16


def reference_tokens(h: int, w: int) -> int:
    """The tokens of a reference image fitted to a generated image of h × w latent cells (8 px each, 2 × 2 cells a
    token), after `reference_pixels` shrinks it to REFERENCE_MAX_PIXELS' area (the pipelines' rule) — `estimate`'s
    count, to within the resize's rounding of a side."""
    height, width = reference_size(8 * h, 8 * w)
    return (height // 16) * (width // 16)


def text_ids(length: int, device) -> torch.Tensor:
    """The text tokens' positional ids [L, 4]: (0, 0, 0, index)."""
    ids = torch.zeros(length, 4, dtype=torch.long)
    ids[:, 3] = torch.arange(length)
    return ids.to(device)


class Flux2Model(PackedLatentModel):
    frozen_components = ("text_encoder", "vae")
    edits = True  # reference images, 0..N per prompt (none: text-to-image)
    conditions_as_given = {}  # the pipelines keep a reference's size (shrunk above REFERENCE_MAX_PIXELS, as ours)

    def configure(self) -> None:
        self.distilled = self.ignores_guidance_of(self.pipeline.config)
        self.guidance_embeds = bool(self.pipeline.transformer.config.guidance_embeds)  # FLUX.2-dev
        self.latent_channels = self.pipeline.transformer.config.in_channels // 4
        self.vae_scale = 2 ** (len(self.vae.config.block_out_channels) - 1)

    # -- conditioning -----------------------------------------------------------------------------------------
    @classmethod
    def pipeline_condition_size(cls, height: int, width: int) -> tuple[int, int]:
        """The pipelines' reference of a source at the output's aspect ratio with at least REFERENCE_MAX_PIXELS
        pixels: that area (Flux2ImageProcessor._resize_to_target_area), each side cut to a multiple of 16."""
        return reference_size(height, width, grow=True)

    def encode_prompts(self, prompts: list[str], negative: list[str] | None = None, images=None) -> TensorDict:
        k = condition_count(self.family, images, len(prompts), most=None)
        if self.distilled or self.guidance_embeds:  # CFG-free or guidance-distilled: negatives play no part
            cond = self.text_conditioning(prompts, None)
        else:
            cond = self.text_conditioning(prompts, [""] * len(prompts) if negative is None else negative)
        if k:  # [B, k, h', w', 4·C]
            cond["image_latents"] = condition_latents(self._encode_references, images).to(self.dtype)
        return cond

    def _encode_references(self, images_NHW3: torch.Tensor) -> torch.Tensor:
        """The latents of reference images (uint8 [N, H, W, 3]), each first sized as the pipelines size theirs."""
        multiple = self.vae_scale * 2
        fitted = [reference_pixels(image.numpy(), self.pipeline.image_processor, multiple) for image in images_NHW3]
        return self.encode(torch.from_numpy(np.stack(fitted)))

    def _encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=texts, device=self.device, max_sequence_length=self.max_sequence_length
        )
        return {"prompt_embeds": embeds}

    @classmethod
    def text_shapes(cls, arch, max_sequence_length: int, prompt_tokens: int) -> dict[str, tuple[int, ...]]:
        """The text encoder's tokens padded to max_sequence_length, its chosen layers' states side by side."""
        return {"prompt_embeds": (max_sequence_length, arch.transformer_config["joint_attention_dim"])}

    # -- the σ schedule -----------------------------------------------------------------------------------------
    def _build_sigma_schedule(self, num_steps: int, height: int, width: int, frames: int) -> torch.Tensor:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        h, w, _ = self.latent_shape(height, width, frames)
        scheduler = self.fresh_scheduler()
        sigmas = np.linspace(1.0, 1.0 / num_steps, num_steps)
        scheduler.set_timesteps(sigmas=sigmas, mu=compute_empirical_mu(h * w, num_steps), device="cpu")
        return scheduler.sigmas.float().cpu()

    # -- the network ------------------------------------------------------------------------------------------
    @classmethod
    def meta_inputs(cls, config: dict, batch: int, latent: tuple[int, int, int], text: int, dtype,
                    sources: int = 0, source_latent: tuple[int, int, int] | None = None) -> dict:  # fmt: skip
        _, h, w = latent
        _, sh, sw = source_latent or latent
        tokens = (h // 2) * (w // 2) + sources * reference_tokens(sh, sw)  # the references' tokens after ours
        return dict(hidden_states=on_meta(batch, tokens, config["in_channels"], dtype=dtype),
                    encoder_hidden_states=on_meta(batch, text, config["joint_attention_dim"], dtype=dtype),
                    timestep=torch.ones(batch, device="meta"), img_ids=on_meta(tokens, 4), txt_ids=on_meta(text, 4),
                    guidance=torch.ones(batch, device="meta") if config.get("guidance_embeds") else None,
                    return_dict=False)  # fmt: skip

    @classmethod
    def condition_encodes(cls, config: dict, sources: int, frames: int,
                          size: tuple[int, int]) -> list[tuple[int, int, int]]:  # fmt: skip
        return [(1, *reference_size(*size))] * sources  # each alone, shrunk to the pipelines' area cap first

    @classmethod
    def ignores_guidance_of(cls, pipeline_config: dict) -> bool:
        return bool(pipeline_config.get("is_distilled", False))  # klein: step-distilled, CFG-free

    def forwards_per_evaluation(self, guidance: float) -> int:
        return 2 if self.true_cfg(guidance) else 1

    def ignores_guidance(self) -> bool:
        return self.distilled

    def true_cfg(self, guidance: float) -> bool:
        if self.ignores_guidance() and guidance > 1.0:
            warn_guidance_ignored(float(guidance))
        return not self.ignores_guidance() and not self.guidance_embeds and guidance > 1.0

    def velocity(self, latents, sigma, cond: TensorDict, guidance: float) -> torch.Tensor:
        B, h, w, K = latents.shape
        x, ids = tokens_of(latents), image_ids(h, w, latents.device)
        refs = cond.get("image_latents", None)  # [B, k, h', w', K]: reference images, their tokens after ours
        if refs is not None:
            x = torch.cat([x, refs.reshape(B, -1, K).to(x.dtype)], dim=1)
            ids = torch.cat([ids, reference_ids(*refs.shape[1:4], latents.device)])
        x = x.to(self.dtype)
        sigma_B = as_sigma_batch(sigma, B, latents.device)
        embeds = cond["prompt_embeds"]
        true_cfg = self.true_cfg(guidance)
        if true_cfg:  # one forward over [uncond; cond]
            x, sigma_B = torch.cat([x, x]), torch.cat([sigma_B, sigma_B])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
        guidance_B = self.guidance_input(guidance, x.shape[0], latents.device)
        v = self.policies.module(
            hidden_states=x,
            encoder_hidden_states=embeds,
            timestep=sigma_B,  # σ: the network scales it by 1000
            guidance=guidance_B,
            img_ids=ids,
            txt_ids=text_ids(embeds.shape[1], latents.device),
            return_dict=False,
        )[0][:, : h * w].float()  # the generated tokens' velocity (reference tokens are inputs only)
        if true_cfg:
            v = guided(*v.chunk(2), guidance)
        return v.reshape(B, h, w, K)

    # -- pixels ------------------------------------------------------------------------------------------------
    def _bn_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-patch-channel mean and std [4·C] (the last axis of the token grid)."""
        bn = self.vae.bn
        std = torch.sqrt(bn.running_var + self.vae.config.batch_norm_eps)
        return bn.running_mean.to(like.device, like.dtype), std.to(like.device, like.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        z = latents.to(self.vae.dtype)
        mean, std = self._bn_stats(z)
        pixels = self.vae.decode(unpack_latents(z * std + mean), return_dict=False)[0]
        return images_to_uint8(pixels)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        pixels = uint8_to_images(images).to(self.device, self.vae.dtype)
        z = pack_latents(self.vae.encode(pixels).latent_dist.mode())
        mean, std = self._bn_stats(z)
        return ((z - mean) / std).float()


PROCESSOR = "PixtralProcessor"  # FLUX.2-dev's tokenizer/ component
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def flux2_components(path: Path) -> dict:
    """FLUX.2-dev: the tokenizer of its PixtralProcessor folder, with the processor's chat template when the tokenizer
    has none and the processor's own files kept for writing back; klein: nothing (diffusers loads it all)."""
    from transformers import AutoTokenizer

    if json.loads((path / "model_index.json").read_text()).get("tokenizer", [None, None])[1] != PROCESSOR:
        return {}
    folder = path / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None and (folder / "chat_template.json").is_file():
        tokenizer.chat_template = json.loads((folder / "chat_template.json").read_text())["chat_template"]
    tokenizer.processor_files = {name: (folder / name).read_text() for name in PROCESSOR_FILES
                                 if (folder / name).is_file()}  # fmt: skip
    return {"tokenizer": tokenizer}


def save_flux2_pipeline(pipeline, directory: Path) -> None:
    """save_pretrained; for FLUX.2-dev the tokenizer/ folder and model_index.json as a PixtralProcessor's."""
    pipeline.save_pretrained(directory)
    files = getattr(pipeline.tokenizer, "processor_files", None)
    if files is None:  # klein
        return
    for name, text in files.items():
        (directory / "tokenizer" / name).write_text(text)
    index_file = directory / "model_index.json"
    index = json.loads(index_file.read_text())
    index["tokenizer"] = ["transformers", PROCESSOR]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


register_family(
    ModelFamily(
        name="flux2",
        pipeline="Flux2KleinPipeline",
        adapter=Flux2Model,
        tiny="diffusion_rl.models.tiny.flux2",
        lora_targets=FLUX2_LORA_TARGETS,
        components=flux2_components,
        save=save_flux2_pipeline,
        variants=("Flux2Pipeline",),
    )
)
