"""PolicyWorker: one device's model, algorithm and optimizer; samples rollouts, keeps them, updates on them.

The local engine holds one; the Ray engine one per device (engine/sharded_worker.py). A training step's
trajectories stay here between `generate` (which returns only the images, for scoring) and `update` (which
receives only the algorithm's targets: advantages or pairs). The trainer never calls a worker directly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from diffusion_rl.algorithms.base import Targets, TrainBatch, make_algorithm
from diffusion_rl.checkpoint import state as checkpoint_state
from diffusion_rl.data.condition_images import ConditionImage, fit_condition_images
from diffusion_rl.engine.optimizer import OptimizerStepper
from diffusion_rl.engine.parallel import SingleDevice
from diffusion_rl.engine.update_loop import run_update
from diffusion_rl.errors import UserError
from diffusion_rl.models.base import FlowModel
from diffusion_rl.models.export import write_lora_adapter
from diffusion_rl.models.loader import load_model
from diffusion_rl.models.policies import DEFAULT
from diffusion_rl.sampling.rollout import SamplerSettings, rollout, sample_images
from diffusion_rl.sampling.trajectory import Generated, SampleIds, Trajectory
from diffusion_rl.sampling.window import SdeWindow
from diffusion_rl.utils.seeding import seed_for

logger = logging.getLogger(__name__)


@dataclass
class UpdatePlan:
    """Where a worker's update rows come from (engine/ray.py plans it; one worker alone needs none)."""

    keep: list[int] | None = None  # positions of the kept rows this worker trains, in order (None: all of them)
    imported: list[Trajectory] = field(default_factory=list)  # rows other workers sampled, trained here after them
    pad_to: int = 0  # units every worker trains: this worker's are padded with weight-0 copies up to it
    padding_only: bool = False  # fewer units than workers: this worker's rows are copies that only pad


