"""The sampling section: training rollouts (steps, size, SDE window, tree rollouts), and the checks that tie
them to the data and algorithm sections."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from diffusion_rl.config.fields import (
    MAX_BATCH,
    MAX_COUNT,
    MAX_FRAMES,
    MAX_GROUP,
    MAX_PIXELS,
    MAX_STEPS,
    OneOf,
    Range,
    check,
    opt,
)
from diffusion_rl.config.plugins import ODE_SOLVERS, STEP_TYPES


@dataclass
class WindowConfig:
    kind: Literal["all", "random", "sliding"] = opt(
        "all",
        "all: every step but the last is SDE (Flow-GRPO); random: a window of `size` steps at a seeded random "
        "start in [lo, hi − size] (Flow-GRPO-Fast); sliding: MixGRPO's window moving along the trajectory.",
    )
    size: int = opt(2, "Window length in steps (random, sliding).", within=Range(1, MAX_STEPS))
    lo: int = opt(0, "random: first step the window may start at.", within=Range(0, MAX_STEPS))
    hi: int | None = opt(
        None, "random: the window ends by this step (exclusive); null = num_steps − 1.", within=Range(0, MAX_STEPS)
    )
    iters_per_window: int = opt(
        25, "sliding: training steps the window stays at one position.", within=Range(1, MAX_COUNT)
    )
    stride: int = opt(1, "sliding: how far the window moves each time.", within=Range(1, MAX_STEPS))
    strategy: Literal["progressive", "random"] = opt("progressive", "sliding: move along, or a random start each step.")


@dataclass
class TreePruneConfig:
    depths: list[int] | None = opt(
        None,
        "Depth pruning: the depths whose steps train (1 = the steps into the first split's children, …, D = the "
        "leaves'); the others sample but get no gradient. null = every depth 1..D.",
        within=Range(1, MAX_STEPS),
    )
    leaves: int | None = opt(
        None,
        "Width pruning: the leaf depth's steps train for only this many leaves per tree, the ⌈n/2⌉ highest and the "
        "⌊n/2⌋ lowest rewards; null = every leaf.",
        within=Range(1, MAX_GROUP),
    )


@dataclass
class TreeConfig:
    branch_at: list[int] = opt(
        list,
        "Steps at which every node splits (increasing; each an SDE step of sampling.window).",
        factory=True,
        within=Range(0, MAX_STEPS),
    )
    branching: int | list[int] = opt(
        2,
        "Children of each split: one number for every split, or one per branch_at step (their product = group).",
        within=Range(2, MAX_GROUP),
    )
    prune: TreePruneConfig = opt(TreePruneConfig, "Which tree steps train (BranchGRPO's pruning).", factory=True)


@dataclass
class SamplingConfig:
    num_steps: int = opt(10, "Denoising steps of a training rollout.", within=Range(2, MAX_STEPS))
    guidance: float = opt(
        4.5,
        "Classifier-free guidance scale (1 = no CFG: one forward per step); FLUX.1-dev: its distilled guidance "
        "embedding (always one forward).",
        within=Range(1, 100),
    )
    guidance_low_noise: float | None = opt(
        None,
        "Wan 2.2 A14B: the guidance of the low-noise expert's steps (t < boundary), diffusers' guidance_scale_2, while "
        "sampling.guidance is the high-noise expert's (Wan2.2-T2V-A14B's release: 3 and 4). null = sampling.guidance; "
        "a model with one transformer refuses it.",
        within=Range(1, 100),
    )
    height: int = opt(64, "Image height in pixels.", within=Range(1, MAX_PIXELS))
    width: int = opt(64, "Image width in pixels.", within=Range(1, MAX_PIXELS))
    num_frames: int = opt(
        1,
        "Frames of each sample: 1 for images; a video family (wan) takes 4k + 1, e.g. 9, 33 or 81.",
        within=Range(1, MAX_FRAMES),
    )
    sde_type: str = opt(
        "sde",
        "Stochastic step inside the window; ode: deterministic sampling (direct_preference family only).",
        within=OneOf(STEP_TYPES),
    )
    noise_level: float = opt(0.7, "SDE noise level a (η for dance_sde; σ_max for sde_linear).", within=Range(0, 10))
    ode_solver: str = opt(
        "euler",
        "Solver of the ODE steps outside the SDE window, one model call per step either way: euler (1st order); "
        "dpm2: DPM-Solver++(2M), as MixGRPO-Flash; ab2: 2-step Adams–Bashforth on the velocity (2nd order on "
        "σ-uniform schedules). SDE steps and log-probs are unchanged.",
        within=OneOf(ODE_SOLVERS),
    )
    window: WindowConfig = opt(WindowConfig, "Which steps are stochastic (and trained).", factory=True)
    share_initial_noise: bool = opt(False, "Same initial noise for every sample of a prompt's group.")
    score_chunks: int = opt(
        1,
        "Sample the batch in this many chunks, scoring each in the background while the next samples.",
        within=Range(1, MAX_BATCH),
    )
    latents_dtype: Literal["fp32", "bf16", "fp16"] = opt(
        "fp32",
        "Memory saver: the dtype the kept trajectory stores its window latents and step means in (half the memory "
        "with bf16/fp16); log-probs stay fp32, and the window's samples are the rounded ones, so the update replays "
        "the rollout's log-probs exactly (sampling/rollout.py).",
    )
    tree: TreeConfig | None = opt(
        None,
        "Tree rollouts (BranchGRPO): each prompt's group shares its prefix and splits at branch_at steps, with "
        "depth-wise advantages (docs/policy_gradient.md). null = flat rollouts.",
    )

    def __post_init__(self):
        if self.tree is not None:
            self._check_tree()

    def _check_tree(self) -> None:
        t = self.tree
        at = list(t.branch_at)
        check(bool(at), "sampling.tree.branch_at is empty: name the steps to split at (e.g. [2, 5]), or set "
                        "sampling.tree to null for flat rollouts")  # fmt: skip
        check(
            all(0 <= k < self.num_steps - 1 for k in at) and all(a < b for a, b in zip(at, at[1:])),
            f"sampling.tree.branch_at={at}: steps must be strictly increasing and in [0, num_steps − 2] "
            f"(num_steps={self.num_steps}; the last step is an ODE step)",
        )
        factors = [t.branching] * len(at) if isinstance(t.branching, int) else list(t.branching)
        check(
            len(factors) == len(at) and all(b >= 2 for b in factors),
            f"sampling.tree.branching={t.branching}: give one number ≥ 2, or one per branch_at step ({len(at)})",
        )
        p = t.prune
        check(
            p.depths is None or (bool(p.depths) and all(1 <= d <= len(at) for d in p.depths)),
            f"sampling.tree.prune.depths={p.depths}: depths are 1..{len(at)} (one per split), and at least one",
        )
        check(
            p.leaves is None or 1 <= p.leaves <= math.prod(factors),
            f"sampling.tree.prune.leaves={p.leaves}: must be in [1, {math.prod(factors)}] (the leaves per tree)",
        )


def check_window(s: SamplingConfig) -> None:
    """A random or sliding window fits inside the trajectory's SDE steps."""
    w = s.window
    if w.kind == "random":
        hi = s.num_steps - 1 if w.hi is None else w.hi
        check(
            w.size >= 1 and w.lo >= 0 and w.lo + w.size <= hi <= s.num_steps,
            f"sampling.window: need 1 ≤ size and lo + size ≤ hi ≤ num_steps; got size={w.size}, "
            f"lo={w.lo}, hi={hi}, num_steps={s.num_steps}",
        )
    if w.kind == "sliding":
        check(
            1 <= w.size <= s.num_steps - 2,
            f"sampling.window: a sliding window stays inside [0, num_steps − 2): need 1 ≤ size ≤ "
            f"{s.num_steps - 2}, got size={w.size}",
        )
