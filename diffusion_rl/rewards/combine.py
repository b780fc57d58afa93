"""Score a batch with several rewards and combine them into one weighted total per sample.

Failure rules (a failure is counted and reported, never replaced by 0):
- A reward that raises on the batch is called again sample by sample, so one bad image does not fail the others.
- A sample on which it still raises, or gets NaN/inf, is failed for that reward. One warning per reward per batch.
- A reward that returns the wrong type, dtype or shape is a bug: RewardOutputError, naming the reward.
- A sample failed on a required reward is failed: total NaN, failed True.
- A non-required reward that fails on a sample is left out of that sample's sum, and the weights of the rewards
  that succeeded are scaled back up to the full weight mass:

      total_i = (sum_k w_k) * (sum_{k ok on i} w_k r_ki) / (sum_{k ok on i} w_k)

  which is sum_k w_k r_ki when every reward succeeded. A sample on which no reward of positive weight succeeded is
  failed.
- If every sample fails, RewardFailure is raised.
"""

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffusion_rl.rewards.base import RewardFn, check_reward_inputs, check_reward_output

logger = logging.getLogger(__name__)


class RewardFailure(RuntimeError):
    """Every sample of a batch failed; the message names the failing reward(s) and the first error."""


@dataclass(frozen=True)
class WeightedReward:
    name: str  # used in metrics ("reward/<name>/mean") and messages; unique within a combiner (a config's label)
    weight: float  # >= 0; a 0-weight reward is scored and logged but does not move the total
    fn: RewardFn  # (images, prompts, metadata) -> float [B], NaN where it failed
    required: bool = True  # a sample this reward fails on is failed; else the reward is left out of its sum

    def __post_init__(self):
        if not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(
                f"reward '{self.name}': weight must be a finite number >= 0, got {self.weight}; to minimise a "
                f"score, use a reward that negates it"
            )


@dataclass
class RewardResult:
    total: np.ndarray  # float32 [B], NaN where failed
    per_reward: dict[str, np.ndarray]  # name -> float32 [B] unweighted scores, NaN where that reward failed
    failed: np.ndarray  # bool [B]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Scored:
    """One reward's scores on a batch and what went wrong."""

    scores: np.ndarray  # float32 [B], NaN where failed
    batch_error: BaseException | None = None  # what the whole-batch call raised, if it did
    sample_errors: dict[int, BaseException] = field(default_factory=dict)  # index -> what the retry raised

    @property
    def failed(self) -> np.ndarray:
        return ~np.isfinite(self.scores)

    def first_error(self) -> str | None:
        if self.sample_errors:
            return _describe(next(iter(self.sample_errors.values())))
        if self.batch_error is not None:
            return _describe(self.batch_error)
        return None


class RewardCombiner:
    """Calls each reward on the batch and returns the weighted total, per-reward scores, failures and metrics."""

    def __init__(self, rewards: Sequence[WeightedReward]):
        if not rewards:
            raise ValueError("RewardCombiner needs at least one reward")
        first_of: dict[str, int] = {}
        for i, r in enumerate(rewards):
            if r.name in first_of:
                raise ValueError(
                    f"rewards {first_of[r.name]} and {i} are both named '{r.name}'; the names key the metrics and "
                    "must be unique (in a config, give one of them its own `label`)"
                )
            first_of[r.name] = i
        self.rewards = list(rewards)
        self.total_weight = float(sum(r.weight for r in rewards))
        if self.total_weight <= 0:
            raise ValueError(f"the reward weights sum to {self.total_weight}; at least one must be > 0")

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardResult:
        return self.combine([self.score(images, prompts, metadata)], metadata)

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> dict[str, _Scored]:
        """Every reward's scores on one chunk of a batch (thread-safe: the trainer scores chunks in the background)."""
        batch_size = check_reward_inputs(images, prompts, metadata)
        scored = {r.name: _score(r, images, prompts, metadata, batch_size) for r in self.rewards}
        for r in self.rewards:
            _warn_failures(r.name, scored[r.name], batch_size)
        return scored

    def combine(self, chunks: Sequence[dict[str, _Scored]], metadata: list[dict[str, Any]]) -> RewardResult:
        """The batch's weighted total, failures and metrics from the scores of its chunks, in order."""
        scored = {r.name: _concat([chunk[r.name] for chunk in chunks]) for r in self.rewards}
        batch_size = len(metadata)
        total, failed = self._combine(scored, batch_size)
        if failed.all():
            raise RewardFailure(_all_failed_message(scored, batch_size))
        per_reward = {name: s.scores for name, s in scored.items()}
        metrics = _metrics(total, failed, per_reward, metadata)
        return RewardResult(total=total, per_reward=per_reward, failed=failed, metrics=metrics)

    def _combine(self, scored: dict[str, _Scored], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        weighted_sum = np.zeros(batch_size, dtype=np.float64)
        ok_weight = np.zeros(batch_size, dtype=np.float64)
        failed = np.zeros(batch_size, dtype=bool)
        for r in self.rewards:
            s = scored[r.name]
            ok = ~s.failed
            if r.required:
                failed |= ~ok
            weighted_sum += np.where(ok, r.weight * np.nan_to_num(s.scores), 0.0)
            ok_weight += np.where(ok, r.weight, 0.0)
        failed |= ok_weight <= 0  # only zero-weight (or no) rewards succeeded: nothing to train on
        with np.errstate(divide="ignore", invalid="ignore"):
            total = self.total_weight * weighted_sum / ok_weight
        total = np.where(failed, np.nan, total).astype(np.float32)
        return total, failed


def _concat(parts: Sequence[_Scored]) -> _Scored:
    """One _Scored for consecutive chunks of a batch (sample indices shifted to the batch's)."""
    if len(parts) == 1:
        return parts[0]
    errors, offset = {}, 0
    for part in parts:
        errors.update({offset + i: e for i, e in part.sample_errors.items()})
        offset += len(part.scores)
    batch_error = next((p.batch_error for p in parts if p.batch_error is not None), None)
    return _Scored(np.concatenate([p.scores for p in parts]), batch_error=batch_error, sample_errors=errors)


def _score(
    reward: WeightedReward, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]], batch_size: int
) -> _Scored:
    try:
        raw = reward.fn(images, prompts, metadata)
    except Exception as e:
        if batch_size == 1:  # the batch call was the per-sample call
            return _Scored(scores=np.full(1, np.nan, dtype=np.float32), sample_errors={0: e})
        return _score_one_by_one(reward, images, prompts, metadata, batch_size, batch_error=e)
    return _Scored(scores=check_reward_output(reward.name, raw, batch_size))


