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

from diffusion_rl.algorithms.losses import LOSSES, PolicyLossInput
from diffusion_rl.engine.ema import EmaWeights
from diffusion_rl.errors import UserError
from diffusion_rl.models.base import FlowModel
from diffusion_rl.models.loader import load_model
from diffusion_rl.sampling.rollout import SamplerSettings, recompute_step, rollout
from diffusion_rl.sampling.window import SdeWindow
from diffusion_rl.utils.seeding import make_generator, seed_for

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
        self.loss_fn = LOSSES.get(cfg.algorithm.loss)
        s = cfg.sampling
        self.settings = SamplerSettings(s.num_steps, s.guidance, s.height, s.width, s.sde_type, s.noise_level)
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

    # -- policy-gradient update --------------------------------------------------------------------------------
    def trained_columns(self, batch: TensorDict, step: int) -> torch.Tensor:
        """[B, K] window columns each sample trains on this step."""
        alg = self.cfg.algorithm
        B, W = batch["log_probs"].shape
        K = max(1, int(W * alg.timestep_fraction))
        if alg.timestep_selection == "first":
            return torch.arange(K).expand(B, K)
        rows = [
            torch.randperm(W, generator=make_generator(self.cfg.run.seed, step, "timesteps", int(i)))[:K]
            for i in batch["sample_index"].tolist()
        ]
        return torch.stack(rows)

    def update(self, batch: TensorDict, step: int) -> dict[str, float]:
        """PPO-style epochs over the rollout; per mini-batch one optimizer step, accumulated over micro-batches
        and trained steps so the gradient is the mean over (kept samples × trained steps) whatever the
        micro-batch size."""
        t, alg = self.cfg.train, self.cfg.algorithm
        B = batch.batch_size[0]
        columns_BK = self.trained_columns(batch, step).to(batch.device)
        keep_B = (batch["advantages"] != 0) if alg.drop_zero_advantage else torch.ones(B, dtype=torch.bool)
        keep_B = keep_B.to(batch.device)
        sums: dict[str, float] = {}
        counts = 0
        grad_norms = []
        for _epoch in range(t.ppo_epochs):
            for m in range(t.num_minibatches):
                rows = torch.arange(m, B, t.num_minibatches, device=batch.device)  # interleaved: mixes groups
                n_kept = int(keep_B[rows].sum())
                if n_kept == 0:
                    continue
                for micro in rows.split(t.micro_batch_size):
                    for k in range(columns_BK.shape[1]):
                        metrics = self._backward_step(
                            batch[micro],
                            columns_BK[micro, k],
                            keep_B[micro],
                            scale=len(micro) / (n_kept * columns_BK.shape[1]),
                        )
                        for name, value in metrics.items():
                            sums[name] = sums.get(name, 0.0) + float(value)
                        counts += 1
                grad_norms.append(self._optimizer_step())
        out = {name: value / max(counts, 1) for name, value in sums.items()}
        finite = [g for g in grad_norms if math.isfinite(g)]
        out.update(
            {
                "grad_norm": sum(finite) / len(finite) if finite else float("nan"),
                "lr": self.scheduler.get_last_lr()[0],
                "train/optimizer_steps": self.optimizer_steps,
                "train/skipped_updates": self.skipped_updates,
                "train/kept_fraction": float(keep_B.float().mean()),
            }
        )
        return out

    def _backward_step(self, mb: TensorDict, cols: torch.Tensor, keep: torch.Tensor, scale: float) -> dict:
        rows = torch.arange(mb.batch_size[0], device=mb.device)
        step_mb = TensorDict(
            {
                "latents": torch.stack([mb["latents"][rows, cols], mb["latents"][rows, cols + 1]], dim=1),
                "sigmas": mb["sigmas"][rows, cols].unsqueeze(1),
                "sigmas_next": mb["sigmas_next"][rows, cols].unsqueeze(1),
            },
            batch_size=mb.batch_size,
        )
        out = recompute_step(self.model, step_mb, mb["cond"], 0, self.settings)
        ref_mean = None
        if self.cfg.algorithm.kl_beta > 0:
            with torch.no_grad(), self.model.reference():
                ref_mean = recompute_step(self.model, step_mb, mb["cond"], 0, self.settings).mean
        sqrt_dt = (step_mb["sigmas"][:, 0] - step_mb["sigmas_next"][:, 0]).sqrt()
        inp = PolicyLossInput(
            log_prob=out.log_prob,
            old_log_prob=mb["log_probs"][rows, cols],
            advantages=mb["advantages"],
            mean=out.mean,
            old_mean=mb["means"][rows, cols],
            ref_mean=ref_mean,
            std=out.std,
            sqrt_dt=sqrt_dt,
            weights=keep.float(),
        )
        loss_out = self.loss_fn(inp, self.cfg.algorithm)
        (loss_out.loss * scale).backward()
        return {"loss": loss_out.loss.detach(), **loss_out.metrics}

    def _optimizer_step(self) -> float:
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
