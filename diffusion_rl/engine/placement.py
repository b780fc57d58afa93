"""Which worker trains which units of an update, and which rows must move between workers for it (engine/ray.py).

Each actor keeps the rows it sampled: a trainer (colocated) or a rollout actor (engine.rollout=separate), the
"sources" 0..N−1 being the N trainers and N.. the rollout actors. An update's units (a row for most algorithms, a
(chosen, rejected) pair of rows for DPO) are spread so that every trainer trains as many units as the others (up
to one), and a unit stays, when it can, on the trainer that holds all its rows; a unit whose rows are elsewhere
moves them actor to actor. Every trainer then pads its units to the largest share with weight-0 copies, so that
all take the same passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diffusion_rl.errors import UserError
from diffusion_rl.utils.split import split_evenly

# engine config fields to lower, per resource, in the message of a layout that cannot fit
_KNOBS = {"CPU": "engine.cpus_per_worker / cpus_per_rollout_worker (fractions are fine)",
          "GPU": "engine.gpus_per_worker / gpus_per_rollout_worker"}  # fmt: skip


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


def layout_demand(engine_cfg) -> list[tuple[str, int, dict[str, float]]]:
    """(actor kind, count, what each reserves) of the Ray engine's layout: the trainers, then any rollout actors."""
    from diffusion_rl.engine.ray_cluster import bundles

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
        from diffusion_rl.engine.ray_cluster import import_ray

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
