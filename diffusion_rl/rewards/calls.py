"""Calling one reward: a deadline, errors that name the reward, and the sample-by-sample retry.

The trainer's `RewardCombiner` and the reward server both score through `score_with_retry`, so a sample fails by
the same rules wherever the reward runs:

- the call runs with a deadline (`timeout_s`; None = none). Past it the call's samples fail with `RewardTimeout`,
  naming the reward; the thread running the call is abandoned (Python cannot stop a thread: a reward stuck in a
  C call or a sleep keeps running in the background, and its late answer is dropped);
- a reward that raises on the whole batch is called again sample by sample (not after a timeout: that would wait
  B more deadlines), so one bad image fails only itself;
- a `BaseException` that is not an `Exception` and not `KeyboardInterrupt` (`SystemExit` from a `sys.exit` in the
  reward, `GeneratorExit`, ...) is a failure like any error, reported as `RewardCallError` naming the reward,
  instead of ending the process without a word. Ctrl-C still stops the run;
- a wrong output type, dtype or shape is a bug, not a failed sample: `RewardOutputError` propagates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffusion_rl.rewards.base import RewardOutputError, check_reward_output


class RewardTimeout(RuntimeError):
    """A reward call did not return within its deadline."""


class RewardCallError(RuntimeError):
    """A reward raised a BaseException that is not an Exception (SystemExit, GeneratorExit, ...)."""


@dataclass
class Scored:
    """One reward's scores on a batch and what went wrong."""

    scores: np.ndarray  # float32 [B], NaN where failed
    batch_error: BaseException | None = None  # what the whole-batch call raised, if it did
    sample_errors: dict[int, BaseException] = field(default_factory=dict)  # index -> what the retry raised

    @property
    def failed(self) -> np.ndarray:
        return ~np.isfinite(self.scores)

    def first_error(self) -> str | None:
        if self.sample_errors:
            return describe(next(iter(self.sample_errors.values())))
        if self.batch_error is not None:
            return describe(self.batch_error)
        return None


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def call_with_deadline(fn: Callable[[], Any], name: str, timeout_s: float | None) -> Any:
    """fn(), or RewardTimeout when it takes longer than `timeout_s` (None: no deadline, called in this thread).

    Whatever fn raises comes back here; a BaseException that is neither an Exception nor KeyboardInterrupt comes
    back as RewardCallError naming the reward.
    """
    if timeout_s is None:
        try:
            return fn()
        except (Exception, KeyboardInterrupt):
            raise
        except BaseException as e:  # SystemExit, GeneratorExit, ...: a failure of the reward, not of the run
            raise RewardCallError(f"reward '{name}' raised {describe(e)} (a BaseException)") from e
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller's thread
            outcome["error"] = e
        finally:
            done.set()

    # daemon: an abandoned call must not keep the process alive at exit
    threading.Thread(target=run, name=f"reward-{name}", daemon=True).start()
    if not done.wait(timeout_s):
        raise RewardTimeout(
            f"reward '{name}' did not return within timeout_s={timeout_s:g} s; its samples are failed and the call "
            "is abandoned (it may still be running in the background)"
        )
    if "error" in outcome:
        error = outcome["error"]
        if isinstance(error, Exception):
            raise error
        raise RewardCallError(f"reward '{name}' raised {describe(error)} (a BaseException)") from error
    return outcome["value"]


def call_reward(
    fn: Callable[..., Any],
    name: str,
    images: np.ndarray,
    prompts: list[str],
    metadata: list[dict[str, Any]],
    timeout_s: float | None = None,
) -> np.ndarray:
    """fn's scores on the batch as float32 [B] (checked: RewardOutputError when they break the contract)."""
    raw = call_with_deadline(lambda: fn(images, prompts, metadata), name, timeout_s)
    return check_reward_output(name, raw, len(images))


def score_with_retry(
    fn: Callable[..., Any],
    name: str,
    images: np.ndarray,
    prompts: list[str],
    metadata: list[dict[str, Any]],
    timeout_s: float | None = None,
) -> Scored:
    """fn's scores on the batch; if the batch call raises, each sample is scored on its own (see the module doc)."""
    batch_size = len(images)
    try:
        return Scored(call_reward(fn, name, images, prompts, metadata, timeout_s))
    except RewardOutputError:
        raise
    except RewardTimeout as e:  # no retry: each sample could take the whole deadline again
        return Scored(np.full(batch_size, np.nan, dtype=np.float32), batch_error=e)
    except Exception as e:
        if batch_size == 1:  # the batch call was the per-sample call
            return Scored(np.full(1, np.nan, dtype=np.float32), sample_errors={0: e})
        batch_error = e
    scores = np.full(batch_size, np.nan, dtype=np.float32)
    errors: dict[int, BaseException] = {}
    for i in range(batch_size):
        try:
            scores[i] = call_reward(fn, name, images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1], timeout_s)[0]
        except RewardOutputError:
            raise
        except RewardTimeout as e:  # the rest would wait too: fail them with this error
            errors.update({j: e for j in range(i, batch_size)})
            break
        except Exception as e:
            errors[i] = e
    return Scored(scores, batch_error=batch_error, sample_errors=errors)
