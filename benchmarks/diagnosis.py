"""Why an algorithm learns or not on the ranking's task: its per-step training metrics, side by side.

    python benchmarks/diagnosis.py --only flow_grpo,awm,nft --steps 60 --seed 0

Each algorithm trains the ShapesWorld task of benchmarks/learning.py (the pretrained tiny model, `shapes_geneval`, its
own quickstart config, lr 3e-5, 2 prompts × 4 images per step unless --set says otherwise) for --steps steps,
without validation, and every step's metrics that say whether an update can move the model are kept: the share of
groups whose rewards are all equal (no advantage), the mean |advantage|, the clip fraction, the spread of the
likelihood ratio, the approximate KL to the rollout policy, the gradient norm and the relative weight change of the
optimizer step (train/weight_change_rel). Writes benchmarks/results/diagnosis[_<label>].json (every step) and prints
each metric's mean over the first, middle and last third of the steps. Read it beside benchmarks/gradient_noise.py,
which measures how much of one step's gradient is signal.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import ROOT, algorithm_configs, build_config, start_shapes_benchmark, write_json  # noqa: E402

# (column, metric key): what the update saw at each step
METRICS = (
    ("reward", "reward/mean"),
    ("zero-std groups", "advantage/zero_std_group_fraction"),
    ("|A| mean", "advantage/abs_mean"),
    ("clip frac", "clip_fraction"),
    ("ratio std", "ratio_std"),
    ("approx KL", "approx_kl"),
    ("grad norm", "grad_norm"),
    ("|Δθ|/|θ|", "train/weight_change_rel"),
)


def run(name: str, path: Path, args, model_dir: Path, info: dict, work: Path) -> list[dict]:
    from diffusion_rl.trainer import make_trainer

    run_args = argparse.Namespace(seed=args.seed, threads=args.threads, set=["log.weight_change=on", *args.set])
    cfg = build_config(path, work / name, run_args, model_dir, info)
    torch.manual_seed(args.seed)
    trainer = make_trainer(cfg)
    rows = []
    for step in range(args.steps):
        metrics = trainer.train_step(step)
        rows.append({key: float(metrics[key]) for _, key in METRICS if key in metrics})
    return rows


def thirds(rows: list[dict], key: str) -> list[float | None]:
    """The mean of `key` over the first, middle and last third of the steps (None where it was not logged)."""
    n = len(rows)
    parts = [rows[: n // 3], rows[n // 3 : 2 * n // 3], rows[2 * n // 3 :]]
    return [sum(r[key] for r in p) / len(p) if p and all(key in r for r in p) else None for p in parts]


def table(results: dict) -> list[str]:
    lines = [f"{'metric':<16}" + "".join(f"{name:>34}" for name in results)]
    for title, key in METRICS:
        cells = []
        for rows in results.values():
            values = thirds(rows, key)
            cells.append(" → ".join("–" if v is None else f"{v:.3g}" for v in values))
        lines.append(f"{title:<16}" + "".join(f"{c:>34}" for c in cells))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="flow_grpo,awm,nft", help="comma-separated algorithm names")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=str(ROOT / "models/shapes"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every config")
    parser.add_argument("--label", default="", help="names the results file: diagnosis_<label>.json")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps: at least 3 (the table shows thirds)")
    model_dir, info, out, header = start_shapes_benchmark("diagnosis.py", "diagnosis", args, argv)
    report = {**header, "steps": args.steps, "seed": args.seed, "overrides": args.set, "algorithms": {}}
    results = report["algorithms"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in algorithm_configs(args.only.split(",")).items():
            results[name] = run(name, path, args, model_dir, info, Path(tmp))
            write_json(out, report)  # after each algorithm: nothing is lost
    print("\n".join(table(results)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
