"""One rank of the Ray engine: a PolicyWorker whose transformer is FSDP2-sharded over all ranks.

This wraps the one PolicyWorker (engine/worker.py) rather than copying it: the worker gets an `Fsdp2Sharded`
parallelism and everything else (sampling, keeping trajectories, the update, the optimizer step, EMA,
checkpoints) is the same code the local engine runs. What is added here is what only a rank needs: joining the
process group, sampling inside `gathered()`, updating inside `training()`, and errors that say which rank on which
host failed.

Plain torch.distributed: Ray only hosts it as an actor (engine/ray.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch

from diffusion_rl.algorithms.base import Targets
from diffusion_rl.engine.optimizer import TrainingDiverged
from diffusion_rl.engine.parallel import Fsdp2Sharded
from diffusion_rl.engine.worker import PolicyWorker, UpdatePlan
from diffusion_rl.errors import UserError
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.trajectory import Generated, SampleIds
from diffusion_rl.sampling.window import SdeWindow

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """An exception raised in a worker, carried to the driver with the worker's rank, host, pid and traceback."""

    def __init__(self, rank: int, host: str, pid: int, kind: str, message: str, worker_traceback: str,
                 role: str = "worker rank"):  # fmt: skip
        super().__init__(rank, host, pid, kind, message, worker_traceback, role)
        self.rank, self.host, self.pid, self.role = rank, host, pid, role
        self.kind, self.message, self.worker_traceback = kind, message, worker_traceback

    @property
    def where(self) -> str:
        return f"{self.role} {self.rank} on {self.host} (pid {self.pid})"

    def __str__(self) -> str:
        trace = self.worker_traceback
        return f"{self.where} raised {self.kind}: {self.message}\n--- traceback on that worker ---\n{trace}"

    def for_driver(self, note: str = "") -> Exception:
        """The exception the driver raises (`note` appended to its message): a UserError or TrainingDiverged keeps
        its type (the CLI prints a user error as one line); anything else is a WorkerError with the traceback."""
        if self.kind == UserError.__name__:
            return UserError(f"{self.where}: {self.message}{note}")
        if self.kind == TrainingDiverged.__name__:
            return TrainingDiverged(f"{self.where}: {self.message}{note}")
        return WorkerError(self.rank, self.host, self.pid, self.kind, self.message + note, self.worker_traceback,
                           self.role)  # fmt: skip


class RowsLost(RuntimeError):
    """The rows a trainer was to fetch from another actor are gone with that actor (it died)."""


def reported(method):
    """Run an actor method; an exception leaves as a WorkerError that says where it happened (the actor has
    `rank`, `host`, `pid` and `role`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as e:
            logger.error("%s %d: %s failed: %s", self.role, self.rank, method.__name__, e)
            raise WorkerError(
                self.rank, self.host, self.pid, type(e).__name__, str(e), traceback.format_exc(), self.role
            ) from None

    return wrapper


def actor_info(actor) -> dict:
    """Where an actor runs (rank, host, pid, Ray node) and the CPU time its process has used so far."""
    import ray

    return {"rank": actor.rank, "host": actor.host, "pid": actor.pid, "cpu_s": time.process_time(),
            "node": ray.get_runtime_context().get_node_id()}  # fmt: skip


def free_address() -> str:
    """tcp://<this node's address>:<a free port> for the process group's rendezvous (rank 0 listens there)."""
    try:
        import ray

        ip = ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        ip = socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ip}:{port}"


