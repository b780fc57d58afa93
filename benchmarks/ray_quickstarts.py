"""Every quickstart config on the Ray engine: colocated workers and separate rollout actors, a few steps each.

For each `configs/quickstart*.yaml` (offline DPO excepted: it needs `prepare pairs` first, and separate rollout
actors refuse it by design, having nothing to sample) and each setting

- `local`: the local engine, the reference;
- `colocated_2`: 2 Ray workers that sample and train their halves;
- `separate_sync`: 2 trainers + 1 rollout actor, max_staleness 0;
- `separate_async`: the same sampling one step ahead (max_staleness 1; rollout correction turns on for the
  policy-gradient family),

it runs `--steps` steps of a reduced batch (2 prompts × 4) on the config's tiny model and prints whether the run
finished, its wall time and its mean training reward. A check that every algorithm and model family runs on every
engine layout, not a speed measurement (the steps are too few to time).

    python benchmarks/ray_quickstarts.py [--steps 3] [--only quickstart_video] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
import traceback
from pathlib import Path

from ray_setup import ROOT  # noqa: E402,I001 -- first: the environment before torch and Ray

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.trainer.trainer import Trainer  # noqa: E402

SETTINGS = {
    "local": (),
    "colocated_2": ("engine.kind=ray", "engine.num_workers=2"),
    "separate_sync": ("engine.kind=ray", "engine.num_workers=2", "engine.rollout=separate", "engine.max_staleness=0"),
    "separate_async": ("engine.kind=ray", "engine.num_workers=2", "engine.rollout=separate", "engine.max_staleness=1"),
}
SKIPPED = {"quickstart_dpo_offline"}
LOCAL_ONLY = {"quickstart_tree"}  # tree rollouts refuse engine.kind=ray (a tree is sampled whole by one worker)


def run(config: Path, setting: tuple[str, ...], workdir: Path, steps: int) -> dict:
    """One reduced run; its status, wall time and mean training reward."""
    overrides = [f"run.dir={workdir / 'run'}", "run.resume=never", "val.every=0", "val.before_train=false",
                 "log.progress_bar=false", "log.console_every=0", "data.prompts_per_step=2", "data.group_size=4",
                 f"train.total_steps={steps}", "engine.cpus_per_worker=1", "engine.cpus_per_rollout_worker=1",
                 *setting]  # fmt: skip
    cfg = load(str(config), overrides)
    # the config's tiny model, created once per config in the shared folder (the quickstarts' own create_tiny rule)
    cfg.model.path = str(workdir.parent / Path(cfg.model.path).name)
    start = time.perf_counter()
    trainer = None
    try:
        trainer = Trainer(cfg)
        rows = trainer.train()
    except Exception as e:  # noqa: BLE001 -- the table reports every failure and goes on
        return {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:200], "trace": traceback.format_exc()}
    finally:
        if trainer is not None and hasattr(trainer.engine, "close"):
            trainer.engine.close()
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    mean = sum(rewards) / len(rewards) if rewards else math.nan
    return {"ok": True, "seconds": time.perf_counter() - start, "reward_mean": mean, "steps": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", default=None, help="one config's stem, e.g. quickstart_video")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import ray

    configs = [c for c in sorted((ROOT / "configs").glob("quickstart*.yaml")) if c.stem not in SKIPPED]
    configs = [c for c in configs if args.only in (None, c.stem)]
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
    results = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for config in configs:
                for name, setting in SETTINGS.items():
                    if config.stem in LOCAL_ONLY and name != "local":
                        continue
                    workdir = Path(tmp) / "models" / f"{config.stem}-{name}"
                    results[f"{config.stem} {name}"] = out = run(config, setting, workdir, args.steps)
                    status = f"{out['seconds']:6.1f} s  reward {out['reward_mean']:+.5f}" if out["ok"] else out["error"]
                    print(f"{config.stem:26s} {name:15s} {status}", flush=True)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps({k: {f: v for f, v in r.items() if f != "trace"} for k, r in results.items()}, indent=1))
    failed = [k for k, r in results.items() if not r["ok"]]
    for k in failed:
        print(f"\n--- {k}\n{results[k]['trace']}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
