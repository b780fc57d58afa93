"""CPU learning benchmark: every algorithm config trains the same model for the same time, one run each.

    python benchmarks/learning.py [--budget-minutes 3] [--seed 0] [--only flow_grpo,nft]
    python benchmarks/learning.py --task quickstart --steps 100   # the quickstarts as they are, step for step

The ranking over seeds, at equal compute, is benchmarks/ranking.py; it builds on this file's task setup.

Each run, task `shapes` (default):
1. The base model is the ShapesWorld model at --model; when that directory holds none, the package's shipped one is
   copied there (`diffusion-rl init-tiny DIR --preset shapes`: the same bits on every machine, so runs made on
   different machines start from one model; `diffusion-rl pretrain configs/shapes_pretrain.yaml` rebuilds it bit for
   bit only on the CPU it was made on).
2. Each algorithm config (configs/quickstart_flow_grpo.yaml is Flow-GRPO, every configs/quickstart_<name>.yaml another
   algorithm; configs that need an offline dataset, and the editing and video ones, are skipped) trains the base
   model on the ShapesWorld training prompts with the `shapes_geneval` reward, keeping its own algorithm settings.
   Only the task is overridden: model, image size, text length, prompts, reward (plus --set overrides, applied to
   every algorithm). A config that trains on a group reward (quickstart_pairwise.yaml) keeps it, over
   `shapes_geneval`'s scores (each pair compared by score; `shapes_geneval` is logged beside it at weight 0, for the
   rate choice); validation always scores `shapes_geneval`.
3. Training time (rollout, reward, update; validation excluded) is capped at the budget. Every
   --val-every-seconds of training time, and at the start and the end, the model samples the held-out
   validation prompts (fixed seeds, ODE) and `shapes_geneval` scores them.

Task `quickstart`: each quickstart config exactly as `diffusion-rl train` runs it (the random tiny model, JPEG
compressibility, its own validation prompts), only the stopping rule and validation schedule set here; a pair
dataset config runs when its `data.pairs` file exists (`diffusion-rl prepare pairs`), else it is skipped.

The budget (per run): --budget-minutes of training time, --steps training steps, or both (whichever comes first).
Writes benchmarks/results/learning.json (quickstart: learning_quickstart.json; per algorithm: the validation curve
against training seconds, steps, seconds per step, images/s, the first and last validation reward) and a PNG
beside it (validation reward against training time).
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ranking_stats import validation_se  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("learning")

SHAPES_REWARD = "shapes_geneval"
SELECTION_FRACTION = 1 / 3  # ranking.py chooses the learning rate on the training reward of each run's last third
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


def algorithm_title(config: Path) -> str:
    """The algorithm's name as its config's first comment line gives it ("# DiffusionNFT on the tiny model: …" →
    "DiffusionNFT"); the file's stem when that line names none."""
    first = config.read_text().splitlines()[0] if config.is_file() else ""
    title = first.removeprefix("#").strip().removeprefix("Quickstart:").strip()
    return title.partition(" on the tiny model")[0] if " on the tiny model" in title else config.stem


def algorithm_configs(only: list[str] | None) -> dict[str, Path]:
    """name → config file: configs/quickstart_<name>.yaml is <name> (quickstart_flow_grpo.yaml: flow_grpo, the
    reference; quickstart.yaml, the README's AWM run on this very task, is not one of them)."""
    found = {p.stem.removeprefix("quickstart_"): p for p in sorted((ROOT / "configs").glob("quickstart_*.yaml"))}
    if only:
        unknown = sorted(set(only) - set(found))
        if unknown:
            sys.exit(f"--only: unknown algorithm(s) {unknown}; available: {', '.join(found)}")
        found = {name: path for name, path in found.items() if name in only}
    return found


def ensure_base_model(model_dir: Path) -> dict:
    """The ShapesWorld model's info at `model_dir`, copying the package's shipped model there when it holds none."""
    from diffusion_rl.errors import UserError
    from diffusion_rl.models.tiny.shipped import copy_shipped
    from diffusion_rl.pretrain.model import INFO_FILE, read_model_info

    if not (model_dir / INFO_FILE).is_file():
        if model_dir.is_dir() and any(model_dir.iterdir()):  # never write into a folder of someone else's files
            raise UserError(f"--model {model_dir} holds files and no ShapesWorld model ({INFO_FILE}): give a new or "
                            "empty directory, or one holding the model")  # fmt: skip
        logger.info("no ShapesWorld model at %s: copying the shipped one there", model_dir)
        copy_shipped("sd3", "shapes", model_dir)
    return read_model_info(model_dir)


