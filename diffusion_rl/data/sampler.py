"""Which prompts each training step uses, as a pure function of (seed, step), so resume needs no saved position.

The prompt order is an endless stream of epochs, each a permutation of range(num_prompts) seeded by (seed, epoch);
step k takes stream positions [k·P, (k+1)·P) for P = prompts_per_step. A step may therefore end one epoch and
start the next, and when P > num_prompts one step spans several epochs.
"""

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import tensorclass

from diffusion_rl.data.condition_images import ConditionImage
from diffusion_rl.data.prompts import PromptRecord
from diffusion_rl.errors import UserError
from diffusion_rl.utils.seeding import make_generator

_STREAM = "data_order"  # names this random stream, so it never coincides with noise drawn from the same seed


def _int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool):
        raise UserError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise UserError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if minimum is not None and value < minimum:
        raise UserError(f"{name} must be at least {minimum}, got {value}")
    return value


class PromptSampler:
    """Prompt indices per training step; `indices(step)` depends only on (seed, step) and the config."""

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int, shuffle: bool = True):
        self.num_prompts = _int("num_prompts", num_prompts, minimum=1)
        self.prompts_per_step = _int("prompts_per_step", prompts_per_step, minimum=1)
        self.seed = _int("seed", seed)
        self.shuffle = bool(shuffle)
        self._cache: dict[int, list[int]] = {}  # a few recent epochs' orders; results never depend on it

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of range(num_prompts) that epoch `epoch` visits (identity without shuffle)."""
        epoch = _int("epoch", epoch, minimum=0)
        if not self.shuffle:
            return list(range(self.num_prompts))
        if epoch not in self._cache:
            generator = make_generator(self.seed, _STREAM, epoch)
            if len(self._cache) >= 4:
                self._cache.pop(next(iter(self._cache)))
            self._cache[epoch] = torch.randperm(self.num_prompts, generator=generator).tolist()
        return self._cache[epoch]

    def indices(self, step: int) -> list[int]:
        """Dataset indices of the `prompts_per_step` prompts of training step `step` (0-based)."""
        step = _int("step", step, minimum=0)
        n = self.num_prompts
        start, end = step * self.prompts_per_step, (step + 1) * self.prompts_per_step
        out: list[int] = []
        for epoch in range(start // n, (end - 1) // n + 1):
            lo, hi = max(start, epoch * n), min(end, (epoch + 1) * n)
            out.extend(self.epoch_order(epoch)[lo - epoch * n : hi - epoch * n])
        return out

    def epoch(self, step: int) -> int:
        """The epoch in which step `step` starts (a step may run into later epochs)."""
        step = _int("step", step, minimum=0)
        return step * self.prompts_per_step // self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "prompts_per_step": self.prompts_per_step,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that a checkpoint's sampler matches this one; there is no position to restore."""
        current = self.state_dict()
        if set(state) != set(current):
            raise UserError(
                f"prompt sampler state has keys {sorted(state)}, expected {sorted(current)}; "
                "the checkpoint was not written by this PromptSampler"
            )
        diffs = [
            f"{key}: checkpoint {state[key]!r}, now {current[key]!r}" for key in current if state[key] != current[key]
        ]
        if diffs:
            raise UserError(
                "prompt sampler settings differ from the checkpoint (" + "; ".join(diffs) + "). Resuming would "
                "not replay the same prompt order: restore the original dataset, prompts_per_step, seed and shuffle, "
                "or start a new run"
            )


@tensorclass
class SampleIds:
    """Who each row is within its training step (`StepPrompts.sample_ids`); it travels with the row's trajectory."""

    sample_index: torch.Tensor  # [B] long: position in the step's batch; seeds the row's noise and timestep draws
    group_index: torch.Tensor  # [B] long: the step's prompt the row belongs to (its advantage group)
    prompt: list  # [B] str: the prompt text (for logs and dumps; the model reads `Trajectory.cond`)
    # [B] long: the version of the weights that sampled the row (the training steps they had taken), stamped by the
    # worker that samples; the update's step minus it is the row's staleness (0 unless rollouts run ahead)
    policy_version: torch.Tensor


