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

from diffusion_rl.engine.direct_preference_update import DirectPreferenceUpdate
from diffusion_rl.engine.ema import EmaWeights
from diffusion_rl.engine.parallel import SingleDevice
from diffusion_rl.engine.policy_gradient_update import PolicyGradientUpdate
from diffusion_rl.errors import UserError
from diffusion_rl.models.base import FlowModel
from diffusion_rl.models.export import save_diffusers_lora
from diffusion_rl.models.loader import load_model
from diffusion_rl.sampling.rollout import SamplerSettings, rollout
from diffusion_rl.sampling.window import SdeWindow
from diffusion_rl.utils.seeding import seed_for

logger = logging.getLogger(__name__)


# algorithm.family → the update it runs (engine/*_update.py); an updater may add named policies to the model
UPDATERS = {"policy_gradient": PolicyGradientUpdate, "direct_preference": DirectPreferenceUpdate}


class TrainingDiverged(RuntimeError):
    """Too many consecutive updates had a non-finite loss or gradient norm."""


class PolicyWorker:
    def __init__(self, cfg, parallel: SingleDevice | None = None):
        """`parallel`: how the network is spread over devices (engine/parallel.py); None = this one device."""
        self.cfg = cfg
        # peft draws LoRA's initial A from the global CPU generator: seed it from run.seed (and put it back after),
        # so the starting adapter does not depend on what the process drew before.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed_for(cfg.run.seed, "model_init"))
            self.model: FlowModel = load_model(cfg.model)
        if cfg.algorithm.kl_beta > 0:
            self.model.policies.keep_reference()
        s = cfg.sampling
        self.settings = SamplerSettings(s.num_steps, s.guidance, s.height, s.width, s.sde_type, s.noise_level)
        self.updater = UPDATERS[cfg.algorithm.family](self)  # may add named policies (old, ema, reference)
        # FSDP2 replaces the parameters by sharded ones: after every policy exists, before the optimizer and EMA
        self.parallel = parallel if parallel is not None else SingleDevice()
        self.parallel.prepare(self.model)
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
        with self.model.using(self.updater.rollout_policy):  # the policy that samples (DiffusionNFT: `old`)
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
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] → latents [B, …] on the CPU (offline datasets cache them)."""
        return self.model.encode(images).cpu()

    def offline_batch(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        sample_index: Sequence[int],
        final_latents: torch.Tensor,
    ) -> TensorDict:
        """A training batch of given clean latents (offline data) instead of a rollout's: final_latents, cond."""
        cond = self.model.encode_prompts(list(prompts), [n or "" for n in negative])
        return TensorDict(
            {
                "final_latents": final_latents.to(self.model.device, torch.float32),
                "cond": cond,
                "sample_index": torch.as_tensor(list(sample_index), device=self.model.device),
            },
            batch_size=[len(prompts)],
            device=self.model.device,
        )

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
        # the optimizer's own list: under FSDP2 the module may hold gathered copies now, the optimizer the shards
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = self.parallel.clip_grad_norm(params, max_norm)  # over all shards
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

    def optimizer_metrics(self, grad_norms: list[float]) -> dict[str, float]:
        """What every update reports about its optimizer steps: the mean finite gradient norm, lr, step counts."""
        finite = [g for g in grad_norms if math.isfinite(g)]
        return {
            "grad_norm": sum(finite) / len(finite) if finite else float("nan"),
            "lr": self.scheduler.get_last_lr()[0],
            "train/optimizer_steps": self.optimizer_steps,
            "train/skipped_updates": self.skipped_updates,
        }

    # -- state ---------------------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Trainable weights (safetensors; LoRA also for peft and diffusers), optimizer, scheduler, EMA, counters."""
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
            save_diffusers_lora(self.model, directory / "adapter")  # also for pipeline.load_lora_weights(adapter/)
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
