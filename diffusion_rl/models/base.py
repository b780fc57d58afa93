"""The model interface every family implements. Nothing outside models/ knows which family it runs.

Times are the flow-matching σ ∈ [0, 1] everywhere outside this package: x_σ = (1 − σ)·x0 + σ·ε, and the
model's velocity v ≈ ε − x0. Each adapter converts σ to its network's own timestep units.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from diffusion_rl.data.condition_images import fit_rows
from diffusion_rl.errors import UserError
from diffusion_rl.models.checkpointing import enable_checkpointing
from diffusion_rl.models.experts import TimestepExperts, high_noise_rows
from diffusion_rl.models.guidance import low_noise_scale, refuse_low_noise_without_experts, runs_cfg
from diffusion_rl.models.offload import HostResident
from diffusion_rl.models.policies import LoraSettings, PolicySet

# the condition images of each row of a batch: row i's uint8 [H, W, 3] arrays (none for a text-only prompt)
ConditionImages = Sequence[Sequence[np.ndarray]]


def on_meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An empty tensor on the meta device: a shape and a dtype, no storage (`estimate`'s transformer inputs)."""
    return torch.empty(*shape, device="meta", dtype=dtype)


def video_vae_stats(vae, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [1, C, 1, 1, 1] of a video VAE's latents [B, C, T, H, W] (Wan's, Qwen-Image's), from its config."""
    config, shape = vae.config, (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean, dtype=dtype, device=vae.device).view(shape)
    std = torch.tensor(config.latents_std, dtype=dtype, device=vae.device).view(shape)
    return mean, std


def freeze(*modules) -> None:
    """Text encoders and the VAE never train: no gradients, eval mode (no dropout)."""
    for module in modules:
        if module is not None:
            module.requires_grad_(False).eval()


# the frozen components each public method of a family uses (`model.offload_frozen` brings them to the device for
# the call): the text encoders ("text": every frozen component but the VAE) or the VAE. An editing family's
# `encode_prompts` reaches the VAE through `self.encode`, which brings it.
USES_FROZEN = {"encode_prompts": "text", "decode": "vae", "encode": "vae"}


def _with_frozen_on_device(method, part: str):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.frozen_on_device(part):
            return method(self, *args, **kwargs)

    return call


# Every attention projection of a joint (MM-DiT) block, image and text streams: the LoRA targets SD3, FLUX.1/2 and
# Qwen-Image share (flow_grpo's SD3 set); each family adds its feed-forwards to them.
JOINT_ATTENTION_LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


class SnippetImage(str):
    """An image file a model card's snippet loads (`load_image(name)`) for a pipeline argument, e.g. FLF2V's
    `last_image`: what `pipeline_call_settings` gives where the pipeline needs more than the prompt's image."""


class FlowModel(ABC):
    """A flow-matching model of images or videos: text encoders, a trainable transformer (`policies`), a VAE.

    A video family (`video = True`) samples `frames` frames: its latents are [C, F', H', W'] and `decode` gives
    uint8 [B, F, H, W, 3]; an image family accepts frames = 1 only. An editing family reads condition images with
    each prompt (`encode_prompts(..., images=...)`, models/condition.py); the others refuse them.

    With `offload_frozen` the text encoders and the VAE live on the CPU and visit `device` only for the calls that
    use them (`USES_FROZEN`; a copy to the device, none back: models/offload.py): every family's `encode_prompts`,
    `decode` and `encode` are wrapped when its class is defined (`__init_subclass__`), so a new family gets this
    without a line of its own.
    """

    family: str  # its registered name, set on the adapter class by register_family (models/registry.py)
    policies: PolicySet
    device: torch.device
    dtype: torch.dtype

    # pipeline attributes that never train (text encoders, VAE): frozen in eval mode
    frozen_components: tuple[str, ...] = ()
    video: bool = False  # samples are videos [F, H, W, 3] (frames > 1 allowed)
    edits: bool = False  # reads condition images with its prompts (an editing family)
    # the pipeline call's keywords under which it reads condition images as given (the model card, for a run that
    # read them at the output size where `pipeline_condition_size` differs); None: no call does
    conditions_as_given: dict | None = None
    sample_conditions: int = 1  # condition images a check samples with when it is given none (`doctor`)
    native_size: int | None = None  # pixels a side its pipeline samples by default, where its configs do not say
    caches_text: bool = True  # text embeddings depend on the text alone (`_encode_texts`): an embedding cache works
    guidance_embeds: bool = False  # guidance-distilled: the scale is an input embedding (one forward), not CFG
    condition_sizing: str = "output"  # model.condition_size: where condition images are fitted (`condition_size`)
    embedding_cache = None  # an EmbeddingCache (models/embedding_cache.py) once attached: the encoders are gone
    directory: Path | None = (
        None  # the diffusers folder load_model read (a Hub id's snapshot in the cache); None: built
    )
    # two timestep experts (Wan 2.2 A14B, models/experts.py): the transformer timestep from which the high-noise one
    # denoises; None: one network
    expert_boundary: float | None = None

    # -- what `estimate` counts (estimate/), from the architecture alone: the transformer is built on the meta device
    @classmethod
    def text_tokens(cls, arch, max_sequence_length: int, prompt_tokens: int) -> int:
        """Text tokens the transformer reads per sample (`arch`: estimate's Architecture; `prompt_tokens`: a
        typical prompt's length, for families that cut the padding)."""
        return max_sequence_length

    @classmethod
    def ignores_guidance_of(cls, pipeline_config: dict) -> bool:
        """Whether a checkpoint whose model_index.json holds `pipeline_config` ignores guidance (`ignores_guidance`)."""
        return False

    @classmethod
    def text_shapes(cls, arch, max_sequence_length: int, prompt_tokens: int) -> dict[str, tuple[int, ...]]:
        """What `_encode_texts` gives per text at the architecture's sizes: name → shape without the batch (an entry
        named `…_mask` is a bool mask); what stands in for the text encoders where none run (the GPU check)."""
        raise NotImplementedError(f"the family '{cls.family}' declares no text shapes (text_shapes)")

    @classmethod
    def meta_inputs(cls, config: dict, batch: int, latent: tuple[int, int, int], text: int, dtype) -> dict:
        """The transformer's keyword arguments as meta tensors (`on_meta`), as `velocity` gives them: `batch` rows,
        latents of `latent` = (frames, height, width) cells, `text` tokens; `config` is the transformer's config. An
        editing family's also takes `sources`, its condition images per row (beside the latents), and
        `source_latent`, the cells of one (default: `latent`'s)."""
        raise NotImplementedError(f"the family '{cls.family}' gives estimate no transformer inputs (meta_inputs)")

    @classmethod
    def meta_latents(cls, inputs: dict) -> list[torch.Tensor]:
        """In `meta_inputs`' result: the latent inputs (the gradient reaches LoRA adapters through them)."""
        return [inputs["hidden_states"]]

    @classmethod
    def meta_token_shape(cls, inputs: dict) -> tuple[tuple[int, ...], int]:
        """In `meta_inputs`' result: the latents' shape [B, …] as the blocks patch them, and text tokens per row."""
        return tuple(inputs["hidden_states"].shape), inputs["encoder_hidden_states"].shape[1]

    @classmethod
    def meta_output(cls, out) -> torch.Tensor:
        """The transformer's first output at `meta_inputs` as one tensor [B, …]."""
        return out

    # -- condition images: the size the model reads them at ----------------------------------------------------
    @classmethod
    def pipeline_condition_size(cls, height: int, width: int) -> tuple[int, int]:
        """(height, width) to which the family's diffusers pipeline sizes a condition image of an output's aspect
        ratio before its VAE: by default the output's own size."""
        return height, width

    @classmethod
    def condition_size(cls, sizing: str, height: int, width: int) -> tuple[int, int]:
        """Where an editing family's condition images are fitted for an output of height × width under
        `model.condition_size` (`sizing`): `output` the output size, `pipeline` the pipeline's size."""
        return cls.pipeline_condition_size(height, width) if sizing == "pipeline" else (height, width)

    @classmethod
    def condition_encodes(cls, config: dict, sources: int, frames: int,
                          size: tuple[int, int]) -> list[tuple[int, int, int]]:  # fmt: skip
        """What the VAE encodes of one prompt's `sources` condition images read at `size`, as (frames, height,
        width) per call (`estimate` counts them; `config`: the transformer's): an editing family each image alone."""
        return [(1, *size)] * sources

    def fit_conditions(self, rows, height: int, width: int) -> ConditionImages | None:
        """Rows of `ConditionImage`s (data/condition_images.py) as the uint8 arrays `encode_prompts` takes, fitted
        to `condition_size` for an output of height × width; None when no row has one."""
        return fit_rows(rows, *self.condition_size(self.condition_sizing, height, width))

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name, part in USES_FROZEN.items():
            if name in cls.__dict__:
                setattr(cls, name, _with_frozen_on_device(cls.__dict__[name], part))

    def __init__(
        self,
        pipeline,
        *,
        lora: LoraSettings | None,
        device: torch.device,
        dtype: torch.dtype,
        max_sequence_length: int = 256,
        gradient_checkpointing: bool | int = False,
        offload_frozen: bool = False,
    ):
        """What every adapter does with its diffusers pipeline: freeze the frozen components, wrap the transformer in
        the policy set (LoRA or full fine-tuning), keep the VAE and the scheduler's config; then `configure`;
        `offload_frozen`: then move the frozen components to the CPU (see `frozen_on_device`)."""
        self.pipeline = pipeline
        self.device, self.dtype = device, dtype
        freeze(*(getattr(pipeline, name, None) for name in self.frozen_components))
        network = self.trained_network(pipeline)
        if isinstance(network, TimestepExperts):
            self.expert_boundary = network.boundary
        enable_checkpointing(network, gradient_checkpointing)  # all, none or the first N blocks
        self.policies = PolicySet(network, lora)
        self.vae = pipeline.vae
        self._scheduler_config = pipeline.scheduler.config
        self.max_sequence_length = max_sequence_length
        self.configure()
        self.offload_frozen = offload_frozen
        self._frozen_users = dict.fromkeys(self.frozen_components, 0)  # calls in progress that hold each on device
        self._resident: dict[str, HostResident] = {}  # offload_frozen: each frozen component's host copy
        if offload_frozen:
            for name in self.frozen_components:
                self._place(name, None)

    def _place(self, name: str, device: torch.device | None) -> None:
        """Frozen component `name` to `device`, or back to its host copy (None); see models/offload.py."""
        module = getattr(self.pipeline, name, None)
        if module is None:
            return
        if name not in self._resident or self._resident[name].module is not module:  # e.g. text encoders loaded late
            self._resident[name] = HostResident(module)
        if device is None:
            self._resident[name].to_host()
        else:
            self._resident[name].to_device(device)

    @contextlib.contextmanager
    def frozen_on_device(self, part: str) -> Iterator[None]:
        """A block in which the frozen components of `part` ("text": the text encoders, "vae") are on `device`;
        with offload_frozen they go back to the CPU when the outermost such block for them ends (nested calls, an
        editing family's `encode_prompts` calling `encode`, move nothing). Without offload_frozen: nothing."""
        if not self.offload_frozen:
            yield
            return
        names = [n for n in self.frozen_components if (n == "vae") == (part == "vae")]
        for name in names:
            if self._frozen_users[name] == 0:
                self._place(name, self.device)
            self._frozen_users[name] += 1
        try:
            yield
        finally:
            for name in names:
                self._frozen_users[name] -= 1
                if self._frozen_users[name] == 0:
                    self._place(name, None)

    def trained_network(self, pipeline) -> nn.Module:
        """The network the policies wrap and training changes: the pipeline's transformer (Wan 2.2 A14B: both of
        its experts as one module, models/experts.py)."""
        return pipeline.transformer

    def configure(self) -> None:  # noqa: B027  (most families read something of their pipeline here)
        """Family-specific settings read from the pipeline, after the common set-up."""

    # -- conditioning -------------------------------------------------------------------------------------
    def encode_prompts(
        self, prompts: list[str], negative: list[str] | None = None, images: ConditionImages | None = None
    ) -> TensorDict:
        """Conditioning, batch [B]: text (negative embeddings included for classifier-free guidance) and, for an
        editing family, the condition images of each row (`images[i]`: uint8 [H, W, 3] arrays, fitted by
        `fit_conditions`); a text-only family refuses images. This default is a text-only family's whose
        negative prompts default to the empty prompt."""
        refuse_condition_images(self.family, images)
        return self.text_conditioning(prompts, negative if negative is not None else [""] * len(prompts))

    encode_prompts = _with_frozen_on_device(encode_prompts, USES_FROZEN["encode_prompts"])  # as a family's own are

    def _encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Each text through the text encoders on its own: name → [N, …] (encoder dtype; a family's names, e.g.
        `prompt_embeds`, `pooled_prompt_embeds`). What the embedding cache stores."""
        raise NotImplementedError(f"the {self.family} family encodes no text on its own")

    def encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """`_encode_texts(texts)` without gradients, the text encoders on the device for the call (offload_frozen):
        how `text_embeddings` and the embedding cache's filling run the encoders."""
        with torch.no_grad(), self.frozen_on_device("text"):
            return self._encode_texts(texts)

    def text_embeddings(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """`_encode_texts(texts)` on the model's device, from the embedding cache when one is attached."""
        if self.embedding_cache is not None:
            return self.embedding_cache.lookup(texts, self.device)
        return self.encode_texts(texts)

    def text_conditioning(self, prompts: list[str], negative: list[str] | None) -> TensorDict:
        """Rows' text conditioning, batch [B]: each distinct text embedded once, then every name of it per prompt
        and `negative_<name>` per negative prompt (`negative` None: none), floating ones in the model's dtype."""
        texts, prompt_idx, negative_idx = distinct_texts(prompts, negative)
        out = {}
        for name, embedded in self.text_embeddings(texts).items():
            embedded = embedded.to(self.dtype) if embedded.is_floating_point() else embedded
            out[name] = embedded[prompt_idx.to(embedded.device)]
            if negative_idx is not None:
                out[f"negative_{name}"] = embedded[negative_idx.to(embedded.device)]
        return TensorDict(out, batch_size=[len(prompts)], device=self.device)

    # -- the network ------------------------------------------------------------------------------------------
    @abstractmethod
    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor | float, cond: TensorDict, guidance: float):
        """v(x_σ, σ) of the active policy with CFG applied when guidance > 1; fp32, same shape as latents."""

    def forwards_per_evaluation(self, guidance: float) -> int:
        """Transformer forwards per sample that one `velocity` call costs: 2 with classifier-free guidance (the
        batch doubled to [uncond; cond]), else 1 (guidance 1, or a guidance-distilled model, whose scale is an
        input). The NFE counts of rollouts (`rollout/nfe_per_image`) use it. Two experts' scales (models/guidance.py):
        CFG when either is > 1."""
        return 2 if runs_cfg(guidance) and not self.guidance_embeds else 1

    def conditional_guidance(self, guidance: float) -> float:
        """The guidance at which `velocity` is the conditional (CFG-free) policy of rollouts sampled at `guidance`:
        what the forward-process losses train. 1 with classifier-free guidance (the conditional prediction, as the
        DiffusionNFT / AWM / Diffusion-DPO papers train it); `guidance` itself for a guidance-distilled model
        (`guidance_embeds`), where the scale is an input of its one forward and guidance 1 is another function
        than the one sampled."""
        return float(guidance) if self.guidance_embeds else 1.0

    def ignores_guidance(self) -> bool:
        """Whether `velocity` is one function at every guidance: a step-distilled, CFG-free model (FLUX.2-klein),
        which has neither an unconditional prediction nor a guidance input."""
        return False

    def pipeline_call_settings(self, guidance: float, low_noise: float | None) -> dict:
        """The keywords of the family's diffusers pipeline that sample as we do at `guidance` (and the low-noise
        expert's `low_noise`), with our text length: what a model card's snippet passes (checkpoint/model_card.py, which
        keeps only those the pipeline's __call__ takes). Families whose pipeline spells guidance otherwise override."""
        call = {"guidance_scale": guidance, "max_sequence_length": self.max_sequence_length}
        if low_noise is not None and self.expert_boundary is not None:
            call["guidance_scale_2"] = low_noise
        return call

    def row_guidance(self, guidance: float, timestep: torch.Tensor, rows: int) -> float | torch.Tensor:
        """The CFG scale of each of a call's `rows` rows at the transformer's `timestep`: `guidance`; with two timestep
        experts and a low-noise scale (models/guidance.py), that scale on the rows the low-noise expert denoises, then
        fp32 [rows] — per row, as rows of one call may sit on both sides (a forward-process loss's times)."""
        low = low_noise_scale(guidance)
        if self.expert_boundary is None or low == float(guidance):
            return float(guidance)
        return torch.where(high_noise_rows(timestep, rows, self.expert_boundary), float(guidance), low)

    def check_low_noise_guidance(self, low_noise: float | None, key: str) -> None:
        """A low-noise expert's guidance (`key`'s value) needs a model with one: else a UserError naming `key`."""
        refuse_low_noise_without_experts(low_noise, key, self.family, 1 if self.expert_boundary is None else 2)

    def guidance_input(self, guidance: float, rows: int, device: torch.device) -> torch.Tensor | None:
        """The transformer's `guidance` input for `rows` rows: the scale itself (the network scales it by 1000 like
        the timestep) when the model embeds guidance, else None."""
        if not self.guidance_embeds:
            return None
        return torch.full((rows,), float(guidance), device=device, dtype=torch.float32)

    @classmethod
    def size_step(cls, vae_scale: int, transformer_config) -> int:
        """Pixels that height and width must be multiples of, from the VAE's down-sampling and the transformer's
        config (a loaded model's, or `estimate`'s architecture's): a token covers 2×2 latent cells (SD3's patch, the
        packed families' packing)."""
        return vae_scale * 2

    @abstractmethod
    def latent_shape(self, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
        """Shape of one sample's latents (without batch) for `frames` frames of height × width pixels (a ValueError
        saying what fits when the model cannot make that size)."""

    def sigma_schedule(self, num_steps: int, height: int, width: int, frames: int = 1) -> torch.Tensor:
        """σ_0 = 1 > … > σ_T = 0, float32 [num_steps + 1] on the CPU, with the model's shift applied (cached:
        building a scheduler per rollout costs about as much as one SDE step of the tiny model)."""
        cache = self.__dict__.setdefault("_sigma_schedules", {})
        key = (num_steps, height, width, frames)
        if key not in cache:
            cache[key] = self._build_sigma_schedule(num_steps, height, width, frames).float().cpu()
        return cache[key].clone()

    @abstractmethod
    def _build_sigma_schedule(self, num_steps: int, height: int, width: int, frames: int) -> torch.Tensor:
        """The family's schedule (see sigma_schedule), from a fresh scheduler."""

    def fresh_scheduler(self):
        """A new scheduler of the pipeline's kind and config (set_timesteps changes a scheduler's state)."""
        return type(self.pipeline.scheduler).from_config(copy.deepcopy(self._scheduler_config))

    def finished_latents(self, latents: torch.Tensor, cond: TensorDict) -> torch.Tensor:
        """The sampler's last latents [B, …] as the pipeline hands them to the VAE: the latents themselves, but
        where a family gives part of them (Wan 2.2 TI2V's first frame), that part put back."""
        return latents

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images as uint8 [B, H, W, 3] (a video family: [B, F, H, W, 3]) on the CPU."""

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images [B, H, W, 3] (a video family: [B, F, H, W, 3]) → latents [B, …] (fp32, on the model's
        device) that `decode` maps back.

        Deterministic (the VAE posterior's mean), so offline datasets can be encoded once and cached.
        """
        raise NotImplementedError(f"the {self.family} family cannot encode images (needed by offline DPO)")

    # -- policies (shared by all families) ---------------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return self.policies.trainable_parameters()

    def reference(self) -> contextlib.AbstractContextManager[None]:
        return self.policies.reference()

    def using(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.policies.using(name)

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        module = self.policies.trained
        was_training = module.training
        module.eval()
        try:
            yield
        finally:
            module.train(was_training)


def distinct_texts(
    prompts: list[str], negative: list[str] | None
) -> tuple[list[str], torch.Tensor, torch.Tensor | None]:
    """The distinct strings among prompts and negatives (each is encoded once), and where each row finds its own.

    Returns (texts, prompt_index [B], negative_index [B]) with texts[prompt_index[i]] == prompts[i];
    `negative` None (a model that uses no negatives) gives negative_index None.
    """
    if negative is not None and len(negative) != len(prompts):
        raise ValueError(f"encode_prompts: {len(negative)} negative prompts for {len(prompts)} prompts")
    texts = list(dict.fromkeys([*prompts, *(negative or [])]))
    position = {text: i for i, text in enumerate(texts)}
    prompt_index = torch.tensor([position[p] for p in prompts], dtype=torch.long)
    if negative is None:
        return texts, prompt_index, None
    return texts, prompt_index, torch.tensor([position[n] for n in negative], dtype=torch.long)


def single_frame(family: str, frames: int) -> None:
    """An image family's check of `frames` (sampling.num_frames)."""
    if frames != 1:
        raise ValueError(f"the {family} family makes images: frames must be 1 (sampling.num_frames), got {frames}")


def refuse_condition_images(family: str, images: ConditionImages | None) -> None:
    """A text-only family's check of `encode_prompts(images=...)`: condition images need an editing family."""
    if images is not None and any(len(row) for row in images):
        from diffusion_rl.models.registry import load_families

        readers = ", ".join(name for name, f in load_families().items() if f.adapter.edits)
        raise UserError(
            f"the {family} family takes no condition images; prompts with images need a family that reads them "
            f"({readers})"
        )


def images_to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] images [B, 3, H, W] → uint8 [B, H, W, 3] on the CPU."""
    images = (images.float() / 2 + 0.5).clamp(0, 1)
    return (images * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def uint8_to_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] → [-1, 1] float32 images [B, 3, H, W] (the inverse of images_to_uint8)."""
    if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 [B, H, W, 3], got {images.dtype} {tuple(images.shape)}")
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1.0


def as_sigma_batch(sigma: torch.Tensor | float, batch: int, device: torch.device) -> torch.Tensor:
    """σ as a float32 tensor of shape [B] on `device` (a float filled there: a tensor made from it would be a copy
    from the host that waits, once per step)."""
    if not isinstance(sigma, torch.Tensor):
        return torch.full((batch,), sigma, dtype=torch.float32, device=device)
    sigma = sigma.to(device, torch.float32)
    return sigma.expand(batch) if sigma.dim() == 0 else sigma
