"""The time of one training step of each family's tiny model at the same settings, next to SD3's.

Each family's `base` tiny model, full fine-tuning, Flow-GRPO (10 SDE steps, 9 trained), 2 prompts × group 4 at
32 × 32 px, JPEG compressibility (frame-wise for video), micro-batches of 8: the quickstart's step. Wan samples 9
frames (3 latent frames; image-to-video from a ShapesWorld first frame); the edit families edit a ShapesWorld source
(configs/prompts/shapes_edits). Per family: the median over the measured steps of `timing/generate`, `timing/update`
and `timing/step`, after warm-up steps, the families taking turns so a change of machine load hits each alike. The
load average is recorded with them.

    python benchmarks/family_step_time.py [--steps 4] [--warmup 1] [--families sd3 flux2 ...]
Writes benchmarks/results/family_step_time.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.models.tiny import build_tiny, save_tiny  # noqa: E402
from diffusion_rl.trainer import make_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EDITS = ROOT / "configs/prompts/shapes_edits"
FAMILIES = {  # family → overrides of configs/quickstart_flow_grpo.yaml beyond the shared ones
    "sd3": [],
    "flux2": ["sampling.guidance=1"],  # FLUX.2-klein: step-distilled, CFG-free
    "flux2_dev": ["sampling.guidance=4"],  # FLUX.2-dev: the guidance embedding, one forward
    "z_image": [],
    "wan": ["sampling.num_frames=9"],
    "wan_i2v": ["sampling.num_frames=9", f"data.train={EDITS / 'train.jsonl'}"],  # a ShapesWorld scene as frame 0
    "qwen_image_edit": [f"data.train={EDITS / 'train.jsonl'}", "model.max_sequence_length=256"],
    "flux_kontext": [f"data.train={EDITS / 'train.jsonl'}", "sampling.guidance=3.5"],
}
TINY = {"flux2_dev": ("flux2", "dev")}  # a row's (family, preset) where it is not (row, "base")
SHARED = ["model.device=cpu", "sampling.height=32", "sampling.width=32", "val.every=0", "val.before_train=false",
          "train.save_every=0", "log.tensorboard=false", "log.console_every=0", "log.progress_bar=false"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="measured steps per family")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES),
                        help="the rows to measure (sd3 first: the ratios are to it)")  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/family_step_time.json"))
    args = parser.parse_args()
    if args.families[0] != "sd3":
        parser.error("--families: start with sd3, the row the others' ratios are to")
    torch.set_num_threads(2)
    results, work = {}, Path(tempfile.mkdtemp(prefix="family_step_time_"))
    trainers = {}
    for family in args.families:
        overrides = FAMILIES[family]
        tiny = TINY.get(family, (family, "base"))
        model_dir = save_tiny(work / f"model_{family}", *tiny, seed=0)
        cfg = load(ROOT / "configs/quickstart_flow_grpo.yaml", [f"model.path={model_dir}", f"run.dir={work / family}",
                                                     f"train.total_steps={args.steps + args.warmup}", *SHARED,
                                                     *overrides])  # fmt: skip
        trainers[family] = make_trainer(cfg)
        params = sum(p.numel() for p in build_tiny(*tiny).transformer.parameters())
        results[family] = {"transformer_parameters": params, "steps": [], "overrides": overrides}
    for step in range(args.steps + args.warmup):  # the families take turns, one step each
        for family, trainer in trainers.items():
            metrics = trainer.train_step(step)
            if step >= args.warmup:
                results[family]["steps"].append({k: metrics[k] for k in ("timing/generate", "timing/update")})
        load_average = os.getloadavg()[0]
        for family in trainers:
            results[family].setdefault("load_average", []).append(load_average)
    sd3 = None
    print(f"{'family':<16}{'params':>10}{'generate s':>12}{'update s':>10}{'step s':>9}{'× sd3':>8}")
    for family, r in results.items():
        generate = statistics.median(s["timing/generate"] for s in r["steps"])
        update = statistics.median(s["timing/update"] for s in r["steps"])
        r.update(generate_s=generate, update_s=update, step_s=generate + update)
        sd3 = sd3 or r["step_s"]
        r["vs_sd3"] = r["step_s"] / sd3
        print(f"{family:<16}{r['transformer_parameters'] / 1e6:>9.2f}M{generate:>12.3f}{update:>10.3f}"
              f"{r['step_s']:>9.3f}{r['vs_sd3']:>7.2f}×")  # fmt: skip
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "settings": {"preset": "base", "size": 32, "batch": "2 prompts × 4", "num_steps": 10, "warmup": args.warmup},
        "families": results,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
