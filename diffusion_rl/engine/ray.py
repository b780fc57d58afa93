"""The Ray engine: `engine.num_workers` trainer actors with the transformer FSDP2-sharded over them, and with
engine.rollout=separate a pool of `engine.rollout_workers` rollout actors beside them.

The driver (the trainer's process) holds no model. It splits each call over the actors and gathers the results:
- generate: colocated, trainer r owns rows [r·B/N, (r+1)·B/N) of the step's batch; each call's rows (a chunk, or
  all) go to their owners, which all-gather the transformer once, sample their rows, keep the trajectories and
  return only the images (and which rows are finite): the driver scores them and prepares the targets exactly as
  with the local engine. Separate, rollout actor r owns rows [r·B/R, (r+1)·B/R) and samples them with the weights
  last pushed to it, stamping each row with their version.
- update: each trainer receives the targets of its rows (advantages or pairs: O(B) numbers) and trains on the
  rows it kept or fetched from the actor that holds them, worker to worker through the object store, never through
  the driver (`place_units` says which). Mini-batches are the interleaved rows m, m+M, … of the batch, so with
  (B/N) % M == 0 each global mini-batch is the union of the workers' local ones; each worker scales its loss by the
  mini-batch's global count, FSDP2 sums the gradients, and the optimizer step equals the local engine's up to
  float reduction order. Separate: then the new weights go to the rollout actors (every engine.sync_every steps;
  engine/weight_sync.py), versioned by the steps they have taken.
- save/load: every trainer writes and reads its shards with torch.distributed.checkpoint, in the one checkpoint
  format of every engine (checkpoint/state.py): a run moves between engines and worker counts. Rollout actors hold
  no state: after a load they get the loaded weights before they next sample.

Calls may come from two driver threads at once (the trainer samples later steps in the background when
engine.max_staleness > 0): generate uses only the rollout actors, update only the trainers, and the shared
bookkeeping is locked.

A failure stops the actors of its group and raises on the driver, naming the actor (engine/ray_cluster.py); the
trainer then publishes no checkpoint, and when a process died it recovers (`restart`, `restart_rollouts`).

Which trainer trains which units of an update (`place_units`): each actor keeps the rows it sampled, a trainer
(colocated) or a rollout actor (engine.rollout=separate), the "sources" 0..N−1 being the N trainers and N.. the
rollout actors. An update's units (a row for most algorithms, a
(chosen, rejected) pair of rows for DPO) are spread so that every trainer trains as many units as the others (up
to one), and a unit stays, when it can, on the trainer that holds all its rows; a unit whose rows are elsewhere
moves them actor to actor. Every trainer then pads its units to the largest share with weight-0 copies, so that
all take the same passes.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffusion_rl.algorithms.credit import Targets
from diffusion_rl.config.engine import EngineConfig
from diffusion_rl.data.condition_images import ConditionImage
from diffusion_rl.data.sampler import StepPrompts
from diffusion_rl.engine.ray_cluster import (
    ActorGroup,
    DriverTraffic,
    WorkerDied,
    actor_env,
    bundles,
    check_layout_fits,
    ensure_ray,
)
from diffusion_rl.engine.sharded_worker import IO_GROUP, RolloutWorker, ShardedWorker
from diffusion_rl.engine.spec import WorkerSpec
from diffusion_rl.engine.worker import UpdatePlan, health_problem
from diffusion_rl.metrics import reduce_metrics
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.trajectory import Generated
from diffusion_rl.sampling.window import SdeWindow
from diffusion_rl.utils.split import chunks_of_shares, split_evenly

logger = logging.getLogger(__name__)


@dataclass
class WorkerShare:
    """One worker's part of an update."""

    local: list[int] = field(default_factory=list)  # the step's rows this worker holds and trains, in its order
    imported: dict[int, list[int]] = field(default_factory=dict)  # source → the rows it sends here
    padding_only: bool = False  # no unit of its own: its rows are a copy of another worker's unit, weight 0

    @property
    def rows(self) -> list[int]:
        """The step's rows this worker trains on, in the order its update sees them: local, then imported."""
        return self.local + [row for source in sorted(self.imported) for row in self.imported[source]]


