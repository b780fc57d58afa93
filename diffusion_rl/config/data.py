"""The data and rewards sections: prompts, group size, offline pairs, and the rewards summed into one score."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from diffusion_rl.settings import MAX_BATCH, MAX_GROUP, MAX_SECONDS, Range, check, opt

if TYPE_CHECKING:
    from diffusion_rl.config import Config


@dataclass
class DataConfig:
    train: str = opt("configs/prompts/quickstart.txt", "Training prompts: .txt, .jsonl or .parquet.")
    prompts_per_step: int = opt(2, "Distinct prompts per training step.", within=Range(1, MAX_BATCH))
    group_size: int = opt(4, "Samples per prompt (the group for advantages).", within=Range(1, MAX_GROUP))
    shuffle: bool = opt(True, "Shuffle prompt order each epoch (seeded).")
    sample_source: Literal["online", "offline"] = opt(
        "online",
        "online: sample and score the current model each step; offline: Diffusion-DPO on the pair dataset "
        "data.pairs (no sampling, no reward for training; data.prompts_per_step pairs per step).",
    )
    pairs: str | None = opt(
        None,
        "Offline pair dataset (.jsonl or .parquet): prompt, chosen and rejected image paths (relative to the file), "
        "optional negative_prompt, chosen_score, rejected_score. Made by `diffusion-rl prepare pairs`.",
    )

    @property
    def batch_size(self) -> int:
        """Rows of a training step: prompts × group size; offline pairs: chosen and rejected of each."""
        if self.sample_source == "offline":
            return 2 * self.prompts_per_step
        return self.prompts_per_step * self.group_size


@dataclass
class RewardSpec:
    name: str = opt("jpeg_incompressibility", "Registered reward name, or module:function / file.py:function.")
    label: str | None = opt(None, "Name in metrics and logs; default: name; must be unique.")
    weight: float = opt(1.0, "Weight in the weighted sum (finite, ≥ 0; 0 = scored and logged only).")
    required: bool = opt(True, "A failure of this reward fails the sample; false: left out and renormalised.")
    kwargs: dict[str, Any] = opt(dict, "Keyword arguments for the reward.", factory=True)
    frames: Literal["mean", "min", "first", "last"] = opt(
        "mean",
        "How an image reward scores a video: the mean or the min of its frames' scores, or the first or last "
        "frame's (a reward that scores whole videos, e.g. temporal_consistency, ignores it).",
    )
    actors: int = opt(
        0,
        "Score in this many Ray actors of the reward's own (model-based rewards); 0 = in the trainer process.",
        within=Range(0, 1024),
    )
    actor_cpus: float = opt(1.0, "CPUs each reward actor reserves.", within=Range(0, 1024))
    actor_gpus: float = opt(
        0.0, "GPUs each reward actor reserves (a fraction shares a GPU between actors).", within=Range(0, 64)
    )
    timeout_s: float | None = opt(
        1800.0,
        "Deadline of one call of the reward (a chunk; a sample when retried; a group): past it the call's samples "
        "fail, naming the reward, and the call's thread is abandoned. null = no deadline.",
        within=Range(0, MAX_SECONDS, lo_open=True),
    )

    def __post_init__(self):
        check(
            self.label is None or bool(self.label.strip()),
            f"rewards: label must be a non-blank name (or null = the reward's name), got {self.label!r}",
        )

    @property
    def metric_name(self) -> str:
        """The reward's name in metrics (reward/<metric_name>/mean) and logs: its label, else its name."""
        return self.label if self.label is not None else self.name


def check_batch(cfg: Config) -> None:
    """Groups that can be compared, and a batch that splits into the mini-batches."""
    data = cfg.data
    # every loss is group-relative (advantages normalised within a prompt's group; online dpo pairs two of its
    # samples): a group of one gives every sample advantage 0 and the run learns nothing
    check(
        data.group_size >= 2 or data.sample_source == "offline",
        f"data.group_size=1: algorithm.loss={cfg.algorithm.loss} compares the samples of each prompt's group "
        "(group-normalised advantages; online dpo: pairs within the group), so every advantage would be 0 and "
        "nothing is learned; set data.group_size to 2 or more",
    )
    batch = data.prompts_per_step * data.group_size
    minibatches = cfg.train.num_minibatches
    check(
        batch % minibatches == 0,
        f"the batch (data.prompts_per_step × data.group_size = {batch}) must split evenly into "
        f"train.num_minibatches = {minibatches}",
    )


def check_rewards(cfg: Config) -> None:
    """A reward to train on (offline DPO needs none); each weight is finite and ≥ 0; each reward's metric name
    (label, else name) is unique (also val.rewards)."""
    check(
        len(cfg.rewards) > 0 or cfg.data.sample_source == "offline",
        "rewards: at least one reward is needed (only offline DPO trains without one)",
    )
    lists = [("rewards", cfg.rewards)]
    if cfg.val.rewards is not None:
        check(bool(cfg.val.rewards), "val.rewards is an empty list; give at least one reward, or null")
        lists.append(("val.rewards", cfg.val.rewards))
    for where, specs in lists:
        for i, spec in enumerate(specs):
            check(
                math.isfinite(spec.weight) and spec.weight >= 0,
                f"{where}.{i}.weight must be a finite number ≥ 0, got {spec.weight}; to minimise a score, use a "
                "reward that negates it",
            )
        first_of: dict[str, int] = {}
        for i, spec in enumerate(specs):
            key = spec.metric_name
            if key in first_of:
                raise ValueError(
                    f"{where}.{first_of[key]} and {where}.{i} are both '{key}' in metrics and logs (the label, "
                    f"else the name, must be unique): give one of them its own label, e.g. "
                    f"{where}.{i}.label={key}_2"
                )
            first_of[key] = i
