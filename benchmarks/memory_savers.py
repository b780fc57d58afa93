"""Peak memory and step time of each memory saver, on a medium SD3-architecture model on the CPU.

The model: a random-weight StableDiffusion3Pipeline built from the real diffusers/transformers classes, with a
transformer of ~100M parameters (5 joint blocks of width 768, 16 latent channels, an 8× VAE as SD3's), tiny CLIPs
and a T5 of T5-v1.1-base's shape (85M), written to disk and loaded back through the loader a real checkpoint goes
through. The step: the quickstart's Flow-GRPO step on it, full fine-tuning (AdamW), 128 px, 1 prompt × 4 images,
4 sampling steps (3 SDE), CFG 4.5, micro-batch 4.

Each arm turns one switch on (the last turns on every saver that frees memory on a CPU) and runs in a process of its
own, so its peak RSS (`ru_maxrss`) is its own: the whole process, loading included, since that is what meets the
machine's limit. Also reported: the RSS once the trainer is built (before the first step) and the median step time
after a warm-up step.

    python benchmarks/memory_savers.py [--steps 2] [--warmup 1] [--only baseline,checkpointing]
Writes benchmarks/results/memory_savers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedding_cache import T5_BASE, save_with_t5_base  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the transformer's sizes; its T5 has T5-v1.1-base's shape (benchmarks/embedding_cache.py), the CLIPs stay tiny
MEDIUM = {"layers": 5, "head_dim": 64, "heads": 12, "latent_channels": 16, "vae_channels": (32, 32, 32, 32),
          "clip_hidden": 64, "t5_hidden": T5_BASE["d_model"], "text_layers": 2, "max_sequence_length": 128,
          "sample_size": 128}  # fmt: skip
STEP = ["model.device=cpu", "model.max_sequence_length=128", "sampling.height=128", "sampling.width=128",
        "sampling.num_steps=4", "data.prompts_per_step=1", "data.group_size=4", "train.micro_batch_size=4",
        "train.lr=1e-5", "val.every=0", "val.before_train=false", "train.save_every=0", "log.tensorboard=false",
        "log.console_every=0", "log.progress_bar=false", "engine.num_threads=2"]  # fmt: skip
ARMS = {
    "baseline": [],
    "checkpointing": ["model.gradient_checkpointing=true"],
    "latents_bf16": ["sampling.latents_dtype=bf16"],
    "embedding_cache": ["model.embedding_cache=auto"],
    "offload_frozen": ["model.offload_frozen=true"],
    "autocast_bf16": ["model.autocast=bf16"],
    "lora": ["model.lora.enabled=true", "model.lora.rank=32", "model.lora.alpha=32", "train.lr=1e-4"],
    "all": [
        "model.gradient_checkpointing=true",
        "sampling.latents_dtype=bf16",
        "model.embedding_cache=auto",
        "model.lora.enabled=true",
        "model.lora.rank=32",
        "model.lora.alpha=32",
        "train.lr=1e-4",
    ],  # fmt: skip
}


def rss_mib() -> float:
    """The process's resident set now, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def build_model(directory: Path) -> dict[str, int]:
    """The medium SD3 (random weights) at `directory`; the parameter counts of its components."""
    from diffusion_rl.models.tiny import sd3 as tiny_sd3

    pipeline = save_with_t5_base(directory, tiny_sd3.TinySpec(**MEDIUM))
    return {name: sum(p.numel() for p in module.parameters()) for name, module in pipeline.components.items()
            if isinstance(module, torch.nn.Module)}  # fmt: skip


def run_arm(model: Path, arm: str, steps: int, warmup: int, work: Path) -> dict:
    """One arm in this process: build its trainer, take warm-up + measured steps."""
    from diffusion_rl.config import load
    from diffusion_rl.trainer import make_trainer

    overrides = [f"model.path={model}", f"run.dir={work / arm}", f"train.total_steps={steps + warmup}", *STEP,
                 *ARMS[arm]]  # fmt: skip
    trainer = make_trainer(load(ROOT / "configs/quickstart_flow_grpo.yaml", overrides))
    built_mib = rss_mib()
    times = []
    for step in range(steps + warmup):
        started = time.perf_counter()
        trainer.train_step(step)
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return {
        "step_s": times,
        "median_step_s": statistics.median(times),
        "rss_after_build_mib": built_mib,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load_average": os.getloadavg(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="measured steps per arm")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    parser.add_argument("--only", default="", help="comma-separated arms (default: all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/memory_savers.json"))
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm in this process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.arm:
        print(json.dumps(run_arm(Path(args.model), args.arm, args.steps, args.warmup, Path(args.work))))
        return
    arms = [a for a in args.only.split(",") if a] or list(ARMS)
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        parser.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    work = Path(tempfile.mkdtemp(prefix="memory_savers_"))
    params = build_model(work / "model")
    sizes = ", ".join(f"{name} {n / 1e6:.1f}M" for name, n in params.items())
    print(f"medium SD3 ({sizes} parameters) written to {work / 'model'}")
    results = {}
    for arm in arms:
        command = [sys.executable, __file__, "--arm", arm, "--model", str(work / "model"), "--work", str(work),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"arm {arm} failed:\n{done.stderr[-3000:]}")
        results[arm] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[arm]
        print(f"{arm:<16} peak RSS {r['peak_rss_mib']:7.0f} MiB (built {r['rss_after_build_mib']:6.0f}), "
              f"step {r['median_step_s']:6.2f} s, load {r['load_average'][0]:.2f}", flush=True)  # fmt: skip
    if "baseline" in results:
        base = results["baseline"]
        print("\n| arm | peak RSS MiB | vs baseline | RSS after build MiB | step s | vs baseline |")
        print("|---|---|---|---|---|---|")
        for arm, r in results.items():
            print(f"| {arm} | {r['peak_rss_mib']:.0f} | {r['peak_rss_mib'] / base['peak_rss_mib']:.2f}× | "
                  f"{r['rss_after_build_mib']:.0f} | {r['median_step_s']:.2f} | "
                  f"{r['median_step_s'] / base['median_step_s']:.2f}× |")  # fmt: skip
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "model": {"spec": MEDIUM, "t5": T5_BASE, "parameters": params},
        "step": STEP,
        "arms": {arm: ARMS[arm] for arm in arms},
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
