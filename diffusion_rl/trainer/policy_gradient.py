"""Policy-gradient family (Flow-GRPO and variants): generate → reward → advantage → update."""

from __future__ import annotations

import torch

from diffusion_rl.algorithms.advantages import compute_group_advantages
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
        with timer("generate"):
            prompts = make_step_prompts(self.records, self.sampler, step, cfg.data.group_size)
            window = self.window_for(step)
            batch = self.engine.generate(prompts, step, window)
        with timer("reward"):
            scored = self.rewards(batch["images"].cpu().numpy(), prompts.prompts, prompts.metadata)
        with timer("advantage"):
            adv = cfg.algorithm.advantage
            advantages = compute_group_advantages(
                torch.from_numpy(scored.total),
                prompts.group_index,
                global_std=adv.global_std,
                std_ddof=adv.std_ddof,
                eps=adv.eps,
                normalize_by_std=adv.normalize_by_std,
            )
            batch["rewards"] = torch.from_numpy(scored.total).to(batch.device)
            batch["advantages"] = advantages.advantages.to(batch.device)
        with timer("update"):
            update_metrics = self.engine.update(batch, step)
        metrics = {**scored.metrics, **advantages.metrics, **update_metrics, **timer.metrics()}
        metrics["window/start"] = window.start
        metrics["images_per_second"] = len(prompts) / sum(timer.seconds.values())
        return metrics
