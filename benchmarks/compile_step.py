"""A whole training step eager vs with model.compile_blocks (regional compilation of the repeated transformer
blocks, used by sampling and by the update's recomputation forward and backward), on the quickstart's shape.

Measures: the eager step (best of --steps after one warm-up step), the compiled step (best of --steps after the
warm-up steps that compile; the two trainers take turns step by step), their ratio, the compile time (the
compiling steps' time beyond compiled steps) and the steps after which compiling has paid for itself; the graphs
dynamo made after warm-up (0: no recompiles per step).

    python benchmarks/compile_step.py [--preset base] [--steps 4] [--micro 8] [--threads 2] [--device cpu]
                                      [--autocast none] [--warm-cache]
Writes benchmarks/results/compile_step.json and prints one summary line. Inductor keeps what it compiled in an
on-disk cache that a later process reuses: by default the run compiles into a fresh cache (a first run's cost);
--warm-cache compiles a second time into the same cache, as a restarted or resumed run would.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# a fresh inductor cache, so the compile time is a first run's (set before torch reads it)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile_step_inductor_")

import torch  # noqa: E402

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.trainer import make_trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def timed_steps(trainer, first: int, count: int) -> list[float]:
    times = []
    for step in range(first, first + count):
        start = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base", help="tiny sd3 preset (the quickstart's: base)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps of each variant")
    parser.add_argument("--micro", type=int, default=8, help="train.micro_batch_size (quickstart: 8 = the batch)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="model.device (cpu, cuda)")
    parser.add_argument("--autocast", default="none", help="model.autocast (none, bf16)")
    parser.add_argument("--warm-cache", action="store_true", help="compile twice; time the second (cached) compile")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/compile_step.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="compile_step_"))

    def trainer(compile_blocks: bool):
        overrides = [
            f"run.dir={tmp / ('compiled' if compile_blocks else 'eager')}",
            f"model.path={tmp / 'model'}",
            f"model.create_tiny_if_missing={args.preset}",
            f"model.compile_blocks={str(compile_blocks).lower()}",
            f"train.micro_batch_size={args.micro}",
            f"engine.num_threads={args.threads}",
            f"model.device={args.device}",
            f"model.autocast={args.autocast}",
            f"data.train={ROOT / 'configs/prompts/quickstart.txt'}",
            "val.every=0",
            "val.before_train=false",
            "train.save_every=0",
            "log.tensorboard=false",
            "log.progress_bar=false",
        ]
        return make_trainer(load(ROOT / "configs/quickstart_flow_grpo.yaml", overrides))

    load_before = os.getloadavg()
    if args.warm_cache:  # fill the on-disk cache in a first compiled trainer, then start over with dynamo's state
        timed_steps(trainer(True), 0, 2)
        torch._dynamo.reset()
    eager, compiled = trainer(False), trainer(True)
    eager_warm = timed_steps(eager, 0, 1)[0]
    warm_steps = 1 if args.micro == 8 else 2  # micro < batch: the second shape recompiles once (then dynamic)
    compile_times = timed_steps(compiled, 0, warm_steps)
    graphs = unique_graphs()
    eager_times, compiled_times = [], []
    for i in range(args.steps):  # taking turns, so a change of machine load hits both alike
        eager_times += timed_steps(eager, 1 + i, 1)
        compiled_times += timed_steps(compiled, warm_steps + i, 1)
    recompiles = unique_graphs() - graphs

    eager_step, compiled_step = min(eager_times), min(compiled_times)
    compile_s = sum(compile_times) - warm_steps * compiled_step
    saved = eager_step - compiled_step
    result = {
        "preset": args.preset,
        "micro_batch_size": args.micro,
        "threads": args.threads,
        "device": args.device,
        "autocast": args.autocast,
        "inductor_cache": "warm" if args.warm_cache else "cold",
        "eager_first_step_s": eager_warm,
        "eager_step_s": eager_step,
        "compiled_step_s": compiled_step,
        "ratio": compiled_step / eager_step,
        "compile_s": compile_s,
        "break_even_steps": compile_s / saved if saved > 0 else None,
        "graphs_after_warmup": recompiles,
        "graphs_total": unique_graphs(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    even = "never" if result["break_even_steps"] is None else f"{result['break_even_steps']:.0f} steps"
    print(
        f"compile_step ({args.preset}, micro {args.micro}, {args.device}, {args.threads} threads, autocast "
        f"{args.autocast}, {result['inductor_cache']} cache): eager {eager_step:.3f} s/step, "
        f"compiled {compiled_step:.3f} s/step, ratio {result['ratio']:.2f}x, compile {compile_s:.0f} s, "
        f"paid back after {even}; graphs after warm-up {recompiles}; load {load_before[0]:.2f} -> "
        f"{result['loadavg_after'][0]:.2f}"
    )


if __name__ == "__main__":
    main()