def build_config(path: Path, run_dir: Path, args, model_dir: Path | None = None, info: dict | None = None):
    """The algorithm's config with the benchmark's control overrides, and the ShapesWorld task when `info` is given."""
    from diffusion_rl.config import load

    overrides = CONTROL + [f"run.dir={run_dir}", f"run.seed={args.seed}", f"engine.num_threads={args.threads}"]
    if info is not None:
        prompts = model_dir / "shapes_prompts"
        # full fine-tuning, but where the algorithm's config trains LoRA adapters (TDM-R1 trains three: it refuses
        # full fine-tuning)
        lora = load(str(path)).model.lora.enabled
        overrides += [o for o in SHAPES if not (lora and o == "model.lora.enabled=false")] + [
            f"model.path={model_dir}",
            f"model.max_sequence_length={info['text_tokens']}",
            f"sampling.height={info['size']}",
            f"sampling.width={info['size']}",
            f"data.train={prompts / 'train.jsonl'}",
            f"val.prompts={prompts / 'val.jsonl'}",
            f"rewards=[{_shapes_reward(path, getattr(args, 'shape_weight', 0.0))}]",
            f"val.rewards=[{{name: {SHAPES_REWARD}}}]",  # a config may validate on its own (a pairwise one does)
        ]
    return load(str(path), overrides + list(args.set))


def _shapes_reward(path: Path, shape_weight: float = 0.0) -> str:
    """The task's training rewards for the config at `path`: shapes_geneval (with `shape_weight`, the objects'
    outlines weighed in: rewards/shapes.py), or for a config that trains on a group reward (Pref-GRPO's pairwise win
    rate, a rank) the same group reward over that score, plus the score itself at weight 0 (logged, not trained on:
    a win rate's batch mean is ½ whatever the images, so the learning-rate choice reads the logged score instead).
    Validation reads plain shapes_geneval either way."""
    from diffusion_rl.config import load

    kwargs = f", kwargs: {{shape_weight: {shape_weight}}}" if shape_weight else ""
    group = load(str(path)).rewards[0].name
    if group in ("pairwise_win_rate", "rank"):
        return (f"{{name: {group}, weight: 1.0, kwargs: {{reward: {{name: {SHAPES_REWARD}{kwargs}}}}}}}, "
                f"{{name: {SHAPES_REWARD}{kwargs}, weight: 0.0}}")  # fmt: skip
    return f"{{name: {SHAPES_REWARD}{kwargs}, weight: 1.0}}"


def training_reward(metrics: dict) -> float | None:
    """A training step's reward for choosing the learning rate: the logged shapes_geneval mean where the config
    trains on a group reward over it (see _shapes_reward), else the batch's mean reward."""
    value = metrics.get(f"reward/{SHAPES_REWARD}/mean", metrics.get("reward/mean"))
    return None if value is None else float(value)


def selection_reward(train_curve: list, fraction: float = SELECTION_FRACTION) -> float | None:
    """Mean training reward of the steps that ended in the last `fraction` of the run: train_curve is (training
    seconds or cumulative FLOPs at the step's end, reward) per step."""
    if not train_curve:
        return None
    start = train_curve[-1][0] * (1 - fraction)
    late = [r for t, r in train_curve if t >= start]
    return sum(late) / len(late)


def validation_point(trainer):
    """point(step, val_n=None) → the trainer's validation at `step` (val_n samples per prompt; None: the config's):
    its mean reward, the standard errors of that mean from the per-image scores (ranking_stats.validation_se), the
    number of images and the seconds it took."""
    scores = []
    score = trainer.val_rewards

    def scored(*args, **kwargs):  # keeps each validation's per-image scores
        result = score(*args, **kwargs)
        scores.append(np.asarray(result.total, dtype=np.float64))
        return result

    trainer.val_rewards = scored

    def point(step: int, val_n: int | None = None) -> dict:
        trainer.step = step  # names the validation grid
        if val_n is not None:
            trainer.cfg.val.n = val_n  # validate() reads it at each call
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
    flops = None  # a step's counted FLOPs (log.flops), the last step's
    while more(train_s, step):
        start = time.perf_counter()
        metrics = trainer.train_step(step)
        train_s += time.perf_counter() - start
        step += 1
        images += trainer.cfg.batch_size
        flops = metrics.get("perf/flops_per_step", flops)
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
        "flops_per_step": flops,
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


