"""Where a training step's batch and its scores come from: the `collect` phase of `Trainer.train_step`.

- `OnlineRollouts` (data.sample_source: online): the step's prompts, each repeated group_size times, are sampled
  by the engine (which keeps the trajectories for the update) and scored by the rewards. The batch is sampled in
  `sampling.score_chunks` chunks; each chunk is scored in a background thread while the next one samples. A sample
  whose latents came out NaN/inf (a diverged policy) is failed without being scored (its image is black, not a
  sample); when every sample of a step is, the run stops with TrainingDiverged.
- `OfflinePairs` (offline, Diffusion-DPO): data.prompts_per_step pairs of a pair dataset, their images
  VAE-encoded once and cached; rows 0..P−1 are the chosen images, P..2P−1 the rejected ones, row p and P + p
  forming group p, and the "scores" are the dataset's labels (1 chosen, 0 rejected), from which the algorithm
  pairs them like any other group.
- `SampledAhead` wraps `OnlineRollouts` when the engine samples ahead (engine.max_staleness k > 0, separate rollout
  actors): the rollouts and scores of the next k steps are made in a background thread while this step's update
  runs. Chosen when the trainer is built (`make_source`): the plain source has no branch for it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from diffusion_rl.data.condition_images import with_condition_images
from diffusion_rl.data.pairs import PreferencePair, load_image
from diffusion_rl.data.prompts import PromptRecord
from diffusion_rl.data.sampler import PromptSampler, StepPrompts, make_step_prompts
from diffusion_rl.errors import TrainingDiverged
from diffusion_rl.rewards import RewardCombiner, RewardResult
from diffusion_rl.rewards.combine import with_unscored_rows
from diffusion_rl.sampling.window import SdeWindow, window_for_step
from diffusion_rl.trainer.timing import PhaseTimer

logger = logging.getLogger(__name__)


def make_source(cfg, records: list[PromptRecord], sampler: PromptSampler, engine, rewards: RewardCombiner | None,
                pairs: list[PreferencePair] | None = None):  # fmt: skip
    """The step's source: offline pairs (`pairs` given), online rollouts, or online rollouts sampled ahead."""
    if pairs is not None:
        return OfflinePairs(cfg, pairs, sampler, engine)
    online = OnlineRollouts(cfg, records, sampler, engine, rewards)
    ahead = cfg.engine.max_staleness  # > 0 only with separate rollout actors (the config checks it)
    return SampledAhead(online, ahead, cfg.train.total_steps) if ahead else online


class RolloutDiverged(TrainingDiverged):
    """Every sample of a step came out NaN/inf: the weights that sampled it (the current ones) are broken."""


@dataclass
class Collected:
    prompts: StepPrompts  # the step's rows
    images: np.ndarray | None  # uint8 [B, H, W, 3] (videos [B, F, H, W, 3]) of the rollout; None for offline data
    scored: RewardResult  # total [B] (NaN = failed), per reward, failed, metrics


class OnlineRollouts:
    def __init__(self, cfg, records: list[PromptRecord], sampler: PromptSampler, engine, rewards: RewardCombiner):
        self.cfg, self.records, self.sampler = cfg, records, sampler
        self.engine, self.rewards = engine, rewards
        # one thread keeps the rewards' own order and state simple
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    def discard_ahead(self) -> None:
        """Nothing is sampled ahead here (SampledAhead does)."""

    def collect(self, step: int, window: SdeWindow | None, timer: PhaseTimer) -> Collected:
        """`timing/generate` covers sampling (and scoring that overlapped it); `timing/reward` the time left
        waiting for scores after the last chunk."""
        prompts = make_step_prompts(self.records, self.sampler, step, self.cfg.data.group_size)
        s = self.cfg.sampling  # the rewards see an edit's sources as the model did: fitted to the output size
        metadata = with_condition_images(prompts.metadata, prompts.condition_images, s.height, s.width)
        parts, pending, sampled = [], [], []  # sampled: the usable rows in the order they were sampled and scored
        chunks = [rows for rows in self.engine.sampling_chunks(len(prompts), s.score_chunks) if rows]
        with timer("generate"):
            for rows in chunks:
                parts.append(part := self.engine.generate(prompts, step, window, rows=rows))
                ok = [row for row, usable in zip(rows, part.finite.tolist()) if usable]
                sampled += ok
                if ok:  # scored in the background while the next chunk samples
                    pending.append(self.pool.submit(self.rewards.score, part.images[part.finite].numpy(),
                                   [prompts.prompts[i] for i in ok], [metadata[i] for i in ok]))  # fmt: skip
        made = torch.cat(parts)[torch.from_numpy(np.argsort(np.concatenate(chunks)))]  # in row order
        images, ok = made.images.numpy(), np.asarray(sampled, dtype=np.int64)
        if len(ok) == 0:
            raise RolloutDiverged(f"step {step + 1}: the latents of every sample came out NaN/inf: the policy has "
                                  "diverged (lower train.lr and resume)")  # fmt: skip
        with timer("reward"):  # group rewards score here, on the whole batch: a group is never split across chunks
            scored = self.rewards.combine([p.result() for p in pending], [metadata[i] for i in ok],
                                          images=images[ok], prompts=[prompts.prompts[i] for i in ok],
                                          group_index=prompts.group_index.numpy()[ok])  # fmt: skip
        if len(ok) < len(prompts):
            logger.warning("step %d: %d of %d samples came out NaN/inf and are failed unscored", step + 1,
                           len(prompts) - len(ok), len(prompts))  # fmt: skip
        if len(ok) < len(prompts) or np.any(np.diff(ok) < 0):  # scored out of row order (several samplers' chunks)
            scored = with_unscored_rows(scored, ok, metadata)  # each row's scores at its row
        scored.metrics["sampling/nonfinite_fraction"] = 1.0 - len(ok) / len(prompts)
        # transformer forwards per image the rollout took (CFG counts 2; a tree's shared nodes split among leaves)
        scored.metrics["rollout/nfe_per_image"] = float(made.nfe.numpy().mean())
        return Collected(prompts, images, scored)


