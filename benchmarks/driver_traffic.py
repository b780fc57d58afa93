"""Bytes through the Ray driver per training step: the design before (every trajectory up to the driver and back
down) against now (images up for scoring, targets down), printed as a ratio.

- At the quickstart shape, measured: the "after" bytes are the `driver/bytes_in|out` a Ray run logs (2 workers);
  the "before" bytes are the size of the step's trajectories with their images (what `generate` used to return
  and `update` to receive), measured on the same step, twice.
- At a real shape, computed from the config: Qwen-Image at 512 px, 512 images a step (32 prompts × 16), 10 SDE
  steps, true CFG, prompt embeddings of 1024 tokens × 3584 (Qwen2.5-VL-7B) in bf16, latents in fp32.

    python benchmarks/driver_traffic.py [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from ray_setup import ROOT  # noqa: E402,I001 -- first: the environment before torch and Ray

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.engine.ray_cluster import payload_bytes  # noqa: E402
from diffusion_rl.models.tiny import save_tiny  # noqa: E402
from diffusion_rl.sampling.window import window_for_step  # noqa: E402
from diffusion_rl.trainer.timing import PhaseTimer  # noqa: E402
from diffusion_rl.trainer.trainer import Trainer  # noqa: E402

MIB = 2**20


def real_shape(images: int = 512, sde_steps: int = 10, tokens: int = 1024, hidden: int = 3584) -> dict:
    """Qwen-Image at 512 px: latents [32, 32, 64] (a 64 × 64 × 16 VAE latent packed 2 × 2), fp32."""
    latent = 32 * 32 * 64 * 4
    per_sample = {
        "latents (W+1 steps)": (sde_steps + 1) * latent,
        "step means (W)": sde_steps * latent,
        "final latents": latent,
        "log-probs, stds, sigmas (W each)": sde_steps * 4 * 4 + sde_steps * 8,
        "prompt + negative embeddings (bf16)": 2 * tokens * hidden * 2 + 2 * tokens,
        "image (uint8)": 512 * 512 * 3,
    }
    trajectory = sum(per_sample.values())
    before = images * (2 * trajectory)  # up (generate returned it), down (update received it)
    after_in = images * per_sample["image (uint8)"]
    after_out = images * (4 + 8) + images * 64  # advantages and ids, ~64 bytes of prompt text per row
    return {"per_sample_bytes": per_sample, "before": before, "after": after_in + after_out}


def quickstart_shape(workdir: Path) -> dict:
    """The quickstart's reduced shape (tiny SD3, 64 px, 4 prompts × 4, the quickstart's window) on 2 Ray workers."""
    import ray

    model = save_tiny(workdir / "model", "sd3", "base", seed=0)
    common = [f"model.path={model}", "val.every=0", "val.before_train=false", "log.progress_bar=false",
              "data.prompts_per_step=4", "data.group_size=4", "train.total_steps=2"]  # fmt: skip
    local = Trainer(load(str(ROOT / "configs/quickstart_flow_grpo.yaml"), [*common, f"run.dir={workdir / 'local'}"]))
    local.source.collect(0, window_for_step(local.cfg.sampling, local.cfg.run.seed, 0), PhaseTimer())
    trajectory = payload_bytes(local.engine.kept.rows(0))  # the step's rows, kept for the update
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        cfg = load(str(ROOT / "configs/quickstart_flow_grpo.yaml"),
                   [*common, f"run.dir={workdir / 'ray'}", "engine.kind=ray", "engine.num_workers=2"])  # fmt: skip
        trainer = Trainer(cfg)
        try:
            rows = [trainer.train_step(step) for step in range(2)]
        finally:
            trainer.engine.close()
    finally:
        ray.shutdown()
    after = rows[-1]["driver/bytes_in"] + rows[-1]["driver/bytes_out"]
    images = cfg.batch_size * cfg.sampling.height * cfg.sampling.width * 3
    return {"trajectory_bytes": trajectory, "images_bytes": images, "before": 2 * trajectory, "after": after,
            "after_in": rows[-1]["driver/bytes_in"], "after_out": rows[-1]["driver/bytes_out"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        quick = quickstart_shape(Path(tmp))
    real = real_shape()
    result = {"quickstart": quick, "qwen_image_512px_512_images": real}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for name, r in result.items():
        ratio = r["before"] / r["after"]
        print(f"{name}: before {r['before'] / MIB:,.2f} MiB, after {r['after'] / MIB:,.2f} MiB a step: {ratio:,.0f}×")
    for field, size in real["per_sample_bytes"].items():
        print(f"  Qwen-Image, per sample: {field}: {size / MIB:.3f} MiB")


if __name__ == "__main__":
    main()
