"""How a PolicyWorker's trained network is spread over devices.

`SingleDevice` (the local engine): the whole network on one device, nothing to reduce. `Fsdp2Sharded` (one rank of
the Ray engine): the transformer sharded with FSDP2 over a torch.distributed process group, one shard per worker.

The worker calls the same methods either way, so its sampling and update code has one copy:
- `prepare(model)` once, after every named policy exists and before the optimizer takes the parameters (FSDP2
  replaces them by sharded DTensors);
- `sum(value)`: a count summed over the workers (e.g. a mini-batch's kept samples, so every worker scales its
  loss by the global count and the summed gradients are the global mean);
- `sync_gradients(last_before_step)` before each backward: whether this backward must reduce the gradients;
- `clip_grad_norm(params, max_norm)`: the norm over all shards, identical on every worker;
- `full_tensors(tensors, keep)`: whole CPU copies of (possibly sharded) tensors, for exports;
- `gathered()`: a block in which the trained network's full weights are on this device, so a worker can sample
  any number of rows (even none) without collectives inside the sampler loop;
- `training()`: a block holding one update (its forwards, backwards and optimizer steps);
- `settle()`: every network back to its shards, before an algorithm edits weights in place (EMA of a policy).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from diffusion_rl.models.experts import TimestepExperts, experts_in
from diffusion_rl.models.policies import DEFAULT

logger = logging.getLogger(__name__)


class SingleDevice:
    rank = 0
    world_size = 1

    def prepare(self, model) -> None:
        """Nothing to do: the model stays as loaded."""

    def sum(self, value: float) -> float:
        return value

    def sync_gradients(self, last_before_step: bool) -> None:
        """Called before each backward; nothing to reduce on one device."""

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def settle(self) -> None:
        """Every network back to its own weights before anything edits them in place (one device: always)."""

    def full_tensors(self, tensors: dict[str, torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
        """Whole CPU copies of `tensors` (one device: they are whole already)."""
        return {name: t.detach().cpu() for name, t in tensors.items()} if keep else {}

    @contextlib.contextmanager
    def gathered(self, policy: str = "default") -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        yield


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a diffusers transformer (FSDP2 units): SD3 `transformer_blocks`, FLUX also
    `single_transformer_blocks`; otherwise the members of its largest ModuleList. Two experts: each one's."""
    if isinstance(module, TimestepExperts):
        return transformer_blocks(module.high) + transformer_blocks(module.low)
    blocks = []
    for name in ("transformer_blocks", "single_transformer_blocks"):
        found = getattr(module, name, None)
        if isinstance(found, nn.ModuleList):
            blocks.extend(found)
    if blocks:
        return blocks
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


