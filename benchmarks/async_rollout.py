"""Colocated workers against separate rollout actors sampling one step ahead, on the Ray engine, printed as ratios.

Settings, each on the same machine and batch:
- colocated, 1 worker: sample, score, update one after the other (the phases: timing/generate, reward, update);
- colocated, 2 workers: each samples and trains half of the batch;
- separate, 1 trainer + 1 rollout actor, max_staleness 0 (synchronous) and 1 (the next step is sampled and
  scored while the update runs).
The step time of each is compared with max(rollout, update) of the colocated single worker, where rollout =
sample + score: what a perfect overlap would take. "hidden" is the share of the shorter phase that sampling ahead
took off the colocated step: (colocated − async) / min(rollout, update).

Two workloads: `slow_reward` (a judge that waits --wait-ms per image, as a VLM or reward server would) and
`balanced` (the JPEG reward; sampling steps chosen so that rollout and update cost about the same).

    python benchmarks/async_rollout.py [--steps 4] [--wait-ms 40] [--json]

Every actor gets one core and one torch thread (OMP_WAIT_POLICY=PASSIVE: ENVIRONMENT-NOTES).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ray_setup import ROOT  # noqa: E402,I001 -- first: the environment before torch and Ray

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.models.tiny import save_tiny  # noqa: E402
from diffusion_rl.trainer.trainer import Trainer  # noqa: E402

SLOW_JUDGE = """
import time

import numpy as np


def reward(images, prompts, metadata):
    time.sleep({wait} * len(images))
    return images.reshape(len(images), -1).mean(axis=1).astype(np.float32) / 255
"""
SETTINGS = {
    "colocated_1": ("engine.num_workers=1",),
    "colocated_2": ("engine.num_workers=2",),
    "separate_sync": ("engine.num_workers=1", "engine.rollout=separate", "engine.max_staleness=0"),
    "separate_async": ("engine.num_workers=1", "engine.rollout=separate", "engine.max_staleness=1"),
}


def run(overrides: list[str], steps: int) -> dict:
    """Mean step time over `steps` steps after a warm-up step, with the phase times of those steps."""
    trainer = Trainer(load(str(ROOT / "configs/quickstart_flow_grpo.yaml"), overrides))
    try:
        trainer.train_step(0)
        times, phases = [], {}
        for step in range(1, steps + 1):
            start = time.perf_counter()
            metrics = trainer.train_step(step)
            times.append(time.perf_counter() - start)
            for key in ("timing/generate", "timing/reward", "timing/update", "timing/sampled_ahead"):
                phases.setdefault(key, []).append(metrics.get(key, 0.0))
        trainer.source.discard_ahead()
    finally:
        trainer.engine.close()
    return {"step_s": statistics.mean(times), **{k: statistics.mean(v) for k, v in phases.items()}}


def workload(name: str, common: list[str], steps: int) -> dict:
    results = {setting: run([*common, *extra], steps) for setting, extra in SETTINGS.items()}
    base = results["colocated_1"]
    rollout = base["timing/generate"] + base["timing/reward"]
    update = base["timing/update"]
    ideal = max(rollout, update)
    summary = {
        "rollout_s": rollout,
        "update_s": update,
        "ideal_overlap_s": ideal,
        "hidden_fraction": (base["step_s"] - results["separate_async"]["step_s"]) / min(rollout, update),
    }
    for setting, r in results.items():
        summary[f"{setting}_step_s"] = r["step_s"]
        summary[f"{setting}_over_ideal"] = r["step_s"] / ideal
    return {"name": name, "summary": summary, "runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="timed steps per setting, after one warm-up step")
    parser.add_argument("--wait-ms", type=float, default=40.0, help="the slow judge's wait per image")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    out = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            model = save_tiny(tmp / "model", "sd3", "base", seed=0)
            judge = tmp / "judge.py"
            judge.write_text(SLOW_JUDGE.format(wait=args.wait_ms / 1000))
            common = [f"model.path={model}", f"run.dir={tmp / 'run'}", "run.resume=never", "val.every=0",
                      "val.before_train=false", "log.progress_bar=false", "log.console_every=0",
                      "engine.kind=ray", "engine.cpus_per_worker=1", "engine.cpus_per_rollout_worker=1",
                      "data.prompts_per_step=4", "data.group_size=4",
                      f"train.total_steps={args.steps + 2}"]  # fmt: skip
            out.append(workload("slow_reward", [*common, f"rewards.0.name={judge}:reward"], args.steps))
            out.append(workload("balanced", [*common, "sampling.num_steps=16"], args.steps))
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(out, indent=1))
        return
    for w in out:
        s = w["summary"]
        print(f"{w['name']}: rollout (sample + score) {s['rollout_s']:.3f} s, update {s['update_s']:.3f} s, "
              f"ideal overlap {s['ideal_overlap_s']:.3f} s")  # fmt: skip
        for setting in SETTINGS:
            print(f"  {setting:15s} {s[f'{setting}_step_s']:.3f} s/step = {s[f'{setting}_over_ideal']:.2f}× ideal")
        print(f"  sampling ahead hid {100 * s['hidden_fraction']:.0f} % of the shorter phase")


if __name__ == "__main__":
    main()
