"""The model section: the weights to train, LoRA, precision, memory savers and kernels."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Literal

from diffusion_rl.config.fields import MAX_BLOCKS, OneOf, Range, check, opt
from diffusion_rl.config.plugins import FAMILIES
from diffusion_rl.errors import did_you_mean
from diffusion_rl.utils.hub_ids import names_hub_repo

DEFAULT_BACKEND = "sdpa"  # the transformer's attention as diffusers builds it (models/attention.py)
_DEVICE = re.compile(r"auto|(cpu|cuda)(:\d+)?")  # cpu:N: the CPU under another name (a test's "moved" model)


def device_problem(name: str) -> str | None:
    """Why `name` is no device model.device (or a --device flag) takes, or None; whether this machine has it is
    models/loader.py's resolve_device's question."""
    if _DEVICE.fullmatch(name):
        return None
    return f"'{name}' is not a device: auto, cpu, cuda or cuda:N"


def device_flag(value: str) -> str:
    """argparse type of the --device flags: the name, or the flag's one-line error."""
    problem = device_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def backend_names() -> list[str]:
    """Every name `model.attention_backend` takes: sdpa, then diffusers' backends that need no download."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return [DEFAULT_BACKEND, *(b.value for b in AttentionBackendName if not b.value.endswith("_hub"))]


@dataclass
class LoraConfig:
    enabled: bool = opt(True, "Train a LoRA adapter (peft) instead of the full transformer.")
    rank: int = opt(32, "LoRA rank r.", within=Range(1, 4096))
    alpha: int = opt(64, "LoRA alpha (scale = alpha / rank).", within=Range(1, 65536))
    target_modules: list[str] = opt(list, "Module names to adapt; empty = the family's preset.", factory=True)


@dataclass
class ModelConfig:
    path: str = opt(
        "./models/tiny",
        "A local diffusers-format model directory, or a Hugging Face Hub repository (owner/name) loaded through "
        "huggingface_hub's cache as diffusers' from_pretrained loads one (a local folder of that name wins; the token, "
        "HF_HUB_OFFLINE and the cache's place come from the environment: docs/models.md).",
    )
    revision: str | None = opt(
        None,
        "The Hub repository's revision when model.path names one: a commit hash (pins it), branch or tag; null = main.",
    )
    family: str = opt("auto", "Model family; auto reads model_index.json.", within=OneOf(FAMILIES, also=("auto",)))
    dtype: Literal["fp32", "bf16", "fp16"] = opt("fp32", "Weight dtype (SDE math is always fp32).")
    device: str = opt("auto", "auto, cpu, cuda or cuda:N.")
    lora: LoraConfig = opt(LoraConfig, "LoRA settings.", factory=True)
    gradient_checkpointing: bool | int | Literal["auto"] = opt(
        False,
        "Recompute the transformer blocks' activations in backward to save memory. true: every block; false: none; "
        "N: the first N blocks (of each call's transformer; at most its block count, checked at load); auto: on a "
        "CUDA device, the fewest blocks that fit the step's peak (`diffusion-rl estimate`'s memory model) into the "
        "device's free memory with 5 % to spare, none elsewhere (models/checkpointing.py, docs/gpu.md).",
        within=Range(0, MAX_BLOCKS),
    )
    offload_frozen: bool = opt(
        False,
        "Memory saver: keep the frozen text encoders and VAE on the CPU, moving each to model.device only while it "
        "encodes prompts or decodes/encodes images (a copy to the device per use from one host copy, pinned on CUDA; "
        "nothing is copied back; outputs unchanged).",
    )
    offload_reference: bool = opt(
        False,
        "Memory saver, full fine-tuning: keep the frozen reference copy (the KL term's, DPO's) on the CPU, moving it "
        "to model.device only for its forward (a host-device copy of the transformer per reference forward). LoRA's "
        "reference is the base with the adapter disabled: no copy to offload.",
    )
    max_sequence_length: int = opt(
        256, "Text tokens per prompt (T5; Qwen-Image: the prompt after its template).", within=Range(1, 8192)
    )
    embedding_cache: str | None = opt(
        None,
        "Prompt-embedding cache: each distinct prompt and negative prompt of data.train/data.pairs and val.prompts "
        "through the text encoders once, then the encoders are released (no device memory). null = off; auto = "
        "<run.dir>/embedding_cache/; a folder: one file per model and text setting, filled on first use; a "
        "*.safetensors file: read only, made by `diffusion-rl prepare embeddings` (docs/models.md).",
    )
    condition_size: Literal["output", "pipeline"] = opt(
        "output",
        "Size at which an editing family reads its condition images. output: fitted to the output size (cover and "
        "centre-crop; the source and the result line up pixel by pixel; the fewest tokens). pipeline: fitted to the "
        "output's aspect ratio at the size the family's diffusers pipeline gives its VAE, whatever the output size "
        "(FLUX.1 Kontext: the nearest of its ~1 MP training resolutions; Qwen-Image-Edit and FLUX.2: 1024² pixels; "
        "the others: the output size), so a trained LoRA reads at training what the pipeline shows it at inference "
        "(docs/models.md).",
    )
    create_tiny_if_missing: str | None = opt(
        None,
        "Create the tiny model of this preset (base, small, …) at model.path when the directory does not exist; "
        "of model.family (sd3 when auto). Never at a path that could name a Hub repository (owner/name): write "
        "./models/tiny.",
    )
    compile: bool = opt(
        False,
        "torch.compile the transformer for sampling (rollouts, validation; training passes stay eager): "
        "minutes of compiling on first use, then faster steps (see benchmarks/RESULTS.md).",
    )
    compile_blocks: bool | Literal["auto"] = opt(
        "auto",
        "Regional compilation: torch.compile each repeated transformer block in place, so training passes (recompute "
        "forward and backward) and sampling both run compiled blocks; one block's compile time, not the network's "
        "(replaces model.compile's whole-network compile; see benchmarks/RESULTS.md). auto: on when the model is on "
        "a CUDA device and model.compile is off, off elsewhere; torch's compile caches go to the user's cache folder "
        "unless TORCHINDUCTOR_CACHE_DIR is set, and the compile time is logged once (models/compiling.py). On an H200 "
        "(SD3.5-Medium LoRA) the step took × 0.54 (× 0.49 on the cache), but the update's log-probs replay the "
        "rollout's only to ~2e-4 (train/logp_diff_max; 0 eager at that size): false for exact replay (docs/gpu.md).",
    )
    attention_backend: str = opt(
        "sdpa",
        "Attention kernel of the transformer through diffusers' dispatcher: sdpa (as diffusers builds it), native, "
        "_native_math, _native_flash, flash, _flash_3, sage, flex, xformers, … (`*_hub` ones are not offered); one "
        "whose package is missing is refused at load, naming the installed ones (models/attention.py).",
    )
    autocast: Literal["none", "bf16"] = opt(
        "none",
        "Precision policy. bf16: the transformer forward runs under torch.autocast(bf16) while the weights, gradients "
        "and optimizer state stay model.dtype (fp32 master weights); the SDE step and log-prob math stay fp32.",
    )

    def __post_init__(self):
        check(device_problem(self.device) is None, f"model.device {device_problem(self.device)}")
        check(
            self.revision is None or (self.revision.strip() == self.revision != ""),
            f"model.revision {self.revision!r}: a commit hash, branch or tag without spaces, or null for main",
        )
        check(
            not (self.compile and self.compile_blocks is True),
            "model.compile and model.compile_blocks are alternatives: compile_blocks already compiles sampling",
        )
        check(
            self.autocast == "none" or self.dtype != "fp16",
            f"model.autocast={self.autocast} with model.dtype=fp16 mixes two half types; use model.dtype fp32 "
            "(fp32 master weights) or bf16",
        )
        check(
            not (self.offload_reference and self.lora.enabled),
            "model.offload_reference offloads full fine-tuning's reference copy; with model.lora.enabled the "
            "reference is the base model with the adapter disabled, no copy: set model.offload_reference=false",
        )
        backends = backend_names()
        check(
            self.attention_backend in backends,
            f"model.attention_backend '{self.attention_backend}' is not an attention backend"
            f"{did_you_mean(self.attention_backend, backends)}; known: {', '.join(backends)}",
        )

    @property
    def tiny_family(self) -> str:
        """The family of the tiny model create_tiny_if_missing makes: model.family, or sd3 when auto."""
        return "sd3" if self.family == "auto" else self.family

    @property
    def tiny_to_create(self) -> str | None:
        """The tiny preset to create at model.path when it is absent: create_tiny_if_missing, but none where model.path
        could name a Hub repository (owner/name), so a random model never stands in for a Hub id."""
        return None if names_hub_repo(self.path) else self.create_tiny_if_missing
