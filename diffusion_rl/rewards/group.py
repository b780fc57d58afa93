"""Group rewards: scores that compare the samples of one prompt with each other (base.py's group form).

- `rank`: the normalised rank of each sample's score (from any per-sample reward) within its group,

      rank_i = (#{j: s_j < s_i} + ½ · #{j ≠ i: s_j = s_i}) / (G' − 1)     in [0, 1]

  over the G' samples whose score is finite (ties share the mean of their ranks; the best gets 1, the worst 0).
  A failed score (NaN) gets NaN; a group with one scored sample gets 0.5 (nothing to compare with).
- `pairwise_win_rate` (Pref-GRPO): the share of the other samples of its group that each sample beats,

      win_i = mean_{j ≠ i} P(i beats j)

  with P from a pairwise preference (`preference`: a VLM judge shown both images, or your function) or from a
  per-sample reward (`reward`: P = 1 if s_i > s_j, ½ on a tie, 0 otherwise). A pairwise judge is asked once per
  unordered pair (i < j) with i shown first, and P(j beats i) = 1 − P(i beats j); `both_orders: true` asks again
  with j first and averages, cancelling a judge's bias for the first (or second) image at twice the cost. A
  comparison that failed (NaN) is left out of both samples' means; a sample with no comparison left gets NaN, and a
  group of one gets 0.5.

A pairwise preference is a callable `prefer(images_a, images_b, prompts, metadata) -> P(a better than b)`, float [N]
in [0, 1] with NaN for a comparison that failed: the `vlm` reward with `mode: pairwise` (its `compare`), or a user
function "file.py:prefer" / "package.module:prefer".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS, RewardOutputError, check_reward_output, is_group_reward, make_reward
from diffusion_rl.rewards.user_fn import check_user_call, is_user_function_spec, load_user_function

Preference = Callable[[np.ndarray, np.ndarray, list[str], list[dict[str, Any]]], Any]
_SPEC_KEYS = ("name", "kwargs")


def _spec(value: Any, who: str, key: str) -> tuple[str, dict[str, Any]]:
    """(name, kwargs) of a nested reward entry {name: ..., kwargs: {...}}, or UserError saying what is wrong."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise UserError(f"{who}: {key} must be {{name: NAME, kwargs: {{...}}}}, got {value!r}")
    unknown = sorted(set(value) - set(_SPEC_KEYS))
    if unknown:
        raise UserError(f"{who}: {key} has unknown keys {unknown}; expected name and (optional) kwargs")
    kwargs = value.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise UserError(f"{who}: {key}.kwargs must be a mapping, got {kwargs!r}")
    return value["name"], dict(kwargs)


def _inner_reward(value: Any, who: str) -> tuple[str, Callable[..., Any]]:
    name, kwargs = _spec(value, who, "reward")
    fn = make_reward(name, **kwargs)
    if is_group_reward(fn):
        raise UserError(f"{who}: reward '{name}' is itself a group reward; give a per-sample reward")
    return name, fn


def _preference(value: Any, who: str) -> tuple[str, Preference]:
    name, kwargs = _spec(value, who, "preference")
    if is_user_function_spec(name):
        fn = load_user_function(name)
        check_user_call(name, fn, ("images_a", "images_b", "prompts", "metadata"), kwargs)
        return name, (lambda a, b, p, m: fn(a, b, p, m, **kwargs)) if kwargs else fn
    judge = make_reward(name, **kwargs)
    compare = getattr(judge, "compare", None)
    if not callable(compare):
        raise UserError(
            f"{who}: '{name}' has no pairwise form; use `reward: {{name: {name}}}` to compare its scores, or a "
            "pairwise preference: `vlm` with mode: pairwise, or a function 'file.py:prefer' taking (images_a, "
            "images_b, prompts, metadata) and returning P(a better than b)"
        )
    return name, compare


def normalized_rank(scores: np.ndarray) -> np.ndarray:
    """(#lower + ½·#tied others) / (G' − 1) over the finite scores (module docstring); NaN stays NaN."""
    scores = np.asarray(scores, dtype=np.float64)
    ok = np.isfinite(scores)
    out = np.full(len(scores), np.nan)
    valid = scores[ok]
    if len(valid) == 1:
        out[ok] = 0.5
    elif len(valid) > 1:
        lower = (valid[None, :] < valid[:, None]).sum(axis=1)
        tied_others = (valid[None, :] == valid[:, None]).sum(axis=1) - 1
        out[ok] = (lower + 0.5 * tied_others) / (len(valid) - 1)
    return out.astype(np.float32)


