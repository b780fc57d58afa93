"""The reward-hacking guard: statistics of the sampled images that no reward optimises, watched every step.

A policy that games its reward (JPEG size by blacking out images, an aesthetic score by saturating colours, a
preference model by collapsing every sample of a prompt onto one picture) shows it in simple image statistics long
before anyone looks at the samples. The guard logs them as `guard/<stat>` (stats.py), compares each with its value
at the start of the run (detector.py), warns naming the statistic, the step, the value and the baseline, and, when
asked, stops the run or rolls it back to the last checkpoint whose images were in range (runner.py). Its settings, the
`guard:` section, are config/guard.py.
"""

from diffusion_rl.guard.detector import Alert, Detector
from diffusion_rl.guard.runner import ALERTS_FILE, GUARD_DIR, SUMMARY_FILE, RunGuard, repeat_key
from diffusion_rl.guard.stats import rollout_stats

__all__ = [
    "ALERTS_FILE",
    "Alert",
    "Detector",
    "GUARD_DIR",
    "RunGuard",
    "SUMMARY_FILE",
    "repeat_key",
    "rollout_stats",
]
