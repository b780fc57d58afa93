"""Wan image-to-video: a video that starts from a given first frame (Wan 2.1 I2V, Wan 2.2 TI2V-5B's image mode), or
runs from a given first to a given last frame (Wan 2.1 FLF2V).

The first frame is the prompt's condition image, through the path every editing family's images take
(data/condition_images.py fits it to the output size; `encode_prompts(..., images)` gets one per row, two with a
last frame: below). As WanImageToVideoPipeline feeds it, in one of two ways, which the checkpoint decides:

- Wan 2.1 I2V (Wan2.1-I2V-14B-480P / 720P): the transformer reads 2·C + 4 channels, its latents followed by a
  4-channel mask (1 on the first latent frame) and the VAE latents of the video [first frame, then F − 1 frames of
  zeros] (normalised as the pipeline does: (z − mean)·(1/std)); and it cross-attends to the first frame's CLIP
  image tokens (the second-to-last hidden states of the pipeline's CLIPVisionModel, `image_embeds`). Both halves of
  CFG see the same image. Every latent frame is generated: whether the video keeps the first frame is up to the
  model (and a reward). The condition's VAE latents depend on the frame count, which only `velocity` knows (from
  the latents' shape): they are made there, each distinct (image, frame count) once, and kept for the next calls
  (`CONDITIONS_KEPT`); the VAE's causal chunks make them the same however often they are made.
- Wan 2.2 TI2V-5B (`expand_timesteps` in the pipeline's config): the first latent frame is the first frame's VAE
  latents, in place of the sampled ones, at timestep 0 (every other token at t). Here the first latent frame's
  velocity is (x − c)/σ, the velocity whose clean estimate is exactly the condition c: the first frame follows
  the straight path from its noise to c, its velocity and so its part of a step's mean do not depend on the
  weights (a constant in every log-prob ratio, nothing for a forward-process loss to train), and the other frames
  see what the pipeline shows them. The finished video's first latent frame is c, as the pipeline puts it back
  after its loop (`finished_latents`: a stochastic last step would leave noise there); c stays fp32, as there.
  The released checkpoint's model_index.json names WanPipeline (one checkpoint for text- and image-to-video):
  `model.family: wan_i2v` loads that directory as this family (`loads_also`).

A row with two condition images is a first and a last frame (the pipeline's `last_image`, first-and-last-frame
interpolation), where the checkpoint takes them: the condition video is [first, F − 2 frames of zeros, last], the
mask is 1 on the first and on the last frame (after the VAE's fold: the last latent frame's last mask channel), and
Wan2.1-FLF2V-14B-720P's transformer (`pos_embed_seq_len` = 2 × 257 in its config) reads both images' CLIP tokens,
which it lays out as one sequence [first's; last's] with a learned positional embedding: it takes them as rows
[first, last] per sample, B·2 rows it views as B (the pipeline's `encode_image([image, last_image])`). A video with
a last frame has at least 5 frames (two latent frames). That
transformer takes two images only; a plain I2V transformer (no `pos_embed_seq_len`) and TI2V-5B (the pipeline ignores
`last_image` with `expand_timesteps`) take one; Wan 2.2 I2V-A14B (no CLIP tokens) takes one or two.

Text: a transformer that reads CLIP image tokens gets the prompt's tokens (cut at `model.max_sequence_length`, as
stored in the conditioning) zero-padded to 512 at each call, both halves of CFG. diffusers' Wan attention takes all
but the last 512 tokens of its context as the image tokens (a constant there, not a config value), so shorter text
would send the image tokens through the text cross-attention; the padded context is the pipeline's at its default
max_sequence_length 512 for a prompt that short (its embeddings are zero after the prompt's tokens). More than 512 is
refused. Wan 2.2 TI2V-5B and I2V-A14B (no image tokens) read the text as it is encoded.

The CLIP encoder sees the fitted image; the pipeline shows it the image as given, which is the same when the image
comes at the output size (as in the pipeline's own example). Wan 2.2 I2V-A14B reads the mask and the given frames'
latents as Wan 2.1 I2V does, without CLIP image tokens, with two experts as Wan 2.2 T2V-A14B (families/wan.py).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tensordict import TensorDict

from diffusion_rl.errors import UserError
from diffusion_rl.models.base import SnippetImage, as_sigma_batch, on_meta, video_vae_stats
from diffusion_rl.models.condition import condition_count, condition_latents, distinct_images, image_key
from diffusion_rl.models.families.wan import WAN_LORA_TARGETS, WanModel, uint8_to_video
from diffusion_rl.models.registry import ModelFamily, register_family

MASK_CHANNELS = 4  # Wan 2.1 I2V's mask: one channel per frame the VAE folds into a latent frame
CONDITIONS_KEPT = 64  # video conditions (images × frame count) kept between velocity calls
# diffusers' WanAttnProcessor (0.42.1) takes all but the last 512 tokens of the cross-attention's context as image
# tokens in a block with add_k_proj ("the context length of the text encoder, hardcoded"): not in the config
IMAGE_SPLIT_TEXT_TOKENS = 512
# Wan's text-to-video targets and, in Wan 2.1 I2V, the image cross-attention's own key and value projections
# (diffusers' Wan LoRA loader fills them with zeros when a LoRA leaves them out)
WAN_I2V_LORA_TARGETS = (*WAN_LORA_TARGETS, "attn2.add_k_proj", "attn2.add_v_proj")


def text_context(config, max_sequence_length: int) -> int | None:
    """The text tokens a transformer of `config` must be given: 512 where it reads CLIP image tokens (its attention's
    `added_kv_proj_dim`), the prompt's zero-padded to them; None where it reads the text as encoded."""
    if config.get("added_kv_proj_dim") is None:
        return None
    if max_sequence_length > IMAGE_SPLIT_TEXT_TOKENS:
        raise UserError(
            f"model.max_sequence_length: at most {IMAGE_SPLIT_TEXT_TOKENS} for a Wan transformer that reads CLIP image "
            f"tokens (diffusers' Wan attention takes all but the context's last {IMAGE_SPLIT_TEXT_TOKENS} tokens as "
            f"image tokens), got {max_sequence_length}"
        )
    return IMAGE_SPLIT_TEXT_TOKENS