class ShardedWorker:
    role = "worker rank"

    def __init__(self, rank: int, world_size: int, num_threads: int):
        self.rank, self.world_size = rank, world_size
        self.host, self.pid = socket.gethostname(), os.getpid()
        # Ray sets OMP_NUM_THREADS to the actor's CPUs, but a reused worker process keeps an old torch setting
        torch.set_num_threads(max(1, num_threads))
        logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        self.worker: PolicyWorker | None = None

    def info(self) -> dict:
        """Where this worker runs, and the CPU time its process has used so far (benchmarks)."""
        return actor_info(self)

    @reported
    def rendezvous_address(self) -> str:
        return free_address()

    @reported
    def setup(self, cfg, init_method: str) -> None:
        """Join the process group, then build the PolicyWorker with its transformer sharded over the group."""
        import torch.distributed as dist

        from diffusion_rl.models.loader import resolve_device

        device = resolve_device(cfg.model.device)
        if device.type == "cuda":  # Ray shows each worker its own GPU(s): index 0 unless model.device names one
            torch.cuda.set_device(device.index or 0)
        if init_method.startswith("file://"):  # a local cluster: gloo's connections stay on loopback too
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=cfg.engine.collective_timeout_s),
        )
        e = cfg.engine
        self.parallel = Fsdp2Sharded(device, e.mixed_precision, e.reshard_after_forward, e.fsdp_cpu_offload)
        self.worker = PolicyWorker(cfg, self.parallel)

    # -- sampling -------------------------------------------------------------------------------------------------
    @reported
    def generate(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        ids: SampleIds,
        step: int,
        window: SdeWindow | None,
        images=None,
    ) -> Generated:
        """This rank's rows of a training rollout, kept here; their images (it still joins the all-gather with
        no rows)."""
        with self.parallel.gathered(self.worker.algorithm.rollout_policy):
            if not prompts:
                s = self.worker.settings
                return Generated.empty(s.height, s.width, s.frames if self.worker.model.video else None)
            return self.worker.generate(prompts, negative, ids, step, window, images)

    @reported
    def keep_offline(
        self, prompts: Sequence[str], negative: Sequence[str | None], ids: SampleIds, latents: torch.Tensor, step: int
    ) -> None:
        self.worker.keep_offline(prompts, negative, ids, latents, step)

    @reported
    def sample_images(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        seeds: Sequence[int],
        settings: SamplerSettings,
        use_ema: bool,
        images=None,
    ) -> torch.Tensor:
        ema = self.worker.optimizer.ema if use_ema else None
        # swap the EMA into the shards before gathering them: the gathered copy is what the sampler runs
        with ema.swapped_in() if ema is not None else contextlib.nullcontext(), self.parallel.gathered():
            return self.worker.sample_images(prompts, negative, seeds, settings, use_ema=False, images=images)

    # -- update -------------------------------------------------------------------------------------------------
    @reported
    def export_rows(self, step: int, positions: list[int]):
        """Rows of this step's kept trajectories that another rank trains on (into the object store)."""
        return self.worker.export_rows(step, positions)

    @reported
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        return self.worker.encode_images(images)

    @reported
    def update(self, targets: Targets, step: int, plan: UpdatePlan) -> dict[str, float]:
        """The update on this rank's rows (some sent by other ranks); FSDP2 sums the gradients over the ranks."""
        import ray

        try:  # references inside an argument are not resolved by Ray
            plan.imported = ray.get(plan.imported)
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError, ray.exceptions.RayActorError) as e:
            raise RowsLost(f"rows of step {step} to train here are lost: {type(e).__name__}") from e
        with self.parallel.training():
            return self.worker.update(targets, step, plan)

    @reported
    def health(self) -> tuple[int, bool]:
        """(consecutive skipped updates, whether this rank's shards of the trained weights are finite)."""
        return self.worker.optimizer.consecutive_skips, self.worker.weights_finite()

    # -- state ------------------------------------------------------------------------------------------------------
    @reported
    def save(self, directory: str) -> dict:
        return self.worker.save(Path(directory))

    @reported
    def load(self, directory: str, state: dict) -> None:
        self.worker.load(Path(directory), state)

    # -- weights for the rollout actors (engine/weight_sync.py) ----------------------------------------------------
    def _rollout_policy_weights(self) -> dict[str, torch.Tensor]:
        """The sampling policy's whole weights on rank 0 (empty elsewhere): a collective over the ranks."""
        policies = self.worker.model.policies
        tensors = policies.state_dict_of(self.worker.algorithm.rollout_policy)
        return self.parallel.full_tensors(tensors, keep=self.rank == 0)

    @reported
    def put_rollout_weights(self) -> list | None:
        """Rank 0: [a reference to the sampling policy's weights in the object store, their bytes] (a list, so that
        the driver receives the reference, not the tensors); None on the other ranks."""
        import ray

        weights = self._rollout_policy_weights()
        if self.rank != 0:
            return None
        return [ray.put(weights), sum(t.numel() * t.element_size() for t in weights.values())]

    @reported
    def join_channel(self, address: str, world_size: int, backend: str, timeout_s: float) -> dict:
        """Rank 0 only: join the broadcast group as its sender; returns the layout (name → shape, dtype) a push
        sends, which the rollout actors allocate."""
        from diffusion_rl.engine.weight_sync import BroadcastChannel, weight_layout

        tensors = self.worker.model.policies.state_dict_of(self.worker.algorithm.rollout_policy)
        self.channel = BroadcastChannel(address, 0, world_size, backend, self.parallel.device, timeout_s)
        return weight_layout(tensors)  # a DTensor's shape is the whole tensor's

    @reported
    def broadcast_rollout_weights(self) -> int:
        """Every rank gathers the sampling policy's weights; rank 0 broadcasts them. Returns the bytes sent."""
        weights = self._rollout_policy_weights()
        return self.channel.send(weights) if self.rank == 0 else 0

    @reported
    def trainable_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The trained policy's full weights (gathered from the shards) on rank 0; None elsewhere."""
        policies = self.worker.model.policies
        full = self.parallel.full_tensors(policies.state_dict_of("default"), keep=self.rank == 0)
        return full if self.rank == 0 else None