def _score_one_by_one(
    reward: WeightedReward,
    images: np.ndarray,
    prompts: list[str],
    metadata: list[dict[str, Any]],
    batch_size: int,
    batch_error: BaseException,
) -> _Scored:
    scores = np.full(batch_size, np.nan, dtype=np.float32)
    errors: dict[int, BaseException] = {}
    for i in range(batch_size):
        try:
            raw = reward.fn(images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1])
        except Exception as e:
            errors[i] = e
            continue
        scores[i] = check_reward_output(reward.name, raw, 1)[0]
    return _Scored(scores=scores, batch_error=batch_error, sample_errors=errors)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _warn_failures(name: str, s: _Scored, batch_size: int) -> None:
    n_failed = int(s.failed.sum())
    if s.batch_error is None and n_failed == 0:
        return
    parts = []
    if s.batch_error is not None:
        parts.append(f"raised on the whole batch ({_describe(s.batch_error)}), retried sample by sample")
    if n_failed:
        n_raised = len(s.sample_errors)
        parts.append(f"failed on {n_failed} of {batch_size} samples ({n_raised} raised, {n_failed - n_raised} NaN/inf)")
        if s.sample_errors:
            parts.append(f"first error: {s.first_error()}")
    else:
        parts.append(f"all {batch_size} samples scored one by one")
    logger.warning("reward '%s' %s", name, "; ".join(parts))


def _all_failed_message(scored: dict[str, _Scored], batch_size: int) -> str:
    lines = []
    for name, s in scored.items():
        n_failed = int(s.failed.sum())
        if n_failed:
            error = s.first_error() or "returned NaN/inf"
            lines.append(f"'{name}' failed on {n_failed}/{batch_size} ({error})")
    return f"every sample of the batch failed its rewards: {'; '.join(lines)}"


def _metrics(
    total: np.ndarray, failed: np.ndarray, per_reward: dict[str, np.ndarray], metadata: list[dict[str, Any]]
) -> dict[str, float]:
    """Statistics over the samples that did not fail; a statistic of an empty set is left out, not logged as 0."""
    ok_total = total[~failed].astype(np.float64)
    metrics = {
        "reward/mean": float(ok_total.mean()),
        "reward/std": float(ok_total.std()),
        "reward/min": float(ok_total.min()),
        "reward/max": float(ok_total.max()),
        "reward/failed_fraction": float(failed.mean()),
    }
    for name, scores in per_reward.items():
        ok = np.isfinite(scores)
        metrics[f"reward/{name}/failed_fraction"] = float(1.0 - ok.mean())
        if ok.any():
            metrics[f"reward/{name}/mean"] = float(scores[ok].astype(np.float64).mean())
            metrics[f"reward/{name}/std"] = float(scores[ok].astype(np.float64).std())
    sources = np.array([str(m.get("data_source")) if m.get("data_source") is not None else "" for m in metadata])
    for source in sorted(set(sources) - {""}):
        in_source = (sources == source) & ~failed
        if in_source.any():
            metrics[f"reward/source/{source}/mean"] = float(total[in_source].astype(np.float64).mean())
    return metrics
