"""Tree rollouts against flat ones at the same group size: transformer forwards per image and rollout wall time.

    python benchmarks/tree_rollout.py [--config configs/quickstart_tree.yaml] [--repeats 5] [--threads 2]

Samples one training step's batch (data.prompts_per_step × data.group_size rows) of the config's tiny model with
its tree (sampling.tree) and again flat (the same SDE window, sampling.tree=null), alternating, and prints the NFE
per image each rollout counted and the median wall time of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.data.prompts import load_prompts  # noqa: E402
from diffusion_rl.data.sampler import PromptSampler, make_step_prompts  # noqa: E402
from diffusion_rl.models.loader import load_model  # noqa: E402
from diffusion_rl.sampling.rollout import SamplerSettings, training_rollout  # noqa: E402
from diffusion_rl.sampling.window import window_for_step  # noqa: E402
from diffusion_rl.trainer.trainer import ensure_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/quickstart_tree.yaml"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load(args.config, args.set)
    ensure_model(cfg)
    model = load_model(cfg.model)
    records = load_prompts(cfg.data.train)
    prompts = make_step_prompts(records, PromptSampler(len(records), cfg.data.prompts_per_step, 0), 0,
                                cfg.data.group_size)  # fmt: skip
    ids = prompts.sample_ids(range(len(prompts)))
    window = window_for_step(cfg.sampling, cfg.run.seed, 0)
    tree = SamplerSettings.of(cfg.sampling)
    flat = dataclasses.replace(tree, tree=None)
    seconds = {"tree": [], "flat": []}
    nfe = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, settings in (("tree", tree), ("flat", flat)):
            start = time.perf_counter()
            traj = training_rollout(model, settings, prompts.prompts, prompts.negative_prompts, ids, 0, window,
                                    seed=cfg.run.seed, share_initial_noise=False)  # fmt: skip
            seconds[name].append(time.perf_counter() - start)
            nfe[name] = float(traj.nfe.mean())
    median = {k: statistics.median(v[1:]) for k, v in seconds.items()}
    with open("/proc/loadavg") as f:
        load_avg = f.read().split()[0]
    t = cfg.sampling.tree
    print(f"rows {len(prompts)} ({cfg.data.prompts_per_step} prompts × {cfg.data.group_size}), "
          f"{cfg.sampling.num_steps} steps, tree {t.branch_at} × {t.branching}")  # fmt: skip
    print(f"NFE per image: tree {nfe['tree']:.2f}, flat {nfe['flat']:.2f} ({nfe['tree'] / nfe['flat']:.3f}×)")
    print(f"rollout seconds (median of {args.repeats}): tree {median['tree']:.3f}, flat {median['flat']:.3f} "
          f"({median['tree'] / median['flat']:.3f}×); load average {load_avg}")  # fmt: skip


if __name__ == "__main__":
    main()
