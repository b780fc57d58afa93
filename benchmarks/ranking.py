"""Ranking at equal compute: every algorithm trains the ShapesWorld model for the same FLOPs, in seed shards.

    python benchmarks/ranking.py --plan               # the shards, their runs, the compute each needs, done or not
    python benchmarks/ranking.py --shard 0            # run (or resume) shard 0 → results/ranking/shard_0.json
    python benchmarks/ranking.py --table [--append-results]    # the table from whatever shard files exist
    python benchmarks/ranking.py --wallclock          # seconds per FLOP vs Flow-GRPO (a quiet machine only)

Budget: every run trains until its cumulative FLOPs (the project's own count: `perf/flops_per_step`, engine/flops.py —
rollout with text encoders, transformer and VAE decode, plus the update's forwards and backwards) reach
BUDGET_FLOPS; it stops at the first step whose cumulative count reaches it, so two runs differ by less than one step's
FLOPs. The count is the same on every machine, so a run's result depends on its seed, not on the machine's speed or
load: shards can run in the background (`nice -n 19`, OMP_WAIT_POLICY=PASSIVE) and on different machines.

Shards (a paired design): shard s runs every algorithm at seed s. The selection shards (--select-seeds, default 0 and
1) run each algorithm at the learning rates of --lrs, a log grid; an algorithm's rate is the one with the highest
training reward (the mean over each run's last third of compute, averaged over the selection shards; validation is
never read). While that best rate is an end of the grid, the grid grows by one rate past it at its own factor, up to
--extend rates (ranking_rates.py), so a chosen rate is bracketed or the table says it is not. The other shards run
each algorithm at its chosen rate, so they wait for the selection shards (an algorithm whose every selection run
failed has no rate, and they leave it out, saying so); the table reads the report shards only
(the selection shards' runs chose the rate). --set overrides every config, --pg-set only the policy-gradient ones
that train every SDE step (the recipe's training window; a config with its own window keeps it). Every finished run
is kept at <out>/runs/shard_<s>/<algorithm>_lr<rate>.json
(resumable: kept runs are skipped, and <out>/settings.json stops a run under other settings before any work, as a
--shard outside 0 … --shards − 1 does); several processes may
run one shard on one machine at once (`--threads 1` each): a run in progress holds a claim file, and each process
takes the next run nobody holds (the base-model validation too: one measures it, the others wait). When the shard's
last run ends, all of them go into <out>/shard_<s>.json with the machine, CPU time and the shard's shared base-model
validation, and the kept files are removed.

Validation (fixed seeds, ODE, `shapes_geneval`, all 78 held-out prompts): the base model's once per shard (every run
starts from it; once per validation setting — DiffusionNFT validates without CFG) on VAL_N samples per prompt (1,092
images, SE ≤ 0.01); at VAL_FRACTIONS of the budget on VAL_N_SUBSET samples per prompt (312 images, SE ≈ 0.017); at
the end on VAL_N again. Each point keeps its SE. The table (benchmarks/ranking_table.py) is recomputed from the shard
files; the wall-clock ratio (benchmarks/ranking_wallclock.py) is measured apart.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning  # noqa: E402
from claims import boot_id, claim  # noqa: E402
from learning import (  # noqa: E402
    ROOT,
    build_config,
    ensure_base_model,
    selection_reward,
    skip_reason,
    training_reward,
    validation_point,
    write_json,
)
from ranking_rates import grid_centre, log_factor, parse_lrs, selection_grid  # noqa: E402
from ranking_table import choices, choose_lr, load_shards  # noqa: E402

from diffusion_rl.errors import UserError  # noqa: E402

logger = logging.getLogger("ranking")

# The compute budget of one run, in FLOPs counted by engine/flops.py: what Flow-GRPO spends in 3 minutes of training
# time on the quiet machine. On that machine (2026-11-22, load 1.35 at the start; benchmarks/results/
# learning_seed1.json) Flow-GRPO made 186 steps in 180.2 s of training time on this task (0.969 s/step; the seed-0
# run beside other work made 155). Its counted FLOPs per step on the task (configs/quickstart_flow_grpo.yaml with
# SHAPES: 2 prompts × 4, 10 SDE steps with CFG 4.5, 32 px; every step the same shapes, so the same count) are
# 106,983,550,976 (`python benchmarks/ranking.py --measure-step-flops`, 2026-11-26: the count depends on the
# architecture and shapes only, not on the weights or the machine). Budget = 186 × that ≈ 1.99e13 FLOPs, exact in
# float64, so Flow-GRPO stops after exactly 186 steps.
FLOW_GRPO_QUIET_STEPS = 186
FLOPS_PER_STEP_FLOW_GRPO = 106_983_550_976
BUDGET_FLOPS = float(FLOW_GRPO_QUIET_STEPS * FLOPS_PER_STEP_FLOW_GRPO)
LRS = "/3,x1,x3"  # a half-decade either side of the task's rate (3e-5: 1e-5, 3e-5, 9e-5)
SELECT_SEEDS = "0,1"
EXTEND = 3  # rates a selection grid may grow by past an end where its best rate sits (ranking_rates.py)
SHARDS = 7  # --plan's default: 5 report seeds (2–6) for the table, beside the 2 selection shards
VAL_N = 14  # 78 × 14 = 1,092 images: the base model's per-image sd 0.292 (+10 %) gives SE ≤ 0.01 (RESULTS.md)
VAL_N_SUBSET = 4  # intermediate points: 78 × 4 = 312 images, SE ≈ 0.017
VAL_FRACTIONS = (0.25, 0.5, 0.75)  # intermediate validation points, as fractions of the budget
OUT = ROOT / "benchmarks/results/ranking"
CLAIM_POLL_S = 30.0  # how often a process waiting for another's base-model validation looks for it


def run_for_flops(trainer, budget: float, point, base: dict, fractions=VAL_FRACTIONS, val_n: int = VAL_N,
                  subset_n: int = VAL_N_SUBSET) -> dict:  # fmt: skip
    """Train until the cumulative perf/flops_per_step reaches `budget` (the step that reaches it is the last one);
    the curve: `base` (the shared base-model validation) at 0, a subset validation (subset_n per prompt) after the
    first step at or past each of `fractions` × budget (one for a step that passes several; none at the end), and
    a full one (val_n) at the end. x of a point: its cumulative FLOPs and their fraction of the budget."""
    curve = [{"flops": 0.0, "fraction": 0.0, **base, "shared": True}]
    flops, step, pending, per_step, train_curve = 0.0, 0, list(fractions), [], []
    alerts, first_alert = None, None  # the guard's alerts so far (guard/alerts_total; None with the guard off)
    train_s, cpu_start = 0.0, time.process_time()
    while flops < budget:
        start = time.perf_counter()
        metrics = trainer.train_step(step)
        train_s += time.perf_counter() - start
        step += 1
        counted = metrics.get("perf/flops_per_step")
        if not counted:
            raise RuntimeError(f"step {step} logged no perf/flops_per_step (log.flops must stay on)")
        flops += counted
        per_step.append(counted)
        if training_reward(metrics) is not None:
            train_curve.append((flops, training_reward(metrics)))
        if "guard/alerts_total" in metrics:
            alerts = int(metrics["guard/alerts_total"])
            first_alert = step if first_alert is None and alerts else first_alert
        crossed = False
        while pending and flops >= pending[0] * budget:
            pending.pop(0)
            crossed = True
        if crossed and flops < budget:
            curve.append({"flops": flops, "fraction": flops / budget, **point(step, subset_n)})
            logger.info("  step %4d, %.2f of the budget: val %.4f (SE %.3f)", step, flops / budget,
                        curve[-1]["val_reward"], curve[-1]["se"])  # fmt: skip
    curve.append({"flops": flops, "fraction": flops / budget, **point(step, val_n)})
    logger.info("  end, step %d: val %.4f (SE %.4f)", step, curve[-1]["val_reward"], curve[-1]["se"])
    return {
        "steps": step,
        "flops": flops,
        "flops_per_step": {"first": per_step[0], "last": per_step[-1], "mean": flops / step},
        "train_seconds": round(train_s, 2),
        "cpu_seconds": round(time.process_time() - cpu_start, 1),
        "val_reward_start": base["val_reward"],
        "val_reward_end": curve[-1]["val_reward"],
        "selection_reward": selection_reward(train_curve),
        "curve": curve,
        "train_curve": train_curve,
        "guard_alerts": alerts,  # a gain the guard flags (reward hacking) is read beside the reward, not as it
        "first_alert_step": first_alert,
    }


def trains_every_sde_step(cfg) -> bool:
    """A policy-gradient config that trains every SDE step (it sets no window of its own): --pg-set applies to it."""
    from diffusion_rl.config.plugins import loss_spec

    return cfg.sampling.window.kind == "all" and loss_spec(cfg.algorithm.loss).algorithm.family == "policy_gradient"


def validation_key(cfg) -> str:
    """What a base-model validation depends on besides the model: the val section and the sampling settings it
    falls back to. Runs with the same key share the shard's base validation."""
    s = cfg.sampling
    fields = {"val": asdict(cfg.val), "guidance": s.guidance, "size": [s.height, s.width], "solver": s.ode_solver}
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


