"""PolicyWorker: one device's model, optimizer and EMA; samples rollouts and updates on its share of a batch.

The local engine holds one; a distributed engine holds one per device. The trainer never calls it directly.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tensordict import TensorDict

from diffusion_rl.engine.ema import EmaWeights
from diffusion_rl.engine.policy_gradient_update import PolicyGradientUpdate
from diffusion_rl.errors import UserError
from diffusion_rl.models.base import FlowModel
from diffusion_rl.models.loader import load_model
from diffusion_rl.sampling.rollout import SamplerSettings, rollout
from diffusion_rl.sampling.window import SdeWindow
from diffusion_rl.utils.seeding import seed_for

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient norm."""


class PolicyWorker:
    def __init__(self, cfg):
        self.cfg = cfg
        # peft draws LoRA's initial A from the global CPU generator: seed it from run.seed (and put it back after),
        # so the starting adapter does not depend on what the process drew before.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed_for(cfg.run.seed, "model_init"))
            self.model: FlowModel = load_model(cfg.model)
        if cfg.algorithm.kl_beta > 0:
            self.model.policies.keep_reference()
        params = self.model.trainable_parameters()
        if not params:
            raise UserError("the model has no trainable parameters: enable model.lora or full fine-tuning")
        t = cfg.train
        self.optimizer = torch.optim.AdamW(
            params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, eps=t.adam_eps
        )
        warmup = t.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: min(1.0, (n + 1) / warmup) if warmup > 0 else 1.0
        )
        self.ema = EmaWeights(params, t.ema.decay) if t.ema.enabled else None
        s = cfg.sampling
        self.settings = SamplerSettings(s.num_steps, s.guidance, s.height, s.width, s.sde_type, s.noise_level)
        self.updater = PolicyGradientUpdate(self)
        self.optimizer_steps = 0
        self.skipped_updates = 0
        self.consecutive_skips = 0

    # -- sampling -------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        sample_index: Sequence[int],
        group_index: Sequence[int],
        step: int,
        window: SdeWindow | None,
    ) -> TensorDict:
        """A training rollout. Sample i's noise comes from (seed, step, sample_index[i]), never from its batch."""
        seed = self.cfg.run.seed
        cond = self.model.encode_prompts(list(prompts), [n or "" for n in negative])
        init_ids = group_index if self.cfg.sampling.share_initial_noise else sample_index
        traj = rollout(
            self.model,
            cond,
            self.settings,
            window,
            init_seeds=[seed_for(seed, step, "init_noise", int(i)) for i in init_ids],
            noise_seeds=[seed_for(seed, step, "sde_noise", int(i)) for i in sample_index],
        )
        traj["cond"] = cond
        traj["sample_index"] = torch.as_tensor(list(sample_index), device=traj.device)
        return traj

    @torch.no_grad()
    def sample_images(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        seeds: Sequence[int],
        settings: SamplerSettings,
        use_ema: bool = True,
    ) -> torch.Tensor:
        """ODE samples (validation, evaluation): uint8 [B, H, W, 3], each from its own seed."""
        cond = self.model.encode_prompts(list(prompts), [n or "" for n in negative])
        swap = self.ema.swapped_in() if (use_ema and self.ema is not None) else contextlib.nullcontext()
        with swap:
            traj = rollout(self.model, cond, settings, None, init_seeds=seeds, noise_seeds=seeds)
        return traj["images"].cpu()

    # -- update ----------------------------------------------------------------------------------------------
    def update(self, batch: TensorDict, step: int) -> dict[str, float]:
        """One training step's update by the algorithm family's updater (see engine/*_update.py)."""
        return self.updater(batch, step)

    def optimizer_step(self) -> float:
        """Clip, then step (or skip a non-finite gradient); returns the gradient norm before clipping."""
        t = self.cfg.train
        params = self.model.trainable_parameters()
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            self.consecutive_skips += 1
            logger.warning(
                "non-finite gradient norm (%s): update skipped (%d in a row)", grad_norm, self.consecutive_skips
            )
            if self.consecutive_skips >= t.max_consecutive_skips:
                raise TrainingDiverged(
                    f"{self.consecutive_skips} consecutive updates had a non-finite loss or gradient norm; "
                    "stopping (the last good checkpoint is kept). Lower train.lr or check the rewards."
                )
            return grad_norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        self.consecutive_skips = 0
        if self.ema is not None and self.optimizer_steps % t.ema.update_every == 0:
            self.ema.update()
        return grad_norm

    # -- state ---------------------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Trainable weights (safetensors; LoRA also in peft format), optimizer, scheduler, EMA and counters."""
        policies = self.model.policies
        for name in policies.names():
            if name.startswith("__"):
                continue
            save_file(
                {k: v.contiguous() for k, v in policies.state_dict_of(name).items()},
                directory / f"policy_{name}.safetensors",
            )
        if policies.lora is not None:
            policies.trained.save_pretrained(directory / "adapter", selected_adapters=["default"])
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "ema": self.ema.state_dict() if self.ema is not None else None,
                "counters": [self.optimizer_steps, self.skipped_updates, self.consecutive_skips],
            },
            directory / "trainer_state.pt",
        )

    def load(self, directory: Path) -> None:
        policies = self.model.policies
        for name in policies.names():
            path = directory / f"policy_{name}.safetensors"
            if path.is_file():
                policies.load_state_dict_of(name, load_file(path, device=str(self.model.device)))
        state = torch.load(directory / "trainer_state.pt", map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
        self.optimizer_steps, self.skipped_updates, self.consecutive_skips = state["counters"]
