"""Ray for the engine: joining or starting a cluster, groups of actors called together, and what a failure becomes.

- `ensure_ray(engine)`: connect once per process, to engine.address or to a new local cluster on loopback only.
- `ActorGroup`: actors of one kind (the trainers, or the rollout actors) started in one placement group, so that
  either all of them fit or none starts; `call` runs a method on all (or some) of them and gathers the results. The
  first failure of any stops the whole group (the others may be waiting in a collective for the failed one) and
  raises on the driver: `WorkerDied` when a process died (killed, out of memory, node lost), the worker's own
  exception otherwise, with its rank, host and traceback.
- `DriverTraffic`: the bytes the driver sends to and receives from actors (`driver/bytes_out|in`).
- `check_layout_fits`: a layout that needs more of a resource than the cluster has is refused in one line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
from tensordict import is_tensorclass

from diffusion_rl.engine.sharded_worker import WorkerError
from diffusion_rl.errors import UserError

logger = logging.getLogger(__name__)

FAILURE_GRACE_S = 5.0  # after a first failure, how long to wait for the others (to name a dead worker as the cause)

# A local cluster of our own listens on loopback only. Ray turns a node address of 127.0.0.1 into the machine's
# reachable one unless "clusters" are off, which keeps every Ray server (GCS, raylets, workers, the runtime-env
# agent) on loopback; with nothing reachable from outside, Ray's token authentication is left off too (it would
# only write ~/.ray/auth_token and warn). Read by Ray when it is first imported.
LOCAL_CLUSTER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


class WorkerDied(RuntimeError):
    """An actor's process ended (killed, out of memory, node lost) while the engine needed it. `group` names which
    actors ("trainer" or "rollout"): the trainer recovers from it (engine.max_failures)."""

    def __init__(self, message: str, group: str = "trainer"):
        super().__init__(message)
        self.group = group


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
    """Bytes the driver sent to and received from the actors since the last update (`driver/bytes_out|in`);
    thread-safe (rollouts may be sampled ahead in a background thread)."""

    def __init__(self):
        self.bytes_in = self.bytes_out = 0
        self._lock = threading.Lock()

    def sent(self, calls) -> None:
        size = payload_bytes(calls)
        with self._lock:
            self.bytes_out += size

    def received(self, results) -> None:
        size = payload_bytes(results)
        with self._lock:
            self.bytes_in += size

    def step_metrics(self) -> dict[str, float]:
        with self._lock:
            metrics = {"driver/bytes_in": float(self.bytes_in), "driver/bytes_out": float(self.bytes_out)}
            self.bytes_in = self.bytes_out = 0
        return metrics


def bundles(count: int, cpus: float, gpus: float, extra: dict[str, float]) -> list[dict[str, float]]:
    """One placement-group bundle per actor: its CPUs, GPUs and any extra resources (e.g. a node label)."""
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **extra}
    return [dict(bundle) for _ in range(count)]


# engine config fields to lower, per resource, in the message of a layout that cannot fit
_KNOBS = {"CPU": "engine.cpus_per_worker / cpus_per_rollout_worker (fractions are fine)",
          "GPU": "engine.gpus_per_worker / gpus_per_rollout_worker"}  # fmt: skip


def layout_demand(engine_cfg) -> list[tuple[str, int, dict[str, float]]]:
    """(actor kind, count, what each reserves) of the Ray engine's layout: the trainers, then any rollout actors."""
    e = engine_cfg
    groups = [("trainer", e.num_workers, bundles(1, e.cpus_per_worker, e.gpus_per_worker, e.trainer_resources)[0])]
    if e.rollout == "separate":
        each = bundles(1, e.cpus_per_rollout_worker, e.gpus_per_rollout_worker, e.rollout_resources)[0]
        groups.append(("rollout actor", e.rollout_workers, each))
    return groups


def check_layout_fits(engine_cfg, cluster: dict[str, float] | None = None) -> None:
    """A UserError in one line when the layout needs more of a resource than the Ray cluster has in all (`cluster`:
    ray.cluster_resources(), asked of the connected Ray when None): no placement group would ever be ready, so
    there is no point waiting engine.start_timeout_s for one."""
    if cluster is None:
        cluster = import_ray().cluster_resources()
    groups = layout_demand(engine_cfg)
    short = []
    for resource in dict.fromkeys(k for _, _, each in groups for k in each):
        parts = [(kind, count, each[resource]) for kind, count, each in groups if each.get(resource)]
        need, have = sum(count * amount for _, count, amount in parts), float(cluster.get(resource, 0.0))
        if need > have + 1e-9:
            terms = " + ".join(
                f"{count} {kind}{'s' if count > 1 else ''} × {amount:g}" for kind, count, amount in parts
            )
            knob = _KNOBS.get(resource, "engine.trainer_resources / rollout_resources")
            short.append(f"{need:g} {resource} ({terms}) but the cluster has {have:g}: lower {knob}")
    if short:
        raise UserError(
            f"engine: the Ray layout needs {'; and '.join(short)}, or engine.num_workers / rollout_workers, or add "
            "nodes"
        )


