"""Evaluation of checkpoints on held-out prompts (`diffusion-rl eval`) and run reports (`diffusion-rl report`)."""

from diffusion_rl.evaluation.evaluate import EvalSettings, RewardChoice, evaluate
from diffusion_rl.evaluation.summary import comparison_table, reward_stats, score_stats
from diffusion_rl.evaluation.targets import BASE, Target, resolve_targets

__all__ = [
    "BASE",
    "EvalSettings",
    "RewardChoice",
    "Target",
    "comparison_table",
    "evaluate",
    "resolve_targets",
    "reward_stats",
    "score_stats",
]
