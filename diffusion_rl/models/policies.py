"""The trained network and its named variants.

A run trains one network (the `default` policy). Some algorithms keep more: a frozen `reference` for the KL
term, an `old` policy (DiffusionNFT), an `ema` policy (AWM). With LoRA they are adapters of one peft model
(the reference is the base with adapters disabled); with full fine-tuning they are frozen copies. With LoRA an
algorithm may also train more adapters beside `default` (`add(name, trained=True)`), each in its own optimizer group
(algorithms/base.py `OptimizerGroup`); `default` stays THE trained policy: the one the EMA, the export and the
weight sync see.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from diffusion_rl.models.compiling import use_compile_cache

DEFAULT = "default"
REFERENCE = "__reference__"  # full fine-tuning's frozen copy of the starting weights (LoRA: adapters disabled)
BLOCK_RECOMPILE_LIMIT = 64  # compiled graphs per block forward (model.compile_blocks); see _compile_blocks


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: int
    target_modules: tuple[str, ...]
    init: str = "gaussian"  # peft init: B=0 so the adapter starts as the identity


class PolicySet:
    def __init__(self, transformer: nn.Module, lora: LoraSettings | None):
        self.lora = lora
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            transformer.requires_grad_(False)
            self._lora_config = LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                target_modules=list(lora.target_modules),
                init_lora_weights=lora.init,
            )
            self.trained: nn.Module = get_peft_model(transformer, self._lora_config, adapter_name=DEFAULT)
            self._copies: dict[str, nn.Module] = {}
        else:
            transformer.requires_grad_(True)
            self.trained = transformer
            self._copies = {}
        self._active = DEFAULT
        self._reference: nn.Module | None = None
        self._trained = [DEFAULT]  # the policies whose tensors train (LoRA: adapters; `default` first)

    # -- which network a forward pass calls ---------------------------------------------------------------
    compile_sampling = False  # model.compile: sampling calls (no grad) go through torch.compile'd networks
    compile_blocks = False  # model.compile_blocks: every call runs networks whose repeated blocks are compiled
    autocast: torch.dtype | None = None  # model.autocast: the forward runs under torch.autocast to this dtype
    # model.offload_reference: full fine-tuning's reference copy lives on the CPU and moves to this device only
    # inside `reference()`; None: it stays where the trained network is
    offload_reference_to: torch.device | None = None

    @property
    def module(self):
        """The network to call now: the active adapter (LoRA) or the active copy (full fine-tuning); a callable that
        enters autocast around it when `autocast` is set (the weights stay in their own dtype)."""
        module = self._copies[self._active] if self.lora is None and self._active != DEFAULT else self.trained
        if self.compile_blocks:
            self._compile_blocks(module)
        elif self.compile_sampling and not torch.is_grad_enabled():
            module = self._compiled(module)
        if self.autocast is not None:
            return _Autocast(module, self.autocast)
        return module

    def _compiled(self, module: nn.Module) -> nn.Module:
        # torch.compile wraps without copying: the wrapper runs `module` with its current weights, so optimizer
        # steps and policy copies stay visible; one wrapper per network, compiled on its first call.
        cache = self.__dict__.setdefault("_compiled_modules", {})
        if id(module) not in cache or cache[id(module)][0] is not module:
            cache[id(module)] = (module, torch.compile(module))
        return cache[id(module)][1]

    def _compile_blocks(self, module: nn.Module) -> None:
        # Regional compilation: each block of the network's block lists is compiled in place (nn.Module.compile),
        # so training (forward and backward) and sampling share the compiled code; blocks of one class share one
        # graph (torch inlines nn.Modules: weights are graph inputs), so compile time does not grow with depth.
        done = self.__dict__.setdefault("_block_compiled", set())
        if id(module) in done:
            return
        # One graph per block variant and call mode: SD3.5's dual-attention and plain blocks and its last
        # (context-only) block, each with and without gradients and with the adapter on and off, exceeded torch's
        # default of 8 per code object on the GPU check, and every block past the 8th then ran eager.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, BLOCK_RECOMPILE_LIMIT)
        use_compile_cache()  # later runs of the same shapes load the kernels compiled here
        for block in repeated_blocks(module):
            block.compile()
        done.add(id(module))

    def names(self) -> list[str]:
        if self.lora is not None:
            return list(self.trained.peft_config)
        return [DEFAULT, *self._copies]

    def saved_names(self) -> list[str]:
        """The policies a checkpoint holds: all but the frozen reference, which is rebuilt from the base weights."""
        return [name for name in self.names() if name != REFERENCE]

    @contextlib.contextmanager
    def using(self, name: str) -> Iterator[None]:
        """Run the block with policy `name` active (no gradients flow into a non-default policy)."""
        if name not in self.names():
            raise KeyError(f"no policy named '{name}'; have {self.names()}")
        previous = self._active
        self._switch(name)
        try:
            yield
        finally:
            self._switch(previous)

    def _switch(self, name: str) -> None:
        if self.lora is not None and name != self._active:
            self.trained.set_adapter(name)
            self._mark_trained()
        self._active = name

    def _mark_trained(self) -> None:
        """peft marks the active adapter, and only it, trainable: keep the trained adapters, and only them, so."""
        for n, p in self.trained.named_parameters():
            p.requires_grad_("lora_" in n and any(f".{name}." in n for name in self._trained))

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen starting point: LoRA disabled, or a frozen copy made before training."""
        if self.lora is not None:
            try:
                with self.trained.disable_adapter():
                    yield
            finally:  # peft's re-enabling marks the active adapter alone trainable: a gradient that reaches an
                self._mark_trained()  # inactive trained adapter later is dropped when its tensors no longer require it
            return
        if self._reference is None:
            raise RuntimeError("no reference copy: call PolicySet.keep_reference() before training")
        previous = self._active
        self._active = REFERENCE
        if self.offload_reference_to is not None:
            self._reference.to(self.offload_reference_to)
        try:
            yield
        finally:
            self._active = previous
            if self.offload_reference_to is not None:
                self._reference.to("cpu")

    def frozen_copies(self) -> dict[str, nn.Module]:
        """Full fine-tuning's frozen networks by name (the reference, `old`, `ema`); empty with LoRA."""
        return dict(self._copies)

    def keep_reference(self) -> None:
        """Full fine-tuning only: freeze a copy of the current weights as the reference."""
        if self.lora is None and self._reference is None:
            # offloaded: copied straight to the CPU, never a second transformer on the device
            offloaded = self.offload_reference_to is not None
            self._reference = _frozen_copy(self.trained, torch.device("cpu") if offloaded else None)
            self._copies[REFERENCE] = self._reference

    # -- named copies ---------------------------------------------------------------------------------------
    def add(self, name: str, *, trained: bool = False, start: str | None = DEFAULT) -> None:
        """A new policy `name` starting as a copy of policy `start` (None: as the base — LoRA's fresh adapter,
        B = 0); `trained`: its tensors train too (LoRA only: `parameters_of(name)` for its optimizer group).
        Frozen otherwise: no gradient reaches it."""
        if trained and self.lora is None:
            raise ValueError("a second trained network needs model.lora (LoRA adapters)")
        if name in self.names():
            if trained and name not in self._trained:
                raise ValueError(f"policy '{name}' exists already, frozen: add it as trained before anything else")
            return
        if self.lora is not None:
            self.trained.add_adapter(name, self._lora_config)
            self.trained.set_adapter(self._active)
            if trained:
                self._trained.append(name)
            self._mark_trained()
            if start is not None:
                self.copy(name, start)
        elif start is None:
            raise ValueError(f"policy '{name}': start=None (the base) needs model.lora (full fine-tuning copies)")
        else:
            self._copies[name] = _frozen_copy(self.trained if start == DEFAULT else self._copies[start])

    def tensors_of(self, name: str) -> dict[str, torch.Tensor]:
        """Policy `name`'s live tensors by name (LoRA: its adapters, names without the adapter tag; else the
        module's parameters)."""
        if self.lora is not None:
            return {n.replace(f".{name}.", "."): p for n, p in self._named_tensors(name)}
        return dict(self._named_tensors(name))

    def _named_tensors(self, name: str) -> list[tuple[str, nn.Parameter]]:
        """Policy `name`'s tensors with their full names in its network (LoRA: with the adapter tag)."""
        if self.lora is not None:
            key = f".{name}."
            return [(n, p) for n, p in self.trained.named_parameters() if key in n and "lora_" in n]
        module = self.trained if name == DEFAULT else self._copies[name]
        return list(module.named_parameters())

    @torch.no_grad()
    def copy(self, target: str, source: str = DEFAULT) -> None:
        self.ema_update(target, source, decay=0.0)

    @torch.no_grad()
    def ema_update(self, target: str, source: str = DEFAULT, decay: float = 0.0) -> None:
        """target ← decay·target + (1 − decay)·source."""
        dst, src = self.tensors_of(target), self.tensors_of(source)
        for n, p in dst.items():
            p.lerp_(src[n].to(p.dtype), 1.0 - decay)

    # -- trainable weights -----------------------------------------------------------------------------------
    def trained_policies(self) -> list[str]:
        """The policies that train: `default`, then those added with trained=True, in the order added."""
        return list(self._trained)

    def parameters_of(self, name: str) -> list[nn.Parameter]:
        """Trained policy `name`'s live trainable tensors (its optimizer group's parameters)."""
        if name not in self._trained:
            raise KeyError(f"policy '{name}' is not trained; the trained ones are {self._trained}")
        return [p for _, p in self._named_tensors(name) if p.requires_grad]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """THE trained policy's (`default`'s) trainable tensors: what the EMA averages and parameter counts count
        (other trained adapters are not among them: `parameters_of`)."""
        return self.parameters_of(DEFAULT)

    def trainable_names(self) -> list[str]:
        """The full names of `trainable_parameters()`, in the same order (the EMA's shadow is stored by them)."""
        return [n for n, p in self._named_tensors(DEFAULT) if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained policy's weights (LoRA tensors, or the whole transformer), names without adapter tags."""
        return {n: p.detach().clone() for n, p in self.tensors_of(DEFAULT).items()}

    def state_dict_of(self, name: str) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.tensors_of(name).items()}

    @torch.no_grad()
    def load_state_dict_of(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        dst = self.tensors_of(name)
        missing = sorted(set(dst) - set(tensors))
        unexpected = sorted(set(tensors) - set(dst))
        if missing or unexpected:
            raise ValueError(
                f"policy '{name}' weights do not match this model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]} — was the checkpoint made with the same model and LoRA settings?"
            )
        for n, p in dst.items():
            p.copy_(tensors[n])


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer's repeated blocks: the members of every nn.ModuleList whose name ends in `blocks`
    (`transformer_blocks`, `single_transformer_blocks`, Wan's `blocks`) — what every family's transformer has."""
    return [
        block
        for name, child in module.named_modules()
        if isinstance(child, nn.ModuleList) and name.rsplit(".", 1)[-1].endswith("blocks")
        for block in child
    ]


class _Autocast:
    """Calls a network under torch.autocast(dtype): matmuls and attention in `dtype`, the weights (and so the
    gradients and the optimizer state) in their own dtype."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        self.module, self.dtype = module, dtype

    def __call__(self, *args, **kwargs):
        device_type = next(self.module.parameters()).device.type
        with torch.autocast(device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def _frozen_copy(module: nn.Module, device: torch.device | None = None) -> nn.Module:
    """A frozen deep copy of `module`, its parameters and buffers on `device` (None: where they are)."""
    memo = {}
    if device is not None:  # deepcopy takes these for the originals: each tensor is copied once, to `device`
        memo = {id(p): nn.Parameter(p.detach().to(device, copy=True), requires_grad=False) for p in module.parameters()}
        memo.update({id(b): b.detach().to(device, copy=True) for b in module.buffers()})
    clone = copy.deepcopy(module, memo)
    clone.requires_grad_(False)
    return clone  # without compiled blocks (nn.Module's pickling drops them): its first call compiles its own