class Benchmark:
    """The algorithms, the task and where results go; `settings` must match every kept run's and shard file's."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out_dir).resolve()
        self.model_dir = Path(args.model).resolve()
        found = learning.algorithm_configs(args.only.split(",") if args.only else None)
        self.configs, self.skipped = {}, {}
        task_info = {"size": 32, "text_tokens": 16}  # neither skip reasons nor rates read the model: none is needed yet
        self.own_sets: dict[str, list[str]] = {}  # the --pg-set overrides, for the configs they apply to
        for name, path in found.items():
            cfg = build_config(path, self.out / "unused", self.namespace(0, []), self.model_dir, task_info)
            if args.pg_set and trains_every_sde_step(cfg):
                self.own_sets[name] = list(args.pg_set)
                cfg = build_config(path, self.out / "unused", self.namespace(0, [], name), self.model_dir, task_info)
            why = skip_reason(cfg, shapes=True)
            if why:
                self.skipped[name] = why
            else:
                self.configs[name] = (path, parse_lrs(args.lrs, grid_centre(path, cfg)))
        try:  # the rates as each algorithm runs them: a mix of factors and rates is checked as it resolves
            for _, lrs in self.configs.values() if args.extend else ():
                if len(lrs) > 1:
                    log_factor(lrs)
        except ValueError as e:
            raise UserError(f"--lrs {args.lrs}: {e}; a grid that grows past an end needs one (or --extend 0)") from None
        self.budget = args.budget_flops
        self.select_seeds = args.select_seeds
        self._model_hash = None
        self.settings = {"budget_flops": self.budget, "val_fractions": list(VAL_FRACTIONS), "val_n": args.val_n,
                         "val_n_subset": args.val_n_subset, "lrs": args.lrs, "select_seeds": list(self.select_seeds),
                         "extend": args.extend, "algorithms": sorted(self.configs), "set": list(args.set),
                         "pg_set": list(args.pg_set)}  # fmt: skip
        if args.shape_weight:  # absent when 0, as in the runs made before it existed
            self.settings["shape_weight"] = args.shape_weight
        if args.plan or args.shard is not None:
            self.check_settings()  # before any work: settings.json of other settings, or unreadable, stops here
        self.info = None if args.plan else ensure_base_model(self.model_dir)  # may copy the shipped one

    def namespace(self, seed: int, extra: list[str], name: str | None = None):
        """The overrides of algorithm `name`'s runs at `seed`: --set, its --pg-set where they apply, the held-out
        validation, then `extra`."""
        heldout = self.model_dir / "shapes_prompts" / "heldout.jsonl"  # every held-out prompt (78)
        own = self.own_sets.get(name, []) if name else []
        return argparse.Namespace(
            seed=seed,
            threads=self.args.threads,
            shape_weight=self.args.shape_weight,
            set=[*self.args.set, *own, f"val.prompts={heldout}", f"val.n={self.args.val_n}", *extra],
        )

    def check_settings(self) -> None:
        """<out>/settings.json must hold this run's settings (written when absent, but by a plan)."""
        kept = self.out / "settings.json"
        if kept.is_file():
            try:
                before = json.loads(kept.read_text())
            except ValueError as e:
                before = e
            if not isinstance(before, dict):
                raise UserError(f"{kept} is empty or not the settings of the runs in {self.out} ({before}): restore "
                                "it, or give another --out-dir")  # fmt: skip
            if before != self.settings:  # a key either side lacks (--shape-weight left out) differs too
                changed = sorted(k for k in {*before, *self.settings} if before.get(k) != self.settings.get(k))
                sys.exit(f"{self.out} holds runs made with other settings ({', '.join(changed)} differ: {kept}); "
                         "give another --out-dir, or delete it to start again")  # fmt: skip
        elif not self.args.plan:
            write_json(kept, self.settings)

    def shard_file(self, s: int) -> Path:
        return self.out / f"shard_{s}.json"

    def kept_dir(self, s: int) -> Path:
        return self.out / "runs" / f"shard_{s}"

    def chosen_lrs(self) -> dict[str, float | None]:
        """algorithm → its rate chosen on the selection shards' files (None until all of them are finished). Once they
        are, an algorithm with no rate (every selection run failed: no_rate) is left out: there is nothing to report."""
        picked, left_out = self._picked()
        return {name: picked.get(name, {}).get("chosen_lr") for name in self.configs if name not in left_out}

    def no_rate(self) -> list[str]:
        """The algorithms whose every selection run failed, once the selection shards are all finished."""
        return self._picked()[1]

    def _picked(self) -> tuple[dict[str, dict], list[str]]:
        """ranking_table.choices of the selection shards' files, read once, and the algorithms with no rate."""
        picked = choices([s for s in load_shards(self.out) if s["shard"] in self.select_seeds])
        return picked, [name for name in self.configs if picked.get(name, {}).get("no_rate")]

    def selection_means(self, name: str) -> dict[float, float | None]:
        """rate → the mean selection reward of algorithm `name`'s runs at it, for the rates finished on every
        selection seed (kept run files and finished selection shards both count)."""
        runs = [(shard["shard"], r) for shard in load_shards(self.out) if shard["shard"] in self.select_seeds
                for r in shard["runs"] if r["algorithm"] == name]  # fmt: skip
        for s in self.select_seeds:
            runs += [(s, json.loads(p.read_text())) for p in self.kept_dir(s).glob(f"{name}_lr*.json")]
        by_lr: dict[float, dict[int, dict]] = {}
        for s, r in runs:
            by_lr.setdefault(r["lr"], {})[s] = r
        done = {lr: list(rs.values()) for lr, rs in by_lr.items() if set(rs) >= set(self.select_seeds)}
        return {lr: choose_lr({lr: rs})[1][f"{lr:.3g}"] for lr, rs in done.items()}

    def selection_grids(self) -> dict[str, tuple[list[float], bool]]:
        """algorithm → (its selection rates so far, whether its grid is final: ranking_rates.selection_grid)."""
        return {name: selection_grid(lrs, self.selection_means(name), self.args.extend)
                for name, (_, lrs) in self.configs.items()}  # fmt: skip

    def shard_runs(self, s: int) -> list[tuple[str, float | None]]:
        """(algorithm, rate) of each run of shard s; a report shard's rate is None while it is not chosen yet."""
        if s in self.select_seeds:
            return [(name, lr) for name, (lrs, _) in self.selection_grids().items() for lr in lrs]
        return list(self.chosen_lrs().items())

    def run_path(self, s: int, name: str, lr: float) -> Path:
        return self.kept_dir(s) / f"{name}_lr{lr:.3g}.json"

    def model_hash(self) -> str:
        """sha256 of the base model's transformer weights: which pretraining a run started from (pretraining is
        deterministic on one machine, not across CPUs)."""
        if self._model_hash is None:
            digest = hashlib.sha256()
            for path in sorted((self.model_dir / "transformer").glob("*.safetensors")):
                digest.update(path.read_bytes())
            self._model_hash = digest.hexdigest()[:16]
        return self._model_hash

    def base_validation(self, s: int, key: str, point) -> dict:
        """The base model's full validation for the validation setting `key`, measured once per shard and kept. A
        process sharing the shard waits while another measures it (its claim file) instead of measuring it too."""
        path = self.kept_dir(s) / f"base_{key}.json"
        held, waiting = path.with_suffix(".claim"), False
        while not path.is_file():
            holder = claim(held)
            if holder is None:
                try:
                    if path.is_file():  # measured by the process that held it until a moment ago
                        break
                    logger.info("shard %d: base-model validation (%d per prompt)", s, self.args.val_n)
                    base = {**point(0, self.args.val_n), "base_model_sha256": self.model_hash()}
                    write_json(path, base)
                    return base
                finally:
                    held.unlink()
            if not waiting:
                logger.info("shard %d: waiting for the base-model validation that %s is measuring", s, holder)
                waiting = True
            time.sleep(CLAIM_POLL_S)
        return json.loads(path.read_text())

    def check_kept_model(self, s: int) -> None:
        """Kept runs and base validations of shard s must come from this base model (another machine's pretraining
        can differ in the last bits): a mismatch stops rather than mixing two base models in one shard."""
        for path in sorted(self.kept_dir(s).glob("*.json")):
            kept = json.loads(path.read_text()).get("base_model_sha256")
            if kept != self.model_hash():
                sys.exit(
                    f"{path} was made from another base model (transformer sha256 {kept}, now "
                    f"{self.model_hash()} at {self.model_dir}): use that model, or delete {self.kept_dir(s)}"
                )

    def run_one(self, s: int, name: str, lr: float) -> dict:
        from diffusion_rl.trainer import make_trainer

        path = self.configs[name][0]
        started, cpu = time.perf_counter(), time.process_time()
        logger.info("shard %d: %s at lr %.3g", s, name, lr)
        record = {"algorithm": name, "config": str(path.relative_to(ROOT)), "lr": lr, "seed": s,
                  "base_model_sha256": self.model_hash()}  # fmt: skip
        try:
            with tempfile.TemporaryDirectory() as tmp:  # its run dir: validation images, thrown away
                cfg = build_config(
                    path, Path(tmp), self.namespace(s, [f"train.lr={lr}"], name), self.model_dir, self.info
                )
                import torch

                key = validation_key(cfg)  # before training: validation sets cfg.val.n as it goes
                torch.manual_seed(s)
                trainer = make_trainer(cfg)
                point = validation_point(trainer)
                base = self.base_validation(s, key, point)
                result = run_for_flops(trainer, self.budget, point, base, VAL_FRACTIONS, self.args.val_n,
                                       self.args.val_n_subset)  # fmt: skip
                record.update(loss=cfg.algorithm.loss, batch=cfg.batch_size, validation=key, **result)
        except Exception as e:  # a broken algorithm is recorded, and the shard goes on
            logger.error("shard %d: %s lr %.3g failed: %s", s, name, lr, e)
            record.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=5))
        record.update(wall_seconds=round(time.perf_counter() - started, 1),
                      process_cpu_seconds=round(time.process_time() - cpu, 1),
                      machine={**learning.machine(), "boot": boot_id()})  # fmt: skip
        return record

    def run_shard(self, s: int) -> Path:
        """Run shard s's runs not kept yet; when all are kept, gather them into its shard file."""
        if self.shard_file(s).is_file():
            sys.exit(f"shard {s} is finished: {self.shard_file(s)}")
        runs = self.shard_runs(s)
        waiting = [name for name, lr in runs if lr is None]
        if waiting:
            seeds = ", ".join(map(str, self.select_seeds))
            sys.exit(f"shard {s} runs each algorithm at its chosen rate: finish the selection shards {seeds} first "
                     f"({len(waiting)} algorithms have no rate)")  # fmt: skip
        for name in self.no_rate():
            logger.warning("shard %d: %s has no rate (every run of its selection failed: %s): not run", s, name,
                           ", ".join(str(t) for t in self.select_seeds))  # fmt: skip
        self.check_kept_model(s)
        seen: set[tuple[str, float]] = set()
        while new := [run for run in runs if run not in seen]:  # a selection grid grows as its runs finish
            seen.update(new)
            for name, lr in new:
                self.run_kept(s, name, lr)
            runs = self.shard_runs(s)
        running = [f"{name} lr {lr:.3g}" for name, lr in runs if not self.run_path(s, name, lr).is_file()]
        if running:
            sys.exit(f"shard {s}: {', '.join(running)} still running in another process; the last to end gathers "
                     "the shard file")  # fmt: skip
        if s in self.select_seeds and not all(final for _, final in self.selection_grids().values()):
            sys.exit(f"shard {s}: its runs are kept; the rate grids wait for the other selection shards "
                     f"({', '.join(str(t) for t in self.select_seeds if t != s)}) before they are final")  # fmt: skip
        gathering = self.kept_dir(s) / "gather.claim"
        if claim(gathering):
            sys.exit(f"shard {s}: another process is gathering the shard file")
        if self.shard_file(s).is_file():  # gathered by another process just now: its kept runs are gone
            gathering.unlink()
            with contextlib.suppress(OSError):
                self.kept_dir(s).rmdir()  # the claim made it again
            sys.exit(f"shard {s} is finished: {self.shard_file(s)}")
        return self.gather(s, runs)

    def run_kept(self, s: int, name: str, lr: float) -> None:
        """Run `name` at `lr` in shard s unless it is kept or another process holds it; keep its record."""
        kept = self.run_path(s, name, lr)
        if kept.is_file():
            logger.info("shard %d: %s lr %.3g kept before", s, name, lr)
            return
        held = kept.with_suffix(".claim")
        holder = claim(held)
        if holder:
            logger.info("shard %d: %s lr %.3g is running in %s", s, name, lr, holder)
            return
        try:
            if kept.is_file():  # kept by the process that held it until a moment ago
                return
            write_json(kept, self.run_one(s, name, lr))
        finally:  # kept, or interrupted: either way no longer held
            held.unlink()

    def gather(self, s: int, runs: list[tuple[str, float]]) -> Path:
        kept = [json.loads(self.run_path(s, name, lr).read_text()) for name, lr in runs]
        bases = {p.stem.removeprefix("base_"): json.loads(p.read_text()) for p in self.kept_dir(s).glob("base_*.json")}
        shard = {
            "shard": s,
            "phase": "select" if s in self.select_seeds else "report",
            "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "settings": self.settings,
            "machine": learning.machine(),
            "base_model": {"path": str(self.model_dir), **(self.info or {})},
            "base_validation": bases,
            "cpu_seconds": round(sum(r["process_cpu_seconds"] for r in kept), 1),
            "wall_seconds": round(sum(r["wall_seconds"] for r in kept), 1),
            "runs": kept,
        }
        write_json(self.shard_file(s), shard)
        shutil.rmtree(self.kept_dir(s))
        logger.info("shard %d finished: %s", s, self.shard_file(s))
        return self.shard_file(s)

    def step_flops(self, name: str = "flow_grpo", steps: int = 2) -> list[float]:
        """An algorithm's counted FLOPs of its first `steps` training steps on the task (Flow-GRPO's: what
        BUDGET_FLOPS rests on)."""
        from diffusion_rl.trainer import make_trainer

        path = self.configs[name][0]
        with tempfile.TemporaryDirectory() as tmp:
            cfg = build_config(path, Path(tmp), self.namespace(0, [], name), self.model_dir, self.info)
            trainer = make_trainer(cfg)
            return [trainer.train_step(step)["perf/flops_per_step"] for step in range(steps)]

    def run_state(self, s: int, name: str, lr: float | None) -> str:
        """kept, running (in whom: its claim file) or to do."""
        if lr is None:
            return "to do"
        kept = self.run_path(s, name, lr)
        if kept.is_file():
            return "kept"
        held = kept.with_suffix(".claim")
        return f"running ({held.read_text().strip()})" if held.is_file() else "to do"

    def plan(self, shards: int) -> list[str]:
        """--plan's printout: per shard its runs (done, kept or to do) and the compute they need."""
        chosen = self.chosen_lrs()
        images = 78 * (len(VAL_FRACTIONS) * self.args.val_n_subset + self.args.val_n)
        lines = [f"budget per run: {self.budget:.4g} FLOPs of training (+ < 1 step); validation per run "
                 f"{images} images ({len(VAL_FRACTIONS)} × 78 × {self.args.val_n_subset} + 78 × {self.args.val_n}), "
                 f"base model once per shard and validation setting (78 × {self.args.val_n})"]  # fmt: skip
        total_todo = 0
        for s in range(shards):
            runs = self.shard_runs(s) if s in self.select_seeds else list(chosen.items())
            if self.shard_file(s).is_file():
                status = {r: "done" for r in runs}
            else:
                status = {(n, lr): self.run_state(s, n, lr) for n, lr in runs}
            todo = sum(v not in ("kept", "done") for v in status.values())
            total_todo += todo
            phase = "select" if s in self.select_seeds else "report"
            lines.append(
                f"shard {s} ({phase}, seed {s}): {len(runs)} runs, {todo} to do, "
                f"{len(runs) * self.budget:.4g} training FLOPs, {len(runs) * images} validation images"
            )
            if phase == "select" and self.args.extend:
                lines.append(f"  (so far: a grid whose best rate is at an end grows past it, up to {self.args.extend} "
                             "rates an algorithm)")  # fmt: skip
            for (name, lr), state in status.items():
                rate = f"{lr:.3g}" if lr is not None else "chosen on shards " + "+".join(map(str, self.select_seeds))
                lines.append(f"  {name:<14} lr {rate:<22} {state}")
        for name, why in self.skipped.items():
            lines.append(f"skipped: {name}: {why}")
        for name in self.no_rate():
            lines.append(f"no rate: {name}: every selection run failed (the report shards leave it out)")
        lines.append(f"{total_todo} runs to do: {total_todo * self.budget:.4g} training FLOPs")
        finished = load_shards(self.out)
        runs = sum(len(shard["runs"]) for shard in finished)
        if total_todo and runs:  # a run's CPU time varies by algorithm; a finished shard holds one of each or three
            per_run = sum(shard["cpu_seconds"] for shard in finished) / runs
            cpus = sorted({shard["machine"]["cpu"] for shard in finished})
            lines.append(f"  about {total_todo * per_run / 3600:.1f} CPU-hours at the finished shards' {per_run:.0f} "
                         f"CPU-s per run ({runs} runs on {', '.join(cpus)}; one process per core)")  # fmt: skip
        if total_todo and self.args.calibrate:  # before any shard: timed by a pilot run of Flow-GRPO
            from ranking_wallclock import pilot_seconds_per_run

            per_run, how = pilot_seconds_per_run(Path(self.args.calibrate), self.budget, images, self.step_flops)
            lines.append(f"  about {total_todo * per_run / 3600:.1f} CPU-hours at {per_run:.0f} CPU-s per run, {how}")
        return lines


