"""The Ray engine: `engine.num_workers` PolicyWorker actors with the transformer FSDP2-sharded over them.

The driver (the trainer's process) holds no model. It splits each call over the workers and gathers the results:
- generate: worker r owns rows [r·B/N, (r+1)·B/N) of the step's batch; each call's rows (a chunk, or all) go to
  their owners, which all-gather the transformer once, sample their rows, keep the trajectories and return only
  the images: the driver scores them and prepares the targets exactly as with the local engine.
- update: worker r receives the targets of its rows (advantages or pairs: O(B) numbers) and trains on the
  trajectories it kept. Mini-batches are the interleaved rows m, m+M, … of the batch, so with (B/N) % M == 0 each
  global mini-batch is the union of the workers' local ones; each worker scales its loss by the mini-batch's global
  count, FSDP2 sums the gradients, and the optimizer step equals the local engine's up to float reduction order.
- save/load: every worker writes and reads its shards with torch.distributed.checkpoint, in the one checkpoint
  format of every engine (checkpoint/state.py): a run moves between engines and worker counts.

A failure on any worker (an exception, or a process that died) stops every worker and raises on the driver with the
worker's rank, host and traceback; the trainer then publishes no checkpoint for the step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tensordict import is_tensorclass

from diffusion_rl.algorithms.base import Targets, make_algorithm
from diffusion_rl.data.condition_images import ConditionImage
from diffusion_rl.data.sampler import StepPrompts
from diffusion_rl.engine.local import health_problem, sample_ids
from diffusion_rl.engine.placement import place_units
from diffusion_rl.engine.sharded_worker import ShardedWorker, WorkerError
from diffusion_rl.engine.worker import UpdatePlan
from diffusion_rl.errors import UserError
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.trajectory import Generated
from diffusion_rl.sampling.window import SdeWindow
from diffusion_rl.utils.split import split_evenly

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 5.0  # after a first failure, how long to wait for the others (to name a dead worker as the cause)


def combine_worker_metrics(results: Sequence[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from the workers' update metrics: `*_max` the max, `*_min` the min, the rest the mean, each
    over the workers that report the key (a worker whose units only pad reports no loss). Every worker has as many
    rows and micro-batches, so the mean of their means is the global mean; the mean of their maxima would not be
    the global maximum."""
    reduce = {"_max": max, "_min": min}
    combined = {}
    for name in dict.fromkeys(key for r in results for key in r):
        values = [r[name] for r in results if name in r]
        combine = reduce.get(name[-4:])
        combined[name] = combine(values) if combine else sum(values) / len(values)
    return combined


