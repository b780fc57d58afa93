"""Exact FLOP counts of a model's networks without weights: built on the meta device, run under FlopCounterMode.

Meta tensors carry shapes and dtypes but no storage, so a 20B-parameter transformer builds in a fraction of a
second and allocates nothing; every op still dispatches, so torch.utils.flop_counter counts each matmul (2·m·n·k),
convolution and attention (on meta, scaled_dot_product_attention runs its math path: two batched matmuls) of the
real module graph. The bytes autograd saves for backward are counted the same way (by distinct storage), and so
are the bytes the memory-bound ops read and write (`Traffic`: what the roofline's second term takes at bandwidth).
"""

from __future__ import annotations

import contextlib
import functools
import json
import weakref
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from diffusion_rl.estimate.architectures import Architecture
from diffusion_rl.models.checkpointing import checkpointable_blocks
from diffusion_rl.models.doctor import count_saved_tensors
from diffusion_rl.models.registry import family_named

META = torch.device("meta")


def counted_once(count):
    """`count(arch, ...)` computed once per architecture and arguments, then answered from memory: a count is a pure
    function of the architecture's classes and configs (not its name: Qwen-Image-2512 counts as Qwen-Image), of its
    family's adapter (which builds the inputs; the class itself is in the key, so a name registered again counts
    anew) and of the arguments, and `estimate` asks for the same one again for a config's variants (checkpointing on
    or off, other GPU counts). The answers are frozen dataclasses: a caller cannot change what the next one gets."""
    answers = {}

    @functools.wraps(count)
    def counted(arch: Architecture, *args, **kwargs):
        parts = (arch.transformer_class, arch.transformer_config, arch.vae_class, arch.vae_config)
        key = (family_named(arch.family).adapter, json.dumps(parts, sort_keys=True, default=repr), repr(args),
               repr(sorted(kwargs.items())))  # fmt: skip
        if key not in answers:
            answers[key] = count(arch, *args, **kwargs)
        return answers[key]

    return counted


def build_on_meta(class_name: str, config: dict) -> torch.nn.Module:
    """The diffusers module `class_name` of `config`, its parameters on the meta device (no memory)."""
    import diffusers

    cls = getattr(diffusers, class_name)
    with META:
        return cls.from_config(config)


