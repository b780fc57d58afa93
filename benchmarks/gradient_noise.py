"""Gradient noise of one training step: how many prompts a step needs before its gradient points somewhere.

    python benchmarks/gradient_noise.py --only flow_grpo,awm,nft --groups 32 --seed 0
    python benchmarks/gradient_noise.py --only flow_grpo --groups 16 --set data.group_size=16 --label g16

For each algorithm: the ShapesWorld task of benchmarks/learning.py (the pretrained tiny model, `shapes_geneval`),
one rollout of `--groups` prompts × `data.group_size` images, scored and turned into targets as a training step
does; then the update loop runs with one unit per mini-batch and the optimizer step replaced by a recorder, so that
every sample's gradient g_i is read at the same (base) weights and nothing is trained. A prompt's group is the
independent unit (its advantages are centred within it), so the per-group mean gradients h_1 … h_G are i.i.d. draws
of a vector whose mean G is the step's expected gradient. With S1 = mean_j |h_j|² and S2 = |mean_j h_j|²:

    tr Σ = (S1 − S2) · G / (G − 1)        the variance of one group's gradient, summed over parameters
    |G|² = S2 − tr Σ / G                  the squared norm of the expected gradient (unbiased)
    B_noise = tr Σ / |G|²                 groups per step at which signal and noise are equal in the step's gradient
                                          (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training")

and, directly, the cosine between the mean gradients of two disjoint halves of the groups (two independent
half-size steps: near 0 when noise dominates). A step of P prompts has signal share |G|² / (|G|² + tr Σ / P).
B_noise is a ratio of estimates: with |G|² near or below 0 the signal is not resolved at this many groups (printed
as such); a bootstrap over the groups gives its 90 % interval. Writes benchmarks/results/gradient_noise[_<label>].json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning import (  # noqa: E402
    ROOT,
    algorithm_configs,
    build_config,
    start_shapes_benchmark,
    write_json,
)


def _signal_and_trace(gram: torch.Tensor, rows: torch.Tensor) -> tuple[float, float]:
    """|G|² and tr Σ of the groups `rows` (with repeats: a bootstrap resample), from the Gram matrix of the group
    gradients: |h_j|² are its diagonal, |mean_j h_j|² the mean of its entries over the rows."""
    G = len(rows)
    counts = torch.bincount(rows, minlength=gram.shape[0]).to(gram.dtype)
    s1 = float(counts @ gram.diagonal()) / G
    s2 = float(counts @ gram @ counts) / G**2
    trace = (s1 - s2) * G / (G - 1)
    return s2 - trace / G, trace


def noise_scale(group_grads: torch.Tensor, replicates: int = 2000, seed: int = 0) -> dict:
    """The estimates of the module docstring from per-group mean gradients [G, P] (float64); the groups' Gram matrix
    is kept in the result, so the estimates can be recomputed without the gradients."""
    G = group_grads.shape[0]
    gram = group_grads @ group_grads.T  # [G, G]
    half = G // 2
    a, b = group_grads[:half].mean(0), group_grads[half : 2 * half].mean(0)
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return {"groups": G, "half_batch_cosine": cosine, **estimates(gram, replicates, seed), "gram": gram.tolist()}


def estimates(gram: torch.Tensor, replicates: int = 2000, seed: int = 0) -> dict:
    """|G|², tr Σ and B_noise from the groups' Gram matrix, with a 90 % bootstrap interval over the groups.

    A resample's truth is the plug-in |mean_j h_j|² = S2 (what the resamples are drawn around), not the estimate
    |G|² = S2 − tr Σ / G, so the interval of |G|² is the estimate less the 95th and 5th percentiles of the resamples'
    error (|G|²* − S2); B_noise's is tr Σ over it (unbounded where |G|²'s lower end is not above 0)."""
    G = gram.shape[0]
    signal, trace = _signal_and_trace(gram, torch.arange(G))
    plug_in = float(gram.mean())
    gen = torch.Generator().manual_seed(seed)
    errors = sorted(_signal_and_trace(gram, torch.randint(G, (G,), generator=gen))[0] - plug_in
                    for _ in range(replicates))  # fmt: skip
    signal_lo, signal_hi = signal - errors[int(0.95 * (replicates - 1))], signal - errors[int(0.05 * (replicates - 1))]

    def b_noise(sig: float) -> float | None:
        return trace / sig if sig > 0 else None

    return {
        "batch_grad_sq_norm": plug_in,
        "trace_sigma": trace,
        "signal_sq_norm": signal,
        "signal_sq_norm_90ci": [signal_lo, signal_hi],
        "b_noise_groups": b_noise(signal),
        "b_noise_groups_90ci": [b_noise(signal_hi), b_noise(signal_lo)],  # None: unbounded (lower: no signal at all)
        "signal_share_at": {p: (signal / (signal + trace / p) if signal > 0 else 0.0) for p in (2, 8, 32, 128)},
    }


class GradientRecorder:
    """Stands in for the worker's optimizer step: adds the gradient of the unit just trained (one unit per
    mini-batch) to its group's sum and drops it; the weights never change."""

    def __init__(self, worker, group_of_row: torch.Tensor):
        self.params = worker.optimizer.params
        self.group_of_row = group_of_row.cpu()
        self.sums: dict[int, torch.Tensor] = {}
        self.current_group: int | None = None

    def loss_wrapper(self, loss_fn):
        def loss(units, k, at):
            self.current_group = int(units.traj.ids.group_index[0])
            return loss_fn(units, k, at)

        return loss

    def step(self) -> float:
        flat = torch.cat([
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double() for p in self.params
        ])  # fmt: skip
        if self.current_group in self.sums:
            self.sums[self.current_group] += flat
        else:
            self.sums[self.current_group] = flat
        for p in self.params:
            p.grad = None
        return float(flat.norm())

    def group_means(self, group_size: int, groups: list[int]) -> torch.Tensor:
        """[G, P]: each group's mean per-sample gradient (a group whose units carried no weight: zeros)."""
        size = next(iter(self.sums.values())).numel()
        return torch.stack([self.sums.get(g, torch.zeros(size, dtype=torch.float64)) / group_size for g in groups])


