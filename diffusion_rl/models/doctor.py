"""What `diffusion-rl doctor` reports about a model: its parts, their sizes, and the memory a training run needs.

The memory estimate adds up what one training process holds on its device:
- weights: every component of the pipeline (text encoders, VAE, transformer) at its dtype;
- training state: for each trainable parameter its gradient and AdamW's two moments, in the parameter's dtype
  (LoRA weights stay fp32 over a bf16/fp16 base); plus a frozen reference copy under full fine-tuning with a KL;
- activations: the bytes autograd saves for backward in one forward of one sample (measured by running it, with
  CFG's doubled batch when the family runs one), times the micro-batch;
- rollout buffer: what a trajectory stores per sample (latents before and after every stochastic step, step means,
  text conditioning), times the rollout batch held on the device.
It leaves out allocator fragmentation, CUDA context and kernel workspaces (typically 1–3 GB more).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn


def pipeline_components(pipeline) -> dict[str, nn.Module]:
    """The pipeline's torch modules by name (transformer, text encoders, VAE), in the pipeline's order."""
    return {name: module for name, module in pipeline.components.items() if isinstance(module, nn.Module)}


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def dtype_of(module: nn.Module) -> str:
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()})
    return "/".join(dtypes) or "-"


@contextlib.contextmanager
def count_saved_tensors(sequence: int | None = None):
    """Within the block, `counter[0]` grows by the bytes of each distinct storage autograd saves for backward.

    A storage is known by its identity, not its address (meta tensors, which `diffusion-rl estimate` counts on, have
    none). `sequence` T: leave out [B·heads, T, T] attention matrices — the math attention path (the one meta
    tensors take) saves them, the fused kernels of a GPU keep only a [B, heads, T] log-sum-exp."""
    counter, seen = [0], set()

    def pack(tensor: torch.Tensor):
        if sequence is not None and tensor.dim() >= 3 and tensor.shape[-1] == tensor.shape[-2] == sequence:
            return tensor
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            counter[0] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counter


def activation_bytes_per_sample(
    model, height: int, width: int, guidance: float, frames: int = 1, sources: list | None = None
) -> int:
    """Bytes saved for backward by one guided velocity of one sample (the trained policy, gradients on); `sources`:
    an edit's condition images (uint8 [height, width, 3] each)."""
    cond = model.encode_prompts(["a photograph of a red apple on a wooden table"], [""], _rows(sources))
    x = torch.randn(1, *model.latent_shape(height, width, frames), device=model.device)
    with count_saved_tensors() as saved:
        v = model.velocity(x, 0.5, cond, guidance)
    del v
    return saved[0]


def _rows(sources: list | None) -> list | None:
    return None if not sources else [sources]


def cond_bytes_per_sample(model, sources: list | None = None) -> int:
    cond = model.encode_prompts(["a photograph"], [""], _rows(sources))
    return sum(t.numel() * t.element_size() for t in cond.values(include_nested=True, leaves_only=True))


@dataclass
class MemoryEstimate:
    weights: int
    training_state: int
    reference_copy: int
    activations: int  # for the whole micro-batch
    rollout_buffer: int  # for the whole rollout batch

    @property
    def total(self) -> int:
        return self.weights + self.training_state + self.reference_copy + self.activations + self.rollout_buffer

    def rows(self) -> list[tuple[str, int]]:
        """(what, bytes) rows, the total last."""
        return [
            ("weights (all components)", self.weights),
            ("grads + AdamW moments", self.training_state),
            ("frozen reference copy", self.reference_copy),
            ("activations (micro-batch)", self.activations),
            ("rollout buffer", self.rollout_buffer),
            ("total", self.total),
        ]


def human_bytes(n: int) -> str:
    """1536 → '1.5 KiB'; sizes in binary units, three significant digits."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.3g} {unit}"


def estimate_memory(
    model,
    *,
    height: int,
    width: int,
    micro_batch: int,
    rollout_batch: int,
    num_steps: int,
    guidance: float,
    kl_reference: bool = False,
    measure_activations: bool = True,
    frames: int = 1,
    sources: list | None = None,
) -> MemoryEstimate:
    """What a training process holds (see the module docstring); `frames` for a video family, `sources` an edit's
    condition images (they lengthen the token sequence and the conditioning)."""
    weights = sum(parameter_bytes(m) for m in pipeline_components(model.pipeline).values())
    trainable = model.trainable_parameters()
    training_state = sum(3 * p.numel() * p.element_size() for p in trainable)  # grad, exp_avg, exp_avg_sq
    reference = parameter_bytes(model.policies.trained) if (kl_reference and model.policies.lora is None) else 0
    per_sample = (
        activation_bytes_per_sample(model, height, width, guidance, frames, sources) if measure_activations else 0
    )
    latent = torch.Size(model.latent_shape(height, width, frames)).numel() * 4  # fp32
    steps = num_steps - 1  # the default window: every step but the last is stochastic
    trajectory = (steps + 1) * latent + steps * latent + latent + cond_bytes_per_sample(model, sources)
    return MemoryEstimate(weights, training_state, reference, per_sample * micro_batch, trajectory * rollout_batch)
