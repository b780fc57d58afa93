"""CPU learning benchmark on ShapesWorld: every algorithm config, the same base model, seed and wall-clock budget.

    python benchmarks/learning.py --budget-minutes 3 [--model models/shapes] [--only flow_grpo,nft]

1. The base model is the ShapesWorld model of `diffusion-rl pretrain configs/shapes_pretrain.yaml` at --model;
   when that directory holds no pretrained model, it is pretrained first (about 15 minutes on 2 cores).
2. Each algorithm config (configs/quickstart.yaml is Flow-GRPO, every configs/quickstart_<name>.yaml another
   algorithm; configs that need an offline dataset are skipped) trains the base model on the ShapesWorld training
   prompts with the `shapes_geneval` reward, keeping its own algorithm settings. Only the task is overridden:
   model, image size, text length, prompts, reward (plus --set overrides, applied to every algorithm).
3. Training time (rollout, reward, update; validation excluded) is capped at the budget. Every
   --val-every-seconds of training time, and at the start and the end, the model samples the held-out
   validation prompts (fixed seeds, ODE) and `shapes_geneval` scores them.

Writes benchmarks/results/learning.json (per algorithm: the validation curve against training seconds, steps,
images/s, the first and last validation reward) and learning.png (validation reward against wall-clock time).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("learning")

REWARD = "shapes_geneval"
# what every algorithm shares on this task, on top of its own config (--set adds more)
COMMON = [
    "model.device=cpu",
    "model.create_tiny_if_missing=null",
    "model.lora.enabled=false",
    "train.save_every=0",
    "val.every=0",
    "val.before_train=false",
    "val.n=4",
    "val.num_steps=10",
    "log.tensorboard=false",
    "log.progress_bar=false",
    "log.console_every=0",
]


def algorithm_configs(only: list[str] | None) -> dict[str, Path]:
    """name → config file: quickstart.yaml is flow_grpo; quickstart_<name>.yaml is <name>."""
    found = {"flow_grpo": ROOT / "configs/quickstart.yaml"}
    for path in sorted((ROOT / "configs").glob("quickstart_*.yaml")):
        found[path.stem.removeprefix("quickstart_")] = path
    if only:
        unknown = sorted(set(only) - set(found))
        if unknown:
            sys.exit(f"--only: unknown algorithm(s) {unknown}; available: {', '.join(found)}")
        found = {name: path for name, path in found.items() if name in only}
    return found


def ensure_base_model(model_dir: Path, threads: int) -> dict:
    from diffusion_rl.pretrain.model import INFO_FILE, read_model_info

    if not (model_dir / INFO_FILE).is_file():
        from diffusion_rl.pretrain.config import load_pretrain_config
        from diffusion_rl.pretrain.trainer import PretrainTrainer

        logger.info("no ShapesWorld model at %s: pretraining it (configs/shapes_pretrain.yaml)", model_dir)
        cfg = load_pretrain_config(
            str(ROOT / "configs/shapes_pretrain.yaml"),
            [f"run.out={model_dir}", f"run.dir={model_dir.parent / (model_dir.name + '_pretrain_run')}",
             f"run.num_threads={threads}"],
        )  # fmt: skip
        PretrainTrainer(cfg).train()
    return read_model_info(model_dir)


def build_config(path: Path, model_dir: Path, info: dict, run_dir: Path, args):
    from diffusion_rl.config import load

    prompts = model_dir / "shapes_prompts"
    overrides = COMMON + [
        f"run.dir={run_dir}",
        f"run.seed={args.seed}",
        "run.resume=never",
        f"model.path={model_dir}",
        f"model.max_sequence_length={info['text_tokens']}",
        f"sampling.height={info['size']}",
        f"sampling.width={info['size']}",
        f"data.train={prompts / 'train.jsonl'}",
        f"val.prompts={prompts / 'val.jsonl'}",
        f"rewards=[{{name: {REWARD}, weight: 1.0}}]",
        "train.total_steps=1000000",  # the budget ends the run
        f"engine.num_threads={args.threads}",
        *args.set,
    ]
    return load(str(path), overrides)


def run_for_budget(trainer, budget_s: float, val_every_s: float) -> dict:
    """Train until `budget_s` seconds of training time; validate at 0, every `val_every_s` and at the end."""
    curve = []

    def validate(train_s: float, step: int) -> None:
        trainer.step = step  # names the validation grid
        reward = trainer.validate()["val/reward/mean"]
        curve.append({"train_seconds": round(train_s, 2), "step": step, "val_reward": reward})
        logger.info("  %6.1f s, step %4d: val %s = %.4f", train_s, step, REWARD, reward)

    validate(0.0, 0)
    train_s, step, next_val, rewards, images = 0.0, 0, val_every_s, [], 0
    while train_s < budget_s:
        start = time.perf_counter()
        metrics = trainer.train_step(step)
        train_s += time.perf_counter() - start
        step += 1
        images += trainer.cfg.batch_size
        if "reward/mean" in metrics:
            rewards.append(float(metrics["reward/mean"]))
        if train_s >= next_val and train_s < budget_s:
            validate(train_s, step)
            next_val += val_every_s
    validate(train_s, step)
    return {
        "steps": step,
        "train_seconds": round(train_s, 2),
        "images_per_second": images / train_s if train_s else None,
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last10": sum(rewards[-10:]) / len(rewards[-10:]) if rewards else None,
        "val_reward_start": curve[0]["val_reward"],
        "val_reward_end": curve[-1]["val_reward"],
        "val_reward_best": max(c["val_reward"] for c in curve),
        "curve": curve,
    }


def run_algorithm(name: str, path: Path, model_dir: Path, info: dict, work: Path, args) -> dict:
    from diffusion_rl.trainer import make_trainer

    cfg = build_config(path, model_dir, info, work / name, args)
    if getattr(cfg.data, "sample_source", "online") != "online":
        return {"config": str(path.relative_to(ROOT)), "skipped": "trains on an offline pair dataset, not on rollouts"}
    logger.info("%s (%s): %d prompts × %d per step", name, path.name, cfg.data.prompts_per_step, cfg.data.group_size)
    torch.manual_seed(args.seed)
    trainer = make_trainer(cfg)
    result = run_for_budget(trainer, args.budget_minutes * 60, args.val_every_seconds)
    return {"config": str(path.relative_to(ROOT)), "family": cfg.algorithm.family, "loss": cfg.algorithm.loss,
            "batch": cfg.batch_size, **result}  # fmt: skip


def plot(results: dict, out_png: Path, base_reward: float | None) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name, r in results.items():
        if "curve" in r:
            xs = [c["train_seconds"] / 60 for c in r["curve"]]
            ax.plot(xs, [c["val_reward"] for c in r["curve"]], marker="o", markersize=3, label=name)
    if base_reward is not None:
        ax.axhline(base_reward, color="grey", linestyle=":", label="base model")
    ax.set_xlabel("training wall-clock time (minutes; validation excluded)")
    ax.set_ylabel(f"held-out validation {REWARD}")
    ax.set_title("ShapesWorld: validation reward against time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-minutes", type=float, default=3.0, help="training time per algorithm")
    parser.add_argument("--model", default=str(ROOT / "models/shapes"), help="the ShapesWorld base model dir")
    parser.add_argument("--only", default=None, help="comma-separated algorithm names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-every-seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every algorithm (repeatable), e.g. train.lr=3e-4")  # fmt: skip
    parser.add_argument("--work", default=None, help="run directories (default: a temporary one)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/learning.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("diffusion_rl", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)

    import tempfile

    load_before = os.getloadavg()
    model_dir = Path(args.model).resolve()
    info = ensure_base_model(model_dir, args.threads)
    configs = algorithm_configs(args.only.split(",") if args.only else None)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work).resolve() if args.work else Path(tmp)
        results = {}
        for name, path in configs.items():
            try:
                results[name] = run_algorithm(name, path, model_dir, info, work, args)
            except Exception as e:  # one broken algorithm must not lose the others' results
                logger.error("%s failed: %s", name, e)
                results[name] = {"config": str(path.relative_to(ROOT)), "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc(limit=5)}  # fmt: skip
    starts = [r["val_reward_start"] for r in results.values() if "val_reward_start" in r]
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "threads": args.threads, "cpus": os.cpu_count(),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"budget_minutes": args.budget_minutes, "seed": args.seed, "reward": REWARD,
                     "val_every_seconds": args.val_every_seconds, "overrides": COMMON + args.set},
        "base_model": {"path": str(model_dir), **info},
        "base_val_reward": starts[0] if starts else None,
        "algorithms": results,
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(results, out.with_suffix(".png"), report["base_val_reward"])
    print(f"{'algorithm':<14} {'steps':>6} {'img/s':>6} {'val start':>10} {'val end':>8} {'val best':>9}")
    for name, r in results.items():
        if "curve" in r:
            print(f"{name:<14} {r['steps']:>6} {r['images_per_second']:>6.2f} {r['val_reward_start']:>10.4f} "
                  f"{r['val_reward_end']:>8.4f} {r['val_reward_best']:>9.4f}")  # fmt: skip
        else:
            print(f"{name:<14} {r.get('skipped') or r.get('error')}")
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
