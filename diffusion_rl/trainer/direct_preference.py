"""Direct-preference / forward-process family (Diffusion-DPO, DiffusionNFT, AWM).

Online: generate → reward → advantage and pairs → update, with the policy-gradient family's rollout, scoring and
advantage phases; sampling may be a plain ODE (`sampling.sde_type: ode`) and CFG-free (`guidance: 1`), since
these losses only need each rollout's clean final latents. Offline (`data.sample_source: offline`, DPO only):
load → update on a pair dataset whose images are VAE-encoded once and cached; nothing samples or scores for
training. The update itself (engine/direct_preference_update.py) picks what its loss needs: advantages (nft,
awm) or pairs (dpo).
"""

from __future__ import annotations

import logging

import torch
from tensordict import TensorDict

from diffusion_rl.algorithms.preference import online_pairs
from diffusion_rl.data.pairs import PreferencePair, load_image, load_pairs
from diffusion_rl.data.prompts import PromptRecord
from diffusion_rl.data.sampler import make_step_prompts
from diffusion_rl.sampling.window import SdeWindow, default_window
from diffusion_rl.trainer.policy_gradient import PolicyGradientTrainer
from diffusion_rl.trainer.timing import PhaseTimer

logger = logging.getLogger(__name__)


def mark_pairs(batch: TensorDict, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
    """Store pairs per row, so they survive slicing the batch: `pair_id` [B] (the pair's index, −1 unpaired) and
    `pair_role` [B] (1 chosen, −1 rejected, 0 unpaired)."""
    B, device = batch.batch_size[0], batch.device
    pair_id = torch.full((B,), -1, dtype=torch.long, device=device)
    role = torch.zeros(B, dtype=torch.long, device=device)
    index = torch.arange(len(chosen), device=device)
    pair_id[chosen.to(device)], role[chosen.to(device)] = index, 1
    pair_id[rejected.to(device)], role[rejected.to(device)] = index, -1
    batch["pair_id"], batch["pair_role"] = pair_id, role


class DirectPreferenceTrainer(PolicyGradientTrainer):
    # Inherits the online phases (generate_and_score, advantages, rollout dumps) of the policy-gradient trainer;
    # train_step, the window and the saved state are this family's own.

    def training_records(self) -> list[PromptRecord]:
        if self.cfg.data.sample_source != "offline":
            return super().training_records()
        self.pairs: list[PreferencePair] = load_pairs(self.cfg.data.pairs)
        self.pair_latents: dict[int, torch.Tensor] = {}  # pair index → latents [2, …] (chosen, rejected), CPU
        logger.info("loaded %d preference pairs from %s", len(self.pairs), self.cfg.data.pairs)
        return [PromptRecord(p.prompt, p.negative_prompt) for p in self.pairs]

    def window_for(self, step: int) -> SdeWindow | None:
        """None (a pure ODE rollout) for sde_type ode; else every step but the last is stochastic."""
        s = self.cfg.sampling
        return None if s.sde_type == "ode" else default_window(s.num_steps)

    def extra_state(self) -> dict:
        return {}  # the `old` / `ema` adapters are policies of the model: the engine saves them

    def train_step(self, step: int) -> dict[str, float]:
        if self.cfg.data.sample_source == "offline":
            return self.offline_step(step)
        cfg, timer = self.cfg, PhaseTimer()
        prompts = make_step_prompts(self.records, self.sampler, step, cfg.data.group_size)
        batch, scored = self.generate_and_score(prompts, step, self.window_for(step), timer)
        with timer("advantage"):
            rewards = torch.from_numpy(scored.total)
            advantages = self.advantages(scored, prompts)
            pairs = online_pairs(rewards, prompts.group_index)
            batch["rewards"] = rewards.to(batch.device)
            batch["advantages"] = advantages.advantages.to(batch.device)
            mark_pairs(batch, pairs.chosen, pairs.rejected)
        with timer("update"):
            update_metrics = self.engine.update(batch, step)
        metrics = {**scored.metrics, **advantages.metrics, **pairs.metrics, **update_metrics, **timer.metrics()}
        metrics["images_per_second"] = len(prompts) / sum(timer.seconds.values())
        if self.rollout_due(step):
            with timer("dump"):
                self.dump_rollout(step, prompts, batch["images"].cpu().numpy(), scored, advantages.advantages)
            metrics["timing/dump"] = timer.seconds["dump"]
        return metrics

    def offline_step(self, step: int) -> dict[str, float]:
        """Diffusion-DPO on data.prompts_per_step pairs of the pair dataset: rows 0..P−1 chosen, P..2P−1 rejected."""
        timer = PhaseTimer()
        with timer("load"):
            indices = self.sampler.indices(step)
            latents = torch.stack([self.latents_of(i) for i in indices])  # [P, 2, …]
            pairs = [self.pairs[i] for i in indices]
            P = len(pairs)
            batch = self.engine.offline_batch(
                [p.prompt for p in pairs] * 2,
                [p.negative_prompt for p in pairs] * 2,
                list(range(2 * P)),
                torch.cat([latents[:, 0], latents[:, 1]]),
            )
            mark_pairs(batch, torch.arange(P), torch.arange(P, 2 * P))
        with timer("update"):
            update_metrics = self.engine.update(batch, step)
        metrics = {"pairs/count": float(P), "data/cached_pairs": float(len(self.pair_latents))}
        metrics.update({**update_metrics, **timer.metrics()})
        return metrics

    def latents_of(self, index: int) -> torch.Tensor:
        """[2, …] VAE latents of pair `index`'s chosen and rejected images, encoded on first use."""
        if index not in self.pair_latents:
            s, pair = self.cfg.sampling, self.pairs[index]
            images = torch.stack([load_image(path, s.height, s.width) for path in (pair.chosen, pair.rejected)])
            self.pair_latents[index] = self.engine.encode_images(images)
        return self.pair_latents[index]
