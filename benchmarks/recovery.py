"""Time from a SIGKILL of a worker to the end of the first training step after the run recovered by itself.

Two deaths, each in its own run of the quickstart's tiny model on the Ray engine (checkpoint every step):
- a trainer of 2 (colocated): the engine starts fresh actors and resumes from the latest checkpoint;
- the rollout actor (engine.rollout=separate, 1 trainer + 1 rollout actor): new rollout actors, the step again.
Printed with the parts the trainer logs (`timing/recovery`: detecting the death and restarting; then the step),
and the step time of the same run before the kill, for scale.

    python benchmarks/recovery.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from ray_setup import ROOT  # noqa: E402,I001 -- first: the environment before torch and Ray

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.models.tiny import save_tiny  # noqa: E402
from diffusion_rl.trainer.trainer import Trainer  # noqa: E402

KILL_AT = 3  # 0-based: the 4th step starts with the kill
VICTIMS = {
    "trainer": (("engine.num_workers=2",), lambda t: t.engine.trainers.pids[1]),
    "rollout_actor": (("engine.num_workers=1", "engine.rollout=separate"), lambda t: t.engine.rollouts.pids[0]),
}


def measure(overrides: list[str], pid_of) -> dict:
    trainer = Trainer(load(str(ROOT / "configs/quickstart_flow_grpo.yaml"), overrides))
    train_step, marks = trainer.train_step, {}

    def step(index: int):
        if index == KILL_AT and "kill" not in marks:
            marks["kill"] = time.perf_counter()
            os.kill(pid_of(trainer), signal.SIGKILL)
        start = time.perf_counter()
        metrics = train_step(index)
        if index == KILL_AT and "kill" in marks:
            marks["resumed_step_done"] = time.perf_counter()
        else:
            marks.setdefault("steps", []).append(time.perf_counter() - start)
        return metrics

    trainer.train_step = step
    try:
        rows = trainer.train()
    finally:
        trainer.engine.close()
    (row,) = [r for r in rows if "engine/failures" in r]
    return {
        "kill_to_first_step_s": marks["resumed_step_done"] - marks["kill"],
        "timing_recovery_s": row["timing/recovery"],
        "step_s_before": min(marks["steps"]),
        "steps_logged": [r["step"] for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model = save_tiny(tmp / "model", "sd3", "base", seed=0)
            for victim, (extra, pid_of) in VICTIMS.items():
                overrides = [f"model.path={model}", f"run.dir={tmp / victim}", "val.every=0",
                             "val.before_train=false", "log.progress_bar=false", "log.console_every=0",
                             "engine.kind=ray", "engine.cpus_per_worker=1", "data.prompts_per_step=4",
                             "data.group_size=4", "train.total_steps=5", "train.save_every=1", *extra]  # fmt: skip
                results[victim] = measure(overrides, pid_of)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for victim, r in results.items():
        print(f"{victim} killed: first step after the recovery done {r['kill_to_first_step_s']:.1f} s after the kill "
              f"(recovery {r['timing_recovery_s']:.1f} s; a step {r['step_s_before']:.2f} s); steps logged "
              f"{r['steps_logged']}")  # fmt: skip


if __name__ == "__main__":
    main()
