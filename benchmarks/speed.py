"""Speed benchmarks, each a ratio measured in one run on the same model, batch and inputs.

- sampler: our rollout (SDE window with log-probs) vs diffusers' StableDiffusion3Pipeline call at the same
  steps, CFG, batch and precomputed text embeddings (goal ≤ 0.95×);
- update: our Flow-GRPO update vs a bare forward+backward of the transformer on the same inputs (plus one
  no-grad forward per trained step when the KL term is on) (goal ≤ 1.05×);
- end to end: images per second of a whole training step and the share of each phase;
- memory: peak RSS of the process (CPU).

    python benchmarks/speed.py [--preset base] [--batch 8] [--steps 10] [--device cpu] [--repeats 3]
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
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.engine.worker import PolicyWorker  # noqa: E402
from diffusion_rl.models.tiny import TINY_PRESETS, save_tiny_model  # noqa: E402
from diffusion_rl.sampling.rollout import rollout  # noqa: E402
from diffusion_rl.sampling.window import default_window  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="base", choices=sorted(TINY_PRESETS))
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
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/speed.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or save_tiny_model(Path(tmp) / "tiny", TINY_PRESETS[args.preset])
        cfg = load(ROOT / "configs/quickstart.yaml", [
            f"run.dir={tmp}/run", f"model.path={model_dir}", f"model.device={args.device}",
            f"model.dtype={args.dtype}", f"sampling.num_steps={args.steps}", f"sampling.guidance={args.guidance}",
            f"sampling.height={args.size}", f"sampling.width={args.size}", "data.prompts_per_step=1",
            f"data.group_size={args.batch}", f"train.micro_batch_size={args.batch}",
            f"algorithm.kl_beta={args.kl_beta}",
        ])  # fmt: skip
        worker = PolicyWorker(cfg)
        results = run_benchmarks(worker, cfg, args)
    results["machine"] = {"platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__, "threads": args.threads, "device": args.device}  # fmt: skip
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

    def ours():
        return rollout(model, cond, worker.settings, window, init_seeds=seeds, noise_seeds=seeds)

    pipe = model.pipeline
    pipe.set_progress_bar_config(disable=True)

    def diffusers_pipeline():
        with torch.no_grad():
            pipe(prompt_embeds=cond["prompt_embeds"], pooled_prompt_embeds=cond["pooled_prompt_embeds"],
                 negative_prompt_embeds=cond["negative_prompt_embeds"],
                 negative_pooled_prompt_embeds=cond["negative_pooled_prompt_embeds"],
                 num_inference_steps=args.steps, guidance_scale=args.guidance, height=args.size, width=args.size,
                 output_type="np")  # fmt: skip

    t_ours, t_pipe = best_of(ours, args.repeats), best_of(diffusers_pipeline, args.repeats)

    # update: the same trajectory, one optimizer step over all trained steps
    batch = ours()
    batch["cond"] = cond
    batch["sample_index"] = torch.arange(B)
    batch["advantages"] = torch.linspace(-1, 1, B)
    state = {k: v.detach().clone() for k, v in model.policies.trainable_state_dict().items()}

    def our_update():
        worker.update(batch, step=0)

    transformer, params = model.policies.module, model.trainable_parameters()

    def bare_forward_backward():
        # the same network work: per trained step one guided forward (2B rows) + backward, optional ref forward
        for j in range(batch["latents"].shape[1] - 1):
            v = model.velocity(batch["latents"][:, j], batch["sigmas"][:, j], cond, args.guidance)
            v.square().mean().backward()
            if args.kl_beta > 0:
                with torch.no_grad(), model.reference():
                    model.velocity(batch["latents"][:, j], batch["sigmas"][:, j], cond, args.guidance)
        for p in params:
            p.grad = None

    t_update, t_bare = best_of(our_update, args.repeats), best_of(bare_forward_backward, args.repeats)
    model.policies.load_state_dict_of("default", state)
    del transformer
    return {
        "settings": {"batch": B, "steps": args.steps, "size": args.size, "guidance": args.guidance,
                     "kl_beta": args.kl_beta, "dtype": args.dtype, "trainable_params_M":
                     sum(p.numel() for p in params) / 1e6},
        "sampler": {"ours_s": t_ours, "diffusers_pipeline_s": t_pipe, "ratio": t_ours / t_pipe},
        "update": {"ours_s": t_update, "bare_forward_backward_s": t_bare, "ratio": t_update / t_bare},
    }  # fmt: skip


if __name__ == "__main__":
    main()