def place_units(
    unit_rows: list[list[int]], held: list[list[int]], trainers: int | None = None
) -> tuple[list[WorkerShare], int]:
    """Each of the `trainers` workers' share of the units (whose rows are `unit_rows`), given the rows `held[s]`
    source s sampled (trainers first; default: every source is a trainer), and the number of units every worker
    pads to."""
    workers = len(held) if trainers is None else trainers
    owner = {row: s for s, rows in enumerate(held) for row in rows}
    quota = [len(share) for share in split_evenly(range(len(unit_rows)), workers)]
    assigned: list[list[int]] = [[] for _ in range(workers)]
    leftover = []
    for u, rows in enumerate(unit_rows):  # first, units that can stay where all their rows are
        home = owner[rows[0]]
        if home < workers and all(owner[r] == home for r in rows) and len(assigned[home]) < quota[home]:
            assigned[home].append(u)
        else:
            leftover.append(u)
    for u in leftover:  # then the rest, to a worker with room, preferring one that holds some of their rows
        room = [w for w in range(workers) if len(assigned[w]) < quota[w]]
        w = max(room, key=lambda w: sum(owner[r] == w for r in unit_rows[u]))
        assigned[w].append(u)
    pad_to = max(quota) if unit_rows else 0
    shares = []
    for w in range(workers):
        units = sorted(assigned[w])
        padding_only = not units and bool(unit_rows)
        if padding_only:
            units = [0]  # a copy of the first unit, trained with weight 0
        share = WorkerShare(padding_only=padding_only)
        rows = [r for u in units for r in unit_rows[u]]
        local = set(rows) & set(held[w])
        share.local = [r for r in held[w] if r in local]  # in the order this worker holds them
        for r in rows:
            if owner[r] != w:
                share.imported.setdefault(owner[r], []).append(r)
        shares.append(share)
    return shares, pad_to


