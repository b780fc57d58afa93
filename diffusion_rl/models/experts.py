"""Two transformers switched by the timestep, trained as one network: Wan 2.2 A14B's high- and low-noise experts.

Wan 2.2 A14B ships two transformers of the same architecture: `transformer` denoises timesteps t ≥ b,
`transformer_2` those below, with b = boundary_ratio · num_train_timesteps (WanPipeline's `boundary_ratio`:
0.875 in text-to-video, 0.9 in image-to-video). `TimestepExperts` holds both as one `nn.Module` (`high`, `low`), so
everything that trains one transformer trains the pair unchanged: LoRA adapts both (peft over the module), the
optimizer, checkpoints, policy copies and FSDP2 (each expert's blocks are units of their own) see one network,
and a step's gradient reaches the expert that made it. A call routes each row by its own timestep, as the pipeline
routes a step: a batch whose rows sit on both sides (forward-process losses draw a time per sample) runs each
expert on its rows.

Sharded (FSDP2, engine/parallel.py): a network whose weights are gathered lazily joins, in each unit's forward and
backward, collectives every rank must join, so every rank must call the same experts. While the sharding asks it
(`agree_over_ranks`, set by the parallel layer while the weights are not gathered up front), a call first agrees
over the group which experts any rank needs (one small all-reduce); a rank with no row for one of them runs it on
one of its rows and adds 0× the result, so that its forward and backward join the same collectives at no effect
on the numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# the pipeline component each expert is (diffusers: `transformer` the high-noise one, `transformer_2` the other)
COMPONENTS = {"high": "transformer", "low": "transformer_2"}


class TimestepExperts(nn.Module):
    """`high` for rows with timestep ≥ `boundary`, `low` below; called as the transformers are (keyword inputs,
    `return_dict=False`), it returns `(output,)`. The timestep is the transformer's (0–1000), [B] or per token
    [B, L] (then a row's first token's)."""

    def __init__(self, high: nn.Module, low: nn.Module, boundary: float):
        super().__init__()
        self.high, self.low = high, low
        self.boundary = float(boundary)
        self.agree_over_ranks = False  # see the module docstring: the parallel layer sets it

    def enable_gradient_checkpointing(self) -> None:
        self.high.enable_gradient_checkpointing()
        self.low.enable_gradient_checkpointing()

    def forward(self, *, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False, **inputs):
        inputs = dict(hidden_states=hidden_states, timestep=timestep, **inputs)
        rows = hidden_states.shape[0]
        high_B = high_noise_rows(timestep, rows, self.boundary)
        n_high = int(high_B.sum())  # the call's one read of the routing on the host
        counts = (n_high, rows - n_high)  # rows of each expert here
        needed = (n_high > 0, n_high < rows)
        if self.agree_over_ranks:  # what any rank needs, every rank runs
            flags = torch.tensor(needed, dtype=torch.int32, device=_collective_device(hidden_states))
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            needed = tuple(bool(f) for f in flags.tolist())
        out, unused = None, []
        for expert, mine, count, wanted in ((self.high, high_B, counts[0], needed[0]),
                                            (self.low, ~high_B, counts[1], needed[1])):  # fmt: skip
            if not wanted:
                continue
            if count == 0:  # only another rank has rows for it: join its collectives on one row
                unused.append(_call(expert, _rows(inputs, torch.zeros(1, dtype=torch.long), rows)))
                continue
            if count == rows:
                out = _call(expert, inputs)
                continue
            index = mine.nonzero().squeeze(1).to(hidden_states.device)
            part = _call(expert, _rows(inputs, index, rows))
            if out is None:
                out = part.new_zeros((rows, *part.shape[1:]))
            out = out.index_copy(0, index, part)
        for part in unused:
            out = out + 0 * part.sum()
        return (out,)


def high_noise_rows(timestep: torch.Tensor, rows: int, boundary: float) -> torch.Tensor:
    """bool [rows]: the rows the high-noise expert denoises, timestep ≥ boundary (the transformer's timestep: a scalar,
    [B], or per token [B, L], then the row's largest: its step's t, where a clean condition frame's tokens sit at 0),
    as the pipeline switches a step; no host read."""
    row_time = timestep if timestep.ndim <= 1 else timestep.amax(dim=1)
    return (row_time.expand(rows) if row_time.ndim == 0 else row_time) >= boundary


def _call(expert: nn.Module, inputs: dict) -> torch.Tensor:
    return expert(**inputs, return_dict=False)[0]


def _rows(inputs: dict, index: torch.Tensor, rows: int) -> dict:
    """The inputs of the rows `index`: every tensor whose first dimension is the batch's."""
    return {
        name: value.index_select(0, index.to(value.device))
        if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == rows
        else value
        for name, value in inputs.items()
    }


def _collective_device(tensor: torch.Tensor) -> torch.device:
    # gloo reduces CPU tensors; NCCL those on the rank's GPU
    return tensor.device if dist.get_backend() != "gloo" else torch.device("cpu")


def experts_in(module: nn.Module) -> list[TimestepExperts]:
    return [m for m in module.modules() if isinstance(m, TimestepExperts)]


def pipeline_parts(network: nn.Module) -> dict[str, nn.Module]:
    """The pipeline components a trained network is: {"transformer": network}, or each expert under its name."""
    if isinstance(network, TimestepExperts):
        return {component: getattr(network, expert) for expert, component in COMPONENTS.items()}
    return {"transformer": network}


def tensors_by_part(network: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """`tensors` named as in `network` (e.g. its LoRA weights) → pipeline component → its tensors, named as in that
    component."""
    if not isinstance(network, TimestepExperts):
        return {"transformer": tensors}
    parts = {component: {} for component in COMPONENTS.values()}
    for name, tensor in tensors.items():
        expert, rest = name.split(".", 1)
        parts[COMPONENTS[expert]][rest] = tensor
    return parts
