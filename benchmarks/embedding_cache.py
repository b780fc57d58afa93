"""Training-step time with and without the prompt-embedding cache (model.embedding_cache), on a CPU, with a T5 at
its real sequence length.

The tiny SD3 (`base` preset: 2.3M-parameter transformer) with its T5 replaced by one of T5-v1.1-base's shape (12
layers, d_model 768, 12 heads of 64, gated-GELU d_ff 2048: 85M parameters with the tiny vocabulary; SD3's T5-XXL,
4.7B, does not fit a 2-core CPU benchmark) and model.max_sequence_length 256, as SD3 pipelines use. The quickstart's
step otherwise (Flow-GRPO, 10 steps at 64 px, 2 prompts × 4, CFG 4.5, JPEG compressibility). Two trainers on the
same model take turns, one step each; per arm the median of the measured steps after warm-up. The cache is filled
when its trainer starts (the one-off cost, reported apart), after which its text encoders are released.

    python benchmarks/embedding_cache.py [--steps 3] [--warmup 1] [--length 256]
Writes benchmarks/results/embedding_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.models.registry import save_pipeline  # noqa: E402
from diffusion_rl.models.tiny import build_seeded  # noqa: E402
from diffusion_rl.models.tiny import sd3 as tiny_sd3  # noqa: E402
from diffusion_rl.trainer import make_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
T5_BASE = {"d_model": 768, "d_ff": 2048, "d_kv": 64, "num_heads": 12, "num_layers": 12}  # T5-v1.1-base's shape
SHARED = ["model.device=cpu", "val.every=0", "val.before_train=false", "train.save_every=0", "log.tensorboard=false",
          "log.console_every=0", "log.progress_bar=false"]  # fmt: skip


def save_with_t5_base(directory: Path, spec: tiny_sd3.TinySpec):
    """The SD3 pipeline of `spec` (random weights, spec.t5_hidden = T5_BASE's d_model) with a T5 of T5-v1.1-base's
    shape, written to `directory`; returns the pipeline."""
    from transformers import T5Config, T5EncoderModel

    def build(spec):
        pipeline = tiny_sd3.build(spec)
        config = T5Config(vocab_size=len(pipeline.tokenizer_3), feed_forward_proj="gated-gelu", **T5_BASE)
        pipeline.text_encoder_3 = T5EncoderModel(config)
        return pipeline

    pipeline = build_seeded(build, spec, seed=0)
    save_pipeline("sd3", pipeline, directory)
    return pipeline


def build_model(directory: Path, length: int) -> int:
    """The tiny SD3 with a T5-base-shaped encoder (random weights) at `directory`; its T5 parameter count."""
    from dataclasses import replace

    spec = replace(tiny_sd3.PRESETS["base"], t5_hidden=T5_BASE["d_model"], max_sequence_length=length)
    pipeline = save_with_t5_base(directory, spec)
    return sum(p.numel() for p in pipeline.text_encoder_3.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="measured steps per arm")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    parser.add_argument("--length", type=int, default=256, help="model.max_sequence_length (SD3: 256 or 512)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/embedding_cache.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="embedding_cache_"))
    t5_params = build_model(work / "model", args.length)
    arms = {"no cache": [], "cache": ["model.embedding_cache=auto"]}
    trainers, start_s, released = {}, {}, {}
    for arm, overrides in arms.items():
        cfg = load(ROOT / "configs/quickstart_flow_grpo.yaml", [f"model.path={work / 'model'}", f"run.dir={work / arm}",
                                                     f"model.max_sequence_length={args.length}",
                                                     f"train.total_steps={args.steps + args.warmup}", *SHARED,
                                                     *overrides])  # fmt: skip
        started = time.perf_counter()
        trainers[arm] = make_trainer(cfg)
        start_s[arm] = time.perf_counter() - started
        pipeline = trainers[arm].engine.model.pipeline
        released[arm] = [
            n for n in ("text_encoder", "text_encoder_2", "text_encoder_3") if getattr(pipeline, n) is None
        ]
    steps: dict[str, list[float]] = {arm: [] for arm in arms}
    loads = []
    for step in range(args.steps + args.warmup):  # the arms take turns, one step each
        for arm, trainer in trainers.items():
            started = time.perf_counter()
            trainer.train_step(step)
            if step >= args.warmup:
                steps[arm].append(time.perf_counter() - started)
        loads.append(os.getloadavg())
    median = {arm: statistics.median(s) for arm, s in steps.items()}
    ratio = median["cache"] / median["no cache"]
    for arm in arms:
        print(f"{arm:<10} step {median[arm]:.3f} s (steps {', '.join(f'{s:.3f}' for s in steps[arm])}); "
              f"start {start_s[arm]:.1f} s; released: {', '.join(released[arm]) or 'none'}")  # fmt: skip
    print(f"step-time ratio, cache / no cache: {ratio:.3f}× (T5 {t5_params / 1e6:.0f}M params, {args.length} tokens)")
    print(f"load average during the steps: {', '.join(f'{a[0]:.2f}' for a in loads)}")
    record = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "settings": {
            "t5": T5_BASE,
            "t5_parameters": t5_params,
            "max_sequence_length": args.length,
            "warmup": args.warmup,
            "batch": "2 prompts × 4",
            "num_steps": 10,
            "size": 64,
        },  # fmt: skip
        "step_s": steps,
        "median_step_s": median,
        "ratio": ratio,
        "start_s": start_s,
        "released": released,
        "load_average": loads,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
