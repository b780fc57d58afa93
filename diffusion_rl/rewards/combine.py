"""Score a batch with several rewards and combine them into one weighted total per sample.

Failure rules (a failure is counted and reported, never replaced by 0):
- Each reward call has a deadline (`timeout_s`); past it the call's samples fail, naming the reward (calls.py).
- A reward that raises on the batch is called again sample by sample, so one bad image does not fail the others.
- A sample on which it still raises, or gets NaN/inf, is failed for that reward. One warning per reward per batch.
- A reward that returns the wrong type, dtype or shape is a bug: RewardOutputError, naming the reward.
- A group reward (base.py: `group = True`, `score_group`) is called once per group; if it raises on a group, every
  sample of that group fails for it (there is no sample-by-sample retry for a score that needs the whole group).
- A sample failed on a required reward is failed: total NaN, failed True.
- A non-required reward that fails on a sample is left out of that sample's sum, and the weights of the rewards
  that succeeded are scaled back up to the full weight mass:

      total_i = (sum_k w_k) * (sum_{k ok on i} w_k r_ki) / (sum_{k ok on i} w_k)

  which is sum_k w_k r_ki when every reward succeeded. A sample on which no reward of positive weight succeeded is
  failed.
- If every sample fails, RewardFailure is raised.

Videos ([B, F, H, W, 3]): an image reward scores them frame by frame, reduced as its `frames` says
(rewards/video.py); a reward with `video = True` gets them whole.

Chunked scoring (the trainer's `sampling.score_chunks`): `score(chunk)` scores the per-sample rewards of one
chunk of a batch; `combine(chunks, metadata, images=, prompts=, group_index=)` then scores the group rewards on
the whole batch, so a group is never split across chunks.
"""

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffusion_rl.errors import RunStopped
from diffusion_rl.rewards.base import RewardFn, RewardOutputError, check_reward_inputs, is_group_reward
from diffusion_rl.rewards.calls import Scored, call_reward, score_with_retry
from diffusion_rl.rewards.reporting import all_failed_message, reward_metrics, warn_failures
from diffusion_rl.rewards.video import FRAME_REDUCTIONS, framewise

logger = logging.getLogger(__name__)


class RewardFailure(RunStopped):
    """Every sample of a batch failed; the message names the failing reward(s) and the first error."""


