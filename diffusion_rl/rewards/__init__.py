"""Rewards: the contract, the registry, the built-in rewards (one module each, registered when REWARDS is first
looked up: diffusion_rl/registry.py), and the weighted combiner."""

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