class ActorGroup:
    """`count` actors of `cls`, one per bundle of one placement group, each made with `args(rank)`.

    `group` ("trainer" or "rollout") and `role` ("worker rank", "rollout actor") name them in errors; `env`: variables
    their processes start with (utils/omp.py's child_env).
    """

    def __init__(self, cls, count: int, bundle_list: list[dict], args, *, group: str, role: str, start_timeout_s,
                 traffic: DriverTraffic, concurrency_groups: dict[str, int] | None = None,
                 env: dict[str, str] | None = None):  # fmt: skip
        ray = import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.group, self.role, self.traffic = group, role, traffic
        self.failed: str | None = None
        self._placement = placement_group(bundle_list, strategy="PACK")
        ready, _ = ray.wait([self._placement.ready()], timeout=start_timeout_s)
        if not ready:
            remove_placement_group(self._placement)
            self._placement = None
            raise UserError(
                f"engine: {count} {group} actors × {bundle_list[0]} do not fit in the Ray cluster within "
                f"{start_timeout_s:.0f} s (it has {ray.cluster_resources()}); ask for fewer or smaller actors, or "
                "add nodes"
            )
        actor = ray.remote(concurrency_groups=concurrency_groups)(cls) if concurrency_groups else ray.remote(cls)
        self.actors = []
        for rank, bundle in enumerate(bundle_list):
            self.actors.append(
                actor.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")} or None,
                    max_restarts=0,  # a lost actor is replaced by the engine (its whole group), not restarted by Ray
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement, rank),
                    runtime_env={"env_vars": env} if env else None,  # set when the process starts (OpenMP's policy)
                ).remote(*args(rank))
            )
        self.where = [f"{role} {r}" for r in range(count)]
        infos = self.call("info")
        self.where = [f"{role} {i['rank']} on {i['host']} (pid {i['pid']})" for i in infos]
        self.pids = [i["pid"] for i in infos]
        self.nodes = [i["node"] for i in infos]

    def __len__(self) -> int:
        return len(self.actors)

    def submit(self, method: str, *args, per_rank: Sequence[tuple] | None = None, ranks: Sequence[int] | None = None,
               concurrency_group: str | None = None) -> tuple[list, list[int]]:  # fmt: skip
        """Start `method` on the actors `ranks` (default all), with `args` or per_rank[i] on the i-th of them;
        returns (their object references, the ranks)."""
        if self.failed:
            raise RuntimeError(f"the {self.group} actors stopped after a failure ({self.failed})")
        ranks = list(range(len(self.actors))) if ranks is None else list(ranks)
        calls = [per_rank[i] if per_rank is not None else args for i in range(len(ranks))]
        self.traffic.sent(calls)
        refs = []
        for rank, call in zip(ranks, calls):
            bound = getattr(self.actors[rank], method)
            if concurrency_group is not None:
                bound = bound.options(concurrency_group=concurrency_group)
            refs.append(bound.remote(*call))
        return refs, ranks

    def call(self, method: str, *args, per_rank: Sequence[tuple] | None = None, ranks: Sequence[int] | None = None,
             concurrency_group: str | None = None) -> list:  # fmt: skip
        """`submit`, then wait for every result; results in the order of `ranks`."""
        refs, ranks = self.submit(method, *args, per_rank=per_rank, ranks=ranks, concurrency_group=concurrency_group)
        results = self.gather(refs, ranks)
        self.traffic.received(results)
        return results

    def gather(self, refs: list, ranks: list[int]) -> list:
        """Results by position; the first failure stops every actor of the group and raises (not a wait on a hung
        collective)."""
        ray = import_ray()
        rank_of = dict(zip(refs, ranks))
        results: dict = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                results[ready[0]] = ray.get(ready[0])
            except Exception as error:
                self._fail(rank_of[ready[0]], error, pending, rank_of)
        return [results[ref] for ref in refs]

    def _fail(self, rank: int, error: Exception, pending: list, rank_of: dict) -> None:
        """Kill every actor of the group (the others may wait in a collective for the failed one) and raise the
        root cause."""
        ray = import_ray()
        errors = {rank: error}
        # an actor killed mid-collective makes the others fail too (peer gone): unless this is the death itself,
        # give Ray a moment to report it, so the message names the dead actor rather than a survivor's broken link
        grace = 0.0 if isinstance(error, ray.exceptions.RayActorError) or not pending else FAILURE_GRACE_S
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=grace)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as other:
                errors[rank_of[ref]] = other
        died = {r: e for r, e in errors.items() if isinstance(e, ray.exceptions.RayActorError) or _lost_rows(e)}
        root_rank, root = next(iter(died.items())) if died else (rank, error)
        self.failed = f"{self.where[root_rank]}: {type(root).__name__}"
        self.kill()
        others = [f"{self.where[r]}: {_short(e)}" for r, e in errors.items() if r != root_rank]
        also = ("\nalso failed: " + "; ".join(others)) if others else ""
        if died:
            what = "lost the rows it was to train (their rollout actor died)" if _lost_rows(root) else "died"
            raise WorkerDied(f"{self.where[root_rank]} {what}: {_short(root)}{also}", self.group) from None
        cause = getattr(root, "cause", None)
        if isinstance(cause, WorkerError):
            raise cause.for_driver(also) from None
        raise RuntimeError(f"{self.where[root_rank]} failed: {root}{also}") from root

    def kill(self) -> None:
        """Stop the actors and free their placement group."""
        ray = import_ray()
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._placement is not None:
            remove_placement_group(self._placement)
            self._placement = None


def _lost_rows(error: Exception) -> bool:
    """A trainer's update failed because the rows it was to fetch from a rollout actor died with that actor."""
    cause = getattr(error, "cause", None)
    return isinstance(cause, WorkerError) and cause.kind == "RowsLost"


def _short(error: Exception) -> str:
    cause = getattr(error, "cause", None)
    if isinstance(cause, WorkerError):
        return f"{cause.kind}: {cause.message}"
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