def measure(name: str, path: Path, args, model_dir: Path, info: dict) -> dict:
    from diffusion_rl.trainer import make_trainer
    from diffusion_rl.trainer.timing import PhaseTimer

    run_args = argparse.Namespace(seed=args.seed, threads=args.threads, set=list(args.set))
    work = Path(args.work) / f"{name}_{args.label or 'default'}"
    probe = build_config(path, work, run_args, model_dir, info)
    if probe.algorithm.spec.family != "policy_gradient" and probe.algorithm.loss not in ("awm", "nft"):
        raise SystemExit(f"{name}: measured for the policy-gradient losses, AWM and DiffusionNFT (one unit per row)")
    batch = args.groups * probe.data.group_size
    run_args.set += [f"data.prompts_per_step={args.groups}", f"train.num_minibatches={batch}",
                     "train.micro_batch_size=1", "train.ppo_epochs=1"]  # fmt: skip
    cfg = build_config(path, work, run_args, model_dir, info)
    torch.manual_seed(args.seed)
    trainer = make_trainer(cfg)
    worker = trainer.engine
    start = time.perf_counter()
    timer = PhaseTimer()
    from diffusion_rl.sampling.window import window_for_step

    window = window_for_step(cfg.sampling, cfg.run.seed, args.step)
    collected = trainer.source.collect(args.step, window, timer)
    targets, prepared = trainer.algorithm.prepare(collected.scored, collected.prompts.group_index)
    group_of_row = collected.prompts.group_index
    recorder = GradientRecorder(worker, group_of_row)
    worker.algorithm.loss = recorder.loss_wrapper(worker.algorithm.loss)
    worker.optimizer.step = recorder.step
    worker.update(targets, args.step)
    groups = sorted(set(group_of_row.tolist()))
    stats = noise_scale(recorder.group_means(cfg.data.group_size, groups))
    rewards = torch.as_tensor(collected.scored.total, dtype=torch.float64)
    return {
        "config": str(path.relative_to(ROOT)),
        "loss": cfg.algorithm.loss,
        "group_size": cfg.data.group_size,
        "guidance": cfg.sampling.guidance,
        "num_steps": cfg.sampling.num_steps,
        "noise_level": cfg.sampling.noise_level,
        "reward_mean": float(rewards.nanmean()),
        "zero_std_group_fraction": prepared.get("advantage/zero_std_group_fraction"),
        "advantage_abs_mean": prepared.get("advantage/abs_mean"),
        "parameters": next(iter(recorder.sums.values())).numel(),
        "seconds": round(time.perf_counter() - start, 1),
        **stats,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="flow_grpo,awm,nft", help="comma-separated algorithm names")
    parser.add_argument("--groups", type=int, default=32, help="prompts (groups) in the measured step")
    parser.add_argument("--step", type=int, default=0, help="which training step's prompts and noise to draw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=str(ROOT / "models/shapes"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every config")
    parser.add_argument("--label", default="", help="names the results file: gradient_noise_<label>.json")
    parser.add_argument("--work", default="/tmp/gradient_noise")
    args = parser.parse_args(argv)
    if args.groups < 4:
        sys.exit("--groups: at least 4 (two halves of two groups each)")
    model_dir, info, out, header = start_shapes_benchmark("gradient_noise.py", "gradient_noise", args, argv)
    results = {}
    for name, path in algorithm_configs(args.only.split(",")).items():
        results[name] = measure(name, path, args, model_dir, info)
        report = {**header, "groups": args.groups, "seed": args.seed, "overrides": args.set}
        write_json(out, {**report, "algorithms": results})  # after each algorithm: nothing is lost
    for name, r in results.items():
        b = r["b_noise_groups"]
        lo, hi = ("∞" if x is None else f"{x:.3g}" for x in r["b_noise_groups_90ci"])
        noise = ("unresolved" if b is None else f"{b:.1f} groups") + f" (90 % {lo}–{hi})"
        print(f"{name:<10} G={r['groups']:>3}×{r['group_size']:<3} zero-std {r['zero_std_group_fraction']:.2f}  "
              f"half-cos {r['half_batch_cosine']:+.3f}  B_noise {noise}  "
              f"share@8 {r['signal_share_at'][8]:.2f}  ({r['seconds']} s)")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