class RayEngine:
    def __init__(self, engine: EngineConfig, spec: WorkerSpec):
        """`engine`: the config's engine section (the cluster, the actors, the weight sync); `spec`: what each
        worker is built from (the rollout actors get its `for_rollout()`)."""
        self.engine, self.spec = engine, spec
        e = engine
        start = time.perf_counter()
        ensure_ray(e)
        check_layout_fits(e)  # a layout the cluster can never hold fails now, not after start_timeout_s
        self.algorithm = spec.algorithm.build()  # its unit_rows: how an update's rows go together (DPO: pairs)
        self.traffic = DriverTraffic()
        self._lock = threading.Lock()
        # step → the rows each source keeps, in its order; sources are the trainers 0..N−1, then rollout actors
        self.held: dict[int, list[list[int]]] = {}
        self._dirs: list[tempfile.TemporaryDirectory] = []
        self.trainers = self._start_trainers()
        self.world_size = len(self.trainers)
        self.rollouts: ActorGroup | None = None
        if e.rollout == "separate":
            self._start_rollouts()
        self.startup_seconds = time.perf_counter() - start
        logger.info("Ray engine ready in %.1f s: %d trainers%s", self.startup_seconds, self.world_size,
                    f", {len(self.rollouts)} rollout actors" if self.rollouts else "")  # fmt: skip

    def _rendezvous(self, name: str, sender: ActorGroup) -> str:
        """Where a group of processes meets: a file on one machine (no socket listens), else a free TCP port on the
        node of `sender`'s rank 0."""
        if self.engine.address is None:
            directory = tempfile.TemporaryDirectory(prefix=f"diffusion_rl_{name}_")
            self._dirs.append(directory)
            return f"file://{directory.name}/store"
        return sender.call("rendezvous_address", ranks=[0])[0]

    def _start_trainers(self) -> ActorGroup:
        e = self.engine
        threads = max(1, int(e.cpus_per_worker))  # engine.num_threads is the trainer process's
        trainers = ActorGroup(ShardedWorker, e.num_workers,
                              bundles(e.num_workers, e.cpus_per_worker, e.gpus_per_worker, e.trainer_resources),
                              lambda rank: (rank, e.num_workers, threads), group="trainer", role="worker rank",
                              start_timeout_s=e.start_timeout_s, traffic=self.traffic,
                              env=actor_env(e))  # fmt: skip
        trainers.call("setup", self.spec, self.engine, self._rendezvous("rendezvous", trainers))
        return trainers

    def _start_rollouts(self) -> None:
        e = self.engine
        threads = max(1, int(e.cpus_per_rollout_worker))
        self.rollouts = ActorGroup(RolloutWorker, e.rollout_workers,
                                   bundles(e.rollout_workers, e.cpus_per_rollout_worker, e.gpus_per_rollout_worker,
                                           e.rollout_resources),
                                   lambda rank: (rank, threads), group="rollout", role="rollout actor",
                                   start_timeout_s=e.start_timeout_s, traffic=self.traffic,
                                   concurrency_groups={IO_GROUP: 2}, env=actor_env(e))  # fmt: skip
        self.rollouts.call("setup", self.spec.for_rollout())
        self.weights_version: int | None = None  # the version the rollout actors hold; None: push before sampling
        self._loading: list = []  # the last object-store push's loads, checked at the next push
        if e.weight_sync == "broadcast":
            address = self._rendezvous("weights", self.trainers)
            gpus = e.gpus_per_worker > 0 and e.gpus_per_rollout_worker > 0
            world, timeout = len(self.rollouts) + 1, e.collective_timeout_s
            refs, _ = self.trainers.submit("join_channel", address, world, "nccl" if gpus else "gloo", timeout,
                                           ranks=[0])  # fmt: skip
            self.rollouts.call("join_channel", address, world, "nccl" if gpus else "gloo", timeout)
            self.rollouts.call("expect_weights", self.trainers.gather(refs, [0])[0])

    @property
    def model(self):
        raise AttributeError(
            "the Ray engine's model lives sharded in its workers; use trainable_state_dict() for its weights"
        )

    @property
    def max_staleness(self) -> int:
        """Later steps the trainer may sample while an update runs (engine.max_staleness; 0 when colocated)."""
        return self.engine.max_staleness if self.rollouts is not None else 0

    # -- the engine interface ---------------------------------------------------------------------------------
    def sampling_chunks(self, rows: int, parts: int) -> list[list[int]]:
        """Each chunk a piece of every sampling actor's rows, so that all of them sample in every chunk (contiguous
        chunks of contiguously owned rows would leave all but one or two of them idle, and load those with a whole
        chunk each)."""
        return chunks_of_shares(rows, len(self.trainers if self.rollouts is None else self.rollouts), parts)

    def generate(
        self, prompts: StepPrompts, step: int, window: SdeWindow | None, rows: Sequence[int] | None = None
    ) -> Generated:
        """Rollouts of the step's prompt instances (or of `rows` of them), each sampled by the actor owning it;
        the actors keep the trajectories, the driver gets the images (in the order of `rows`)."""
        rows = list(range(len(prompts))) if rows is None else [int(i) for i in rows]
        if self.rollouts is None:
            group, offset = self.trainers, 0
        else:
            self._ensure_weights(step)
            group, offset = self.rollouts, self.world_size
        owned = [set(share) for share in split_evenly(range(len(prompts)), len(group))]
        shares = [[i for i in rows if i in mine] for mine in owned]
        # colocated, every trainer joins the all-gather, with rows or without; a rollout actor only when it has rows
        ranks = [r for r in range(len(group)) if shares[r] or self.rollouts is None]
        per_rank = [(prompts.select(shares[r]), step, window) for r in ranks]
        generated = group.call("generate", per_rank=per_rank, ranks=ranks)
        with self._lock:
            held = self.held.setdefault(step, [[] for _ in range(self.world_size + len(self.rollouts or []))])
            for r in ranks:
                held[offset + r].extend(shares[r])
        return torch.cat([g for r, g in zip(ranks, generated) if shares[r]])  # shares follow `rows`' order

    def keep_offline(self, prompts: StepPrompts, latents: torch.Tensor, step: int) -> None:
        shares = split_evenly(list(range(len(prompts))), self.world_size)
        per_rank = [(prompts.select(s), latents[s], step) for s in shares]
        self.trainers.call("keep_offline", per_rank=per_rank)
        with self._lock:
            self.held[step] = [list(s) for s in shares]

    def update(self, targets: Targets, step: int) -> dict[str, float]:
        """Data-parallel update: the units (rows, or DPO's pairs) spread evenly over the trainers, each trained where
        its rows are or with its rows sent there actor to actor; each trainer gets the targets of its rows (O(B)
        numbers). Metrics combined over trainers, with the driver's traffic and the weight push of the step."""
        with self._lock:
            held = self.held.pop(step, None)
            self.held = {s: h for s, h in self.held.items() if s > step}  # what an interrupted step left
        if held is None:
            raise RuntimeError(f"update of step {step}: the workers keep no rollout of that step")
        shares, pad_to = place_units(self.algorithm.unit_rows(targets), held, trainers=self.world_size)
        exports = {}  # (source, destination) → the rows' trajectories, in the object store: never on the driver
        for dest, share in enumerate(shares):
            for source, rows in share.imported.items():
                positions = [held[source].index(r) for r in rows]
                if source < self.world_size:
                    exports[source, dest] = self.trainers.submit("export_rows", step, positions, ranks=[source])[0][0]
                else:
                    exports[source, dest] = self.rollouts.submit("export_rows", step, positions,
                                                                 ranks=[source - self.world_size],
                                                                 concurrency_group=IO_GROUP)[0][0]  # fmt: skip
        per_rank = []
        for w, share in enumerate(shares):
            keep = [held[w].index(r) for r in share.local]
            imported = [exports[source, w] for source in sorted(share.imported)]
            plan = UpdatePlan(keep=keep, imported=imported, pad_to=pad_to, padding_only=share.padding_only,
                              staleness_bound=self.engine.staleness_bound)  # fmt: skip
            per_rank.append((targets[torch.tensor(share.rows, dtype=torch.long)], step, plan))
        metrics = reduce_metrics(self.trainers.call("update", per_rank=per_rank))
        if self.rollouts is not None:
            self.rollouts.call("release", step, concurrency_group=IO_GROUP)
            if (step + 1) % self.engine.sync_every == 0:
                metrics.update(self._push_weights(version=step + 1))
        metrics.update(self.traffic.step_metrics())
        return metrics

    # -- weights for the rollout actors ---------------------------------------------------------------------------
    def _ensure_weights(self, step: int) -> None:
        """Before sampling: the rollout actors hold some version of the trained weights (after a start or a load,
        the current ones, as version `step`)."""
        with self._lock:
            missing = self.weights_version is None
        if missing:
            self._push_weights(version=step)

    def _push_weights(self, version: int) -> dict[str, float]:
        """The sampling policy's weights from the trainers to every rollout actor, as `version`. Object store: the
        trainers wait only for the put; the actors load before their next call. Broadcast: both sides wait."""
        start = time.perf_counter()
        if self.engine.weight_sync == "object_store":
            if self._loading:  # the previous push's loads: a failure there surfaces now
                self.rollouts.gather(*self._loading)
            ref, sent = self.trainers.call("put_rollout_weights")[0]
            self._loading = list(self.rollouts.submit("load_weights", [ref], version))
        else:
            trainer_refs, trainer_ranks = self.trainers.submit("broadcast_rollout_weights")
            rollout_refs, rollout_ranks = self.rollouts.submit("receive_weights", version)
            try:
                self.rollouts.gather(rollout_refs, rollout_ranks)
            except WorkerDied as died:  # trainer rank 0 waits in the broadcast for the dead actor: a lost group
                self.trainers.kill()
                raise WorkerDied(f"{died} (during a weight broadcast: the trainers stop too)", "trainer") from None
            sent = self.trainers.gather(trainer_refs, trainer_ranks)[0]
        with self._lock:
            self.weights_version = version
        seconds = time.perf_counter() - start
        logger.debug("weights of version %d pushed in %.3f s", version, seconds)
        return {"timing/weight_push": seconds, "rollout/weights_version": float(version), "sync/bytes": float(sent)}

    # -- everything else runs on the trainers ---------------------------------------------------------------------
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] → latents [B, …] (the VAE is whole on every worker: the first one encodes)."""
        return self.trainers.call("encode_images", images, ranks=[0])[0]

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
        samples = self.trainers.call(
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
        return self.trainers.call("save", Path(directory).resolve())[0]

    def load(self, directory: Path, state: dict) -> None:
        self.trainers.call("load", Path(directory).resolve(), state)
        with self._lock:
            self.weights_version = None  # the rollout actors get the loaded weights before they next sample

    def health_problem(self) -> str | None:
        return health_problem(self.trainers.call("health"))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained policy's full weights on the driver (names as PolicySet.trainable_state_dict)."""
        return self.trainers.call("trainable_state_dict")[0]

    def worker_cpu_seconds(self) -> list[float]:
        """CPU time each actor's process has used so far: the trainers by rank, then the rollout actors (a measure
        of work that CPU contention leaves alone, unlike wall-clock time)."""
        groups = [self.trainers] + ([self.rollouts] if self.rollouts is not None else [])
        return [info["cpu_s"] for group in groups for info in group.call("info")]

    # -- recovery -------------------------------------------------------------------------------------------------
    def restart(self) -> None:
        """Fresh actors for all of it (a trainer died: its process group is gone): the caller loads a checkpoint."""
        self.close()
        self.__init__(self.engine, self.spec)

    def restart_rollouts(self) -> None:
        """Fresh rollout actors (one died; the trainers are intact): they get the trainers' weights before they
        next sample, and the step whose rows were lost is sampled again."""
        if self.rollouts is not None:
            self.rollouts.kill()
        with self._lock:
            self.held = {}
        self._start_rollouts()

    def close(self) -> None:
        """Stop the actors and free their resources (the Ray session stays up for other engines)."""
        for group in (getattr(self, "rollouts", None), getattr(self, "trainers", None)):
            if group is not None:
                group.kill()
        for directory in getattr(self, "_dirs", []):
            directory.cleanup()
        self._dirs = []
