"""Exact FLOP counts of a model's networks without weights: built on the meta device, run under FlopCounterMode.

Meta tensors carry shapes and dtypes but no storage, so a 20B-parameter transformer builds in a fraction of a
second and allocates nothing; every op still dispatches, so torch.utils.flop_counter counts each matmul (2·m·n·k),
convolution and attention (on meta, scaled_dot_product_attention runs its math path: two batched matmuls) of the
real module graph. The bytes autograd saves for backward are counted the same way (by distinct storage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from diffusion_rl.estimate.architectures import Architecture
from diffusion_rl.models.doctor import count_saved_tensors
from diffusion_rl.models.registry import family_named

META = torch.device("meta")


def build_on_meta(class_name: str, config: dict) -> torch.nn.Module:
    """The diffusers module `class_name` of `config`, its parameters on the meta device (no memory)."""
    import diffusers

    cls = getattr(diffusers, class_name)
    with META:
        return cls.from_config(config)


@dataclass
class Shapes:
    """One transformer call: `batch` rows (CFG's doubled batch included), an image of height × width pixels and
    `frames` frames, `text` text tokens per row, and an editing family's `sources` condition images per row."""

    batch: int
    height: int
    width: int
    frames: int
    text: int
    sources: int = 0


def transformer_inputs(arch: Architecture, s: Shapes, dtype: torch.dtype) -> dict:
    """The keyword arguments the family's adapter gives the transformer for `s`, as meta tensors (its meta_inputs)."""
    latent = ((s.frames - 1) // arch.temporal_scale + 1, s.height // arch.vae_scale, s.width // arch.vae_scale)
    adapter = family_named(arch.family).adapter
    sources = {"sources": s.sources} if adapter.edits else {}  # only an editing family reads condition images
    return adapter.meta_inputs(arch.transformer_config, s.batch, latent, s.text, dtype, **sources)


@dataclass
class TransformerCost:
    forward_flops: float  # one call at the shapes
    train_flops: float  # forward + backward of one call (trained parameters' gradients and the activations')
    saved_bytes: int  # activations autograd keeps for backward in one call (as fused attention kernels do)
    params: int
    blocks: int  # transformer blocks (gradient checkpointing keeps one block's activations live)
    hidden_bytes: int  # one block's input hidden states (what checkpointing keeps per block)


def transformer_cost(arch: Architecture, s: Shapes, full_finetune: bool, dtype=torch.bfloat16) -> TransformerCost:
    """Count one transformer call at `s`: forward, forward + backward, saved activations.

    Full fine-tuning: every parameter needs its gradient (backward ≈ 2× forward). LoRA: the base weights are frozen
    but the gradient still flows through every layer to the adapters (backward ≈ 1× forward); the rank-r adapter
    matmuls themselves are left out (r/d of the layer, ~2–4 % at r 64 on 3072-wide layers).
    """
    module = build_on_meta(arch.transformer_class, arch.transformer_config).to(dtype)
    params = sum(p.numel() for p in module.parameters())
    module.requires_grad_(full_finetune)
    inputs = transformer_inputs(arch, s, dtype)
    with FlopCounterMode(display=False) as forward, torch.no_grad():
        module(**inputs)
    if not full_finetune:  # the gradient reaches the adapters through the activations
        for latents in _latent_inputs(inputs):
            latents.requires_grad_(True)
    tokens = _tokens(inputs)
    with FlopCounterMode(display=False) as train, count_saved_tensors(tokens) as saved:
        out = module(**inputs)[0]
        out = torch.stack(out) if isinstance(out, list) else out  # Z-Image answers with a list of rows
        out.float().sum().backward()
    blocks = sum(len(m) for name, m in module.named_children() if isinstance(m, torch.nn.ModuleList))
    c = arch.transformer_config
    width = c.get("dim") or c.get("num_attention_heads", 1) * c.get("attention_head_dim", 1)
    return TransformerCost(float(forward.get_total_flops()), float(train.get_total_flops()), saved[0], params,
                           max(blocks, 1), s.batch * tokens * width * torch.finfo(dtype).bits // 8)  # fmt: skip


def _latent_inputs(inputs: dict) -> list[torch.Tensor]:
    """The latent inputs: `hidden_states` [B, …], or Z-Image's list `x` of rows [C, F, H, W]."""
    return [inputs["hidden_states"]] if "hidden_states" in inputs else list(inputs["x"])


def _tokens(inputs: dict) -> int:
    """Tokens per row the transformer's blocks carry (image + text)."""
    if "hidden_states" in inputs:
        x, text = inputs["hidden_states"], inputs["encoder_hidden_states"].shape[1]
    else:  # Z-Image: one [C, F, H, W] latent and one [L, D] caption per row
        x, text = inputs["x"][0][None], inputs["cap_feats"][0].shape[0]
    if x.dim() == 3:
        return x.shape[1] + text
    spatial = x.shape[2:]  # [C, (F,) H, W] with a 2×2 (Wan: 1×2×2) patch
    count = 1
    for n in spatial[-2:]:
        count *= n // 2
    if len(spatial) == 3:
        count *= spatial[0]
    return count + text


def vae_decode_flops(arch: Architecture, height: int, width: int, frames: int, dtype=torch.bfloat16) -> float:
    """FLOPs of decoding one sample's latents to pixels, counted on the meta device."""
    vae = build_on_meta(arch.vae_class, arch.vae_config).to(dtype)
    h, w = height // arch.vae_scale, width // arch.vae_scale
    c = arch.vae_config
    channels = c.get("latent_channels") or c.get("z_dim")
    if "temperal_downsample" in c:
        f = (frames - 1) // arch.temporal_scale + 1
        z = torch.empty(1, channels, f, h, w, device=META, dtype=dtype)
    else:
        z = torch.empty(1, channels, h, w, device=META, dtype=dtype)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        vae.decode(z)
    return float(counter.get_total_flops())
