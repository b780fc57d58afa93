"""PolicyWorker: one device's model, algorithm and optimizer; samples rollouts, keeps them, updates on them.

Every engine runs this one class (engine/__init__.py): the local engine is one PolicyWorker; the Ray engine's
trainer actors are PolicyWorkers whose transformer is FSDP2-sharded over them (engine/sharded_worker.py: only the
`parallel` differs, engine/parallel.py); its rollout actors are PolicyWorkers that do not train (`trains=False`:
no optimizer, the model in engine.rollout_dtype, weights received from the trainers and applied when a step's
sampling starts, engine/weight_sync.py's `WeightReceiver`, which stamps the rows with their version). A
training step's trajectories stay here between `generate` (which returns only the images, for scoring) and `update`
(which receives only the algorithm's targets: advantages or pairs). With separate rollout actors the rows come from
them instead, worker to worker (`UpdatePlan.imported`).

`update` is the one update loop every algorithm runs through (algorithms/base.py says what an algorithm supplies;
the loop never names one): epochs × mini-batches × micro-batches × chunks, gradient sync, optimizer steps, metrics.
Mini-batch m holds units m, m + M, … of the U units the algorithm made of the batch; each chunk's loss (a mean over
its micro-batch's units) is multiplied by len(micro) / (n · K), with n the units that carry weight in the mini-batch
summed over every worker and K the chunks per micro-batch, so the accumulated gradient of an optimizer step is the
mean over the mini-batch's (unit, chunk) pairs, whatever the micro-batch size and the number of workers. Only the
last backward before an optimizer step reduces gradients across workers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffusion_rl.algorithms.base import OptimizerGroup, TrainBatch, UpdatePosition, minibatch_rows
from diffusion_rl.algorithms.credit import Targets
from diffusion_rl.checkpoint import state as checkpoint_state
from diffusion_rl.data.condition_images import ConditionImage
from diffusion_rl.data.sampler import StepPrompts
from diffusion_rl.engine.flops import FlopTally, device_peak_flops
from diffusion_rl.engine.optimizer import OptimizerStepper, apply_train_hyperparameters
from diffusion_rl.engine.parallel import SingleDevice
from diffusion_rl.engine.spec import WorkerSpec
from diffusion_rl.errors import UserError
from diffusion_rl.metrics import MAX, declare_metrics, reduce_metrics
from diffusion_rl.models.base import FlowModel
from diffusion_rl.models.checkpointing import resolved
from diffusion_rl.models.compiling import CompileReport
from diffusion_rl.models.embedding_cache import use_embedding_cache
from diffusion_rl.models.export import write_lora_adapter
from diffusion_rl.models.image_size import size_problem
from diffusion_rl.models.loader import load_model, resolve_device
from diffusion_rl.models.policies import DEFAULT
from diffusion_rl.sampling.rollout import SamplerSettings, sample_images, training_rollout
from diffusion_rl.sampling.sde import sde_linear_advice
from diffusion_rl.sampling.trajectory import Generated, Trajectory
from diffusion_rl.sampling.window import SdeWindow
from diffusion_rl.utils.seeding import seed_for
from diffusion_rl.utils.split import chunks_of_shares

logger = logging.getLogger(__name__)


@dataclass
class UpdatePlan:
    """Where a worker's update rows come from (engine/ray.py plans it; one worker alone needs none)."""

    keep: list[int] | None = None  # positions of the kept rows this worker trains, in order (None: all of them)
    imported: list[Trajectory] = field(default_factory=list)  # rows other workers sampled, trained here after them
    pad_to: int = 0  # units every worker trains: this worker's are padded with weight-0 copies up to it
    padding_only: bool = False  # fewer units than workers: this worker's rows are copies that only pad
    staleness_bound: int = 0  # updates a row may lag behind (rollouts sampled ahead): its staleness is reported

    def pad(self, units):
        """This worker's `units` as the plan has them train: weight 0 when they only pad, padded up to `pad_to`."""
        if self.padding_only:
            units.weight = torch.zeros_like(units.weight)
        return pad_units(units, self.pad_to) if self.pad_to else units

    def staleness(self, step: int, traj: Trajectory) -> dict[str, float]:
        """The staleness of the rows trained at `step` (`staleness_metrics`) when they may lag; else nothing."""
        bound = self.staleness_bound
        return staleness_metrics(step, traj.ids.policy_version, bound) if bound else {}


