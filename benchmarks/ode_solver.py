"""Quality per model call of the ODE solvers (`sampling.ode_solver`) on the tiny model.

ODE samples at N steps (one velocity evaluation per step, CFG included, for every solver) against a fine reference
from the same initial noise and prompts; the distance is the pixel RMSE of the decoded uint8 images (0–255 scale)
and the RMSE of the final latents. The reference is 200 `ab2` steps; its own size is shown by how far 200 euler
steps are from it.

Second part, the step after an SDE window: a window of 2 SDE steps from step 0 (noise level 0.7), then the ODE
steps with each solver, restarting its history after the window (what `rollout` does) or keeping the prediction
of the last SDE step's starting point (what MixGRPO's code does), against a fine ODE solution (the coarse schedule
refined 25× between its points, `ab2`) from the same post-window state.

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

from diffusion_rl.config.model import LoraConfig, ModelConfig  # noqa: E402
from diffusion_rl.models.loader import load_model  # noqa: E402
from diffusion_rl.models.tiny import save_tiny  # noqa: E402
from diffusion_rl.sampling.ode import ODE_SOLVER_NAMES, OdeSolver  # noqa: E402
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, rollout  # noqa: E402
from diffusion_rl.sampling.window import SdeWindow  # noqa: E402

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
    p.add_argument("--after-window-steps", type=int, nargs="+", default=[6, 10])
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
        for solver in ODE_SOLVER_NAMES:
            if steps == args.reference_steps and solver == "ab2":
                continue
            latents, images = sample(steps, solver)
            rows.append({"steps": steps, "solver": solver, "pixel_rmse": rmse(images, ref_images),
                         "latent_rmse": rmse(latents, ref_latents)})  # fmt: skip
            print(f"N={steps:4d} {solver:6s} pixel RMSE {rows[-1]['pixel_rmse']:7.3f}  "
                  f"latent RMSE {rows[-1]['latent_rmse']:.4f}")  # fmt: skip
    after = [row for steps in args.after_window_steps for row in after_window(model, cond, prompts, seeds, args, steps)]
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
        "after_window": after,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")


@torch.no_grad()
def after_window(model, cond, prompts, seeds, args, steps: int, size: int = 2) -> list[dict]:
    settings = SamplerSettings(steps, args.guidance, args.size, args.size, "sde", 0.7)
    traj = rollout(model, cond, settings, SdeWindow(0, size), init_seeds=seeds, noise_seeds=seeds,
                   ids=anonymous_ids(prompts))  # fmt: skip
    sigmas = model.sigma_schedule(steps, args.size, args.size).tolist()
    x_before, x_after = traj.latents[:, -2], traj.latents[:, -1]  # around the last SDE step (σ_{size−1} → σ_size)

    def velocity(x, sigma):
        with model.eval_mode():
            return model.velocity(x, sigma, cond, args.guidance)

    def integrate(schedule, solver: str, keep_history: bool):
        ode, x = OdeSolver(solver), x_after
        if keep_history:  # the history as if the SDE step had been an ODE step from x_before
            ode.step(x_before, velocity(x_before, sigmas[size - 1]), sigmas[size - 1], sigmas[size])
        for sigma, sigma_next in zip(schedule[:-1], schedule[1:]):
            x = ode.step(x, velocity(x, sigma), sigma, sigma_next)
        return x

    coarse = sigmas[size:]
    fine = [a + (b - a) * i / 25 for a, b in zip(coarse[:-1], coarse[1:]) for i in range(25)] + [0.0]
    reference = integrate(fine, "ab2", False)
    ref_images = model.decode(reference).float()
    rows = []
    for solver, keep in (("euler", False), ("dpm2", False), ("dpm2", True), ("ab2", False), ("ab2", True)):
        x = integrate(coarse, solver, keep)
        row = {"steps": steps, "window": size, "solver": solver, "history": "kept" if keep else "restart",
               "latent_rmse": float(((x - reference) ** 2).mean().sqrt()),
               "pixel_rmse": float(((model.decode(x).float() - ref_images) ** 2).mean().sqrt())}  # fmt: skip
        rows.append(row)
        print(f"after a {size}-step window, N={steps}: {solver:5s} {row['history']:7s} "
              f"pixel RMSE {row['pixel_rmse']:6.3f} latent RMSE {row['latent_rmse']:.4f}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