def win_rates(beats_GG: np.ndarray) -> np.ndarray:
    """win_i = mean over j ≠ i of beats[i, j] = P(i beats j), NaN entries left out; NaN without any comparison."""
    beats = np.asarray(beats_GG, dtype=np.float64)
    size = len(beats)
    if size == 1:
        return np.full(1, 0.5, dtype=np.float32)
    off_diagonal = ~np.eye(size, dtype=bool)
    valid = np.isfinite(beats) & off_diagonal
    counts = valid.sum(axis=1)
    sums = np.where(valid, beats, 0.0).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / counts, np.nan).astype(np.float32)


@REWARDS.register("rank")
class RankReward:
    """Normalised rank within the group of a per-sample reward's score, in [0, 1] (1 = best of its group)."""

    group = True
    relative = True  # a batch's mean is the same every step: says nothing about progress (tracking/console.py)

    def __init__(self, reward: Any):
        """reward: the per-sample reward to rank, {name: NAME, kwargs: {...}} (or just its name)."""
        self.name, self.reward = _inner_reward(reward, "rank")

    def score_group(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        scores = check_reward_output(self.name, self.reward(images, prompts, metadata), len(images))
        return normalized_rank(scores)


@REWARDS.register("pairwise_win_rate")
class PairwiseWinRate:
    """Share of its group that each sample beats, from a pairwise preference or a per-sample reward, in [0, 1]."""

    group = True
    relative = True  # a group's win rates average ½ every step

    def __init__(self, preference: Any = None, reward: Any = None, both_orders: bool = False):
        """
        preference: a pairwise preference {name: NAME, kwargs: {...}}: `vlm` with mode: pairwise, or a user
            function 'file.py:prefer' (images_a, images_b, prompts, metadata) -> P(a better than b) [N].
        reward: instead, a per-sample reward whose scores are compared (P = 1, ½ on a tie, 0).
        both_orders: ask the preference about each pair in both orders and average (cancels a position bias).
        """
        if (preference is None) == (reward is None):
            raise UserError("pairwise_win_rate: give exactly one of `preference` (a pairwise judge) or `reward`")
        self.both_orders = bool(both_orders)
        self.preference: Preference | None = None
        self.reward = None
        if preference is not None:
            self.name, self.preference = _preference(preference, "pairwise_win_rate")
        else:
            self.name, self.reward = _inner_reward(reward, "pairwise_win_rate")
            if both_orders:
                raise UserError("pairwise_win_rate: both_orders applies to a `preference`; compared scores have none")

    def score_group(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        size = len(images)
        if size == 1:
            return np.full(1, 0.5, dtype=np.float32)
        beats = np.full((size, size), np.nan)
        if self.reward is not None:
            s = check_reward_output(self.name, self.reward(images, prompts, metadata), size).astype(np.float64)
            with np.errstate(invalid="ignore"):
                beats = np.where(s[:, None] > s[None, :], 1.0, np.where(s[:, None] == s[None, :], 0.5, 0.0))
            beats[~np.isfinite(s)] = np.nan
            beats[:, ~np.isfinite(s)] = np.nan
            return win_rates(beats)
        first, second = np.triu_indices(size, k=1)
        p = self._ask(images, prompts, metadata, first, second)
        if self.both_orders:  # the two orders' mean; where one failed (NaN), the other's verdict alone
            both = np.stack([p, 1.0 - self._ask(images, prompts, metadata, second, first)])
            answered = np.isfinite(both).sum(axis=0)
            p = np.where(answered > 0, np.nansum(both, axis=0) / np.maximum(answered, 1), np.nan)
        beats[first, second] = p
        beats[second, first] = 1.0 - p
        return win_rates(beats)

    def _ask(self, images, prompts, metadata, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """P(a[k] beats b[k]) for each pair k, checked: floats in [0, 1] or NaN."""
        raw = self.preference(images[a], images[b], [prompts[i] for i in a], [metadata[i] for i in a])
        p = check_reward_output(self.name, raw, len(a)).astype(np.float64)
        if np.any((p < 0) | (p > 1)):
            raise RewardOutputError(
                f"preference '{self.name}' returned {p[(p < 0) | (p > 1)][:3].tolist()}; a preference returns "
                "P(first image better) in [0, 1] (NaN for a comparison that failed)"
            )
        return p