class PolicyWorker:
    def __init__(self, cfg, parallel: SingleDevice | None = None):
        """`parallel`: how the network is spread over devices (engine/parallel.py); None = this one device."""
        self.cfg = cfg
        # peft draws LoRA's initial A from the global CPU generator: seed it from run.seed (and put it back after),
        # so the starting adapter does not depend on what the process drew before.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed_for(cfg.run.seed, "model_init"))
            self.model: FlowModel = load_model(cfg.model)
        self.algorithm = make_algorithm(cfg)
        self.algorithm.attach(self.model)  # may add named policies (old, ema, reference)
        self.settings = SamplerSettings.of(cfg.sampling)
        try:  # a size or frame count the model cannot make: say so before any work
            self.model.latent_shape(self.settings.height, self.settings.width, self.settings.frames)
        except ValueError as e:
            raise UserError(f"sampling.height/width/num_frames do not fit the {self.model.family} model: {e}") from None
        # FSDP2 replaces the parameters by sharded ones: after every policy exists, before the optimizer and EMA
        self.parallel = parallel if parallel is not None else SingleDevice()
        self.parallel.prepare(self.model)
        params = self.model.trainable_parameters()
        if not params:
            raise UserError("the model has no trainable parameters: enable model.lora or full fine-tuning")
        self.optimizer = OptimizerStepper(params, cfg.train, self.parallel)
        self.pending: list[Trajectory] = []  # this step's trajectories, in the order generate() made them
        self.pending_step: int | None = None

    # -- sampling -------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        ids: SampleIds,
        step: int,
        window: SdeWindow | None,
        images: Sequence[Sequence[ConditionImage]] | None = None,
    ) -> Generated:
        """Roll out a training batch, keep its trajectory for `update`, return its images (uint8 [B, H, W, 3], a
        video family's [B, F, H, W, 3]; CPU) and which rows are finite. `images`: each row's condition images
        (editing families), fitted to the output size here.
        Sample i's noise comes from (seed, step, sample_index[i]) (its group's with share_initial_noise)."""
        seed = self.cfg.run.seed
        cond = self.model.encode_prompts(list(prompts), [n or "" for n in negative], self._fitted(images))
        init_ids = ids.group_index if self.cfg.sampling.share_initial_noise else ids.sample_index
        with self.model.using(self.algorithm.rollout_policy):  # the policy that samples (DiffusionNFT: `old`)
            traj = rollout(
                self.model,
                cond,
                self.settings,
                window,
                init_seeds=[seed_for(seed, step, "init_noise", int(i)) for i in init_ids],
                noise_seeds=[seed_for(seed, step, "sde_noise", int(i)) for i in ids.sample_index],
                ids=ids,
            )
        self._keep(traj, step)
        return Generated(images=traj.images.cpu(), finite=traj.finite_rows().cpu(), batch_size=traj.batch_size)

    def keep_offline(
        self, prompts: Sequence[str], negative: Sequence[str | None], ids: SampleIds, latents: torch.Tensor, step: int
    ) -> None:
        """Keep given clean latents [B, …] (an offline dataset) as this step's batch instead of a rollout's."""
        device = self.model.device
        traj = Trajectory(
            final_latents=latents.to(device, torch.float32),
            cond=self.model.encode_prompts(list(prompts), [n or "" for n in negative]),
            ids=ids.to(device),
            batch_size=[len(prompts)],
            device=device,
        )
        self._keep(traj, step)

    def _fitted(self, images: Sequence[Sequence[ConditionImage]] | None) -> list[list[np.ndarray]] | None:
        """Each row's condition images at the output size, or None when no row has any (a text-only batch)."""
        if images is None or not any(images):
            return None
        return fit_condition_images(images, self.settings.height, self.settings.width)

    def _keep(self, traj: Trajectory, step: int) -> None:
        if self.pending_step != step:  # a new step: whatever an interrupted one left is dropped
            self.pending, self.pending_step = [], step
        self.pending.append(traj)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] → latents [B, …] on the CPU (offline datasets cache them)."""
        return self.model.encode(images).cpu()

    @torch.no_grad()
    def sample_images(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        seeds: Sequence[int],
        settings: SamplerSettings,
        use_ema: bool = True,
        images: Sequence[Sequence[ConditionImage]] | None = None,
    ) -> torch.Tensor:
        """ODE samples (validation): uint8 [B, H, W, 3] (videos [B, F, H, W, 3]), each from its own seed, with its
        row's condition images (editing families), in micro-batch-sized chunks."""
        ema = self.optimizer.ema
        with ema.swapped_in() if (use_ema and ema is not None) else contextlib.nullcontext():
            return sample_images(
                self.model,
                prompts,
                negative,
                settings,
                init_seeds=seeds,
                batch_size=self.cfg.train.micro_batch_size,
                images=self._fitted(images),
            )

    # -- update ----------------------------------------------------------------------------------------------
    def kept(self, step: int) -> Trajectory:
        """This step's kept trajectories, in the order generate() made them."""
        if self.pending_step != step or not self.pending:
            raise RuntimeError(f"update of step {step}: no trajectories of that step were generated on this worker")
        return torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]

    def export_rows(self, step: int, positions: Sequence[int]) -> Trajectory:
        """Rows of this step's kept trajectories (by position) that another worker trains on (engine/ray.py)."""
        return self.kept(step)[torch.tensor(list(positions), dtype=torch.long)].cpu()

    def update(self, targets: Targets, step: int, plan: UpdatePlan | None = None) -> dict[str, float]:
        """Train on this step's kept trajectories with the algorithm's targets for the same rows, in order; `plan`
        (several workers) says which kept rows train here, which come from other workers, and the units to pad to."""
        traj = self.kept(step)
        self.pending, self.pending_step = [], None
        plan = plan or UpdatePlan()
        if plan.keep is not None:
            traj = traj[torch.tensor(plan.keep, dtype=torch.long, device=traj.device)]
        if plan.imported:
            traj = torch.cat([traj, *(rows.to(traj.device) for rows in plan.imported)])
        if targets.batch_size != traj.batch_size:
            raise RuntimeError(f"update: {targets.batch_size[0]} targets for the {traj.batch_size[0]} rows here")
        batch = TrainBatch(traj=traj, targets=targets.to(traj.device), batch_size=traj.batch_size)
        return run_update(self.algorithm, batch, step, self.cfg.train, self.parallel, self.optimizer, plan.pad_to,
                          plan.padding_only)  # fmt: skip

    def weights_finite(self) -> bool:
        """Whether every trained weight is finite (this worker's shards): a diverged model's are not."""
        return all(bool(torch.isfinite(p.detach()).all()) for p in self.optimizer.params)

    # -- state -----------------------------------------------------------------------------------------------
    def tensors(self, with_ema: bool = True) -> dict:
        """What dcp/ holds for this worker, shaped (and sharded) like its model: every named policy's weights, the
        optimizer state and the EMA. Loading fills the same structure."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        policies = self.model.policies
        state = {
            "policies": {name: policies.state_dict_of(name) for name in policies.saved_names()},
            "optimizer": get_optimizer_state_dict(policies.trained, self.optimizer.optimizer),
        }
        ema = self.optimizer.ema
        if ema is not None and with_ema:
            state["ema"] = dict(zip(policies.trainable_names(), ema.shadow))
        return state

    def save(self, directory: Path) -> dict:
        """Write this worker's tensors to directory/dcp and (LoRA) the adapter export to directory/adapter, both
        collective on several workers; return the plain state (LR schedule, counters) for the trainer's state.pt."""
        checkpoint_state.save_tensors(self.tensors(), directory)
        policies, rank0 = self.model.policies, self.parallel.rank == 0
        if policies.lora is not None:
            lora = {n: p for n, p in policies.trained.named_parameters() if "lora_" in n and f".{DEFAULT}." in n}
            whole = self.parallel.full_tensors(lora, keep=rank0)
            if rank0:
                write_lora_adapter(self.model, directory / checkpoint_state.ADAPTER_DIR, whole)
        return self.optimizer.counters_state()

    def load(self, directory: Path, state: dict) -> None:
        """Load directory/dcp into this worker's (possibly differently sharded) model and optimizer, and `state`."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        has_ema = any(key.startswith("ema.") for key in checkpoint_state.saved_keys(directory))
        if self.optimizer.ema is not None and not has_ema:
            logger.warning("%s holds no EMA weights: the EMA restarts from the current weights", directory)
        tensors = self.tensors(with_ema=has_ema and self.optimizer.ema is not None)
        checkpoint_state.load_tensors(tensors, directory)
        policies = self.model.policies
        for name, weights in tensors["policies"].items():
            policies.load_state_dict_of(name, weights)
        set_optimizer_state_dict(policies.trained, self.optimizer.optimizer, tensors["optimizer"])
        if "ema" in tensors:
            self.optimizer.ema.load_shadow(list(tensors["ema"].values()))
        self.optimizer.load_counters_state(state)
