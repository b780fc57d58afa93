"""Quality per model call of the ODE solvers (`sampling.ode_solver`) on the tiny model.

ODE samples at N steps (one velocity evaluation per step, CFG included, for every solver) against a fine reference
from the same initial noise and prompts; the distance is the pixel RMSE of the decoded uint8 images (0–255 scale)
and the RMSE of the final latents. The reference is 200 `ab2` steps; its own size is shown by how far 200 euler
steps are from it.

    python benchmarks/ode_solver.py [--preset base] [--steps 4 6 10 20] [--batch 8] [--size 64]
Writes benchmarks/results/ode_solver.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from diffusion_rl.config import LoraConfig, ModelConfig  # noqa: E402
from diffusion_rl.models.loader import load_model  # noqa: E402
from diffusion_rl.models.tiny import save_tiny  # noqa: E402
from diffusion_rl.sampling.ode import ODE_SOLVERS  # noqa: E402
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, rollout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red cube on a table", "a blue ball", "green grass under a sky", "a yellow star"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--steps", type=int, nargs="+", default=[4, 6, 10, 20])
    p.add_argument("--reference-steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--guidance", type=float, default=4.5)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/ode_solver.json"))
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny(Path(tmp) / "tiny", "sd3", args.preset, seed=0)
        model = load_model(ModelConfig(path=str(path), device="cpu", max_sequence_length=32,
                                       lora=LoraConfig(enabled=False)))  # fmt: skip
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    cond = model.encode_prompts(prompts)
    seeds = list(range(1000, 1000 + args.batch))

    def sample(steps: int, solver: str):
        settings = SamplerSettings(steps, args.guidance, args.size, args.size, ode_solver=solver)
        traj = rollout(model, cond, settings, None, init_seeds=seeds, noise_seeds=seeds, ids=anonymous_ids(prompts))
        return traj.final_latents, traj.images.float()

    def rmse(a, b) -> float:
        return float(((a - b) ** 2).mean().sqrt())

    start = time.perf_counter()
    ref_latents, ref_images = sample(args.reference_steps, "ab2")
    rows = []
    for steps in [*args.steps, args.reference_steps]:
        for solver in ODE_SOLVERS:
            if steps == args.reference_steps and solver == "ab2":
                continue
            latents, images = sample(steps, solver)
            rows.append({"steps": steps, "solver": solver, "pixel_rmse": rmse(images, ref_images),
                         "latent_rmse": rmse(latents, ref_latents)})  # fmt: skip
            print(f"N={steps:4d} {solver:6s} pixel RMSE {rows[-1]['pixel_rmse']:7.3f}  "
                  f"latent RMSE {rows[-1]['latent_rmse']:.4f}")  # fmt: skip
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "preset": args.preset,
        "batch": args.batch,
        "size": args.size,
        "guidance": args.guidance,
        "reference": f"{args.reference_steps} ab2 steps",
        "loadavg": os.getloadavg(),
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
