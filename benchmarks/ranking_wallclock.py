"""Wall-clock efficiency apart from the ranking (benchmarks/ranking.py --wallclock; needs a quiet machine).

The ranking gives every algorithm the same FLOPs; how long those FLOPs take differs by algorithm (reward calls,
optimizer steps, what the FLOP count leaves out: elementwise ops, data movement). This measures it once, on one
machine, with every algorithm's trainer built up front and the algorithms taking turns — `steps_per_turn` training
steps each, the order rotated every round — so a change in the machine's load falls on all of them alike. Each
trainer's first step (FLOPs counted under the dispatch mode, slower) is a warm-up and not timed. The result,
<out>/wallclock.json: per algorithm its training seconds per counted FLOP and the ratio to Flow-GRPO's (the total
and per round, to show the spread), which ranking_table.py turns into the reward at Flow-GRPO's wall-clock.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from learning import build_config, machine, write_json
from ranking_table import REFERENCE

logger = logging.getLogger("ranking.wallclock")


def measure(bench, rounds: int, steps_per_turn: int) -> dict:
    """Time every algorithm of `bench` (a ranking.Benchmark) in turns; write and return <out>/wallclock.json."""
    import torch

    from diffusion_rl.trainer import make_trainer

    if REFERENCE not in bench.configs:
        raise SystemExit(f"--wallclock measures against {REFERENCE}: include it in --only")
    chosen = bench.chosen_lrs()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        trainers, steps = {}, {}
        for name, (path, lrs) in bench.configs.items():
            lr = chosen.get(name) or lrs[len(lrs) // 2]  # before the choice: the middle rate, the task's own
            cfg = build_config(path, Path(tmp) / name, bench.namespace(0, [f"train.lr={lr}"]), bench.model_dir,
                               bench.info)  # fmt: skip
            torch.manual_seed(0)
            trainers[name] = make_trainer(cfg)
            trainers[name].train_step(0)  # warm-up, not timed
            steps[name] = 1
        names = list(trainers)
        totals = {name: {"seconds": 0.0, "flops": 0.0, "steps": 0} for name in names}
        per_round = []
        for r in range(rounds):
            this_round = {name: {"seconds": 0.0, "flops": 0.0} for name in names}
            for name in names[r % len(names) :] + names[: r % len(names)]:
                for _ in range(steps_per_turn):
                    start = time.perf_counter()
                    metrics = trainers[name].train_step(steps[name])
                    seconds = time.perf_counter() - start
                    steps[name] += 1
                    for acc in (totals[name], this_round[name]):
                        acc["seconds"] += seconds
                        acc["flops"] += metrics["perf/flops_per_step"]
                    totals[name]["steps"] += 1
            per_round.append(ratios(this_round))
            logger.info("round %d: %s", r, {n: round(v, 3) for n, v in per_round[-1].items()})
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine(), "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "rounds": rounds,
        "steps_per_turn": steps_per_turn,
        "totals": totals,
        "seconds_per_flop": {n: t["seconds"] / t["flops"] for n, t in totals.items()},
        "seconds_per_flop_vs_flow_grpo": ratios(totals),
        "per_round_vs_flow_grpo": per_round,
    }  # fmt: skip
    write_json(bench.out / "wallclock.json", result)
    logger.info("wrote %s", bench.out / "wallclock.json")
    return result


def ratios(times: dict[str, dict]) -> dict[str, float]:
    """name → (its seconds per FLOP) / (Flow-GRPO's): above 1, the same compute takes it longer."""
    per_flop = {n: t["seconds"] / t["flops"] for n, t in times.items()}
    return {n: v / per_flop[REFERENCE] for n, v in per_flop.items()}


def pilot_seconds_per_run(path: Path, budget: float, val_images: int, step_flops) -> tuple[float, str]:
    """A ranking run's seconds timed by a learning.py record of Flow-GRPO at the ranking's recipe (`--plan
    --calibrate`), and how, in words: its seconds per training FLOP × the budget, plus its validation's seconds per
    image × a run's validation images. A step's FLOPs are the record's, else `step_flops()`'s count of Flow-GRPO's
    steps here (a step of the task). Other algorithms spend other seconds per FLOP (--wallclock): it is Flow-GRPO's
    figure for every run."""
    record = json.loads(path.read_text())
    run = next(iter(record["algorithms"].values()))
    flops = run.get("flops_per_step") or step_flops()[-1]
    points = [c for c in run["curve"] if c.get("images")]
    per_image = sum(c["seconds"] for c in points) / sum(c["images"] for c in points)
    per_run = budget / flops * run["seconds_per_step"] + val_images * per_image
    load = record.get("machine", {}).get("load_average_after")
    return per_run, (f"Flow-GRPO's {run['seconds_per_step']:.1f} s a step of {flops:.4g} FLOPs and {per_image:.3f} s "
                     f"a validation image in {path.name} (load after it {load}; one process per core)")  # fmt: skip