class WanI2VModel(WanModel):
    frozen_components = ("text_encoder", "vae", "image_encoder")
    edits = True

    def configure(self) -> None:
        super().configure()
        config = self.pipeline.transformer.config
        self.latent_channels = int(self.vae.config.z_dim)
        self.replaces_first_frame = bool(self.pipeline.config.get("expand_timesteps", False))  # Wan 2.2 TI2V
        self.reads_image_tokens = config.image_dim is not None  # Wan 2.1 I2V's CLIP image tokens
        self.text_context = text_context(config, self.max_sequence_length)
        c = self.latent_channels
        wanted = c if self.replaces_first_frame else 2 * c + MASK_CHANNELS
        if config.in_channels != wanted:
            raise UserError(
                f"this Wan transformer reads {config.in_channels} channels, not the {wanted} of image-to-video with "
                f"its {self.latent_channels}-channel VAE: a text-to-video checkpoint without expand_timesteps cannot "
                "take a first frame (use Wan2.1-I2V or Wan2.2-TI2V-5B)"
            )
        if self.reads_image_tokens and getattr(self.pipeline, "image_encoder", None) is None:
            raise UserError("this Wan I2V transformer reads CLIP image tokens, but the model has no image_encoder/")
        self.frames_given, self._why = self._frames_it_takes(config)
        self.sample_conditions = min(self.frames_given)  # FLF2V: a first and a last frame
        self._conditions: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def _frames_it_takes(self, config) -> tuple[tuple[int, ...], str]:
        """How many given frames a row may carry (1: the first; 2: the first and the last), and why, as the
        checkpoint and WanImageToVideoPipeline take them."""
        if self.replaces_first_frame:
            return (1,), "Wan 2.2 TI2V-5B (expand_timesteps) takes a first frame only (the pipeline ignores last_image)"
        if not self.reads_image_tokens:  # Wan 2.2 I2V-A14B: the mask and the frames' latents alone
            return (1, 2), "a first frame, or a first and a last frame"
        if config.get("pos_embed_seq_len"):
            why = f"pos_embed_seq_len {config.pos_embed_seq_len} in transformer/config.json: Wan2.1-FLF2V"
            return (2,), f"this transformer reads a first and a last frame's CLIP tokens ({why})"
        why = "no pos_embed_seq_len in transformer/config.json; first and last frame: Wan2.1-FLF2V-14B-720P"
        return (1,), f"this transformer reads one image's CLIP tokens ({why})"

    def pipeline_call_settings(self, guidance: float, low_noise: float | None) -> dict:
        """A transformer that reads CLIP image tokens: the pipeline at max_sequence_length 512 (`text_context`), whose
        text embeddings of a prompt within ours are ours zero-padded; at ours it would misroute the image tokens."""
        call = super().pipeline_call_settings(guidance, low_noise)
        call["max_sequence_length"] = self.text_context or self.max_sequence_length
        if self.frames_given == (2,):  # FLF2V: the last frame too
            call["last_image"] = SnippetImage("last.png")
        return call

    # -- conditioning -----------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str], negative: list[str] | None = None, images=None) -> TensorDict:
        k = condition_count(self.family, images, len(prompts), most=None)
        if k not in self.frames_given:
            wanted = " or ".join(map(str, self.frames_given))
            raise UserError(
                f"the {self.family} family: every prompt needs {wanted} condition image(s), got {k} (a dataset row's "
                f"`images`, or `--image` once each: its first frame, then its last; data/condition_images.py): "
                f"{self._why}"
            )
        cond = self.text_conditioning(prompts, negative if negative is not None else [""] * len(prompts))
        if self.replaces_first_frame:  # [B, 1, C, 1, h, w]: the first frame alone through the VAE
            encode = lambda pixels: self.vae_latents(uint8_to_video(pixels[:, None]))  # noqa: E731
            # fp32, as the pipeline keeps them: the video's first latent frame ends at them (velocity), and the
            # model's dtype would round it (bf16: by up to 2⁻⁹ of each value); the transformer sees them cast
            cond["image_latents"] = condition_latents(encode, images)
            return cond
        cond["given_frames"] = torch.from_numpy(np.stack([np.stack(row) for row in images])).to(self.device)
        if self.reads_image_tokens:
            unique, index = distinct_images(images)
            with torch.no_grad():
                tokens = self.pipeline.encode_image([Image.fromarray(i) for i in unique], self.device)
            cond["image_embeds"] = tokens.to(self.dtype)[index.to(self.device)]  # [B, k, T, D]
        return cond

    def _encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """WanPipeline's text encoding, which the image-to-video pipeline copies but for its text cleaning: that
        calls ftfy unguarded (diffusers 0.42.1), where WanPipeline's uses it when installed."""
        from diffusers import WanPipeline

        embeds = WanPipeline._get_t5_prompt_embeds(
            self.pipeline, texts, max_sequence_length=self.max_sequence_length, device=self.device
        )
        return {"prompt_embeds": embeds}

    @torch.no_grad()
    def vae_latents(self, pixels_B3FHW: torch.Tensor) -> torch.Tensor:
        """[-1, 1] videos → their fp32 VAE latents normalised as the image-to-video pipeline does, (z − mean)·(1/std)
        in fp32 whatever the VAE's dtype."""
        with self.frozen_on_device("vae"):
            mean, std = video_vae_stats(self.vae, torch.float32)
            z = self.vae.encode(pixels_B3FHW.to(self.vae.device, self.vae.dtype)).latent_dist.mode().float()
            return ((z - mean) * (1.0 / std)).to(self.device)

    def video_condition(self, given_BkHW3: torch.Tensor, latent_frames: int) -> torch.Tensor:
        """[B, 4 + C, F', h, w]: Wan 2.1 I2V's mask and the VAE latents of [first frame, F − 1 frames of zeros], or
        with a last frame (k = 2) of [first frame, F − 2 frames of zeros, last frame]."""
        rows = []
        for given in given_BkHW3.cpu().numpy():  # [k, H, W, 3]
            key = (*map(image_key, given), latent_frames)
            if key not in self._conditions:
                self._conditions[key] = self._row_condition(given, latent_frames)
                if len(self._conditions) > CONDITIONS_KEPT:
                    self._conditions.popitem(last=False)
            self._conditions.move_to_end(key)
            rows.append(self._conditions[key])
        return torch.stack(rows)

    def _row_condition(self, given_kHW3: np.ndarray, latent_frames: int) -> torch.Tensor:
        T, k = self.temporal_scale, len(given_kHW3)
        frames = (latent_frames - 1) * T + 1
        if frames < k:
            raise UserError(f"sampling.num_frames: a first and a last frame need at least {T + 1} frames, got {frames}")
        pixels = uint8_to_video(torch.from_numpy(given_kHW3)[None])  # [1, 3, k, H, W]
        zeros = pixels.new_zeros(1, 3, frames - k, *pixels.shape[-2:])
        latents = self.vae_latents(torch.cat([pixels[:, :, :1], zeros, pixels[:, :, 1:]], dim=2))[0]  # [C, F', h, w]
        given = torch.zeros(frames, device=latents.device)  # which pixel frames are given, as the pipeline's mask
        given[0] = 1
        if k == 2:
            given[-1] = 1
        # the VAE folds the first frame alone and T frames into each latent frame after it: the first frame's flag
        # is repeated T times, then the flags are folded T per latent frame, one mask channel each
        mask = torch.cat([given[:1].expand(T), given[1:]]).view(latent_frames, T).T  # [T, F']
        return torch.cat([mask[:, :, None, None].expand(-1, -1, *latents.shape[2:]), latents])

    # -- the network ------------------------------------------------------------------------------------------
    def velocity(self, latents, sigma, cond: TensorDict, guidance: float) -> torch.Tensor:
        B = latents.shape[0]
        sigma_B = as_sigma_batch(sigma, B, latents.device)
        timestep = self.model_timestep(sigma_B)
        x = latents.to(self.dtype)  # [B, C, F', H', W']
        if not self.replaces_first_frame:  # Wan 2.1 I2V: the condition as extra channels, the image's tokens
            condition = self.video_condition(cond["given_frames"], latents.shape[2]).to(self.dtype)
            same = {}
            if self.reads_image_tokens:  # [B·k, T, D], each row's k images in turn: FLF2V's views them as [B, k·T, D]
                same["encoder_hidden_states_image"] = cond["image_embeds"].flatten(0, 1)
            return self.guided_forward(torch.cat([x, condition], dim=1), timestep, cond, guidance, **same)
        c = cond["image_latents"][:, 0]  # [B, C, 1, H', W']
        frame_tokens = (x.shape[3] // self.patch[1]) * (x.shape[4] // self.patch[2])
        per_token = timestep[:, None].repeat(1, x.shape[2] * frame_tokens)  # [B, L]: the first frame's at 0
        per_token[:, :frame_tokens] = 0
        v = self.guided_forward(torch.cat([c.to(self.dtype), x[:, :, 1:]], dim=2), per_token, cond, guidance)
        first = (latents[:, :, :1].float() - c.float()) / sigma_B.view(B, 1, 1, 1, 1)
        return torch.cat([first, v[:, :, 1:]], dim=2)  # not in place: v may be what autograd saved

    def finished_latents(self, latents: torch.Tensor, cond: TensorDict) -> torch.Tensor:
        """Wan 2.2 TI2V: the given first frame's latents in the first latent frame, as the pipeline puts them back
        after its loop. An ODE last step ends there already (up to rounding); a stochastic one (a window through
        the last step) draws noise into it too, ~0.8 of a unit off with Flow-GRPO's SDE at noise level 0.7."""
        if not self.replaces_first_frame:
            return latents
        return torch.cat([cond["image_latents"][:, 0].to(latents), latents[:, :, 1:]], dim=2)

    @classmethod
    def text_tokens(cls, arch, max_sequence_length: int, prompt_tokens: int) -> int:
        """The context the transformer reads: 512 tokens where it reads CLIP image tokens (`text_context`)."""
        return text_context(arch.transformer_config, max_sequence_length) or max_sequence_length

    @staticmethod
    def _replaces_first_frame(config: dict) -> bool:
        """Wan 2.2 TI2V: the transformer reads the latents alone (in the channels it writes), the first frame's in
        place of the noise, and each token its own timestep (the pipeline's `expand_timesteps`)."""
        return config["in_channels"] == config["out_channels"]

    @classmethod
    def condition_encodes(cls, config: dict, sources: int, frames: int,
                          size: tuple[int, int]) -> list[tuple[int, int, int]]:  # fmt: skip
        """Wan 2.2 TI2V: the first frame alone; Wan 2.1 I2V and 2.2 I2V-A14B: one video of `frames` frames, the given
        ones with zeros between (`_row_condition`)."""
        if sources == 0:
            return []
        return [(1, *size)] if cls._replaces_first_frame(config) else [(frames, *size)]

    @classmethod
    def meta_inputs(cls, config: dict, batch: int, latent: tuple[int, int, int], text: int, dtype,
                    sources: int = 1, source_latent: tuple[int, int, int] | None = None,
                    image_tokens: int = 0) -> dict:  # fmt: skip
        """image_tokens: the image encoder's tokens per image (ViT-H/14 at 224 px: 257; estimate's Architecture)."""
        inputs = super().meta_inputs(config, batch, latent, text, dtype)  # in_channels: the first frame's included
        if cls._replaces_first_frame(config):  # a timestep per token, as `velocity` gives it (the time embedding's)
            _, ph, pw = config["patch_size"]
            tokens = latent[0] * (latent[1] // ph) * (latent[2] // pw)
            inputs["timestep"] = inputs["timestep"][:, None].expand(batch, tokens)
        if config.get("image_dim"):  # FLF2V: two images' tokens per row, which the transformer views as one sequence
            paired = config.get("pos_embed_seq_len")
            images, tokens = (2, paired // 2) if paired else (1, image_tokens)
            inputs["encoder_hidden_states_image"] = on_meta(images * batch, tokens, config["image_dim"], dtype=dtype)
        return inputs


def save_i2v_pipeline(pipeline, directory: Path) -> None:
    """save_pretrained, with model_index.json naming the image processor as a real checkpoint does
    (CLIPImageProcessor; transformers builds its PIL variant where torchvision is missing)."""
    pipeline.save_pretrained(directory)
    index_file = Path(directory) / "model_index.json"
    index = json.loads(index_file.read_text())
    if (index.get("image_processor") or [None])[0] == "transformers":
        index["image_processor"] = ["transformers", "CLIPImageProcessor"]
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def i2v_components(path: Path) -> dict:
    """The image processor as its PIL variant (transformers asks for torchvision for CLIPImageProcessor and warns
    when it falls back); none where the checkpoint has no image encoder (Wan 2.2 TI2V)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder = Path(path) / "image_processor"
    return {"image_processor": CLIPImageProcessorPil.from_pretrained(folder)} if folder.is_dir() else {}


register_family(
    ModelFamily(
        name="wan_i2v",
        pipeline="WanImageToVideoPipeline",
        adapter=WanI2VModel,
        tiny="diffusion_rl.models.tiny.wan_i2v",
        lora_targets=WAN_I2V_LORA_TARGETS,
        components=i2v_components,
        save=save_i2v_pipeline,
        loads_also=("WanPipeline",),
        task="image-to-video",
    )
)
