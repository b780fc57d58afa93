"""Scoring overlapped with sampling: time of generate+reward for one training batch, chunks=1 vs chunks=N.

With `sampling.score_chunks: N` each chunk of the batch is scored in a background thread while the next chunk
samples. The gain is largest for rewards that wait (a judge server, a VLM over HTTP) and smaller for rewards
that compete with sampling for the same CPU cores. Measured in one run on the same model, batch and prompts:

    python benchmarks/reward_overlap.py [--batch 16] [--chunks 4] [--latency-ms 40] [--repeats 3]
Writes benchmarks/results/reward_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.data.ocr_prepare import write_synthetic_ocr  # noqa: E402
from diffusion_rl.models.tiny import save_tiny  # noqa: E402
from diffusion_rl.sampling.window import window_for_step  # noqa: E402
from diffusion_rl.trainer.timing import PhaseTimer  # noqa: E402
from diffusion_rl.trainer.trainer import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LATENCY_REWARD = """
import time
import numpy as np

def reward(images, prompts, metadata, latency_ms=40.0):
    time.sleep(latency_ms / 1000 * len(images))  # a judge that answers one image at a time
    return images.reshape(len(images), -1).mean(axis=1).astype(np.float32)
"""


def time_generate_and_score(trainer, repeats: int) -> float:
    window = window_for_step(trainer.cfg.sampling, trainer.cfg.run.seed, 0)
    trainer.source.collect(0, window, PhaseTimer())  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.source.collect(0, window, PhaseTimer())
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--latency-ms", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/reward_overlap.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny(Path(tmp) / "tiny", "sd3", "base")
        (Path(tmp) / "judge.py").write_text(LATENCY_REWARD)
        ocr_prompts = Path(tmp) / "ocr.jsonl"
        write_synthetic_ocr(32, ocr_prompts, seed=0)
        rewards = {
            "latency_judge": [
                f"rewards=[{{name: '{tmp}/judge.py:reward', kwargs: {{latency_ms: {args.latency_ms}}}}}]"
            ],
            "ocr": ["rewards=[{name: ocr}]", f"data.train={ocr_prompts}"],
            "jpeg": ["rewards=[{name: jpeg_compressibility}]"],
        }
        for name, overrides in rewards.items():
            times = {}
            for chunks in (1, args.chunks):
                cfg = load(ROOT / "configs/quickstart_flow_grpo.yaml", [
                    f"run.dir={tmp}/run_{name}_{chunks}", f"model.path={model}", "data.prompts_per_step=4",
                    f"data.group_size={args.batch // 4}", f"sampling.score_chunks={chunks}", "val.prompts=null",
                    "log.tensorboard=false", *overrides,
                ])  # fmt: skip
                times[chunks] = time_generate_and_score(Trainer(cfg), args.repeats)
            results[name] = {"chunks_1_s": times[1], f"chunks_{args.chunks}_s": times[args.chunks],
                             "ratio": times[args.chunks] / times[1]}  # fmt: skip
            print(f"{name}: {times[1]:.3f} s → {times[args.chunks]:.3f} s with {args.chunks} chunks "
                  f"(ratio {times[args.chunks] / times[1]:.2f})", flush=True)  # fmt: skip
    results["settings"] = vars(args) | {"python": sys.version.split()[0], "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
