"""What a batch's reward scores report: the step's reward metrics and the warnings and messages about failures
(the combiner's formula is rewards/combine.py; these are its reports, read by name)."""

import logging
from typing import Any

import numpy as np

from diffusion_rl.rewards.calls import RewardTimeout, Scored, describe

logger = logging.getLogger(__name__)


def warn_failures(name: str, s: Scored, batch_size: int, batch: str) -> None:
    """`batch`: which batch, in words ("the batch", "the validation batch (val.prompts: …)")."""
    n_failed = int(s.failed.sum())
    if s.batch_error is None and n_failed == 0:
        return
    if isinstance(s.batch_error, RewardTimeout):
        logger.warning("reward '%s' failed all %d samples of a chunk of %s: %s", name, batch_size, batch, s.batch_error)
        return
    parts = []
    if s.batch_error is not None:
        parts.append(f"raised on the whole batch ({describe(s.batch_error)}), retried sample by sample")
    if n_failed:
        n_raised = len(s.sample_errors)
        parts.append(f"failed on {n_failed} of {batch_size} samples of {batch} ({n_raised} raised, "
                     f"{n_failed - n_raised} NaN/inf)")  # fmt: skip
        if s.sample_errors:
            parts.append(f"first error: {s.first_error()}")
    else:
        parts.append(f"all {batch_size} samples scored one by one")
    logger.warning("reward '%s' %s", name, "; ".join(parts))


def all_failed_message(scored: dict[str, Scored], batch_size: int, batch: str) -> str:
    lines = []
    for name, s in scored.items():
        n_failed = int(s.failed.sum())
        if n_failed:
            error = s.first_error() or "returned NaN/inf"
            lines.append(f"'{name}' failed on {n_failed}/{batch_size} ({error})")
    return f"every sample of {batch} failed its rewards: {'; '.join(lines)}"


def reward_metrics(
    total: np.ndarray, failed: np.ndarray, per_reward: dict[str, np.ndarray], metadata: list[dict[str, Any]]
) -> dict[str, float]:
    """Statistics over the samples that did not fail; a statistic of an empty set is left out, not logged as 0."""
    good = total[~failed].astype(np.float64)
    metrics = {"reward/mean": float(good.mean()), "reward/std": float(good.std()), "reward/min": float(good.min()),
               "reward/max": float(good.max()), "reward/failed_fraction": float(failed.mean())}  # fmt: skip
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