# FLOPs per byte below which an op is memory-bound: elementwise ops, norms, casts, copies and LoRA's thin rank-r
# matmuls; the transformers' dense matmuls and convolutions are far above it (hundreds to thousands). Between the
# ridge points of the GPUs in the table (A100 153, H100/H200 206–295), well clear of both groups.
MEMORY_BOUND_INTENSITY = 100.0


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Traffic(TorchDispatchMode):
    """Counts `bytes`: what the memory-bound ops read and write (inputs and outputs; views move nothing, in-place
    ops are left out). Attention is counted as a fused kernel does it (`FusedAttention`), not as the math path runs
    on meta (whose T×T matrices a GPU never writes out)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage()._cdata for t in inputs}
        if not outputs or all(t.untyped_storage()._cdata in storages for t in outputs):
            return out  # a view, or in place
        moved = _nbytes(inputs) + _nbytes(outputs)
        packet = func._overloadpacket
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        if flops < MEMORY_BOUND_INTENSITY * moved:
            self.bytes += moved
        return out

    @contextlib.contextmanager
    def pause(self):
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


class _FusedAttention(torch.autograd.Function):
    """scaled_dot_product_attention as a fused kernel moves memory: q, k, v read and the output written; backward
    reads them, the output and its gradient and writes three gradients. Its FLOPs are what the math path counts: the
    forward runs it, the backward runs its four T×T products (dS = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q)."""

    @staticmethod
    def forward(ctx, traffic, kwargs, q, k, v):
        ctx.traffic = traffic
        ctx.save_for_backward(q, k, v)
        with traffic.pause():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        traffic.bytes += _nbytes((q, k, v, out))
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        with ctx.traffic.pause():
            k, v = _heads_of(k, q), _heads_of(v, q)  # grouped-query attention: each query head's keys
            probabilities = q.new_empty(*q.shape[:-1], k.shape[-2])  # [.., Tq, Tk], kept by the math path
            ds = grad @ v.transpose(-1, -2)
            probabilities.transpose(-1, -2) @ grad, ds @ k, ds.transpose(-1, -2) @ q
            grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        ctx.traffic.bytes += 2 * _nbytes((q, k, v)) + 2 * _nbytes((grad,))  # + the output, read again
        return None, None, *grads


def _heads_of(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    if t.dim() < 3 or t.shape[-3] == q.shape[-3]:
        return t
    return t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3)


class FusedAttention(TorchFunctionMode):
    """Within the block, scaled_dot_product_attention is `_FusedAttention` for the `traffic` count."""

    def __init__(self, traffic: Traffic):
        super().__init__()
        self.traffic = traffic

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value")
        q, k, v = [*args[:3], *(kwargs.pop(n) for n in names[len(args[:3]) :])]
        return _FusedAttention.apply(self.traffic, kwargs, q, k, v)


@contextlib.contextmanager
def counting_traffic():
    """Within the block, `counter.bytes` grows by the bytes the memory-bound ops move (see Traffic)."""
    traffic = Traffic()
    with traffic, FusedAttention(traffic):
        yield traffic


@dataclass(frozen=True)
class Shapes:
    """One transformer call: `batch` rows (CFG's doubled batch included), an image of height × width pixels and
    `frames` frames, `text` text tokens per row, and an editing family's `sources` condition images per row, each
    `source_size` = (height, width) pixels (None: the image's size, model.condition_size: output)."""

    batch: int
    height: int
    width: int
    frames: int
    text: int
    sources: int = 0
    source_size: tuple[int, int] | None = None


def transformer_inputs(arch: Architecture, s: Shapes, dtype: torch.dtype) -> dict:
    """The keyword arguments the family's adapter gives the transformer for `s`, as meta tensors (its meta_inputs)."""
    latent = ((s.frames - 1) // arch.temporal_scale + 1, s.height // arch.vae_scale, s.width // arch.vae_scale)
    adapter = family_named(arch.family).adapter
    extra = {}
    if adapter.edits:  # only an editing family reads condition images
        height, width = s.source_size or (s.height, s.width)
        extra = {"sources": s.sources, "source_latent": (1, height // arch.vae_scale, width // arch.vae_scale)}
    if arch.image_encoder is not None:  # Wan 2.1 I2V / FLF2V: the transformer cross-attends to the frame's tokens
        extra["image_tokens"] = arch.image_encoder.positions
    return adapter.meta_inputs(arch.transformer_config, s.batch, latent, s.text, dtype, **extra)


@dataclass(frozen=True)
class TransformerCost:
    forward_flops: float  # one call at the shapes
    train_flops: float  # forward + backward of one call (trained parameters' gradients and the activations')
    saved_bytes: int  # activations autograd keeps for backward in one call (as fused attention kernels do)
    params: int  # the base transformer's (LoRA adapters not included)
    blocks: int  # transformer blocks (gradient checkpointing keeps one block's activations live)
    hidden_bytes: int  # one block's input hidden states (what checkpointing keeps per block)
    forward_traffic: float = 0.0  # bytes the memory-bound ops of one call move (Traffic)
    train_traffic: float = 0.0  # ... of one call with its backward


def in_dtype(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` cast to `dtype`, except the submodules its class keeps in fp32 (as from_pretrained(dtype=…) does:
    Wan's norms, rope and time embedding)."""
    module = module.to(dtype)
    keep = getattr(module, "_keep_in_fp32_modules", None) or []
    if dtype != torch.float32:
        for name, sub in module.named_modules():
            if any(k in name.split(".") for k in keep):
                sub.float()
    return module


@counted_once
def transformer_cost(arch: Architecture, s: Shapes, full_finetune: bool, dtype=torch.bfloat16,
                     lora: tuple[tuple[str, ...], int] | None = None) -> TransformerCost:  # fmt: skip
    """Count one transformer call at `s`: forward, forward + backward, saved activations, memory-bound traffic.

    Full fine-tuning: every parameter needs its gradient (backward ≈ 2× forward). LoRA: the base weights are frozen
    but the gradient still flows through every layer to the adapters (backward ≈ 1× forward). `lora` (target module
    names, rank): the adapters are put on the meta module as peft puts them on the real one, so their matmuls (r/d
    of a layer's FLOPs) and the bytes they move (a pass over each target's input and output) are counted.
    """
    module = in_dtype(build_on_meta(arch.transformer_class, arch.transformer_config), dtype)
    params = sum(p.numel() for p in module.parameters())
    blocks = len(checkpointable_blocks(module))  # what model.gradient_checkpointing counts
    module.requires_grad_(full_finetune)
    if lora is not None and not full_finetune:
        from peft import LoraConfig, get_peft_model

        targets, rank = lora
        with META:  # the adapters too: peft would draw their initial values on the CPU, for nothing on meta
            module = get_peft_model(module, LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)))
        _saves_uncounted(m for name, m in module.named_modules() if name.split(".")[-2:-1] in (["lora_A"], ["lora_B"]))
    inputs = transformer_inputs(arch, s, dtype)
    adapter = family_named(arch.family).adapter
    if not full_finetune:  # the gradient reaches the adapters through the activations
        for latents in adapter.meta_latents(inputs):
            latents.requires_grad_(True)
    tokens = _tokens(*adapter.meta_token_shape(inputs))
    # one forward: the counts when it returns are the forward's (the same ops as without gradients: the dispatch modes
    # see them below autograd), the counts after the backward the training call's
    with FlopCounterMode(display=False) as train, count_saved_tensors(tokens) as saved, counting_traffic() as traffic:
        out = module(**inputs)[0]
        forward_flops, forward_traffic = float(train.get_total_flops()), float(traffic.bytes)
        out = adapter.meta_output(out)
        out.float().sum().backward()
    c = arch.transformer_config
    width = c.get("dim") or c.get("num_attention_heads", 1) * c.get("attention_head_dim", 1)
    return TransformerCost(forward_flops, float(train.get_total_flops()), saved[0], params, max(blocks, 1),
                           s.batch * tokens * width * torch.finfo(dtype).bits // 8, forward_traffic,
                           float(traffic.bytes))  # fmt: skip


def _saves_uncounted(modules) -> None:
    """What `modules` save for backward is left out of count_saved_tensors: the adapters' fp32 copies of their
    inputs, which the GPU check's measured peaks (benchmarks/results/gpu_check_h200.json) do not show."""
    entered = []

    def enter(module, args):
        entered.append(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        entered[-1].__enter__()

    def leave(module, args, output):
        entered.pop().__exit__(None, None, None)

    for m in modules:
        m.register_forward_pre_hook(enter)
        m.register_forward_hook(leave)


def _tokens(shape: tuple[int, ...], text: int) -> int:
    """Tokens per row the transformer's blocks carry (image + text), from the latents' shape [B, …]."""
    if len(shape) == 3:
        return shape[1] + text
    spatial = shape[2:]  # [C, (F,) H, W] with a 2×2 (Wan: 1×2×2) patch
    count = 1
    for n in spatial[-2:]:
        count *= n // 2
    if len(spatial) == 3:
        count *= spatial[0]
    return count + text


class PeakLive(TorchDispatchMode):
    """Tracks the bytes of the tensors the ops within the block create and that are still alive: `peak` is the most
    at once (each storage once, freed when its last tensor goes)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage → [bytes, tensors on it]
        self.now = self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                entry = self.live.get(storage._cdata)
                if entry is None:
                    entry = self.live[storage._cdata] = [storage.nbytes(), 0]
                    self.now += entry[0]
                    self.peak = max(self.peak, self.now)
                entry[1] += 1
                weakref.finalize(t, self._release, storage._cdata)
        return out


@dataclass(frozen=True)
class VaeCost:
    flops: float  # one sample's decode, or one condition's encode
    traffic: float  # bytes its memory-bound ops move
    peak_bytes: int  # the most its intermediate tensors hold at once (beyond its input and the weights)


def _vae_call_cost(arch: Architecture, call: str, shape: tuple[int, ...], dtype) -> VaeCost:
    vae = in_dtype(build_on_meta(arch.vae_class, arch.vae_config), dtype)
    x = torch.empty(*shape, device=META, dtype=dtype)
    with FlopCounterMode(display=False) as counter, torch.no_grad(), counting_traffic() as traffic, PeakLive() as live:
        getattr(vae, call)(x)
    return VaeCost(float(counter.get_total_flops()), float(traffic.bytes), live.peak)


def _video_vae(arch: Architecture) -> bool:
    return "temperal_downsample" in arch.vae_config  # (sic: diffusers' spelling)


@counted_once
def vae_decode_cost(arch: Architecture, height: int, width: int, frames: int, dtype=torch.bfloat16) -> VaeCost:
    """FLOPs, memory-bound traffic and working memory of decoding one sample's latents, counted on the meta device."""
    h, w = height // arch.vae_scale, width // arch.vae_scale
    c = arch.vae_config
    channels = c.get("latent_channels") or c.get("z_dim")
    f = ((frames - 1) // arch.temporal_scale + 1,) if _video_vae(arch) else ()
    return _vae_call_cost(arch, "decode", (1, channels, *f, h, w), dtype)


@counted_once
def vae_encode_cost(arch: Architecture, height: int, width: int, frames: int, dtype=torch.bfloat16) -> VaeCost:
    """The same for encoding one condition: an image, or a video VAE's `frames` frames (Wan I2V's given frames with
    the zeros between them)."""
    f = (frames,) if _video_vae(arch) else ()
    return _vae_call_cost(arch, "encode", (1, 3, *f, height, width), dtype)
