"""CPU learning benchmark: every algorithm config from the same model, for the same budget, ranked over seeds.

    python benchmarks/learning.py --plan          # the runs (done or to do) and the estimated wall time
    python benchmarks/learning.py [--budget-minutes 3] [--seeds 5] [--lrs /3,x1,x3] [--only flow_grpo,nft]
    python benchmarks/learning.py --single --budget-minutes 3          # one run per algorithm (seed 0, its lr)
    python benchmarks/learning.py --single --task quickstart --steps 100   # the quickstarts as they are

Ranked (the default): for each algorithm, each learning rate of --lrs (factors of the rate the task gives it:
3e-5 on ShapesWorld, the config's own on the quickstart) runs on the first --select-seeds seeds; the rate with the
highest training reward (the mean over each run's last third of training time, averaged over those seeds;
validation is never read) is chosen and runs on the remaining seeds up to --seeds. The result per algorithm: each
seed's final validation reward at the chosen rate, their mean ± 95 % Student-t interval, a rank (a range of
ranks where intervals overlap: benchmarks/ranking_stats.py), and the validation curve's band over seeds. Validation
covers every held-out ShapesWorld prompt (78), val.n samples each: --val-n, or sized so that a point's standard
error (per-image sd / √images) is at most --target-se (0.01), from the base model's per-image sd measured once.
Every run's result is kept under --work as it finishes (benchmarks/results/learning_runs/<task>/runs/<algorithm>/
lr<rate>_seed<seed>.json); running the command again skips them, so an interrupted benchmark resumes. Writes
benchmarks/results/learning_ranked.json and .png (bands), prints the markdown table; --append-results adds a dated
section with it to benchmarks/RESULTS.md.

Each run, in either mode, task `shapes` (default):
1. The base model is the ShapesWorld model of `diffusion-rl pretrain configs/shapes_pretrain.yaml` at --model;
   when that directory holds no pretrained model, it is pretrained first (7.5 minutes on 2 idle cores).
2. Each algorithm config (configs/quickstart.yaml is Flow-GRPO, every configs/quickstart_<name>.yaml another
   algorithm; configs that need an offline dataset, and the editing and video ones, are skipped) trains the base
   model on the ShapesWorld training prompts with the `shapes_geneval` reward, keeping its own algorithm settings.
   Only the task is overridden: model, image size, text length, prompts, reward (plus --set overrides, applied to
   every algorithm). A config
   that trains on a group reward (quickstart_pairwise.yaml) keeps it, over `shapes_geneval`'s scores (each pair
   compared by score; `shapes_geneval` is logged beside it at weight 0, for the rate choice); validation always
   scores `shapes_geneval`.
3. Training time (rollout, reward, update; validation excluded) is capped at the budget. Every
   --val-every-seconds of training time, and at the start and the end, the model samples the held-out
   validation prompts (fixed seeds, ODE) and `shapes_geneval` scores them.

Task `quickstart`: each quickstart config exactly as `diffusion-rl train` runs it (the random tiny model, JPEG
compressibility, its own validation prompts), only the stopping rule and validation schedule set here; a pair
dataset config runs when its `data.pairs` file exists (`diffusion-rl prepare pairs`), else it is skipped.

The budget (per run): --budget-minutes of training time, --steps training steps, or both (whichever comes first).
--single writes benchmarks/results/learning.json (quickstart: learning_quickstart.json; per algorithm: the
validation curve against training seconds, steps, seconds per step, images/s, the first and last validation reward)
and a PNG beside it (validation reward against training time).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranking_stats import (  # noqa: E402
    band,
    common_grid,
    images_for_se,
    interval,
    rank_label,
    rank_with_ties,
    validation_se,
)

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("learning")

SHAPES_REWARD = "shapes_geneval"
SELECTION_FRACTION = 1 / 3  # the learning rate is chosen on the training reward of the last third of each run
# how the benchmark runs every config, whatever the task: it validates and stops, nothing is checkpointed
CONTROL = [
    "run.resume=never",
    "train.total_steps=1000000",  # the budget ends the run
    "train.save_every=0",
    "val.every=0",
    "val.before_train=false",
    "log.tensorboard=false",
    "log.progress_bar=false",
    "log.console_every=0",
]
# what every algorithm shares on ShapesWorld, on top of its own config (--set adds more). The learning rate: the
# quickstarts' 1e-3 suits a random model learning JPEG size; on the pretrained ShapesWorld model it wrecked
# Flow-GRPO within a minute (validation 0.45 → 0.15), 1e-4 rose for 90 s and then fell below the start, 3e-5
# rose steadily (2-minute runs, 2026-11-22).
SHAPES = [
    "train.lr=3e-5",
    "model.device=cpu",
    "model.create_tiny_if_missing=null",
    "model.lora.enabled=false",
    "val.n=4",
    "val.num_steps=10",
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


def build_config(path: Path, run_dir: Path, args, model_dir: Path | None = None, info: dict | None = None):
    """The algorithm's config with the benchmark's control overrides, and the ShapesWorld task when `info` is given."""
    from diffusion_rl.config import load

    overrides = CONTROL + [f"run.dir={run_dir}", f"run.seed={args.seed}", f"engine.num_threads={args.threads}"]
    if info is not None:
        prompts = model_dir / "shapes_prompts"
        overrides += SHAPES + [
            f"model.path={model_dir}",
            f"model.max_sequence_length={info['text_tokens']}",
            f"sampling.height={info['size']}",
            f"sampling.width={info['size']}",
            f"data.train={prompts / 'train.jsonl'}",
            f"val.prompts={prompts / 'val.jsonl'}",
            f"rewards=[{_shapes_reward(path)}]",
            f"val.rewards=[{{name: {SHAPES_REWARD}}}]",  # a config may validate on its own (a pairwise one does)
        ]
    return load(str(path), overrides + list(args.set))


def _shapes_reward(path: Path) -> str:
    """The task's training rewards for the config at `path`: shapes_geneval, or for a config that trains on a group
    reward (Pref-GRPO's pairwise win rate, a rank) the same group reward over shapes_geneval's scores, plus
    shapes_geneval itself at weight 0 (logged, not trained on: a win rate's batch mean is ½ whatever the images,
    so the learning-rate choice reads the logged score instead)."""
    from diffusion_rl.config import load

    group = load(str(path)).rewards[0].name
    if group in ("pairwise_win_rate", "rank"):
        return (f"{{name: {group}, weight: 1.0, kwargs: {{reward: {{name: {SHAPES_REWARD}}}}}}}, "
                f"{{name: {SHAPES_REWARD}, weight: 0.0}}")  # fmt: skip
    return f"{{name: {SHAPES_REWARD}, weight: 1.0}}"


def training_reward(metrics: dict) -> float | None:
    """A training step's reward for choosing the learning rate: the logged shapes_geneval mean where the config
    trains on a group reward over it (see _shapes_reward), else the batch's mean reward."""
    value = metrics.get(f"reward/{SHAPES_REWARD}/mean", metrics.get("reward/mean"))
    return None if value is None else float(value)


def selection_reward(train_curve: list, fraction: float = SELECTION_FRACTION) -> float | None:
    """Mean training reward of the steps that ended in the last `fraction` of the run's training time."""
    if not train_curve:
        return None
    start = train_curve[-1][0] * (1 - fraction)
    late = [r for t, r in train_curve if t >= start]
    return sum(late) / len(late)


def validation_point(trainer):
    """point(step) → the trainer's validation at `step`: its mean reward, the standard errors of that mean from the
    per-image scores (ranking_stats.validation_se), the number of images and the seconds it took."""
    scores = []
    score = trainer.val_rewards

    def scored(*args, **kwargs):  # keeps each validation's per-image scores
        result = score(*args, **kwargs)
        scores.append(np.asarray(result.total, dtype=np.float64))
        return result

    trainer.val_rewards = scored

    def point(step: int) -> dict:
        trainer.step = step  # names the validation grid
        start = time.perf_counter()
        reward = trainer.validate()["val/reward/mean"]
        se = validation_se(scores[-1], trainer.cfg.val.n)
        return {"step": step, "val_reward": reward, "se": se["se"], "se_within_prompts": se["se_within_prompts"],
                "images": se["n"], "sd": se["sd"], "seconds": round(time.perf_counter() - start, 2)}  # fmt: skip

    return point


def run_for_budget(trainer, budget_s: float | None, max_steps: int | None, val_every_s: float) -> dict:
    """Train until `budget_s` seconds of training time or `max_steps` steps, whichever comes first; validate at 0,
    every `val_every_s` and at the end."""
    curve = []
    point = validation_point(trainer)

    def validate(train_s: float, step: int) -> None:
        curve.append({"train_seconds": round(train_s, 2), **point(step)})
        logger.info("  %6.1f s, step %4d: val reward = %.5g (SE %.3g)", train_s, step, curve[-1]["val_reward"],
                    curve[-1]["se"] or 0.0)  # fmt: skip

    def more(train_s: float, step: int) -> bool:
        return (budget_s is None or train_s < budget_s) and (max_steps is None or step < max_steps)

    validate(0.0, 0)
    train_s, step, next_val, rewards, images, train_curve = 0.0, 0, val_every_s, [], 0, []
    while more(train_s, step):
        start = time.perf_counter()
        metrics = trainer.train_step(step)
        train_s += time.perf_counter() - start
        step += 1
        images += trainer.cfg.batch_size
        if "reward/mean" in metrics:
            rewards.append(float(metrics["reward/mean"]))
        if training_reward(metrics) is not None:
            train_curve.append((round(train_s, 2), training_reward(metrics)))
        if train_s >= next_val and more(train_s, step):
            validate(train_s, step)
            next_val += val_every_s
    validate(train_s, step)
    start, end = curve[0]["val_reward"], curve[-1]["val_reward"]
    return {
        "steps": step,
        "train_seconds": round(train_s, 2),
        "seconds_per_step": train_s / step if step else None,
        "images_per_second": images / train_s if train_s else None,
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last10": sum(rewards[-10:]) / len(rewards[-10:]) if rewards else None,
        "val_reward_start": start,
        "val_reward_end": end,
        "val_gain_percent": 100 * (end - start) / abs(start) if start else None,
        "val_reward_best": max(c["val_reward"] for c in curve),
        "selection_reward": selection_reward(train_curve),
        "curve": curve,
        "train_curve": train_curve,
    }


def skip_reason(cfg, shapes: bool) -> str | None:
    """Why a config cannot run on the task: an offline pair dataset (ShapesWorld has none, or the file is missing),
    or on ShapesWorld a model family other than the text-to-image one (editing, video); None when it can."""
    if cfg.data.sample_source != "online":
        pairs = Path(cfg.data.pairs or "")
        if shapes or not pairs.is_file():
            why = "a pair dataset config (ShapesWorld has none)" if shapes else f"no pair file at {pairs}"
            return f"{why}; make one with `diffusion-rl prepare pairs`"
    if shapes and cfg.model.family not in ("auto", "sd3"):
        return f"a {cfg.model.family} config (ShapesWorld trains a text-to-image model)"
    return None


def run_algorithm(name: str, path: Path, work: Path, args, model_dir: Path | None = None, info: dict | None = None):
    from diffusion_rl.trainer import make_trainer

    cfg = build_config(path, work / name, args, model_dir, info)
    record = {"config": str(path.relative_to(ROOT))}
    why = skip_reason(cfg, info is not None)
    if why:
        return {**record, "skipped": why}
    logger.info("%s (%s): %d prompts × %d per step", name, path.name, cfg.data.prompts_per_step, cfg.data.group_size)
    torch.manual_seed(args.seed)
    trainer = make_trainer(cfg)
    result = run_for_budget(
        trainer, args.budget_minutes * 60 if args.budget_minutes else None, args.steps, args.val_every_seconds
    )
    family, loss = cfg.algorithm.spec.family, cfg.algorithm.loss
    return {**record, "family": family, "loss": loss, "batch": cfg.batch_size, **result}


def plot(results: dict, out_png: Path, base_reward: float | None, reward: str, task: str = "shapes") -> None:
    def draw(ax) -> None:
        for name, r in results.items():
            if "curve" in r:
                xs = [c["train_seconds"] / 60 for c in r["curve"]]
                ax.plot(xs, [c["val_reward"] for c in r["curve"]], marker="o", markersize=3, label=name)
        if base_reward is not None:
            ax.axhline(base_reward, color="grey", linestyle=":", label="base model")

    curves_figure(draw, out_png, reward, task, "validation reward against training time")


def curves_figure(draw, out_png: Path, reward: str, task: str, what: str) -> None:
    """A figure of validation reward against training minutes, its curves drawn by `draw(axes)`, saved as PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    draw(ax)
    ax.set_xlabel("training wall-clock time (minutes; validation excluded)")
    ax.set_ylabel(f"validation {reward}")
    title = "ShapesWorld (held-out prompts)" if task == "shapes" else "quickstart configs (tiny model, JPEG)"
    ax.set_title(f"{title}:\n{what}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)


# -- the ranked benchmark: seeds × learning rates per algorithm, resumable ------------------------------------------

DEFAULT_LRS = "/3,x1,x3"  # a half-decade either side of the base rate (3e-5 on ShapesWorld: 1e-5, 3e-5, 9e-5)
CALIBRATION_N = 4  # samples per validation prompt when measuring the per-image spread that sizes validation
SD_MARGIN = 1.1  # validation is sized for a per-image sd 10 % above the base model's (trained models spread more)
ASSUMED_SD = 0.3  # the per-image sd a --plan assumes before calibration has measured it
ASSUMED_SECONDS_PER_IMAGE = 0.01  # validation seconds per image a --plan assumes before calibration measured it
STARTUP_SECONDS = 5.0  # building a trainer, per run


def parse_lrs(spec: str, base: float) -> list[float]:
    """'/3,x1,x3,1e-4' → rates: an 'x' token multiplies the config's rate, a '/' token divides it, a number is a
    rate; 3 significant digits (they name the result files)."""
    rates = []
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        if token[0] in "x/":
            rate = base * float(token[1:]) if token[0] == "x" else base / float(token[1:])
        else:
            rate = float(token)
        rates.append(float(f"{rate:.3g}"))
    if len(set(rates)) != len(rates):
        sys.exit(f"--lrs {spec}: the rates {rates} repeat")
    return rates


def run_path(work: Path, name: str, lr: float, seed: int) -> Path:
    """Where one (algorithm, learning rate, seed) run's result is kept: its presence means the run is done."""
    return work / "runs" / name / f"lr{lr:.3g}_seed{seed}.json"


def write_json(path: Path, data) -> None:
    """Write atomically (a temporary file renamed into place), so an interrupted write leaves no half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def run_once(name: str, path: Path, lr: float, seed: int, args, extra: list[str], work: Path,
             model_dir: Path | None, info: dict | None) -> dict:  # fmt: skip
    """One run, or its kept result when it has run before (a failed run keeps nothing, so it is tried again)."""
    import tempfile

    out = run_path(work, name, lr, seed)
    if out.is_file():
        logger.info("%s lr %.3g seed %d: done before (%s)", name, lr, seed, out)
        return {**json.loads(out.read_text()), "resumed": True}
    run_args = argparse.Namespace(**{**vars(args), "seed": seed, "set": [*args.set, *extra, f"train.lr={lr}"]})
    logger.info("%s lr %.3g seed %d", name, lr, seed)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:  # its run dir: validation images, thrown away
            result = run_algorithm(name, path, Path(tmp), run_args, model_dir, info)
    except Exception as e:  # one broken run must not lose the others
        logger.error("%s lr %.3g seed %d failed: %s", name, lr, seed, e)
        return {"lr": lr, "seed": seed, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=5)}
    result = {**result, "lr": lr, "seed": seed, "wall_seconds": round(time.perf_counter() - start, 2)}
    if "curve" in result:
        write_json(out, result)
    return result


def choose_lr(by_lr: dict[float, list[dict]]) -> tuple[float | None, dict[str, float | None]]:
    """The rate whose runs have the highest mean selection_reward (training reward over each run's last third;
    validation is never read), and each rate's mean. Rates without a finished run are not candidates."""
    means = {}
    for lr, runs in by_lr.items():
        values = [r["selection_reward"] for r in runs if r.get("selection_reward") is not None]
        means[f"{lr:.3g}"] = sum(values) / len(values) if values else None
    candidates = [lr for lr in by_lr if means[f"{lr:.3g}"] is not None]
    return (max(candidates, key=lambda lr: means[f"{lr:.3g}"]) if candidates else None), means


def validation_size(args, configs: dict[str, Path], work: Path, extra: list[str], model_dir, info) -> dict:
    """val.n (samples per validation prompt): --val-n, or sized so that one point's standard error is at most
    --target-se, from the per-image sd of the base model's validation (CALIBRATION_N samples per prompt; measured
    once, kept in <work>/validation_size.json). Also the validation seconds per image, for --plan's estimate."""
    kept = work / "validation_size.json"
    if args.val_n is not None:
        known = json.loads(kept.read_text()) if kept.is_file() else {}
        return {**known, "val_n": args.val_n, "source": "--val-n"}
    if kept.is_file():
        return json.loads(kept.read_text())
    import tempfile

    from diffusion_rl.trainer import make_trainer

    name, path = next(iter(configs.items()))
    run_args = argparse.Namespace(**{**vars(args), "set": [*args.set, *extra, f"val.n={CALIBRATION_N}"]})
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config(path, Path(tmp), run_args, model_dir, info)
        point = validation_point(make_trainer(cfg))(0)  # the base model's validation
    prompts = point["images"] // CALIBRATION_N
    images = images_for_se(point["sd"] * SD_MARGIN, args.target_se)
    size = {"val_n": max(1, -(-images // prompts)), "prompts": prompts, "calibration_sd": point["sd"],
            "sd_margin": SD_MARGIN, "target_se": args.target_se, "calibrated_with": f"{name}, val.n={CALIBRATION_N}",
            "seconds_per_image": point["seconds"] / point["images"], "source": "calibration"}  # fmt: skip
    logger.info("validation: per-image sd %.3f → %d samples × %d prompts for SE ≤ %g", point["sd"], size["val_n"],
                prompts, args.target_se)  # fmt: skip
    write_json(kept, size)
    return size


def check_work_settings(work: Path, args, extra: list[str]) -> None:
    """The settings every kept run was made with, kept in <work>/settings.json: a run kept under other settings
    (another budget, task, model or override) must not be mixed in, so a mismatch stops the benchmark."""
    settings = {"task": args.task, "model": args.model if args.task == "shapes" else None,
                "budget_minutes": args.budget_minutes, "steps": args.steps, "val_every_seconds": args.val_every_seconds,
                "threads": args.threads, "val_n": args.val_n, "target_se": args.target_se,
                "set": [*args.set, *extra]}  # fmt: skip
    kept = work / "settings.json"
    if kept.is_file():
        before = json.loads(kept.read_text())
        if before != settings:
            changed = sorted(k for k in settings if before.get(k) != settings[k])
            sys.exit(f"{work} holds runs made with other settings ({', '.join(changed)} differ: {kept}); "
                     "give another --work, or delete it to start again")  # fmt: skip
    elif not args.plan:
        write_json(kept, settings)


def algorithm_runs(name, path, args, lrs, seeds, select_seeds, extra, work, model_dir, info, execute=True) -> dict:
    """Every run of one algorithm: each rate on the selection seeds, the chosen rate on the rest. With execute
    false, nothing runs: the plan (the runs, done or to do; the rest of the seeds once a rate can be chosen)."""
    by_lr, planned, every = {}, [], []
    for lr in lrs:
        by_lr[lr] = []
        for seed in select_seeds:
            done = run_path(work, name, lr, seed).is_file()
            planned.append({"lr": lr, "seed": seed, "phase": "select", "done": done})
            if execute or done:
                by_lr[lr].append(run_once(name, path, lr, seed, args, extra, work, model_dir, info))
                every.append(by_lr[lr][-1])
    complete = all(len([r for r in runs if "curve" in r]) == len(select_seeds) for runs in by_lr.values())
    chosen, selection = choose_lr(by_lr) if (execute or complete) else (None, {})
    final = list(by_lr.get(chosen, [])) if chosen is not None else []
    for seed in seeds:
        if seed in select_seeds:
            continue
        done = chosen is not None and run_path(work, name, chosen, seed).is_file()
        planned.append({"lr": chosen, "seed": seed, "phase": "report", "done": done})
        if chosen is not None and (execute or done):
            final.append(run_once(name, path, chosen, seed, args, extra, work, model_dir, info))
            every.append(final[-1])
    return {"by_lr": by_lr, "chosen_lr": chosen, "selection": selection, "final": final, "planned": planned,
            "all": every}  # fmt: skip


def summarise(runs: dict, base_lr: float, level: float = 0.95) -> dict:
    """One algorithm's result: the chosen rate, each seed's final validation reward, their mean ± interval, the
    validation curve's band over seeds and the largest standard error of any of its points."""
    finished = [r for r in runs["final"] if "curve" in r]
    finals = [r["val_reward_end"] for r in finished]
    points = [c for r in finished for c in r["curve"] if c.get("se") is not None]
    curves = [[(c["train_seconds"], c["val_reward"]) for c in r["curve"]] for r in finished]
    return {
        "base_lr": base_lr,
        "lrs": [float(f"{lr:.3g}") for lr in runs["by_lr"]],
        "selection_reward_by_lr": runs["selection"],
        "chosen_lr": runs["chosen_lr"],
        "seeds": [r["seed"] for r in finished],
        "final_val_reward": finals,
        "start_val_reward": [r["val_reward_start"] for r in finished],
        "interval": interval(finals, level),
        "max_point_se": max((c["se"] for c in points), default=None),
        "band": band(curves, common_grid(curves), level) if curves else [],
        "steps": [r["steps"] for r in finished],
        "runs": runs["all"],
        "failed": [{k: r[k] for k in ("lr", "seed", "error")} for r in runs["all"] if "error" in r],
    }  # fmt: skip


def estimate_run_seconds(args, size: dict) -> float:
    """One run's wall time: its training budget, its validations (at 0, every --val-every-seconds, at the end),
    each of val.n × prompts images, and building the trainer. A --steps-only budget has no time to go by: None."""
    if not args.budget_minutes:
        return None
    budget = args.budget_minutes * 60
    validations = 1 + math.ceil(budget / args.val_every_seconds)  # at 0, every interval before the end, the end
    images = size["val_n"] * size.get("prompts", 78)
    return budget + validations * images * size.get("seconds_per_image", ASSUMED_SECONDS_PER_IMAGE) + STARTUP_SECONDS


def ranked_table(algorithms: dict) -> list[str]:
    """The markdown table: rank (a range where intervals overlap), final validation reward mean ± 95 % interval."""
    ranked = [n for n, r in algorithms.items() if "rank" in r]
    lines = ["| rank | algorithm | lr (chosen of) | final val reward, mean ± 95 % CI | seeds | per seed | "
             "gain vs start | max SE of a point |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    order = sorted(ranked, key=lambda n: algorithms[n]["rank"]["rank"])
    for name in order:
        r = algorithms[name]
        iv = r["interval"]
        ci = f"{iv['mean']:.4f} ± {iv['half_width']:.4f}" if iv["half_width"] is not None else f"{iv['mean']:.4f}"
        starts = r["start_val_reward"]
        gain = f"{iv['mean'] - sum(starts) / len(starts):+.4f}" if starts else "–"
        rates = ", ".join(f"{lr:.3g}" for lr in r["lrs"])
        se = f"{r['max_point_se']:.4f}" if r["max_point_se"] is not None else "–"
        seeds = " ".join(f"{v:.3f}" for v in r["final_val_reward"])
        lines.append(f"| {rank_label(r['rank'])} | {name} | {r['chosen_lr']:.3g} ({rates}) | {ci} | "
                     f"{iv['n']} | {seeds} | {gain} | {se} |")  # fmt: skip
    for name, r in algorithms.items():
        if name not in ranked:
            lines.append(f"| – | {name} | | {r.get('skipped') or 'no finished run'} | | | | |")
    return lines


def plot_bands(algorithms: dict, out_png: Path, reward: str, task: str) -> None:
    """Each algorithm's validation curve at its chosen rate: the mean over seeds and its 95 % band."""

    def draw(ax) -> None:
        for name, r in algorithms.items():
            points = r.get("band") or []
            if not points:
                continue
            xs = [p["t"] / 60 for p in points]
            (line,) = ax.plot(xs, [p["mean"] for p in points], label=f"{name} (lr {r['chosen_lr']:.3g})")
            if all(p["low"] is not None for p in points):
                low, high = [p["low"] for p in points], [p["high"] for p in points]
                ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)

    curves_figure(draw, out_png, reward, task, "mean over seeds and 95 % band, each at its chosen lr")


def rank_benchmark(args, configs: dict[str, Path], work: Path, model_dir, info) -> dict:
    """The ranked benchmark (or with --plan, its run list and estimated wall time): every algorithm at each rate
    on the selection seeds, the rate chosen on training reward, that rate on every seed; ranks by the final
    validation reward's mean ± 95 % interval over seeds."""
    extra = []
    if info is not None:  # every held-out prompt (the default val.jsonl is a 32-prompt subset of them)
        extra.append(f"val.prompts={model_dir / 'shapes_prompts' / 'heldout.jsonl'}")
    check_work_settings(work, args, extra)
    seeds = list(range(args.seed, args.seed + args.seeds))
    select_seeds = seeds[: args.select_seeds or len(seeds)]
    if args.plan and args.val_n is None and not (work / "validation_size.json").is_file():
        prompts = 78 if info is not None else 4  # the held-out ShapesWorld prompts; the quickstart's val prompts
        size = {"val_n": -(-images_for_se(ASSUMED_SD * SD_MARGIN, args.target_se) // prompts), "prompts": prompts,
                "source": f"not calibrated yet: assumes a per-image sd of {ASSUMED_SD}"}  # fmt: skip
    else:
        size = validation_size(args, configs, work, extra, model_dir, info)
    extra.append(f"val.n={size['val_n']}")
    algorithms, plan = {}, []
    for name, path in configs.items():
        cfg = build_config(path, work / "unused", args, model_dir, info)
        why = skip_reason(cfg, info is not None)
        if why:
            algorithms[name] = {"config": str(path.relative_to(ROOT)), "skipped": why}
            continue
        lrs = parse_lrs(args.lrs, cfg.train.lr)
        runs = algorithm_runs(name, path, args, lrs, seeds, select_seeds, extra, work, model_dir, info,
                              execute=not args.plan)  # fmt: skip
        plan += [{"algorithm": name, **p} for p in runs["planned"]]
        if not args.plan:
            algorithms[name] = {"config": str(path.relative_to(ROOT)), **summarise(runs, cfg.train.lr)}
    per_run = estimate_run_seconds(args, size)
    todo = sum(not p["done"] for p in plan)
    estimate = {"runs": len(plan), "to_do": todo, "seconds_per_run": per_run,
                "seconds_to_do": per_run * todo if per_run else None}  # fmt: skip
    if args.plan:
        return {"plan": plan, "estimate": estimate, "validation": size}
    ranks = rank_with_ties({n: r["interval"] for n, r in algorithms.items() if "interval" in r})
    for name, rank in ranks.items():
        algorithms[name]["rank"] = rank
    return {"algorithms": algorithms, "validation": size, "estimate": estimate,
            "seeds": seeds, "selection_seeds": select_seeds}  # fmt: skip


def plan_lines(result: dict) -> list[str]:
    """--plan's printout: each run, done or to do, and the estimated wall time of what is left."""
    lines = [f"{'algorithm':<14} {'lr':>8} {'seed':>4}  phase   status"]
    for p in result["plan"]:
        lr = f"{p['lr']:.3g}" if p["lr"] is not None else "chosen"
        lines.append(f"{p['algorithm']:<14} {lr:>8} {p['seed']:>4}  {p['phase']:<7} {'done' if p['done'] else 'to do'}")
    e, v = result["estimate"], result["validation"]
    lines.append(f"validation: {v['val_n']} samples × {v.get('prompts', '?')} prompts ({v['source']})")
    when = f"{e['seconds_to_do'] / 3600:.2f} h" if e["seconds_to_do"] is not None else "unknown (no time budget)"
    per = f"{e['seconds_per_run']:.0f} s" if e["seconds_per_run"] else "?"
    lines.append(f"{e['runs']} runs, {e['to_do']} to do, about {per} each: estimated wall time {when}")
    return lines


def results_section(report: dict, command: str, png: Path) -> str:
    """A dated RESULTS.md section: settings, machine load, wall time, the ranked table and the band plot."""
    s, m = report["settings"], report["machine"]
    lines = [
        f"## Ranked learning benchmark, {s['task']} ({report['date'][:10]}; `{command}`)",
        "",
        f"{len(report['seeds'])} seeds ({', '.join(map(str, report['seeds']))}), learning rates `{s['lrs']}` chosen "
        f"on the mean training reward of each run's last third over seeds {report['selection_seeds']}; budget "
        f"{s['budget_minutes']} min / {s['steps']} steps of training time; validation {report['validation']['val_n']}"
        f" samples × {report['validation'].get('prompts', '?')} prompts. Load average before/after: "
        f"{m['load_average_before']} / {m['load_average_after']}; `/proc/loadavg` at the start: "
        f"`{m['proc_loadavg']}`. Wall time of this invocation: {report['wall_seconds'] / 60:.1f} min (runs kept "
        f"from earlier invocations: {report['resumed_runs']}; the runs' own wall time sums to "
        f"{report['run_wall_seconds'] / 60:.1f} min).",
        "",
        *ranked_table(report["algorithms"]),
        "",
        "Rank: a range where the algorithm's 95 % interval overlaps others' (not separated by this benchmark).",
        "",
        f"![validation reward, mean and 95 % band over seeds]({os.path.relpath(png, ROOT / 'benchmarks')})",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["shapes", "quickstart"], default="shapes",
                        help="shapes: the ShapesWorld model; quickstart: the quickstart configs as is")  # fmt: skip
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help="training time per run (default 3 unless --steps is given)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="training steps per run")
    parser.add_argument("--model", default=str(ROOT / "models/shapes"), help="the ShapesWorld base model dir")
    parser.add_argument("--only", default=None, help="comma-separated algorithm names (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed (--single: the only one)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per algorithm: --seed, --seed + 1, …")
    parser.add_argument("--select-seeds", type=int, default=2,
                        help="the first this many seeds run every rate and choose it (0: all seeds)")  # fmt: skip
    parser.add_argument("--lrs", default=DEFAULT_LRS,
                        help="learning rates: x or / a factor of the config's train.lr, or a rate")  # fmt: skip
    parser.add_argument("--val-n", type=int, default=None,
                        help="validation samples per prompt (default: sized for --target-se)")  # fmt: skip
    parser.add_argument("--target-se", type=float, default=0.01, help="a validation point's standard error")
    parser.add_argument("--plan", "--dry-run", action="store_true",
                        help="print the runs (done or to do) and the estimated wall time; run nothing")  # fmt: skip
    parser.add_argument("--append-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    parser.add_argument("--single", action="store_true",
                        help="one run per algorithm at --seed and its config's rate (the old benchmark)")  # fmt: skip
    parser.add_argument("--val-every-seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every algorithm (repeatable), e.g. train.lr=3e-4")  # fmt: skip
    parser.add_argument("--work", default=None,
                        help="ranked: where each run's result is kept, to resume (default: benchmarks/results/"
                             "learning_runs/<task>); --single: run dirs (default: temporary)")  # fmt: skip
    parser.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/<stem>.json)")
    args = parser.parse_args(argv)
    if args.budget_minutes is None and args.steps is None:
        args.budget_minutes = 3.0
    started, command = time.perf_counter(), " ".join(["python benchmarks/learning.py", *(argv or sys.argv[1:])])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("diffusion_rl", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)

    stem = ("learning" if args.single else "learning_ranked") + ("" if args.task == "shapes" else "_quickstart")
    out = Path(args.out).resolve() if args.out else ROOT / "benchmarks/results" / f"{stem}.json"
    default_work = None if args.single else ROOT / "benchmarks/results/learning_runs" / args.task
    work_dir = Path(args.work).resolve() if args.work else default_work
    os.chdir(ROOT)  # the configs name their files relative to the repository root
    load_before = os.getloadavg()
    proc_loadavg = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").is_file() else None
    model_dir = info = None
    if args.task == "shapes":
        model_dir = Path(args.model).resolve()
        info = ensure_base_model(model_dir, args.threads)
    configs = algorithm_configs(args.only.split(",") if args.only else None)
    reward = SHAPES_REWARD if info is not None else "the config's reward"
    if args.single:
        results = single_runs(args, configs, work_dir, model_dir, info)
    else:
        ranked = rank_benchmark(args, configs, work_dir, model_dir, info)
        if args.plan:
            print("\n".join(plan_lines(ranked)))
            return
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
                    "threads": args.threads, "cpus": os.cpu_count(), "proc_loadavg": proc_loadavg,
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"task": args.task, "budget_minutes": args.budget_minutes, "steps": args.steps, "seed": args.seed,
                     "reward": reward, "val_every_seconds": args.val_every_seconds,
                     "overrides": CONTROL + (SHAPES if info is not None else []) + args.set},
        "base_model": {"path": str(model_dir), **info} if info is not None else None,
    }  # fmt: skip
    if args.single:
        report["algorithms"] = results
        write_json(out, report)
        starts = {r["val_reward_start"] for r in results.values() if "val_reward_start" in r}
        base = starts.pop() if len(starts) == 1 else None  # one start for all: the base model's
        plot(results, out.with_suffix(".png"), base, reward, args.task)
        print("\n".join(summary_lines(results)))
        print(f"wrote {out} and {out.with_suffix('.png')}")
        return
    runs = [r for a in ranked["algorithms"].values() for r in a.get("runs", [])]
    selection = f"mean training reward of each run's last {SELECTION_FRACTION:.3g} of training time, over seeds"
    report["settings"].update({"seeds": args.seeds, "select_seeds": args.select_seeds, "lrs": args.lrs,
                               "target_se": args.target_se, "selection": selection})  # fmt: skip
    report.update(ranked, work=str(work_dir), wall_seconds=round(time.perf_counter() - started, 1),
                  resumed_runs=sum(bool(r.get("resumed")) for r in runs),
                  run_wall_seconds=round(sum(r.get("wall_seconds", 0.0) for r in runs), 1))  # fmt: skip
    for a in report["algorithms"].values():
        a.pop("runs", None)
    write_json(out, report)
    plot_bands(report["algorithms"], out.with_suffix(".png"), reward, args.task)
    print("\n".join(ranked_table(report["algorithms"])))
    print(f"wall time {report['wall_seconds'] / 60:.1f} min; wrote {out} and {out.with_suffix('.png')}")
    if args.append_results:
        with open(ROOT / "benchmarks/RESULTS.md", "a") as f:
            f.write("\n" + results_section(report, command, out.with_suffix(".png")))


def single_runs(args, configs: dict[str, Path], work_dir: Path | None, model_dir, info) -> dict:
    """--single: one run per algorithm at --seed and its config's rate; the step time relative to Flow-GRPO's."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        work = work_dir or Path(tmp)
        results = {}
        for name, path in configs.items():
            try:
                results[name] = run_algorithm(name, path, work, args, model_dir, info)
            except Exception as e:  # one broken algorithm must not lose the others' results
                logger.error("%s failed: %s", name, e)
                results[name] = {"config": str(path.relative_to(ROOT)), "error": f"{type(e).__name__}: {e}",
                                 "traceback": traceback.format_exc(limit=5)}  # fmt: skip
    reference = results.get("flow_grpo", {}).get("seconds_per_step")
    for r in results.values():
        if reference and r.get("seconds_per_step"):
            r["step_time_vs_flow_grpo"] = r["seconds_per_step"] / reference
    return results


# (heading, result key, column width, number format) of the summary table
SUMMARY_COLUMNS = [
    ("steps", "steps", 6, ""),
    ("s/step", "seconds_per_step", 7, ".3f"),
    ("×fgrpo", "step_time_vs_flow_grpo", 7, ".2f"),
    ("img/s", "images_per_second", 6, ".2f"),
    ("val start", "val_reward_start", 10, ".5g"),
    ("val end", "val_reward_end", 10, ".5g"),
    ("gain %", "val_gain_percent", 7, "+.1f"),
    ("val best", "val_reward_best", 10, ".5g"),
]


def summary_lines(results: dict) -> list[str]:
    """The table printed at the end: one row per algorithm (a skipped or failed one says why). A missing value
    (None, e.g. the gain % of a run whose validation started at 0) is a dash; 0 is a number like any other."""

    def cell(value, width: int, spec: str) -> str:
        text = "–" if value is None else format(value, spec)
        return f"{text:>{width}}"

    lines = [f"{'algorithm':<14} " + " ".join(f"{title:>{width}}" for title, _, width, _ in SUMMARY_COLUMNS)]
    for name, r in results.items():
        if "curve" in r:
            cells = [cell(r.get(key), width, spec) for _, key, width, spec in SUMMARY_COLUMNS]
            lines.append(f"{name:<14} " + " ".join(cells))
        else:
            lines.append(f"{name:<14} {r.get('skipped') or r.get('error')}")
    return lines


if __name__ == "__main__":
    main()