@dataclass
class StepPrompts:
    """The prompt instances of one step: P prompts, each repeated group_size times consecutively (B = P·G)."""

    records: list[PromptRecord]  # [B]
    uids: list[str]  # [B]; the same within a group and unique across steps: f"s{step}-p{position}"
    group_index: torch.Tensor  # [B] long, 0..P-1: which group (prompt of this step) each instance belongs to
    prompt_index: list[int]  # [B] index of each instance's prompt in the dataset
    step: int
    group_size: int
    positions: list[int] | None = None  # [B] each instance's position in the step's batch (None: 0..B−1; `select`)

    def __post_init__(self):
        b = len(self.records)
        lengths = {"uids": len(self.uids), "group_index": len(self.group_index), "prompt_index": len(self.prompt_index)}
        if self.positions is not None:
            lengths["positions"] = len(self.positions)
        if any(n != b for n in lengths.values()):
            raise ValueError(f"StepPrompts fields must all have {b} entries (one per record), got {lengths}")

    def __len__(self) -> int:
        return len(self.records)

    def select(self, rows: Sequence[int]) -> "StepPrompts":
        """Some rows of the step's prompts, which keep their positions in the step (what one Ray actor is sent)."""
        rows = [int(i) for i in rows]
        return StepPrompts(
            records=[self.records[i] for i in rows],
            uids=[self.uids[i] for i in rows],
            group_index=self.group_index[rows].clone(),
            prompt_index=[self.prompt_index[i] for i in rows],
            step=self.step,
            group_size=self.group_size,
            positions=[self.positions[i] if self.positions is not None else i for i in rows],
        )

    def sample_ids(self, rows: Sequence[int]) -> SampleIds:
        """The ids of `rows`: their positions in the step's batch (which seed their noise), groups and prompts."""
        rows = [int(i) for i in rows]
        positions = rows if self.positions is None else [self.positions[i] for i in rows]
        return SampleIds(
            sample_index=torch.tensor(positions, dtype=torch.long),
            group_index=self.group_index[rows].clone(),
            prompt=[self.records[i].prompt for i in rows],
            policy_version=torch.full((len(rows),), self.step, dtype=torch.long),  # the sampler stamps its own
            batch_size=[len(rows)],
        )

    @property
    def num_groups(self) -> int:
        return len(self.records) // self.group_size

    @property
    def prompts(self) -> list[str]:
        return [r.prompt for r in self.records]

    @property
    def negative_prompts(self) -> list[str | None]:
        return [r.negative_prompt for r in self.records]

    @property
    def condition_images(self) -> list[tuple[ConditionImage, ...]]:
        """Per instance: the record's condition images (references, read when used; empty for a text prompt)."""
        return [r.images for r in self.records]

    @property
    def metadata(self) -> list[dict[str, Any]]:
        """Per instance: the record's metadata plus its ground_truth and data_source (these two win on a clash).

        Each instance gets its own dict, so a reward function may modify one without touching the others.
        """
        return [r.reward_metadata() for r in self.records]


def make_step_prompts(records: list[PromptRecord], sampler: PromptSampler, step: int, group_size: int) -> StepPrompts:
    """The prompts of training step `step`, each repeated `group_size` times (a GRPO group)."""
    if len(records) != sampler.num_prompts:
        raise UserError(
            f"the prompt sampler was built for {sampler.num_prompts} prompts but the dataset has {len(records)}; "
            "build the PromptSampler with num_prompts=len(records)"
        )
    step = _int("step", step, minimum=0)
    group_size = _int("group_size", group_size, minimum=1)
    chosen = sampler.indices(step)
    return StepPrompts(
        records=[records[i] for i in chosen for _ in range(group_size)],
        uids=[f"s{step}-p{pos}" for pos in range(len(chosen)) for _ in range(group_size)],
        group_index=torch.arange(len(chosen), dtype=torch.long).repeat_interleave(group_size),
        prompt_index=[i for i in chosen for _ in range(group_size)],
        step=step,
        group_size=group_size,
    )