@dataclass(frozen=True)
class WeightedReward:
    name: str  # used in metrics ("reward/<name>/mean") and messages; unique within a combiner (a config's label)
    weight: float  # >= 0; a 0-weight reward is scored and logged but does not move the total
    fn: RewardFn  # (images, prompts, metadata) -> float [B], NaN where it failed; or a group reward (base.py)
    required: bool = True  # a sample this reward fails on is failed; else the reward is left out of its sum
    timeout_s: float | None = None  # deadline of one call (a chunk, a sample, a group); None = no deadline
    frames: str = "mean"  # how an image reward scores a video (rewards/video.py); a video reward ignores it

    def __post_init__(self):
        if not math.isfinite(self.weight) or self.weight < 0:
            raise ValueError(
                f"reward '{self.name}': weight must be a finite number >= 0, got {self.weight}; to minimise a "
                f"score, use a reward that negates it"
            )
        if self.frames not in FRAME_REDUCTIONS:
            raise ValueError(f"reward '{self.name}': frames={self.frames!r}; known: {', '.join(FRAME_REDUCTIONS)}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"reward '{self.name}': timeout_s must be > 0 or None, got {self.timeout_s}")

    @property
    def group(self) -> bool:
        return is_group_reward(self.fn)

    def scorer_of(self, images: np.ndarray) -> RewardFn:
        """The callable that scores `images`: the reward itself, or for videos its frame-wise form."""
        return framewise(self.fn, self.frames, self.name) if images.ndim == 5 else self.fn


@dataclass
class RewardResult:
    total: np.ndarray  # float32 [B], NaN where failed
    per_reward: dict[str, np.ndarray]  # name -> float32 [B] unweighted scores, NaN where that reward failed
    failed: np.ndarray  # bool [B]
    metrics: dict[str, float] = field(default_factory=dict)
    image_stats: Any = None  # the rows' image statistics (guard/stats.py RolloutStats), set by the guard when watching


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
        self.group_rewards = [r for r in self.rewards if r.group]  # scored in `combine`, on the whole batch
        self.total_weight = float(sum(r.weight for r in rewards))
        if self.total_weight <= 0:
            raise ValueError(f"the reward weights sum to {self.total_weight}; at least one must be > 0")

    def __call__(
        self,
        images: np.ndarray,
        prompts: list[str],
        metadata: list[dict[str, Any]],
        group_index: Sequence[int] | np.ndarray | None = None,
        batch: str = "the batch",
    ) -> RewardResult:
        """Score and combine one batch. `group_index` [B] says which group each sample belongs to (for group
        rewards); None groups the samples by identical prompt text. `batch` names it in warnings and errors (e.g.
        the validation batch: a failure there is not the training data's)."""
        chunk = self.score(images, prompts, metadata, batch)
        return self.combine([chunk], metadata, images=images, prompts=prompts, group_index=group_index, batch=batch)

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
              batch: str = "the batch") -> dict[str, Scored]:  # fmt: skip
        """The per-sample rewards' scores on one chunk of a batch (thread-safe: the trainer scores chunks in the
        background). Group rewards are left for `combine`, which sees whole groups."""
        batch_size = check_reward_inputs(images, prompts, metadata)
        scored = {}
        for r in self.rewards:
            if not r.group:
                scored[r.name] = score_with_retry(r.scorer_of(images), r.name, images, prompts, metadata, r.timeout_s)
                warn_failures(r.name, scored[r.name], batch_size, batch)
        return scored

    def combine(self, chunks: Sequence[dict[str, Scored]], metadata: list[dict[str, Any]], *,
                images: np.ndarray | None = None, prompts: list[str] | None = None,
                group_index: Sequence[int] | np.ndarray | None = None,
                batch: str = "the batch") -> RewardResult:  # fmt: skip
        """The batch's weighted total, failures and metrics from the scores of its chunks, in order. Group rewards
        are scored here, on the whole batch (a group is never split): `images` and `prompts` are then required,
        `group_index` as in __call__."""
        group = self._score_group_rewards(images, prompts, metadata, group_index, batch) if self.group_rewards else {}
        # in the config's order (metrics, messages); a per-sample reward's chunks joined
        scored = {r.name: group.get(r.name) or _concat([c[r.name] for c in chunks]) for r in self.rewards}
        total, failed = self._combine(scored, len(metadata))
        if failed.all():
            raise RewardFailure(all_failed_message(scored, len(metadata), batch))
        per_reward = {name: s.scores for name, s in scored.items()}
        return RewardResult(total, per_reward, failed, reward_metrics(total, failed, per_reward, metadata))

    def _score_group_rewards(self, images, prompts, metadata, group_index, batch) -> dict[str, Scored]:
        """The group rewards' scores, on the whole batch (`combine`)."""
        if images is None or prompts is None:
            names = ", ".join(r.name for r in self.group_rewards)
            raise ValueError(f"group rewards ({names}) need the whole batch: pass images= and prompts= to combine")
        check_reward_inputs(images, prompts, metadata)
        groups, scored = _group_index(prompts, group_index), {}
        for r in self.group_rewards:
            scored[r.name] = _score_groups(r, images, prompts, metadata, groups)
            warn_failures(r.name, scored[r.name], len(metadata), batch)
        return scored

    def _combine(self, scored: dict[str, Scored], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        weighted_sum, ok_weight, failed = np.zeros(batch_size), np.zeros(batch_size), np.zeros(batch_size, dtype=bool)
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


def with_unscored_rows(result: RewardResult, scored_rows: np.ndarray, metadata: list[dict[str, Any]]) -> RewardResult:
    """The result of scoring only the batch's `scored_rows` as the whole batch's: every other row failed (total and
    per-reward scores NaN), the metrics over the whole batch. For samples that could not be scored at all, e.g. a
    rollout whose latents came out NaN."""
    batch_size = len(metadata)

    def spread(values: np.ndarray, fill) -> np.ndarray:
        out = np.full(batch_size, fill, dtype=values.dtype)
        out[scored_rows] = values
        return out

    total, failed = spread(result.total, np.nan), spread(result.failed, True)
    per_reward = {name: spread(scores, np.nan) for name, scores in result.per_reward.items()}
    return RewardResult(total, per_reward, failed, reward_metrics(total, failed, per_reward, metadata))


def _group_index(prompts: list[str], group_index: Sequence[int] | np.ndarray | None) -> np.ndarray:
    """int [B]: the given group of each sample, or one group per distinct prompt text."""
    if group_index is None:
        return np.unique(np.asarray(prompts, dtype=object), return_inverse=True)[1].reshape(-1)
    groups = np.asarray(group_index).reshape(-1)
    if len(groups) != len(prompts):
        raise ValueError(f"group_index has {len(groups)} entries for a batch of {len(prompts)}")
    return groups


def _score_groups(
    reward: WeightedReward,
    images: np.ndarray,
    prompts: list[str],
    metadata: list[dict[str, Any]],
    groups: np.ndarray,
) -> Scored:
    """A group reward's scores: one `score_group` call per group; a group it raises on is failed as a whole."""
    scores = np.full(len(images), np.nan, dtype=np.float32)
    errors: dict[int, BaseException] = {}
    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        try:
            scores[rows] = call_reward(
                reward.scorer_of(images).score_group,
                reward.name,
                images[rows],
                [prompts[i] for i in rows],
                [metadata[i] for i in rows],
                reward.timeout_s,
            )
        except RewardOutputError:
            raise
        except Exception as e:
            errors.update({int(i): e for i in rows})
    return Scored(scores, sample_errors=errors)


def _concat(parts: Sequence[Scored]) -> Scored:
    """One Scored for consecutive chunks of a batch (sample indices shifted to the batch's)."""
    offsets = np.cumsum([0, *(len(part.scores) for part in parts)]).tolist()
    errors = {offset + i: e for offset, part in zip(offsets, parts) for i, e in part.sample_errors.items()}
    batch_error = next((p.batch_error for p in parts if p.batch_error is not None), None)
    return Scored(np.concatenate([p.scores for p in parts]), batch_error=batch_error, sample_errors=errors)
