"""Speed benchmarks, each a ratio measured in one run on the same model, batch and inputs.

- sampler: our rollout (SDE window with log-probs) vs diffusers' StableDiffusion3Pipeline call at the same
  steps, CFG, batch and precomputed text embeddings (goal ≤ 0.95×);
- update: our Flow-GRPO update vs a bare forward+backward of the transformer on the same inputs (plus one
  no-grad forward per trained step when the KL term is on) (goal ≤ 1.05×);
- end to end: images per second of a whole training step of the quickstart and the share of each phase;
- where the sampler's time goes: transformer, VAE decode, everything else (ours and the pipeline's);
- memory: peak RSS of the process (CPU) / peak allocated (GPU).

    python benchmarks/speed.py [--preset base] [--batch 8] [--steps 10] [--device cpu] [--repeats 3] [--e2e-steps 5]
Writes benchmarks/results/speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from diffusion_rl.algorithms.credit import Targets  # noqa: E402
from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.engine.worker import PolicyWorker  # noqa: E402
from diffusion_rl.models.tiny import save_tiny, tiny_presets  # noqa: E402
from diffusion_rl.sampling.rollout import anonymous_ids, rollout  # noqa: E402
from diffusion_rl.sampling.window import default_window  # noqa: E402
from diffusion_rl.trainer.setup import worker_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def best_of(*fns, repeats: int) -> list[float]:
    """The best time of each function over `repeats` runs after a warm-up, the functions taking turns so that a
    change of machine load while measuring hits each alike."""
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, runs in zip(fns, times):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - start)
    return [min(runs) for runs in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base", choices=sorted(tiny_presets("sd3")))
    parser.add_argument("--model", default=None, help="an existing diffusers model dir instead of the tiny one")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--guidance", type=float, default=4.5)
    parser.add_argument("--kl-beta", type=float, default=0.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="model.compile=true: our sampler torch.compile'd")
    parser.add_argument("--e2e-steps", type=int, default=5, help="training steps timed end to end (0 = skip)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/speed.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or save_tiny(Path(tmp) / "tiny", "sd3", args.preset)
        cfg = load(ROOT / "configs/quickstart_flow_grpo.yaml", [
            f"run.dir={tmp}/run", f"model.path={model_dir}", f"model.device={args.device}",
            f"model.dtype={args.dtype}", f"sampling.num_steps={args.steps}", f"sampling.guidance={args.guidance}",
            f"sampling.height={args.size}", f"sampling.width={args.size}", "data.prompts_per_step=1",
            f"data.group_size={args.batch}", f"train.micro_batch_size={args.batch}",
            f"algorithm.flow_grpo.kl_beta={args.kl_beta}", f"model.compile={str(args.compile).lower()}",
        ])  # fmt: skip
        worker = PolicyWorker(worker_spec(cfg))
        results = run_benchmarks(worker, cfg, args)
        del worker
        if args.e2e_steps > 0:
            e2e_cfg = load(ROOT / "configs/quickstart_flow_grpo.yaml", [
                f"run.dir={tmp}/e2e", f"model.path={model_dir}", f"model.device={args.device}",
                f"model.dtype={args.dtype}", f"sampling.num_steps={args.steps}", f"sampling.guidance={args.guidance}",
                f"sampling.height={args.size}", f"sampling.width={args.size}", "val.prompts=null",
                f"algorithm.flow_grpo.kl_beta={args.kl_beta}", "log.tensorboard=false", "log.progress_bar=false",
                f"model.compile={str(args.compile).lower()}",
            ])  # fmt: skip
            results["end_to_end"] = run_end_to_end(e2e_cfg, args.e2e_steps)
    results["machine"] = {"platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__, "threads": args.threads, "device": args.device,
                          "cpus": os.cpu_count(), "load_average_before": [round(x, 2) for x in load_before],
                          "load_average_after": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
    results["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if torch.cuda.is_available():
        results["peak_cuda_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def run_benchmarks(worker: PolicyWorker, cfg, args) -> dict:
    model, B = worker.model, args.batch
    prompts = ["a red apple on a wooden table"] * B
    cond = model.encode_prompts(prompts, [""] * B)
    seeds = list(range(B))
    window = default_window(args.steps)

    ids = anonymous_ids(prompts)

    def ours():
        return rollout(model, cond, worker.settings, window, init_seeds=seeds, noise_seeds=seeds, ids=ids)

    pipe = model.pipeline
    pipe.set_progress_bar_config(disable=True)

    def diffusers_pipeline():
        with torch.no_grad():
            pipe(prompt_embeds=cond["prompt_embeds"], pooled_prompt_embeds=cond["pooled_prompt_embeds"],
                 negative_prompt_embeds=cond["negative_prompt_embeds"],
                 negative_pooled_prompt_embeds=cond["negative_pooled_prompt_embeds"],
                 num_inference_steps=args.steps, guidance_scale=args.guidance, height=args.size, width=args.size,
                 output_type="np")  # fmt: skip

    t_ours, t_pipe = best_of(ours, diffusers_pipeline, repeats=args.repeats)

    # update: the same trajectory, one optimizer step over all trained steps
    traj = ours()
    targets = Targets(advantages=torch.linspace(-1, 1, B), batch_size=[B])
    state = {k: v.detach().clone() for k, v in model.policies.trainable_state_dict().items()}

    def our_update():
        worker.kept.add(0, traj)  # the kept rollout the update trains on (the update releases it)
        worker.update(targets, step=0)

    transformer, params = model.policies.module, model.trainable_parameters()

    def bare_forward_backward():
        # the same network work: per trained step one guided forward (2B rows) + backward, optional ref forward
        for j in range(traj.window_size):
            v = model.velocity(traj.latents[:, j], traj.sigmas[:, j], cond, args.guidance)
            v.square().mean().backward()
            if args.kl_beta > 0:
                with torch.no_grad(), model.reference():
                    model.velocity(traj.latents[:, j], traj.sigmas[:, j], cond, args.guidance)
        for p in params:
            p.grad = None

    t_update, t_bare = best_of(our_update, bare_forward_backward, repeats=args.repeats)
    model.policies.load_state_dict_of("default", state)
    del transformer
    # (timing wrappers inside a compiled network would only measure graph breaks)
    breakdown = None if args.compile else sampler_breakdown(model, ours, diffusers_pipeline, args.repeats)
    return {
        "settings": {"batch": B, "steps": args.steps, "size": args.size, "guidance": args.guidance,
                     "kl_beta": args.kl_beta, "dtype": args.dtype, "compile": args.compile, "trainable_params_M":
                     sum(p.numel() for p in params) / 1e6},
        "sampler": {"ours_s": t_ours, "diffusers_pipeline_s": t_pipe, "ratio": t_ours / t_pipe},
        "update": {"ours_s": t_update, "bare_forward_backward_s": t_bare, "ratio": t_update / t_bare},
        "sampler_breakdown_s": breakdown,
    }  # fmt: skip


def sampler_breakdown(model, ours, theirs, repeats: int) -> dict:
    """Seconds in the transformer, in the VAE decode and in everything else, for each sampler (best run)."""
    transformer, vae = model.policies.module, model.vae
    spent = {"transformer": 0.0, "vae_decode": 0.0}

    def timed(fn, key):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start

        return call

    transformer.forward = timed(transformer.forward, "transformer")  # instance attributes shadow the methods
    vae.decode = timed(vae.decode, "vae_decode")
    out = {}
    try:
        for name, fn in (("ours", ours), ("diffusers_pipeline", theirs)):
            runs = []
            for _ in range(repeats + 1):
                spent.update(transformer=0.0, vae_decode=0.0)
                start = time.perf_counter()
                fn()
                total = time.perf_counter() - start
                runs.append({"total": total, **spent, "other": total - sum(spent.values())})
            out[name] = min(runs[1:], key=lambda r: r["total"])  # the first run warms up
    finally:
        del transformer.forward, vae.decode
    return out


def run_end_to_end(cfg, steps: int) -> dict:
    """Whole training steps (generate → reward → advantage → update) of the quickstart: images/s, phase shares."""
    from diffusion_rl.trainer import make_trainer

    trainer = make_trainer(cfg)
    trainer.train_step(0)  # warm-up
    totals: dict[str, float] = {}
    start = time.perf_counter()
    for step in range(1, steps + 1):
        metrics = trainer.train_step(step)
        for key, value in metrics.items():
            if key.startswith("timing/"):
                totals[key.removeprefix("timing/")] = totals.get(key.removeprefix("timing/"), 0.0) + value
    wall = time.perf_counter() - start
    phases = sum(totals.values())
    return {
        "steps": steps,
        "images_per_step": cfg.batch_size,
        "seconds_per_step": wall / steps,
        "images_per_second": steps * cfg.batch_size / wall,
        "phase_seconds_per_step": {k: v / steps for k, v in totals.items()},
        "phase_share": {k: v / phases for k, v in totals.items()},
    }


if __name__ == "__main__":
    main()