def payload_bytes(obj) -> int:
    """Bytes of what a value carries: tensors and arrays by their data, an object reference as nothing (its data
    stays in the object store), other values by their pickled size."""
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return int(obj.nbytes)
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    if type(obj).__name__ == "ObjectRef":
        return 0
    if is_tensorclass(obj):
        return sum(payload_bytes(v) for v in obj.to_tensordict().values(include_nested=True, leaves_only=True))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(payload_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return len(pickle.dumps(obj))


class DriverTraffic:
    """Bytes the driver sent to and received from the workers since the last update (`driver/bytes_out|in`)."""

    def __init__(self):
        self.bytes_in = self.bytes_out = 0

    def sent(self, calls) -> None:
        self.bytes_out += payload_bytes(calls)

    def received(self, results) -> None:
        self.bytes_in += payload_bytes(results)

    def step_metrics(self) -> dict[str, float]:
        metrics = {"driver/bytes_in": float(self.bytes_in), "driver/bytes_out": float(self.bytes_out)}
        self.bytes_in = self.bytes_out = 0
        return metrics


class WorkerDied(RuntimeError):
    """A worker process ended (killed, out of memory, node lost) while the engine needed it."""


# A local cluster of our own listens on loopback only. Ray turns a node address of 127.0.0.1 into the machine's
# reachable one unless "clusters" are off, which keeps every Ray server (GCS, raylets, workers, the runtime-env
# agent) on loopback; with nothing reachable from outside, Ray's token authentication is left off too (it would
# only write ~/.ray/auth_token and warn). Read by Ray when it is first imported.
LOCAL_CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def import_ray(local: bool = False):
    """Ray, imported for a local cluster on loopback (see LOCAL_CLUSTER_ENV) or for one joined at an address."""
    if local and "ray" not in sys.modules:
        for key, value in LOCAL_CLUSTER_ENV.items():
            os.environ.setdefault(key, value)
    try:
        import ray
    except ImportError:
        raise UserError("engine.kind=ray needs Ray: pip install 'diffusion-rl[ray]'") from None
    return ray


def ensure_ray(engine_cfg) -> None:
    """Connect to Ray once per process: the cluster at engine.address, or a new local one (on loopback) when null."""
    local = engine_cfg.address is None
    ray = import_ray(local)
    if ray.is_initialized():
        return
    start = time.perf_counter()
    ray.init(address=engine_cfg.address, include_dashboard=False, logging_level=logging.WARNING)
    if local and ray.util.get_node_ip_address() != "127.0.0.1":
        logger.warning(
            "the local Ray cluster listens on %s, not loopback only: Ray was imported before diffusion-rl could "
            "set %s; set them in the environment to keep it local",
            ray.util.get_node_ip_address(),
            ", ".join(f"{k}={v}" for k, v in LOCAL_CLUSTER_ENV.items()),
        )
    logger.info(
        "Ray %s in %.1f s: %s",
        "joined" if engine_cfg.address else "started",
        time.perf_counter() - start,
        ray.cluster_resources(),
    )


class RayEngine:
    def __init__(self, cfg):
        self.cfg = cfg
        e = cfg.engine
        start = time.perf_counter()
        ensure_ray(e)
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size = e.num_workers
        self.failed: str | None = None
        self.held: list[list[int]] = [[] for _ in range(self.world_size)]  # the rows each worker keeps, in order
        self.held_step: int | None = None
        self.algorithm = make_algorithm(cfg)  # its unit_rows: how an update's rows go together (DPO: pairs)
        self.traffic = DriverTraffic()
        bundle = {"CPU": e.cpus_per_worker, **({"GPU": e.gpus_per_worker} if e.gpus_per_worker else {})}
        # one bundle per worker, reserved all at once: either every worker can start or none does
        self._group = placement_group([bundle] * self.world_size, strategy="PACK")
        if not self._wait_ready(self._group, e.start_timeout_s):
            remove_placement_group(self._group)
            raise UserError(
                f"engine: {self.world_size} workers × {bundle} do not fit in the Ray cluster within "
                f"{e.start_timeout_s:.0f} s (it has {ray.cluster_resources()}); lower engine.num_workers, "
                "engine.cpus_per_worker or engine.gpus_per_worker, or add nodes"
            )
        threads = max(1, int(e.cpus_per_worker))  # engine.num_threads is the trainer process's
        actor = ray.remote(ShardedWorker)
        self.workers = [
            actor.options(
                num_cpus=e.cpus_per_worker,
                num_gpus=e.gpus_per_worker,
                max_restarts=0,  # a rank cannot rejoin a process group: a lost worker stops the run
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=rank),
            ).remote(rank, self.world_size, threads)
            for rank in range(self.world_size)
        ]
        self.where = [f"worker rank {r}" for r in range(self.world_size)]
        infos = self._call("info")
        self.where = [f"worker rank {i['rank']} on {i['host']} (pid {i['pid']})" for i in infos]
        self.pids = [i["pid"] for i in infos]
        if e.address is None:  # one machine: rendezvous through a file, so no store listens on a socket
            self._rendezvous_dir = tempfile.TemporaryDirectory(prefix="diffusion_rl_rendezvous_")
            address = f"file://{self._rendezvous_dir.name}/store"
        else:
            address = self._gather([self.workers[0].rendezvous_address.remote()], ranks=[0])[0]
        started = time.perf_counter()
        self._call("setup", cfg, address)
        self.startup_seconds = time.perf_counter() - start
        logger.info(
            "Ray engine: %d workers ready in %.1f s (actors up in %.1f s, process group + sharded model in %.1f s)",
            self.world_size,
            self.startup_seconds,
            started - start,
            time.perf_counter() - started,
        )

    @staticmethod
    def _wait_ready(group, timeout_s: float) -> bool:
        ray = import_ray()
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        return bool(ready)

    @property
    def model(self):
        raise AttributeError(
            "the Ray engine's model lives sharded in its workers; use trainable_state_dict() for its weights"
        )

    # -- the engine interface ---------------------------------------------------------------------------------
    def generate(
        self, prompts: StepPrompts, step: int, window: SdeWindow | None, rows: Sequence[int] | None = None
    ) -> Generated:
        """Rollouts of the step's prompt instances (or of `rows` of them), each sampled by the worker owning it;
        the workers keep the trajectories, the driver gets the images (in the order of `rows`)."""
        rows = list(range(len(prompts))) if rows is None else [int(i) for i in rows]
        shares = self._hold(len(prompts), rows, step)
        texts, negative, images = prompts.prompts, prompts.negative_prompts, prompts.condition_images
        per_rank = [
            ([texts[i] for i in s], [negative[i] for i in s], sample_ids(prompts, s), step, window,
             [images[i] for i in s])
            for s in shares
        ]  # fmt: skip
        generated = self._call("generate", per_rank=per_rank)
        return torch.cat([generated[r] for r in range(self.world_size) if shares[r]])  # shares follow `rows`' order

    def keep_offline(self, prompts: StepPrompts, latents: torch.Tensor, step: int) -> None:
        shares = self._hold(len(prompts), list(range(len(prompts))), step)
        negative = prompts.negative_prompts
        per_rank = [
            ([prompts.prompts[i] for i in s], [negative[i] for i in s], sample_ids(prompts, s), latents[s], step)
            for s in shares
        ]
        self._call("keep_offline", per_rank=per_rank)

    def _hold(self, batch_size: int, rows: list[int], step: int) -> list[list[int]]:
        """The part of `rows` each worker samples and keeps: worker r owns rows [r·B/N, (r+1)·B/N) of the step."""
        if self.held_step != step:
            self.held, self.held_step = [[] for _ in range(self.world_size)], step
        owned = [set(share) for share in split_evenly(range(batch_size), self.world_size)]
        shares = [[i for i in rows if i in mine] for mine in owned]
        for held, share in zip(self.held, shares):
            held.extend(share)
        return shares

    def update(self, targets: Targets, step: int) -> dict[str, float]:
        """Data-parallel update: the units (rows, or DPO's pairs) spread evenly over the workers, each trained where
        its rows are or with its rows sent there worker to worker; each worker gets the targets of its rows (O(B)
        numbers). Metrics combined over workers, with the driver's traffic of the step."""
        if self.held_step != step:
            raise RuntimeError(f"update of step {step}: the workers keep no rollout of that step")
        shares, pad_to = place_units(self.algorithm.unit_rows(targets), self.held)
        exports = {  # (source, destination) → the rows' trajectories, in the object store: never on the driver
            (source, dest): self.workers[source].export_rows.remote(step, [self.held[source].index(r) for r in rows])
            for dest, share in enumerate(shares)
            for source, rows in share.imported.items()
        }
        per_rank = []
        for w, share in enumerate(shares):
            keep = [self.held[w].index(r) for r in share.local]
            imported = [exports[source, w] for source in sorted(share.imported)]
            plan = UpdatePlan(keep=keep, imported=imported, pad_to=pad_to, padding_only=share.padding_only)
            per_rank.append((targets[torch.tensor(share.rows, dtype=torch.long)], step, plan))
        self.held_step = None
        metrics = combine_worker_metrics(self._call("update", per_rank=per_rank))
        metrics.update(self.traffic.step_metrics())
        return metrics

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] → latents [B, …] (the VAE is whole on every worker: the first one encodes)."""
        return self._gather([self.workers[0].encode_images.remote(images)], ranks=[0])[0]

    def sample_images(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        seeds: Sequence[int],
        settings: SamplerSettings,
        use_ema: bool = True,
        images: Sequence[Sequence[ConditionImage]] | None = None,
    ) -> torch.Tensor:
        shares = split_evenly(list(range(len(prompts))), self.world_size)
        samples = self._call(
            "sample_images",
            per_rank=[
                ([prompts[i] for i in s], [negative[i] for i in s], [seeds[i] for i in s], settings, use_ema,
                 None if images is None else [images[i] for i in s])
                for s in shares
            ],
        )  # fmt: skip
        return torch.cat(samples)

    def save(self, directory: Path) -> dict:
        """Every worker writes its shards into `directory` (the trainer's temp dir, published when all returned);
        returns the plain state (LR schedule, counters: the same on every worker) for the trainer's state.pt."""
        return self._call("save", str(Path(directory).resolve()))[0]

    def load(self, directory: Path, state: dict) -> None:
        self._call("load", str(Path(directory).resolve()), state)

    def health_problem(self) -> str | None:
        reports = self._call("health")  # (consecutive skips, this rank's shards finite) per worker
        return health_problem(reports[0][0], all(finite for _, finite in reports))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained policy's full weights on the driver (names as PolicySet.trainable_state_dict)."""
        return self._call("trainable_state_dict")[0]

    def worker_cpu_seconds(self) -> list[float]:
        """CPU time each worker's process has used so far, by rank (a measure of work that CPU contention leaves
        alone, unlike wall-clock time)."""
        return [info["cpu_s"] for info in self._call("info")]

    def close(self) -> None:
        """Stop the workers and free their resources (the Ray session stays up for other engines)."""
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group

        for worker in getattr(self, "workers", []):
            ray.kill(worker, no_restart=True)
        self.workers = []
        if getattr(self, "_group", None) is not None:
            remove_placement_group(self._group)
            self._group = None
        if getattr(self, "_rendezvous_dir", None) is not None:
            self._rendezvous_dir.cleanup()
            self._rendezvous_dir = None

    # -- calls and failures --------------------------------------------------------------------------------------
    def _call(self, method: str, *args, per_rank: Sequence[tuple] | None = None) -> list:
        """Call `method` on every worker (with `args`, or per_rank[r] on worker r); their results by rank."""
        if self.failed:
            raise RuntimeError(f"the Ray engine stopped after a worker failure ({self.failed}); start a new run")
        calls = [per_rank[rank] if per_rank is not None else args for rank in range(len(self.workers))]
        self.traffic.sent(calls)
        refs = [getattr(worker, method).remote(*call) for worker, call in zip(self.workers, calls)]
        results = self._gather(refs, ranks=list(range(len(refs))))
        self.traffic.received(results)
        return results

    def _gather(self, refs: list, ranks: list[int]) -> list:
        """Results by position; the first failure stops every worker and raises (not a wait on a hung collective)."""
        ray = import_ray()
        rank_of = dict(zip(refs, ranks))
        results: dict[int, object] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                results[rank_of[ready[0]]] = ray.get(ready[0])
            except Exception as error:
                self._fail(rank_of[ready[0]], error, pending, rank_of)
        return [results[r] for r in ranks]

    def _fail(self, rank: int, error: Exception, pending: list, rank_of: dict) -> None:
        """Kill every worker (the others may wait in a collective for the failed one) and raise the root cause."""
        ray = import_ray()
        errors = {rank: error}
        # a worker killed mid-collective makes the others fail too (peer gone): unless this is the death itself, give
        # Ray a moment to report it, so the message names the dead worker rather than a survivor's broken connection
        grace = 0.0 if isinstance(error, ray.exceptions.RayActorError) or not pending else FAILURE_GRACE_S
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as other:
                errors[rank_of[ref]] = other
        died = {r: e for r, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)}
        root_rank, root = next(iter(died.items())) if died else (rank, error)
        self.failed = f"{self.where[root_rank]}: {type(root).__name__}"
        self.close()
        others = [f"{self.where[r]}: {_short(e)}" for r, e in errors.items() if r != root_rank]
        also = ("\nalso failed: " + "; ".join(others)) if others else ""
        if isinstance(root, ray.exceptions.RayActorError):
            raise WorkerDied(f"{self.where[root_rank]} died: {_short(root)}{also}") from None
        cause = getattr(root, "cause", None)
        if isinstance(cause, WorkerError):
            raise cause.for_driver(also) from None
        raise RuntimeError(f"{self.where[root_rank]} failed: {root}{also}") from root


def _short(error: Exception) -> str:
    cause = getattr(error, "cause", None)
    if isinstance(cause, WorkerError):
        return f"{cause.kind}: {cause.message}"
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
