"""Gradient checkpointing of some of the transformer's blocks (`model.gradient_checkpointing`): all, none, the first
N, or, `auto`, as many as the device's free memory needs.

The blocks are the members of the transformer's top-level block lists (`nn.ModuleList`s: SD3's
`transformer_blocks`, FLUX's double then single blocks, Z-Image's refiners then `layers`, Wan's `blocks`), in the
order the forward runs them; two timestep experts (models/experts.py): each expert's, as each call runs one of them.
Checkpointing the first N keeps, for each of them, only its input through the forward and recomputes its activations
in the backward; the later blocks keep theirs. The first ones, because the backward frees the later blocks'
activations before it reaches them: the peak is the end of the forward,

    activations(N) = N · input + max(L − N, 1) · per_block

(L blocks, `per_block` the activations one block saves, `input` its input hidden states); N = L is the all-block
checkpointing (`true`: diffusers' own), N = 0 none. `auto` takes the smallest N whose peak — the rest of the step's
memory (`estimate`'s, estimate/estimator.py) plus activations(N) — leaves MARGIN of the device's free memory unused.

The blocks are marked (CHECKPOINTED) and the transformer's checkpointing function checkpoints marked blocks only, so a
policy copy (a deep copy) checkpoints the same blocks; diffusers calls that function at each block, so compiled blocks
(`model.compile_blocks`) run inside the checkpoint as with `true`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from diffusion_rl.errors import UserError
from diffusion_rl.models.experts import TimestepExperts

logger = logging.getLogger(__name__)

CHECKPOINTED = "_drl_checkpointed"  # the mark of a block to checkpoint
MARGIN = 0.05  # `auto` leaves this share of the device's free memory unused (estimate's TIGHT: fragmentation)
KEY = "model.gradient_checkpointing"


def checkpointable_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer's blocks in the order its forward runs them: the members of its top-level ModuleLists (of each
    expert's, two timestep experts)."""
    if isinstance(module, TimestepExperts):
        return checkpointable_blocks(module.high) + checkpointable_blocks(module.low)
    return [block for child in module.children() if isinstance(child, nn.ModuleList) for block in child]


def blocks_per_call(module: nn.Module) -> int:
    """Blocks one transformer call runs (two experts: one expert's)."""
    return blocks_per_call(module.high) if isinstance(module, TimestepExperts) else len(checkpointable_blocks(module))


def checked_count(setting: bool | int, blocks: int) -> int:
    """Blocks to checkpoint per call for a resolved `setting` (true: all, false: none, N) of a network of `blocks`
    blocks per call; N > blocks is a UserError naming the key."""
    if isinstance(setting, bool):
        return blocks if setting else 0
    if setting > blocks:
        raise UserError(f"{KEY}={setting} but the transformer has {blocks} blocks: give at most {blocks}, or true")
    return setting


def enable_checkpointing(network: nn.Module, setting: bool | int) -> int:
    """Checkpoint the first `setting` blocks of each call's network (true: all, as diffusers does; false or 0: none);
    the count per call."""
    count = checked_count(setting, blocks_per_call(network))
    if count == 0:
        return 0
    if setting is True:
        network.enable_gradient_checkpointing()  # diffusers' own: every block, as before selective counts existed
        return count
    experts = [network.high, network.low] if isinstance(network, TimestepExperts) else [network]
    for expert in experts:
        for block in checkpointable_blocks(expert)[:count]:
            setattr(block, CHECKPOINTED, True)
        expert.enable_gradient_checkpointing(checkpoint_marked)
    return count


def checkpoint_marked(block: nn.Module, *args):
    """diffusers' checkpointing function (non-reentrant torch.utils.checkpoint) for marked blocks; a plain call
    for the others."""
    if not getattr(block, CHECKPOINTED, False):
        return block(*args)
    return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)


def marked_blocks(network: nn.Module) -> int:
    """How many of the network's blocks are marked for checkpointing (of both experts, two experts)."""
    return sum(bool(getattr(block, CHECKPOINTED, False)) for block in checkpointable_blocks(network))


# -- the count `auto` chooses ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointPlan:
    """What `auto` weighs, from `estimate` (bytes per GPU): the step's peak memory without the activations, and a
    call's blocks, the activations it saves without checkpointing (`saved`, `per_block` = saved / blocks each) and a
    block's input hidden states."""

    fixed: float
    blocks: int
    saved: float
    block_input: float

    @property
    def per_block(self) -> float:
        return self.saved / self.blocks

    def activations(self, count: int) -> float:
        """Activations live at the peak with the first `count` blocks checkpointed (module docstring)."""
        return count * self.block_input + self.saved * max(self.blocks - count, 1) / self.blocks

    def choose(self, free: float | None) -> int:
        """The fewest blocks to checkpoint so the peak leaves MARGIN of `free` bytes unused (all when none does; 0
        when `free` is unknown, as on a CPU)."""
        if free is None:
            return 0
        room = (1 - MARGIN) * free - self.fixed
        return next((n for n in range(self.blocks + 1) if self.activations(n) <= room), self.blocks)


def resolved(model_cfg, plan: CheckpointPlan | None, device: torch.device):
    """`model_cfg` (a ModelConfig) with `auto` resolved to a count for `device`, before the model loads there: the
    plan's choice for the device's free memory now (CUDA), none elsewhere or without a plan; said in one log line."""
    if model_cfg.gradient_checkpointing != "auto":
        return model_cfg
    free = float(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else None
    count = 0 if plan is None else plan.choose(free)
    if plan is not None:
        logger.info(describe(plan, free, count))
    return dataclasses.replace(model_cfg, gradient_checkpointing=count)


def describe(plan: CheckpointPlan, free: float | None, count: int) -> str:
    """One line saying what `auto` chose and from which numbers (GiB)."""
    gib = 2**30
    where = "no CUDA device: nothing to fit" if free is None else f"{free / gib:.1f} GiB free"
    return (
        f"{KEY}=auto: {count} of {plan.blocks} blocks checkpointed ({where}; the rest of the step "
        f"{plan.fixed / gib:.1f} GiB, activations {plan.activations(count) / gib:.2f} GiB with them, "
        f"{math.ceil(plan.per_block / 2**20)} MiB per plain block)"
    )
