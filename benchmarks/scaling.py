"""Ray engine scaling: images per second of a full training step with 1 and N workers, printed as a ratio.

A full step is what the trainer times: sample the batch on the workers, score it (JPEG reward, in the driver),
advantages, the FSDP2 update. On CPU each worker gets one core (engine.cpus_per_worker=1, one torch thread), so
the ratio shows what a second core buys through the Ray engine; with --device cuda each worker gets one GPU.

    python benchmarks/scaling.py [--workers 1,2] [--prompts 4 --group 4] [--steps 3] [--device cpu|cuda]

Besides the wall clock, it reports images per CPU second of the busiest worker: on a machine shared with other
work the wall clock counts the time other processes hold the cores, the workers' CPU time does not. Prints
Ray's start-up (ray.init, then the workers: processes, process group, sharded model) and writes
benchmarks/results/scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from ray_setup import ROOT  # noqa: E402,I001 -- first: the environment before torch and Ray

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.models.tiny import save_tiny, tiny_presets  # noqa: E402
from diffusion_rl.trainer.trainer import Trainer  # noqa: E402


def measure(trainer: Trainer, steps: int) -> dict:
    """After one warm-up step, `steps` timed training steps: images/s of the best one (wall clock) and of the
    busiest worker's CPU time per step (what the step would take with a free core per worker: on a shared machine
    the wall clock also counts the time other processes hold the cores)."""
    engine = trainer.engine
    trainer.train_step(0)  # warm-up: first forwards, allocator, Ray object store
    best, phases = float("inf"), {}
    cpu_start, driver_start = engine.worker_cpu_seconds(), time.process_time()
    for step in range(1, steps + 1):
        start = time.perf_counter()
        metrics = trainer.train_step(step)
        seconds = time.perf_counter() - start
        if seconds < best:
            best, phases = seconds, {k: v for k, v in metrics.items() if k.startswith("timing/")}
    cpu = [(b - a) / steps for a, b in zip(cpu_start, engine.worker_cpu_seconds())]
    images = trainer.cfg.batch_size
    return {
        "images_per_second": images / best,
        "worker_cpu_s_per_step": cpu,
        "driver_cpu_s_per_step": (time.process_time() - driver_start) / steps,
        "images_per_worker_cpu_second": images / max(cpu),
        **phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="worker counts to compare, e.g. 1,2 or 1,2,4,8")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting (the best counts)")
    parser.add_argument("--preset", default="base", choices=sorted(tiny_presets("sd3")))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/scaling.json"))
    args = parser.parse_args()
    import ray
    import torch

    counts = [int(n) for n in args.workers.split(",")]
    gpu = args.device == "cuda"
    start = time.perf_counter()
    ray.init(
        num_cpus=None if gpu else max(counts),
        include_dashboard=False,
        logging_level="WARNING",
        _node_ip_address="127.0.0.1",
    )
    ray_init_s = time.perf_counter() - start
    print(f"ray.init: {ray_init_s:.1f} s", flush=True)
    results: dict = {"ray_init_s": ray_init_s, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny(Path(tmp) / "tiny", "sd3", args.preset)
        for n in counts:
            cfg = load(ROOT / "configs/quickstart_flow_grpo.yaml", [
                f"run.dir={tmp}/run_{n}", f"model.path={model}", f"model.device={args.device}",
                f"data.prompts_per_step={args.prompts}", f"data.group_size={args.group}",
                f"train.micro_batch_size={args.prompts * args.group}", "val.prompts=null", "log.tensorboard=false",
                "engine.kind=ray", f"engine.num_workers={n}", "engine.cpus_per_worker=1",
                f"engine.gpus_per_worker={1 if gpu else 0}", "engine.num_threads=1",
            ])  # fmt: skip
            trainer = Trainer(cfg)
            try:
                run = measure(trainer, args.steps)
            finally:
                trainer.engine.close()
            run["engine_startup_s"] = trainer.engine.startup_seconds
            results["runs"][n] = run
            cpu = ", ".join(f"{c:.2f}" for c in run["worker_cpu_s_per_step"])
            print(
                f"{n} worker(s): {run['images_per_second']:.2f} images/s wall clock, "
                f"{run['images_per_worker_cpu_second']:.2f} images per busiest-worker CPU second "
                f"(worker CPU s/step: {cpu}; engine start-up {run['engine_startup_s']:.1f} s)",
                flush=True,
            )
    first = results["runs"][counts[0]]
    for n in counts[1:]:
        for key, label in (("images_per_second", "wall clock"), ("images_per_worker_cpu_second", "CPU time")):
            ratio = results["runs"][n][key] / first[key]
            results[f"ratio_{n}_vs_{counts[0]}_{key}"] = ratio
            print(f"scaling {counts[0]} → {n} workers ({label}): {ratio:.2f}×", flush=True)
    busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if busy is not None and busy > (os.cpu_count() or 1):
        print(f"note: load average {busy:.1f} on {os.cpu_count()} cores: the wall-clock ratio is not meaningful here")
    results["settings"] = vars(args) | {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "ray": ray.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
