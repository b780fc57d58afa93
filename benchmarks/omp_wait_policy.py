"""What the CLI's default OMP_WAIT_POLICY=PASSIVE costs a run alone on a quiet machine (issue 26 item 12).

The CLI sets OMP_WAIT_POLICY=PASSIVE when the user has not (diffusion_rl/cli.py): idle OpenMP threads sleep instead of
spinning, which keeps two torch processes on the same cores from spin-waiting each other. Alone, sleeping threads
wake later than spinning ones; this measures by how much. Each round runs the quickstart (tiny SD3, configs/
quickstart.yaml) in two fresh processes, one with OpenMP's own default (the variable unset) and one with PASSIVE, in
alternating order, through the library (not the CLI, which would set the variable); a process's step time is the
median over its steps after the first of images / perf/images_per_s. Prints each round and the median ratio
PASSIVE / default; time it only on a quiet machine (`cat /proc/loadavg` below ~1.5) and say the load.

    python benchmarks/omp_wait_policy.py [--rounds 4] [--steps 6]
Writes benchmarks/results/omp_wait_policy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, statistics, sys
from diffusion_rl.config import load
from diffusion_rl.trainer import make_trainer
cfg = load("configs/quickstart.yaml", [f"run.dir={sys.argv[1]}", f"train.total_steps={sys.argv[2]}", "val.every=0",
                                       "train.save_every=0"])
rows = make_trainer(cfg).train()
images = cfg.data.prompts_per_step * cfg.data.group_size
print(json.dumps(statistics.median(images / row["perf/images_per_s"] for row in rows[1:])))
"""
# OpenMP's own default (libgomp: spin ~300k iterations, then sleep), PASSIVE (sleep at once), and a short spin
POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin10k": {"GOMP_SPINCOUNT": "10000"}}


def step_seconds(policy: dict[str, str], steps: int, work: Path) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(policy, PYTHONPATH=str(ROOT))
    run_dir = tempfile.mkdtemp(dir=work)
    done = subprocess.run([sys.executable, "-c", CHILD, run_dir, str(steps)], cwd=ROOT, env=env, capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"the quickstart child failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6, help="quickstart steps per process (the first is not timed)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rounds = []
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            order = list(POLICIES)[r % len(POLICIES) :] + list(POLICIES)[: r % len(POLICIES)]  # each goes first in turn
            seconds = {name: step_seconds(POLICIES[name], args.steps, Path(work)) for name in order}
            ratios = {name: seconds[name] / seconds["default"] for name in POLICIES if name != "default"}
            rounds.append({**seconds, "ratios": ratios, "order": order})
            print(f"round {r}: " + ", ".join(f"{n} {seconds[n]:.3f} s/step" for n in POLICIES) + "; / default: "
                  + ", ".join(f"{n} {v:.3f}" for n, v in ratios.items()), flush=True)  # fmt: skip
    ratio = {name: statistics.median(r["ratios"][name] for r in rounds) for name in POLICIES if name != "default"}
    result = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "steps": args.steps,
        "rounds": rounds,
        "median_ratio_to_default": ratio,
    }
    (ROOT / "benchmarks/results/omp_wait_policy.json").write_text(json.dumps(result, indent=1) + "\n")
    medians = ", ".join(f"{name} {value:.3f}" for name, value in ratio.items())
    print(f"median / default: {medians} (load {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after)")


if __name__ == "__main__":
    main()
