"""Rewards: the contract, the registry, the built-in rewards, and the weighted combiner."""

from diffusion_rl.rewards import jpeg  # noqa: F401  (registers the JPEG rewards)
from diffusion_rl.rewards.base import REWARDS, RewardFn, RewardOutputError, make_reward
from diffusion_rl.rewards.combine import RewardCombiner, RewardFailure, RewardResult, WeightedReward

__all__ = [
    "REWARDS",
    "RewardCombiner",
    "RewardFailure",
    "RewardFn",
    "RewardOutputError",
    "RewardResult",
    "WeightedReward",
    "make_reward",
]
