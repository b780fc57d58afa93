"""Requests arriving together are scored as one batch, on one worker thread.

The batcher takes the first waiting job, then whatever arrives within `max_wait_ms` of it, up to `max_batch` images,
and calls the reward once per image size. If that call raises, each job is scored on its own by
`rewards.calls.score_with_retry`, the path the trainer's combiner uses too: a job on which the reward still raises
is scored image by image, and an image on which it raises gets null.

At most `max_queue` jobs wait or are being scored; `submit` beyond that raises `Busy` (the server answers 503), so
an overloaded server sheds load at once instead of growing a queue nobody will wait for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import RewardFn, RewardOutputError
from diffusion_rl.rewards.calls import call_reward, describe, score_with_retry

logger = logging.getLogger(__name__)


class Busy(RuntimeError):
    """The queue is full; try again later."""


@dataclass
class Job:
    """One request's samples, waiting to be scored in a batch."""

    images: np.ndarray  # uint8 [n, H, W, 3]
    prompts: list[str]
    metadata: list[dict[str, Any]]
    future: Future = field(default_factory=Future)  # -> the job itself, with scores (and error) set
    scores: list[float | None] | None = None
    error: str | None = None  # what the reward raised, if it did
    fatal: str | None = None  # the reward broke its contract (RewardOutputError): the server answers 500

    def __len__(self) -> int:
        return len(self.images)


@dataclass
class BatchStats:
    """Counters for /metrics (read without a lock: each is one int, updated on the batcher thread)."""

    batches: int = 0
    images: int = 0
    failed_images: int = 0


def check_batching(max_batch: int, max_wait_ms: float, max_queue: int) -> None:
    """The batcher's settings in range, or UserError; serve-reward checks them before the reward is built."""
    if not (max_batch >= 1 and max_wait_ms >= 0 and max_queue >= 1):  # `not`: a NaN wait is out of range too
        raise UserError(
            f"serve-reward: need --max-batch >= 1, --max-wait-ms >= 0 and --max-queue >= 1; got {max_batch}, "
            f"{max_wait_ms}, {max_queue}"
        )


class BatchingScorer:
    """Collects jobs from the request handlers and scores them in batches on one worker thread."""

    def __init__(
        self,
        reward_fn: RewardFn,
        name: str = "reward",
        max_batch: int = 64,
        max_wait_ms: float = 20.0,
        max_queue: int = 64,
        timeout_s: float | None = None,
    ):
        check_batching(max_batch, max_wait_ms, max_queue)
        self.reward_fn, self.name = reward_fn, name
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_ms / 1000, max_queue
        self.timeout_s = timeout_s  # deadline of one reward call (calls.py); None = none
        self.stats = BatchStats()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._carry: Job | None = None  # a job that did not fit in the previous batch
        self._pending = 0  # jobs submitted and not finished
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="reward-batcher", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._pending

    def submit(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> Job:
        """Queue the samples; `job.future` completes when they are scored. Busy when max_queue jobs are pending."""
        with self._lock:
            if self._pending >= self.max_queue:
                raise Busy(f"{self._pending} requests are waiting to be scored (max_queue={self.max_queue})")
            self._pending += 1
        job = Job(images, prompts, metadata)
        job.future.add_done_callback(self._finished)
        self._queue.put(job)
        return job

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> Job:
        """submit() and wait for the job (for in-process use and tests)."""
        job = self.submit(images, prompts, metadata)
        return job.future.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _finished(self, _future: Future) -> None:
        with self._lock:
            self._pending -= 1

    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                return
            for group in _group_by_size(batch):
                self.stats.batches += 1
                try:
                    self._score_group(group)
                except RewardOutputError as e:  # a bug in the reward: every job of the group gets it
                    logger.error("reward '%s' broke the reward contract: %s", self.name, e)
                    for job in group:
                        job.fatal = str(e)
                        _resolve(job)

    def _collect(self) -> list[Job] | None:
        """The next batch: the first waiting job, then whatever arrives within max_wait of it, up to max_batch."""
        first, self._carry = self._carry, None
        if first is None:
            first = self._queue.get()
            if first is None:
                return None
        batch, size = [first], len(first)
        deadline = time.monotonic() + self.max_wait_s
        while size < self.max_batch:
            try:
                job = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if job is None:  # closing: score what we have, then stop
                self._queue.put(None)
                break
            if size + len(job) > self.max_batch:
                self._carry = job
                break
            batch.append(job)
            size += len(job)
        return batch

    def _score_group(self, jobs: list[Job]) -> None:
        """Score jobs whose images share one size with one reward call; if it raises, each job on its own."""
        if len(jobs) > 1:
            images = np.concatenate([job.images for job in jobs])
            prompts = [p for job in jobs for p in job.prompts]
            metadata = [m for job in jobs for m in job.metadata]
            try:
                scores = call_reward(self.reward_fn, self.name, images, prompts, metadata, self.timeout_s)
            except RewardOutputError:
                raise
            except Exception as e:
                logger.info("reward '%s' raised on a batch of %d requests (%s); scoring each alone", self.name,
                            len(jobs), describe(e))  # fmt: skip
            else:
                start = 0
                for job in jobs:
                    self._finish(job, scores[start : start + len(job)])
                    start += len(job)
                return
        for job in jobs:
            scored = score_with_retry(self.reward_fn, self.name, job.images, job.prompts, job.metadata, self.timeout_s)
            if scored.sample_errors or (scored.batch_error is not None and scored.failed.any()):
                failed = scored.sample_errors or dict.fromkeys(range(len(job)), scored.batch_error)
                first, error = next(iter(failed.items()))
                logger.error("reward '%s' raised on %d of %d samples of a request (first: sample %d)", self.name,
                             len(failed), len(job), first, exc_info=error)  # fmt: skip
                job.error = (
                    f"reward '{self.name}' raised on {len(failed)} of {len(job)} samples (their scores are null); "
                    f"sample {first}: {describe(error)}"
                )
            self._finish(job, scored.scores)

    def _finish(self, job: Job, scores: np.ndarray) -> None:
        job.scores = [float(s) if np.isfinite(s) else None for s in scores]
        self.stats.images += len(job)
        self.stats.failed_images += sum(s is None for s in job.scores)
        _resolve(job)


def _resolve(job: Job) -> None:
    if not job.future.done():  # a job cancelled by its caller is finished anyway, and nobody reads it
        job.future.set_result(job)


def _group_by_size(jobs: list[Job]) -> list[list[Job]]:
    groups: dict[tuple[int, ...], list[Job]] = {}
    for job in jobs:
        groups.setdefault(job.images.shape[1:], []).append(job)
    return list(groups.values())
