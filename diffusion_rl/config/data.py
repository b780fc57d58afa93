"""The data and rewards sections: prompts, group size, offline pairs, and the rewards summed into one score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from diffusion_rl.config.fields import MAX_BATCH, MAX_GROUP, MAX_SECONDS, Range, check, opt


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
    weight: float = opt(
        1.0, "Weight in the weighted sum (0 = scored and logged only; to minimise a score, use a reward that negates "
        "it).", within=Range(0, 1e6),
    )  # fmt: skip
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