class SampledAhead:
    """Online rollouts whose next `ahead` steps are sampled and scored in a background thread while this step's
    update runs (engine.max_staleness k > 0: separate rollout actors); `collect` then only waits for what is left of
    them: `timing/generate` is that wait and `timing/sampled_ahead` the time the step's sampling and scoring took."""

    def __init__(self, source: OnlineRollouts, ahead: int, total_steps: int):
        self.source, self.ahead, self.total_steps = source, ahead, total_steps
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sample-ahead")
        self.started: dict[int, Future] = {}  # later step → its (Collected, seconds) being made

    def collect(self, step: int, window: SdeWindow | None, timer: PhaseTimer) -> Collected:
        future = self.started.pop(step, None)
        if future is None:
            collected = self.source.collect(step, window, timer)
        else:
            with timer("generate"):
                collected, seconds = future.result()
            collected.scored.metrics["timing/sampled_ahead"] = seconds
        for later in range(step + 1, min(step + self.ahead, self.total_steps - 1) + 1):
            if later not in self.started:
                self.started[later] = self.thread.submit(self._timed, later)
        return collected

    def _timed(self, step: int) -> tuple[Collected, float]:
        start = time.perf_counter()
        window = window_for_step(self.source.cfg.sampling, self.source.cfg.run.seed, step)
        collected = self.source.collect(step, window, PhaseTimer())
        return collected, time.perf_counter() - start

    def discard_ahead(self) -> None:
        """Forget the steps sampled ahead (their actors are gone, or the run goes back to a checkpoint)."""
        for future in self.started.values():
            future.cancel()
            with contextlib.suppress(Exception):  # what failed there is what the caller is recovering from
                future.result()  # a started one finishes first: nothing then still calls the engine
        self.started = {}


class OfflinePairs:
    def __init__(self, cfg, pairs: list[PreferencePair], sampler: PromptSampler, engine):
        self.cfg, self.pairs, self.sampler, self.engine = cfg, pairs, sampler, engine
        self.latents: dict[int, torch.Tensor] = {}  # pair index → latents [2, …] (chosen, rejected), CPU

    def discard_ahead(self) -> None:
        """Nothing is sampled ahead from a pair dataset."""

    def collect(self, step: int, window: SdeWindow | None, timer: PhaseTimer) -> Collected:
        with timer("load"):
            indices = self.sampler.indices(step)
            latents = torch.stack([self.latents_of(i) for i in indices])  # [P, 2, …]
            pairs = [self.pairs[i] for i in indices]
            P = len(pairs)
            records = [PromptRecord(p.prompt, p.negative_prompt) for p in pairs] * 2
            prompts = StepPrompts(
                records=records,
                uids=[f"s{step}-pair{i}" for i in indices] * 2,
                group_index=torch.arange(P).repeat(2),
                prompt_index=list(indices) * 2,
                step=step,
                group_size=2,
            )
            self.engine.keep_offline(prompts, torch.cat([latents[:, 0], latents[:, 1]]), step)
        labels = np.concatenate([np.ones(P), np.zeros(P)]).astype(np.float32)
        scored = RewardResult(
            total=labels,
            per_reward={},
            failed=np.zeros(2 * P, dtype=bool),
            metrics={"data/cached_pairs": float(len(self.latents))},
        )
        return Collected(prompts, None, scored)

    def latents_of(self, index: int) -> torch.Tensor:
        """[2, …] VAE latents of pair `index`'s chosen and rejected images, encoded on first use."""
        if index not in self.latents:
            s, pair = self.cfg.sampling, self.pairs[index]
            images = torch.stack([load_image(path, s.height, s.width) for path in (pair.chosen, pair.rejected)])
            self.latents[index] = self.engine.encode_images(images)
        return self.latents[index]