class OneLineParser(argparse.ArgumentParser):
    """A bad argument is one line (argparse adds the usage): what is wrong, status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--plan", action="store_true", help="print the shards, their runs and compute; run nothing")
    what.add_argument("--shard", type=int, help="run (or resume) this shard")
    what.add_argument("--table", action="store_true", help="the table from the shard files that exist")
    what.add_argument("--wallclock", action="store_true", help="seconds per FLOP vs Flow-GRPO, algorithms alternating")
    what.add_argument("--measure-step-flops", action="store_true", help="each algorithm's counted FLOPs per step")
    parser.add_argument("--shards", type=int, default=SHARDS,
                        help="shards (seeds) in all: --plan lists them, --shard takes 0 … N − 1")  # fmt: skip
    parser.add_argument("--model", default=str(ROOT / "models/shapes"),
                        help="the ShapesWorld base model dir (the shipped one copied there when empty)")  # fmt: skip
    parser.add_argument("--only", default=None, help="comma-separated algorithm names (default: all)")
    parser.add_argument("--out-dir", default=str(OUT), help="shard files, kept runs and the table")
    parser.add_argument("--budget-flops", type=float, default=BUDGET_FLOPS, help="training FLOPs per run")
    parser.add_argument("--lrs", default=LRS, help="learning rates: x or / a factor of the task's train.lr, or a rate")
    parser.add_argument("--select-seeds", default=SELECT_SEEDS, help="the selection shards (seeds), comma-separated")
    parser.add_argument("--extend", type=int, default=EXTEND,
                        help="rates a selection grid may grow by past an end where its best rate sits")  # fmt: skip
    parser.add_argument("--val-n", type=int, default=VAL_N, help="samples per prompt at the base and final points")
    parser.add_argument("--val-n-subset", type=int, default=VAL_N_SUBSET, help="samples per prompt in between")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calibrate", default=None, metavar="JSON",
                        help="--plan: time the runs by this learning.py record of Flow-GRPO at the recipe")  # fmt: skip
    parser.add_argument("--shape-weight", type=float, default=0.0,
                        help="train on shapes_geneval with the outlines weighed in (as learning.py)")  # fmt: skip
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every algorithm (repeatable)")  # fmt: skip
    parser.add_argument("--pg-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the policy-gradient configs that train every SDE step (the recipe's "
                        "training window; configs with their own window keep it)")  # fmt: skip
    parser.add_argument(
        "--append-results",
        action="store_true",
        help="--table: add it to benchmarks/RESULTS.md (replacing the one an earlier run put there)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--wallclock: rounds of every algorithm in turn")
    parser.add_argument("--steps-per-turn", type=int, default=5, help="--wallclock: steps per algorithm per turn")
    args = parser.parse_args(argv)
    try:
        args.select_seeds = tuple(int(t) for t in args.select_seeds.split(","))
    except ValueError:
        parser.error(f"--select-seeds {args.select_seeds}: give seeds as integers, e.g. 0 or 0,1")
    if not 0 <= args.extend <= 8:
        parser.error(f"--extend {args.extend}: give 0 (the grid as given) to 8 rates")
    if not (args.budget_flops and math.isfinite(args.budget_flops) and args.budget_flops > 0):
        parser.error(f"--budget-flops must be > 0, got {args.budget_flops}")
    if args.shard is not None and not 0 <= args.shard < args.shards:
        parser.error(f"--shard {args.shard}: the shards are 0 to {args.shards - 1} (--shards {args.shards}; more "
                     "report seeds: a larger --shards)")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> None:
    """A mistake in the input (a settings file, a --model folder pretraining would replace) is one line, status 2."""
    try:
        run(parse_args(argv))
    except UserError as e:
        print(f"ranking.py: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def run(args: argparse.Namespace) -> None:
    learning.setup_logging(args.threads)
    os.chdir(ROOT)  # the configs name their files relative to the repository root
    if args.table:
        from ranking_table import write_table

        write_table(Path(args.out_dir).resolve(), args.append_results)
        return
    bench = Benchmark(args)
    if args.plan:
        print("\n".join(bench.plan(args.shards)))
    elif args.measure_step_flops:
        print(f"{'algorithm':<14} {'FLOPs/step (steps 1, 2)':>28} {'steps in the budget':>20}")
        measured = {name: bench.step_flops(name) for name in bench.configs}
        for name, (first, second) in measured.items():
            print(f"{name:<14} {first:>13.6g} {second:>13.6g} {math.ceil(bench.budget / second):>20}", flush=True)
        if "flow_grpo" in measured:
            print(
                f"Flow-GRPO × {FLOW_GRPO_QUIET_STEPS} quiet steps = "
                f"{FLOW_GRPO_QUIET_STEPS * measured['flow_grpo'][1]:.6g} FLOPs"
            )
    elif args.wallclock:
        from ranking_wallclock import measure

        measure(bench, args.rounds, args.steps_per_turn)
    else:
        print(bench.run_shard(args.shard))


if __name__ == "__main__":
    main()
