"""Wan 2.1 / 2.2 text-to-video: a UMT5 text encoder, a causal 3-D VAE, video latents [C, F', H', W'].

Latents keep the VAE's layout, [C, F', H/s, W/s] per sample with F' = (F − 1)/t + 1 for F frames (t the VAE's
temporal down-sampling, s its spatial one): the step functions and losses reduce over every non-batch dimension,
so nothing else needs to know a sample is a video. `decode` gives uint8 [B, F, H, W, 3].

Text: the pipeline pads every prompt to `max_sequence_length` tokens and zeroes the padding, so conditionings of
different prompts concatenate as they are. Guidance: ordinary CFG with the negative prompts, in one batched forward
over [negative; positive] (the pipeline runs two forwards; the sum is the same).

Time: `WanTransformer3DModel` takes the timestep in the scheduler's 0–1000 units, t = 1000·σ (`model_timestep`).
Wan 2.2 TI2V-5B's pipeline gives every token its own timestep (`expand_timesteps`, for its image-to-video mode,
where the first frame's tokens get 0); in text-to-video every token has the same one, which is what one timestep
per sample gives, so we pass that.

σ schedule: the checkpoints ship a UniPC multistep scheduler on flow sigmas with a fixed `flow_shift`. RL needs
single steps with a Gaussian log-density, so we sample on that scheduler's σ points (`unipc_flow_sigmas`: its grid
shifted once by the checkpoint's flow_shift, not the flow-matching Euler scheduler's, whose σ_min is shifted before
its points are shifted again) and step them with our ODE/SDE steps, as the other families do: the solver differs
from the pipeline's, the points do not.

Wan 2.2 A14B: two transformers of one architecture, `transformer` for timesteps ≥ boundary_ratio · 1000 and
`transformer_2` below (the pipeline's switch); trained as one network (models/experts.py), LoRA on both, each
row of a call routed by its own timestep. Guidance as the pipeline's: `sampling.guidance` (its guidance_scale) for the
high-noise expert's rows, `sampling.guidance_low_noise` (its guidance_scale_2; null: the same) for the low-noise
expert's, chosen row by row (`FlowModel.row_guidance`, models/guidance.py); the forward-process losses train the
conditional velocity, at neither. Image-to-video: models/families/wan_i2v.py.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from diffusion_rl.errors import UserError
from diffusion_rl.models.base import FlowModel, as_sigma_batch, on_meta, video_vae_stats
from diffusion_rl.models.experts import TimestepExperts
from diffusion_rl.models.guidance import guided, runs_cfg
from diffusion_rl.models.registry import ModelFamily, register_family

# attention of both kinds (self-attention over the video tokens, cross-attention to the text) and the feed-forward
WAN_LORA_TARGETS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
)


def video_to_uint8(video_B3FHW: torch.Tensor) -> torch.Tensor:
    """[-1, 1] videos [B, 3, F, H, W] → uint8 [B, F, H, W, 3] on the CPU."""
    video = (video_B3FHW.float() / 2 + 0.5).clamp(0, 1)
    return (video * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).cpu()


def uint8_to_video(video_BFHW3: torch.Tensor) -> torch.Tensor:
    """uint8 [B, F, H, W, 3] → [-1, 1] float32 videos [B, 3, F, H, W] (the inverse of video_to_uint8)."""
    if video_BFHW3.dtype != torch.uint8 or video_BFHW3.ndim != 5 or video_BFHW3.shape[-1] != 3:
        raise ValueError(f"videos must be uint8 [B, F, H, W, 3], got {video_BFHW3.dtype} {tuple(video_BFHW3.shape)}")
    return video_BFHW3.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def unipc_flow_sigmas(num_steps: int, flow_shift: float, num_train_timesteps: int) -> torch.Tensor:
    """σ_0 = 1 > … > σ_{N−1} > σ_N = 0, float64 [N + 1]: the σ points of the Wan checkpoints' scheduler,
    UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=s, final_sigmas_type="zero").set_timesteps(N), as
    diffusers 0.42 computes them: N + 1 times evenly spaced from 1 to 1/T, the last dropped,
    u_k = 1 − k·(1 − 1/T)/N for k = 0 … N − 1, each shifted once, σ_k = s·u_k / (1 + (s − 1)·u_k), then σ_N = 0.
    E.g. s = 3, N = 10: u_9 = 0.1009, σ_9 = 0.3027/1.2018 = 0.2519. UniPC lowers σ_0 to 1 − 1e-6 (against
    log(1 − σ) = −inf in its multistep update; our Euler and SDE steps need no guard, so σ_0 stays 1); diffusers
    0.33 (flow_grpo's pin) spaced u from 1 − 1/T to (1 − 1/T)/N instead, each 1/T lower than these."""
    k = torch.arange(num_steps, dtype=torch.float64)
    u = 1 - k * (1 - 1 / num_train_timesteps) / num_steps
    sigmas = flow_shift * u / (1 + (flow_shift - 1) * u)
    return torch.cat([sigmas, sigmas.new_zeros(1)])


class WanModel(FlowModel):
    frozen_components = ("text_encoder", "vae")
    video = True
    native_size = 480  # WanPipeline's default height (its default video is 480 × 832, 81 frames)
    # text tokens the transformer's context must hold, the prompt's zero-padded to them at the call; None: the
    # encoded ones as they are (Wan 2.1 I2V's transformer splits image from text tokens at 512: wan_i2v.py)
    text_context: int | None = None

    def trained_network(self, pipeline) -> nn.Module:
        """The transformer; Wan 2.2 A14B's two experts as one module, switched where the pipeline switches."""
        second = getattr(pipeline, "transformer_2", None)
        if second is None:
            if pipeline.transformer is None:
                raise UserError("this Wan model has no transformer/ (a transformer_2/ alone is not supported)")
            return pipeline.transformer
        ratio = pipeline.config.get("boundary_ratio")
        if pipeline.transformer is None or ratio is None:
            raise UserError(
                "this Wan model has a transformer_2/ but "
                + ("no transformer/" if pipeline.transformer is None else "no boundary_ratio in model_index.json")
                + ": Wan 2.2 A14B needs both experts and the timestep that switches them"
            )
        num_train_timesteps = int(pipeline.scheduler.config.get("num_train_timesteps", 1000))
        return TimestepExperts(pipeline.transformer, second, boundary=float(ratio) * num_train_timesteps)

    def configure(self) -> None:
        self.vae_scale = int(self.pipeline.vae_scale_factor_spatial)
        self.temporal_scale = int(self.pipeline.vae_scale_factor_temporal)
        self.patch = tuple(self.pipeline.transformer.config.patch_size)  # (frames, rows, columns)
        self.latent_channels = int(self.pipeline.transformer.config.in_channels)
        config = self._scheduler_config
        self.timestep_scale = float(config.get("num_train_timesteps", 1000))
        # UniPC names its fixed shift flow_shift, the flow-matching Euler scheduler shift
        self.shift = float(config.get("flow_shift", config.get("shift", 1.0)))

    def model_timestep(self, sigma_B: torch.Tensor) -> torch.Tensor:
        """The transformer's `timestep` for σ: 1000·σ (it embeds the timestep as it comes)."""
        return sigma_B * self.timestep_scale

    # -- conditioning -----------------------------------------------------------------------------------------
    def _encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipeline.encode_prompt(
            prompt=texts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        return {"prompt_embeds": embeds}

    @classmethod
    def text_shapes(cls, arch, max_sequence_length: int, prompt_tokens: int) -> dict[str, tuple[int, ...]]:
        """UMT5's tokens, padded to max_sequence_length."""
        return {"prompt_embeds": (max_sequence_length, arch.transformer_config["text_dim"])}

    # -- the network ------------------------------------------------------------------------------------------
    def velocity(self, latents, sigma, cond: TensorDict, guidance: float) -> torch.Tensor:
        timestep = self.model_timestep(as_sigma_batch(sigma, latents.shape[0], latents.device))
        return self.guided_forward(latents.to(self.dtype), timestep, cond, guidance)  # x: [B, C, F', H', W']

    def guided_forward(self, x, timestep, cond: TensorDict, guidance: float, **same) -> torch.Tensor:
        """The transformer on x [B, …] at `timestep` ([B] or per token [B, L]), CFG applied when a scale is > 1 in one
        forward over [uncond; cond], each row at its expert's scale (`row_guidance`); `same`: further inputs both
        halves share (an image-to-video's image embeddings). fp32."""
        embeds, cfg = cond["prompt_embeds"], runs_cfg(guidance)
        scale = self.row_guidance(guidance, timestep, x.shape[0])
        if cfg:
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            same = {name: torch.cat([value, value]) for name, value in same.items()}
        if self.text_context is not None:  # zeros after the prompt's tokens, as the pipeline pads its embeddings
            embeds = nn.functional.pad(embeds, (0, 0, 0, self.text_context - embeds.shape[1]))
        v = self.policies.module(
            hidden_states=x, timestep=timestep, encoder_hidden_states=embeds, return_dict=False, **same
        )[0].float()
        if cfg:
            v = guided(*v.chunk(2), scale)
        return v

    @classmethod
    def size_step(cls, vae_scale: int, transformer_config) -> int:
        return vae_scale * tuple(transformer_config["patch_size"])[1]  # patch: (frames, rows, columns)

    def latent_shape(self, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        step = self.size_step(self.vae_scale, self.pipeline.transformer.config)
        if height % step or width % step:
            raise ValueError(f"height and width must be multiples of {step}, got {height}×{width}")
        if frames < 1 or (frames - 1) % self.temporal_scale:
            raise ValueError(
                f"frames must be {self.temporal_scale}·k + 1 (the VAE keeps the first frame and folds each "
                f"{self.temporal_scale} after it into one latent frame), got {frames}"
            )
        latent_frames = (frames - 1) // self.temporal_scale + 1
        return (self.latent_channels, latent_frames, height // self.vae_scale, width // self.vae_scale)

    def _build_sigma_schedule(self, num_steps: int, height: int, width: int, frames: int) -> torch.Tensor:
        self.latent_shape(height, width, frames)  # the size check; the shift is fixed
        return unipc_flow_sigmas(num_steps, self.shift, int(self.timestep_scale))

    @classmethod
    def meta_inputs(cls, config: dict, batch: int, latent: tuple[int, int, int], text: int, dtype) -> dict:
        return dict(hidden_states=on_meta(batch, config["in_channels"], *latent, dtype=dtype),
                    timestep=torch.ones(batch, device="meta") * 1000,
                    encoder_hidden_states=on_meta(batch, text, config["text_dim"], dtype=dtype),
                    return_dict=False)  # fmt: skip

    # -- pixels ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        mean, std = video_vae_stats(self.vae, self.vae.dtype)
        z = latents.to(self.vae.device, self.vae.dtype) * std + mean
        return video_to_uint8(self.vae.decode(z, return_dict=False)[0])

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        mean, std = video_vae_stats(self.vae, self.vae.dtype)
        pixels = uint8_to_video(images).to(self.vae.device, self.vae.dtype)
        return ((self.vae.encode(pixels).latent_dist.mode() - mean) / std).float()


register_family(
    ModelFamily(
        name="wan",
        pipeline="WanPipeline",
        adapter=WanModel,
        tiny="diffusion_rl.models.tiny.wan",
        lora_targets=WAN_LORA_TARGETS,
        task="text-to-video",
    )
)