def staleness_metrics(step: int, policy_version: torch.Tensor, bound: int) -> dict[str, float]:
    """When rollouts may run ahead of the update (bound > 0): how many updates behind the weights that sampled each
    row were (step − its policy version): the mean, the max and the fraction of rows at each staleness 1..bound."""
    staleness = (step - policy_version).float()
    metrics = {"rollout/staleness_mean": float(staleness.mean()), "rollout/staleness_max": float(staleness.max())}
    for k in range(1, bound + 1):
        metrics[f"rollout/staleness_{k}_fraction"] = float((staleness == k).float().mean())
    return metrics


declare_metrics({"rollout/staleness_max": MAX})


def health_problem(reports: Sequence[tuple[int, bool]]) -> str | None:
    """Why a model should not be checkpointed, from each worker's `health()`: its last updates were skipped, or its
    weights (any worker's shards) are not finite."""
    if not all(finite for _, finite in reports):
        return "the trained weights are not finite"
    if skips := reports[0][0]:
        return f"the last {skips} update(s) were skipped for a non-finite gradient"
    return None


def pad_units(units, size: int):
    """`units` padded to `size` with weight-0 copies of its first unit (engine workers must all take the same
    forward and backward passes; a padding unit computes like a real one and trains nothing)."""
    missing = size - units.batch_size[0]
    if missing <= 0:
        return units
    if units.batch_size[0] == 0:
        raise ValueError(f"cannot pad an update with no unit to {size}: the engine must give every worker a unit")
    extra = units[torch.zeros(missing, dtype=torch.long, device=units.device)].clone()
    extra.weight = torch.zeros_like(extra.weight)
    return torch.cat([units, extra])


class KeptRollouts:
    """The rollouts a worker sampled and keeps, by training step, until the update that trains them.

    A step's batch may be sampled in several calls (score chunks); its rows are kept in the order they were made, and
    positions in that order name them. Several steps may be kept at once when rollouts run ahead of the update
    (engine.max_staleness > 0). Thread-safe: a rollout actor exports rows of one step while it samples the next."""

    def __init__(self):
        self._by_step: dict[int, list[Trajectory]] = {}
        self._lock = threading.Lock()

    def add(self, step: int, traj: Trajectory, drop_earlier: bool = False) -> None:
        """Keep `traj` among `step`'s rows; `drop_earlier`: forget what earlier (interrupted) steps left."""
        with self._lock:
            if drop_earlier:
                self._by_step = {s: parts for s, parts in self._by_step.items() if s >= step}
            self._by_step.setdefault(step, []).append(traj)

    def holds(self, step: int) -> bool:
        with self._lock:
            return bool(self._by_step.get(step))

    def rows(self, step: int, positions: Sequence[int] | None = None) -> Trajectory:
        """The step's kept rows (all, or those at `positions`, in that order)."""
        with self._lock:
            parts = self._by_step.get(step)
            if not parts:
                raise RuntimeError(f"no trajectories of step {step} are kept here (kept: {sorted(self._by_step)})")
            if len(parts) > 1:
                parts[:] = [torch.cat(parts)]  # concatenated once
        traj = parts[0]
        return traj if positions is None else traj[torch.tensor(list(positions), dtype=torch.long, device=traj.device)]

    def release(self, step: int) -> None:
        with self._lock:
            self._by_step.pop(step, None)


