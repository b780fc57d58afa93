"""Policy-gradient family (Flow-GRPO and variants): generate → reward → advantage → update."""

from __future__ import annotations

import numpy as np
import torch

from diffusion_rl.algorithms.advantages import AdvantageResult, combine_per_reward_advantages, compute_group_advantages
from diffusion_rl.data.sampler import make_step_prompts
from diffusion_rl.sampling.window import SdeWindow, default_window, random_window, sliding_window, window_generator
from diffusion_rl.trainer.base import Trainer
from diffusion_rl.trainer.timing import PhaseTimer


class PolicyGradientTrainer(Trainer):
    def window_for(self, step: int) -> SdeWindow:
        """The SDE window of training step `step`: a pure function of (config, seed, step), so exactly resumable."""
        s, w = self.cfg.sampling, self.cfg.sampling.window
        generator = window_generator(self.cfg.run.seed, step)
        if w.kind == "random":
            hi = s.num_steps - 1 if w.hi is None else w.hi
            return random_window(s.num_steps, w.size, w.lo, hi, generator)
        if w.kind == "sliding":
            return sliding_window(
                step,
                s.num_steps,
                w.size,
                iters_per_window=w.iters_per_window,
                stride=w.stride,
                strategy=w.strategy,
                generator=generator,
            )
        return default_window(s.num_steps)

    def extra_state(self) -> dict:
        # the window is recomputed from the step; stored so a checkpoint says where a sliding window stood
        return {"window_start": self.window_for(self.step).start}

    def train_step(self, step: int) -> dict[str, float]:
        cfg, timer = self.cfg, PhaseTimer()
        prompts = make_step_prompts(self.records, self.sampler, step, cfg.data.group_size)
        window = self.window_for(step)
        batch, scored = self.generate_and_score(prompts, step, window, timer)
        with timer("advantage"):
            advantages = self.advantages(scored, prompts)
            batch["rewards"] = torch.from_numpy(scored.total).to(batch.device)
            batch["advantages"] = advantages.advantages.to(batch.device)
        with timer("update"):
            update_metrics = self.engine.update(batch, step)
        metrics = {**scored.metrics, **advantages.metrics, **update_metrics, **timer.metrics()}
        metrics["window/start"] = window.start
        metrics["images_per_second"] = len(prompts) / sum(timer.seconds.values())
        if self.rollout_due(step):  # after images_per_second: writing files is not sampling speed
            with timer("dump"):
                self.dump_rollout(step, prompts, batch["images"].cpu().numpy(), scored, advantages.advantages)
            metrics["timing/dump"] = timer.seconds["dump"]
        return metrics

    def generate_and_score(self, prompts, step: int, window: SdeWindow, timer: PhaseTimer):
        """Sample the batch in `sampling.score_chunks` chunks; each chunk is scored in a background thread while
        the next one samples. `timing/reward` is the time left waiting for scores after the last chunk."""
        chunks = torch.arange(len(prompts)).tensor_split(self.cfg.sampling.score_chunks)
        parts, pending = [], []
        with timer("generate"):
            for rows in (c.tolist() for c in chunks if len(c)):
                part = self.engine.generate(prompts, step, window, rows=rows)
                parts.append(part)
                images = part["images"].cpu().numpy()
                pending.append(self.reward_pool.submit(self.rewards.score, images, [prompts.prompts[i] for i in rows],
                                                       [prompts.metadata[i] for i in rows]))  # fmt: skip
            batch = torch.cat(parts) if len(parts) > 1 else parts[0]
        with timer("reward"):
            images = batch["images"].cpu().numpy()
            # group rewards are scored here, on the whole batch: a group is never split across chunks
            scored = self.rewards.combine([p.result() for p in pending], prompts.metadata, images=images,
                                          prompts=prompts.prompts, group_index=prompts.group_index.numpy())  # fmt: skip
        with timer("guard"):  # guard hook: image statistics of the rollout, logged with the reward metrics
            scored.metrics.update(self.guard.on_rollout(step + 1, images, prompts.group_index.numpy()))
        return batch, scored

    def advantages(self, scored, prompts) -> AdvantageResult:
        adv = self.cfg.algorithm.advantage
        options = dict(global_std=adv.global_std, std_ddof=adv.std_ddof, eps=adv.eps,
                       normalize_by_std=adv.normalize_by_std)  # fmt: skip
        if adv.combine == "sum_rewards":
            return compute_group_advantages(torch.from_numpy(scored.total), prompts.group_index, **options)
        # MixGRPO's advantage_aggr: normalise each reward within its groups, then sum with the weights;
        # a failed sample (a required reward failed) is NaN in every reward, so it gets advantage 0
        per_reward = {
            name: torch.from_numpy(np.where(scored.failed, np.nan, s)) for name, s in scored.per_reward.items()
        }
        weights = {r.name: r.weight for r in self.rewards.rewards}
        return combine_per_reward_advantages(per_reward, weights, prompts.group_index, **options)
