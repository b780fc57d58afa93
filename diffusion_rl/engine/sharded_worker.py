"""The Ray engine's actors: a rank that trains (`ShardedWorker`) is the one PolicyWorker with its transformer
FSDP2-sharded over all ranks; what is added here is only what a Ray actor needs: joining the process group, where it
runs, and errors that say which rank on which host failed (every public method is wrapped in `reported`).

Plain torch.distributed: Ray only hosts it as an actor (engine/ray.py); every method's exception reaches the driver
as a WorkerError naming the actor.

A rollout actor (engine.rollout=separate, `RolloutWorker`) is a PolicyWorker that does not train: it holds the whole
model (no optimizer, no gradients, no sharding), in engine.rollout_dtype if set, and samples training rollouts with
whatever weights the trainers last pushed (engine/weight_sync.py), stamping each row with their version. Its rows stay
there until the trainers fetch the ones they train on, worker to worker (`export_rows`, which runs in its own
concurrency group, so that the trainers can fetch step t while the actor samples step t + 1).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import socket
import time
import traceback
from datetime import timedelta

import torch

from diffusion_rl.algorithms.credit import Targets
from diffusion_rl.config.engine import EngineConfig
from diffusion_rl.engine.parallel import Fsdp2Sharded
from diffusion_rl.engine.spec import WorkerSpec
from diffusion_rl.engine.weight_sync import BroadcastChannel, WeightReceiver, WeightSender
from diffusion_rl.engine.worker import PolicyWorker, UpdatePlan
from diffusion_rl.errors import TrainingDiverged, UserError, WeightsUnchanged

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
        """The exception the driver raises (`note` appended to its message): a UserError keeps its type, as does a
        run's own stop (TrainingDiverged, WeightsUnchanged: the CLI prints both as one line); anything else is a
        WorkerError with the traceback."""
        if self.kind == UserError.__name__:
            return UserError(f"{self.where}: {self.message}{note}")
        for stop in (TrainingDiverged, WeightsUnchanged):  # a run's own stop: one line, its last good checkpoint
            if self.kind == stop.__name__:
                return stop(f"{self.where}: {self.message}{note}")
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
        except WorkerError:  # from a reported method it called: already says where
            raise
        except Exception as e:
            logger.error("%s %d: %s failed: %s", self.role, self.rank, method.__name__, e)
            raise WorkerError(
                self.rank, self.host, self.pid, type(e).__name__, str(e), traceback.format_exc(), self.role
            ) from None

    return wrapper


def reported_methods(cls):
    """Class decorator: every public method of an actor class (its bases' included) wrapped in `reported`."""
    for name in dir(cls):
        attr = inspect.getattr_static(cls, name)
        if not name.startswith("_") and inspect.isfunction(attr):
            setattr(cls, name, reported(attr))
    return cls


class RayActor:
    """Where an actor runs (rank, host, pid) and what every actor sets up first: its torch threads (Ray sets
    OMP_NUM_THREADS to the actor's CPUs, but a reused worker process keeps an old torch setting) and log lines."""

    role = "actor"

    def _start(self, rank: int, num_threads: int, log_prefix: str) -> None:
        self.rank, self.host, self.pid = rank, socket.gethostname(), os.getpid()
        torch.set_num_threads(max(1, num_threads))
        logging.basicConfig(level=logging.INFO, format=f"[{log_prefix}] %(levelname)s %(name)s: %(message)s")

    def info(self) -> dict:
        """Where this actor runs, and the CPU time its process has used so far (benchmarks)."""
        return actor_info(self)


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


@reported_methods
class ShardedWorker(RayActor, WeightSender, PolicyWorker):
    role = "worker rank"

    def __init__(self, rank: int, world_size: int, num_threads: int):
        self._start(rank, num_threads, f"rank {rank}")
        self.world_size = world_size

    def rendezvous_address(self) -> str:
        return free_address()

    def setup(self, spec: WorkerSpec, engine: EngineConfig, init_method: str) -> None:
        """Join the process group, then become the PolicyWorker with its transformer sharded over the group."""
        import torch.distributed as dist

        from diffusion_rl.models.loader import resolve_device

        device = resolve_device(spec.model.device)
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
            timeout=timedelta(seconds=engine.collective_timeout_s),
        )
        e = engine
        PolicyWorker.__init__(self, spec, Fsdp2Sharded(device, e.mixed_precision, e.reshard_after_forward,
                                                      e.fsdp_cpu_offload))  # fmt: skip

    def update(self, targets: Targets, step: int, plan: UpdatePlan) -> dict[str, float]:
        """The update on this rank's rows, some sent by other actors as object-store references (Ray does not
        resolve references inside an argument); FSDP2 sums the gradients over the ranks."""
        import ray

        try:
            plan.imported = ray.get(plan.imported)
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError, ray.exceptions.RayActorError) as e:
            raise RowsLost(f"rows of step {step} to train here are lost: {type(e).__name__}") from e
        return PolicyWorker.update(self, targets, step, plan)


IO_GROUP = "io"  # the concurrency group of the calls that may run while the actor samples


@reported_methods
class RolloutWorker(RayActor, WeightReceiver, PolicyWorker):
    role = "rollout actor"

    def __init__(self, rank: int, num_threads: int):
        self._start(rank, num_threads, f"rollout {rank}")
        self.channel: BroadcastChannel | None = None

    def setup(self, spec: WorkerSpec) -> None:
        """Load the model (LoRA configured as the trainers', so that adapter names match) in the rollout dtype."""
        from diffusion_rl.models.loader import resolve_device

        device = resolve_device(spec.model.device)
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        PolicyWorker.__init__(self, spec)