class PolicyWorker:
    def __init__(self, spec: WorkerSpec, parallel: SingleDevice | None = None):
        """`spec`: what the worker is built from (engine/spec.py; a rollout actor's has no algorithm: it only samples
        with the weights it is sent); `parallel`: how the network is spread over devices (engine/parallel.py); None =
        this one device."""
        self.spec, self.trains = spec, spec.trains
        # peft draws LoRA's initial A from the global CPU generator: seed it from run.seed (and put it back after),
        # so the starting adapter does not depend on what the process drew before.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed_for(spec.seed, "model_init"))
            model_cfg = resolved(spec.model, spec.checkpoint_plan, resolve_device(spec.model.device))
            self.model: FlowModel = load_model(model_cfg, text_encoders=spec.embedding_cache is None)
        if spec.embedding_cache is not None:  # the run's texts cached (in the model's dtype), encoders released
            use_embedding_cache(self.model, self.model.directory, spec.embedding_cache, list(spec.texts))
        self.algorithm = spec.algorithm.build() if self.trains else None
        self.rollout_policy = self.algorithm.rollout_policy if self.trains else DEFAULT  # the policy that samples
        if self.trains:  # may add named policies (old, ema, reference; adapters that start as the base, whose
            with torch.random.fork_rng(devices=[]):  # LoRA A peft draws from the global generator: seeded too)
                torch.default_generator.manual_seed(seed_for(spec.seed, "attach"))
                self.algorithm.attach(self.model)
        s = spec.sampling
        self.settings = SamplerSettings.of(s)
        # a size or frame count the model cannot make: say so before any work (validation's too, at its own size)
        self._check_size(s.height, s.width, "sampling")
        if spec.val_size is not None:
            self._check_size(*spec.val_size, "val")
        self.model.check_low_noise_guidance(s.guidance_low_noise, "sampling.guidance_low_noise")
        self.model.check_low_noise_guidance(spec.val_guidance_low_noise, "val.guidance_low_noise")
        # FSDP2 replaces the parameters by sharded ones: after every policy exists, before the optimizer and EMA
        self.parallel = parallel if parallel is not None else SingleDevice()
        self.parallel.prepare(self.model)
        advice = sde_linear_advice(
            s.sde_type, s.noise_level, self.model.sigma_schedule(s.num_steps, s.height, s.width, self.settings.frames)
        )
        if advice and self.trains and self.parallel.rank == 0:  # one line per run, not one per worker
            logger.warning(advice)
        if self.trains:
            self.algorithm.sum_over_workers = self.parallel.sum
        self.optimizer: OptimizerStepper | None = None
        if self.trains:
            groups = self._optimizer_groups()
            self.optimizer = OptimizerStepper(groups, spec.train, self.parallel, spec.weight_change)
        self.version: int | None = None  # a rollout actor's: the steps its received weights had taken (None: none)
        self.kept = KeptRollouts()
        self.flops = FlopTally(spec.flops, device_peak_flops(self.model.device, spec.peak_tflops))
        self.compile_report = CompileReport(self.trains and self.model.policies.compile_blocks)

    def _optimizer_groups(self) -> list[tuple[OptimizerGroup, list[torch.nn.Parameter]]]:
        """The algorithm's optimizer groups with their policies' parameters, the trained `default` policy's first."""
        groups = self.algorithm.optimizer_groups(self.algorithm.settings)
        if not groups or groups[0].policy != DEFAULT:
            raise ValueError(f"optimizer groups {groups}: the first must be the '{DEFAULT}' policy's")
        pairs = [(group, self.model.policies.parameters_of(group.policy)) for group in groups]
        if not pairs[0][1]:
            raise UserError("the model has no trainable parameters: enable model.lora or full fine-tuning")
        return pairs

    def _check_size(self, height: int, width: int, section: str) -> None:
        """A UserError naming `section`'s keys when the model cannot make height × width pixels (`size_problem`:
        its step, its largest) or the run's frames."""
        problem = size_problem(self.model, height, width, (f"{section}.height", f"{section}.width"))
        if problem is None:
            try:
                self.model.latent_shape(height, width, self.settings.frames)
            except ValueError as e:
                problem = str(e)
        if problem:
            keys = "sampling.height/width/num_frames" if section == "sampling" else f"{section}.height/{section}.width"
            raise UserError(f"{keys} do not fit the {self.model.family} model: {problem}")

    # -- sampling -------------------------------------------------------------------------------------------
    def sampling_chunks(self, rows: int, parts: int) -> list[list[int]]:
        return chunks_of_shares(rows, 1, parts)  # one process samples every row: contiguous chunks

    def generate(
        self, prompts: StepPrompts, step: int, window: SdeWindow | None, rows: Sequence[int] | None = None
    ) -> Generated:
        """Roll out `rows` of a training step's prompts (all of them when None) with the weights of that step
        (sampling.rollout.training_rollout), each row the same sample whichever worker draws it; keep their
        trajectory for `update`, return their images (uint8 [n, H, W, 3], a video family's [n, F, H, W, 3]; CPU)
        and which are finite. A sharded worker joins the weights' all-gather even with no rows."""
        rows = list(range(len(prompts))) if rows is None else [int(i) for i in rows]
        s = self.spec.sampling
        with self.parallel.gathered(self.rollout_policy):
            if not rows:
                return Generated.empty(s.height, s.width, s.num_frames if self.model.video else None)
            texts, negative = [prompts.prompts[i] for i in rows], [prompts.negative_prompts[i] for i in rows]
            images = [prompts.condition_images[i] for i in rows]
            shape = ("generate", len(rows), window.size if window is not None else 0, any(images))
            with self.model.using(self.rollout_policy), self.flops.count(shape):  # the sampling policy (NFT: old)
                traj = training_rollout(self.model, self.settings, texts, negative, prompts.sample_ids(rows), step,
                                        window, self.model.fit_conditions(images, s.height, s.width),
                                        seed=self.spec.seed, share_initial_noise=s.share_initial_noise)  # fmt: skip
        self._keep(traj, step)
        return traj.generated()

    def keep_offline(self, prompts: StepPrompts, latents: torch.Tensor, step: int) -> None:
        """Keep given clean latents [B, …] (an offline dataset) as this step's batch instead of a rollout's."""
        device = self.model.device
        rows = range(len(prompts))
        traj = Trajectory(
            final_latents=latents.to(device, torch.float32),
            cond=self.model.encode_prompts(prompts.prompts, [n or "" for n in prompts.negative_prompts]),
            ids=prompts.sample_ids(rows).to(device),
            batch_size=[len(prompts)],
            device=device,
        )
        self._keep(traj, step)

    def _keep(self, traj: Trajectory, step: int) -> None:
        """Keep a training step's rows, stamped with the version of the weights that sampled them: this step's (a
        rollout actor's are the version it received, engine/weight_sync.py); what an interrupted earlier step left
        goes."""
        traj.ids.policy_version.fill_(step)
        self.kept.add(step, traj, drop_earlier=True)

    def release(self, step: int) -> None:
        """Forget step `step`'s kept rows (a rollout actor's, once the trainers have them)."""
        self.kept.release(step)

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
        row's condition images (editing families), in micro-batch-sized chunks; with the EMA weights if `use_ema`
        (swapped into the shards before they are gathered: the gathered copy is what the sampler runs)."""
        ema = self.optimizer.ema if (use_ema and self.optimizer is not None) else None
        with ema.swapped_in() if ema is not None else contextlib.nullcontext(), self.parallel.gathered():
            return sample_images(
                self.model,
                prompts,
                negative,
                settings,
                init_seeds=seeds,
                batch_size=self.spec.train.micro_batch_size,
                images=self.model.fit_conditions(images, settings.height, settings.width),
            )

    # -- update ----------------------------------------------------------------------------------------------
    def export_rows(self, step: int, positions: Sequence[int]) -> Trajectory:
        """Rows of this step's kept trajectories (by position) that another worker trains on (engine/ray.py)."""
        return self.kept.rows(step, positions).cpu()

    def update(self, targets: Targets, step: int, plan: UpdatePlan | None = None) -> dict[str, float]:
        """Train on this step's kept trajectories with the algorithm's targets for the same rows, in order (the
        update loop: module docstring); `plan` (several workers) says which kept rows train here, which come from
        other workers, and the units every worker trains (this one's padded with weight-0 copies up to it)."""
        traj = self.kept.rows(step) if plan is None else self._planned_rows(step, plan)
        self.kept.release(step)
        if targets.batch_size != traj.batch_size:
            raise RuntimeError(f"update: {targets.batch_size[0]} targets for the {traj.batch_size[0]} rows here")
        batch = TrainBatch(traj=traj, targets=targets.to(traj.device), batch_size=traj.batch_size)
        alg, parallel, train = self.algorithm, self.parallel, self.spec.train
        with parallel.training():
            with self.flops.count(("begin", traj.batch_size[0])):  # FLOPs counted once per shape (engine/flops.py)
                units, out = alg.begin(batch, step)
            if plan is not None:  # several workers take as many passes; rows sampled ahead report their staleness
                units, out = plan.pad(units), {**plan.staleness(step, traj), **out}
            out["train/units"] = float(parallel.sum(int(units.weight.sum())))
            U, M, K = units.batch_size[0], train.num_minibatches, alg.chunks(units)
            passes, rows_of_pass = [], []
            with self.flops.count(("update", U, K)):  # by the units, not the rows: DPO's pairs vary by step
                for epoch in range(train.ppo_epochs):
                    for m in range(M):
                        rows = minibatch_rows(U, M, m, units.weight.device)  # units.device is None (made without one)
                        # the units that carry weight, over all workers: each scales by that global count, so the
                        # summed gradients are the global mean
                        n = parallel.sum(int(units.weight[rows].sum()))
                        if n == 0:
                            continue
                        micros = rows.split(alg.micro_size)
                        for i, micro in enumerate(micros):
                            chunk = units[micro]
                            for k in range(K):
                                parallel.sync_gradients(last_before_step=(i, k) == (len(micros) - 1, K - 1))
                                loss = alg.loss(chunk, k, UpdatePosition(epoch, m, step))
                                (loss.loss * (len(micro) / (n * K))).backward()
                                if chunk.weight.any():  # padding units only: they train and report nothing
                                    passes.append({"loss": loss.loss.detach(), **loss.metrics})
                                    rows_of_pass.append(len(micro))
                        self.optimizer.step()
            parallel.settle()
            # the passes' metrics each by its declared rule (diffusion_rl/metrics.py), then the algorithm's, optimizer's
            out.update({**reduce_metrics(passes, rows_of_pass), **alg.end(step), **self.optimizer.metrics()})
        self.compile_report.after_update()  # the compile time, once
        return {**out, **self.flops.metrics()}  # this step's: its rollouts since the last update, and this update

    def _planned_rows(self, step: int, plan: UpdatePlan) -> Trajectory:
        """The rows `plan` trains here: the kept ones it names, then those other workers sampled."""
        device = self.model.device
        parts = [] if plan.keep == [] else [self.kept.rows(step, plan.keep).to(device)]  # []: all from others
        return torch.cat([*parts, *(self._as_own(rows.to(device)) for rows in plan.imported)])

    def _as_own(self, traj: Trajectory) -> Trajectory:
        """Rows sampled elsewhere with the conditioning in this model's dtype (a rollout actor may sample in
        engine.rollout_dtype)."""
        dtype = self.model.dtype
        traj.cond = traj.cond.apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
        return traj

    def health(self) -> tuple[int, bool]:
        """(consecutive skipped updates, whether this worker's shards of the trained weights are finite)."""
        finite = all(bool(torch.isfinite(p.detach()).all()) for p in self.optimizer.params)
        return self.optimizer.consecutive_skips, finite

    def health_problem(self) -> str | None:
        return health_problem([self.health()])

    def trainable_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The trained policy's full weights (gathered from the shards) on rank 0; None elsewhere."""
        rank0 = self.parallel.rank == 0
        full = self.parallel.full_tensors(self.model.policies.state_dict_of(DEFAULT), keep=rank0)
        return full if rank0 else None

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
        return {**self.optimizer.counters_state(), "algorithm": self.algorithm.state_dict()}

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
        self.algorithm.load_state_dict(state.get("algorithm") or {})
        stepper = self.optimizer
        apply_train_hyperparameters(
            stepper.optimizer, stepper.scheduler, self.spec.train, self.parallel.rank == 0, stepper.groups
        )