class Fsdp2Sharded(SingleDevice):
    """FSDP2 over a one-dimensional device mesh of all workers (the process group is already initialised).

    mixed_precision "bf16": compute in bf16 (parameters all-gathered in bf16), gradients reduced in fp32; the
    sharded parameters and the optimizer state stay in the model's dtype.

    reshard_after_forward False (the default): inside `training()` each unit is all-gathered once per optimizer
    step and its gradients are reduce-scattered once per optimizer step (accumulated unsharded over the micro-batches
    and trained steps before it), which on a small model cuts the collectives per step from ~3 per unit per
    micro-step to 2 per unit. True: FSDP2's own schedule (ZeRO-3), the least memory: weights are gathered for every
    forward and backward and gradients reduced after every backward.

    cpu_offload: FSDP2's CPUOffloadPolicy — the shards, their gradients and so the optimizer state live in host
    memory; each unit's weights are copied to the device when gathered and its reduced gradients back (pinned host
    memory on a GPU; plain memory on a CPU-only machine, where FSDP2 cannot pin).
    """

    def __init__(
        self,
        device: torch.device,
        mixed_precision: str = "none",
        reshard_after_forward: bool = False,
        cpu_offload: bool = False,
    ):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = device
        self.mesh = init_device_mesh(device.type, (self.world_size,))
        self.mixed_precision = mixed_precision
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.roots: dict[str, nn.Module] = {}  # the FSDP root of each sharded network, by policy: "default" trains
        self._accumulating = False  # inside training() with reshard_after_forward False

    def prepare(self, model) -> None:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
        )

        policy = MixedPrecisionPolicy()
        if self.mixed_precision == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        policies = model.policies
        networks = {DEFAULT: policies.trained, **policies.frozen_copies()}  # LoRA: every adapter is in "default"
        for name, network in networks.items():
            # peft wraps the diffusers transformer: shard the transformer itself, which holds every parameter
            root = network.get_base_model() if hasattr(network, "get_base_model") else network
            for block in transformer_blocks(root):
                fully_shard(block, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
            fully_shard(root, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
            for experts in experts_in(root):  # lazily gathered: every rank calls the experts any rank needs
                experts.agree_over_ranks = True
            # every worker scales its loss by the global count (see `sum`): the gradients must be summed, not
            # averaged over the workers. A plain SUM: gloo has no PREMUL_SUM (what a divide factor uses otherwise)
            for module in root.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
            self.roots[name] = root
        self.units = self._units_of(DEFAULT)
        logger.info("FSDP2: %d blocks + root sharded over %d workers", len(self.units) - 1, self.world_size)

    def _units_of(self, policy: str) -> list[nn.Module]:
        """The FSDP units of the network that runs `policy` (a LoRA adapter runs in the trained network)."""
        from torch.distributed.fsdp import FSDPModule

        root = self.roots.get(policy, self.roots[DEFAULT])
        return [m for m in root.modules() if isinstance(m, FSDPModule)]

    def sum(self, value: float) -> float:
        import torch.distributed as dist

        total = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return type(value)(total.item()) if isinstance(value, int) else total.item()

    def full_tensors(self, tensors: dict[str, torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
        """Unsharded CPU copies: an all-gather per DTensor, in the dict's order (a collective: the same on every
        rank). With keep=False this rank takes part in the gathers but keeps nothing (only rank 0 needs them)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for name, t in tensors.items():
            full = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
            if keep:
                out[name] = full.cpu()
        return out

    def sync_gradients(self, last_before_step: bool) -> None:
        """Called before each backward: reduce the gradients only on the last one before an optimizer step."""
        if self._accumulating:
            self.roots[DEFAULT].set_requires_gradient_sync(last_before_step, recurse=True)

    def clip_grad_norm(self, params: list[nn.Parameter], max_norm: float) -> float:
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        if isinstance(total, DTensor):  # a partial norm per shard: reduce it over the workers
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        if self._accumulating:  # the optimizer is about to change the shards: the gathered copies go stale
            self._reshard()
        return float(total)

    # -- when the full weights stay gathered --------------------------------------------------------------------------
    def _keep_gathered(self, keep: bool, policy: str = DEFAULT) -> None:
        root = self.roots.get(policy, self.roots[DEFAULT])
        root.set_reshard_after_forward(not keep, recurse=True)
        root.set_reshard_after_backward(not keep, recurse=True)
        if not keep:  # fully_shard's default: the root keeps its parameters from forward to backward
            root.set_reshard_after_forward(False, recurse=False)

    def settle(self) -> None:
        """Reshard every network: a frozen copy's root keeps the weights a forward gathered (it waits for a backward
        that never comes), and an in-place edit of gathered weights (an EMA of `old`) would be lost."""
        for policy in self.roots:
            self._reshard(self._units_of(policy))

    def _reshard(self, units: list[nn.Module] | None = None) -> None:
        for unit in self.units if units is None else units:
            unit.reshard()

    @contextlib.contextmanager
    def gathered(self, policy: str = DEFAULT) -> Iterator[None]:
        """All-gather the network that runs `policy` once (a collective: every worker enters this together); its
        forwards inside the block are then local. Resharded on exit: nothing done to it inside is kept."""
        units = self._units_of(policy)
        experts = experts_in(self.roots.get(policy, self.roots[DEFAULT]))
        self._keep_gathered(True, policy)
        try:
            for unit in units:
                unit.unshard()
            for each in experts:  # gathered: a rank calls only the experts of its own rows (it may have none)
                each.agree_over_ranks = False
            yield
        finally:
            for each in experts:
                each.agree_over_ranks = True
            self._reshard(units)
            self._keep_gathered(False, policy)

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """An update: with reshard_after_forward False, gather once and reduce once per optimizer step."""
        if self.reshard_after_forward:
            yield
            return
        self._keep_gathered(True)
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False
            self.roots[DEFAULT].set_requires_gradient_sync(True, recurse=True)
            self._reshard()
            self._keep_gathered(False)