def curves_figure(draw, out_png: Path, reward: str, task: str, what: str,
                  xlabel: str = "training wall-clock time (minutes; validation excluded)") -> None:  # fmt: skip
    """A figure of validation reward against `xlabel`, its curves drawn by `draw(axes)`, saved as PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    draw(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"validation {reward}")
    title = "ShapesWorld (held-out prompts)" if task == "shapes" else "quickstart configs (tiny model, JPEG)"
    ax.set_title(f"{title}:\n{what}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)


def write_json(path: Path, data) -> None:
    """Write atomically (a temporary file renamed into place), so an interrupted write leaves no half a result; the
    temporary file is this process's own, so two processes writing one file (a shared base validation) cannot clash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["shapes", "quickstart"], default="shapes",
                        help="shapes: the ShapesWorld model; quickstart: the quickstart configs as is")  # fmt: skip
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help="training time per run (default 3 unless --steps is given)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="training steps per run")
    parser.add_argument("--model", default=str(ROOT / "models/shapes"), help="the ShapesWorld base model dir")
    parser.add_argument("--only", default=None, help="comma-separated algorithm names (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-every-seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--shape-weight",
        type=float,
        default=0.0,
        help="train on shapes_geneval with the outlines weighed in (its shape_weight); validate on it plain",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every algorithm (repeatable), e.g. train.lr=3e-4")  # fmt: skip
    parser.add_argument("--work", default=None, help="run dirs (default: temporary)")
    parser.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/<stem>.json)")
    args = parser.parse_args(argv)
    if args.budget_minutes is None and args.steps is None:
        args.budget_minutes = 3.0
    setup_logging(args.threads)
    stem = "learning" + ("" if args.task == "shapes" else "_quickstart")
    out = Path(args.out).resolve() if args.out else ROOT / "benchmarks/results" / f"{stem}.json"
    work_dir = Path(args.work).resolve() if args.work else None
    os.chdir(ROOT)  # the configs name their files relative to the repository root
    load_before = os.getloadavg()
    model_dir = info = None
    if args.task == "shapes":
        model_dir = Path(args.model).resolve()
        info = ensure_base_model(model_dir)
    configs = algorithm_configs(args.only.split(",") if args.only else None)
    reward = SHAPES_REWARD if info is not None else "the config's reward"
    results = single_runs(args, configs, work_dir, model_dir, info)
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python benchmarks/learning.py", *(argv or sys.argv[1:])]),
        "machine": {**machine(), "threads": args.threads, "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"task": args.task, "budget_minutes": args.budget_minutes, "steps": args.steps, "seed": args.seed,
                     "reward": reward, "val_every_seconds": args.val_every_seconds,
                     "overrides": CONTROL + (SHAPES if info is not None else []) + args.set},
        "base_model": {"path": str(model_dir), **info} if info is not None else None,
        "algorithms": results,
    }  # fmt: skip
    write_json(out, report)
    starts = {r["val_reward_start"] for r in results.values() if "val_reward_start" in r}
    base = starts.pop() if len(starts) == 1 else None  # one start for all: the base model's
    plot(results, out.with_suffix(".png"), base, reward, args.task)
    print("\n".join(summary_lines(results)))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def start_shapes_benchmark(script: str, stem: str, args, argv: list[str] | None) -> tuple[Path, dict, Path, dict]:
    """What a ShapesWorld benchmark with --threads, --model and --label does before its runs: logging and threads,
    the repository as the working directory, the base model (pretrained when absent), its results file
    (benchmarks/results/<stem>[_<label>].json) and its report's header (the command, the machine, the load)."""
    setup_logging(args.threads)
    os.chdir(ROOT)
    model_dir = Path(args.model).resolve()
    info = ensure_base_model(model_dir)
    out = ROOT / "benchmarks/results" / (stem + (f"_{args.label}" if args.label else "") + ".json")
    header = {"command": " ".join([f"python benchmarks/{script}", *(argv or sys.argv[1:])]),
              "machine": {**machine(), "load_average_before": [round(x, 2) for x in os.getloadavg()]}}  # fmt: skip
    return model_dir, info, out, header


def setup_logging(threads: int) -> None:
    """INFO lines from the benchmark, warnings only from the libraries, no progress bars; `threads` torch threads."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("diffusion_rl", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(threads)


def machine() -> dict:
    """The machine a result came from: CPU model, whether it has AMX tiles (bf16/fp32 results and speed differ
    with them), cores, platform, versions, /proc/loadavg now."""
    cpu, flags = None, ""
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and cpu is None:
                cpu = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value
    loadavg = Path("/proc/loadavg").read_text().strip() if Path("/proc/loadavg").is_file() else None
    return {"cpu": cpu or platform.processor(), "amx": "amx_tile" in flags.split(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
            "proc_loadavg": loadavg}  # fmt: skip


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
