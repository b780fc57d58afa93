"""Rewards: the contract, the registry, the built-in rewards, and the weighted combiner."""

# importing these registers the built-in rewards; their heavy dependencies are imported when a reward is made
from diffusion_rl.rewards import (  # noqa: F401
    clip,
    edit,
    geneval,
    group,
    hps,
    imagereward,
    jpeg,
    ocr,
    remote,
    shapes,
    shapes_edit,
    video,
    vlm,
)
from diffusion_rl.rewards.base import REWARDS, RewardFn, RewardOutputError, is_group_reward, make_reward
from diffusion_rl.rewards.combine import RewardCombiner, RewardFailure, RewardResult, WeightedReward

__all__ = [
    "REWARDS",
    "RewardCombiner",
    "RewardFailure",
    "RewardFn",
    "RewardOutputError",
    "RewardResult",
    "WeightedReward",
    "is_group_reward",
    "make_reward",
]
