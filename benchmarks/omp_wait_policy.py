"""OpenMP's wait policy alone and side by side: what each costs, and what a spinning run does to one beside it (issue 26
item 12; diffusion_rl/utils/omp.py decides the CLI's policy from these numbers).

Alone: each round runs the quickstart (tiny SD3, configs/quickstart_flow_grpo.yaml) in one fresh process per policy,
in turn (each goes first once), through the library (not the CLI, which decides the policy itself); a process's step
time is the median over its steps after the first of images / perf/images_per_s. Side by side: two quickstarts at
once, one per policy of a pair; each takes one untimed step, waits for the other, then trains for --pair-seconds; a
process's step time is the median over its steps that ran wholly while the other was training too. The pair "default +
passive" is a run started on a quiet machine (auto: OpenMP's default spinning) with a second one started later (auto
sees the load: PASSIVE). Time it on a quiet machine (`cat /proc/loadavg`, below ~1.5) and say the load.

    python benchmarks/omp_wait_policy.py [--rounds 3] [--steps 6] [--alone default,passive] [--pair-seconds 60]
Writes benchmarks/results/omp_wait_policy.json (--out elsewhere).
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
SETUP = """
import json, os, statistics, sys, time
from diffusion_rl.config import load
from diffusion_rl.trainer import make_trainer
cfg = load("configs/quickstart_flow_grpo.yaml", [f"run.dir={sys.argv[1]}", f"train.total_steps={sys.argv[2]}",
                                                 "val.every=0",
                                       "train.save_every=0"])
trainer = make_trainer(cfg)
"""
ALONE = (
    SETUP
    + """
rows = trainer.train()
images = cfg.data.prompts_per_step * cfg.data.group_size
print(json.dumps(statistics.median(images / row["perf/images_per_s"] for row in rows[1:])))
"""
)
# argv: run dir, a step count no run reaches, this one's ready file, the other's, seconds to train side by side
SIDE_BY_SIDE = (
    SETUP
    + """
ready, other, seconds = sys.argv[3], sys.argv[4], float(sys.argv[5])
train_step, stamps, deadline = trainer.train_step, [], []
def timed(step):
    start = time.time()
    out = train_step(step)
    if not deadline:  # the first step (untimed) is done: wait for the other process's
        open(ready, "w").close()
        while not os.path.exists(other):
            time.sleep(0.02)
        deadline.append(time.time() + seconds)
    else:
        stamps.append((start, time.time()))
        if time.time() > deadline[0]:
            trainer.cfg.train.total_steps = step + 1  # the loop ends after this step
    return out
trainer.train_step = timed
trainer.train()
print(json.dumps(stamps))
"""
)
# OpenMP's own default (libgomp: spin 300,000 iterations, then sleep), PASSIVE (sleep at once), and a short spin
POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin10k": {"GOMP_SPINCOUNT": "10000"}}
PAIRS = "passive+passive,default+passive,default+default"


def _child(code: str, policy: str, args: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    env.update(POLICIES[policy], PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _result(process: subprocess.Popen):
    out, err = process.communicate()
    if process.returncode != 0:
        sys.exit(f"a quickstart child failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def alone(policy: str, steps: int, work: Path) -> float:
    return _result(_child(ALONE, policy, [tempfile.mkdtemp(dir=work), str(steps)]))


def side_by_side(pair: tuple[str, str], seconds: float, work: Path) -> dict:
    """Each process's median step time over the steps it ran wholly while the other one trained too."""
    here = Path(tempfile.mkdtemp(dir=work))
    ready = [str(here / "ready0"), str(here / "ready1")]
    processes = [
        _child(SIDE_BY_SIDE, policy, [str(here / f"run{i}"), "1000000", ready[i], ready[1 - i], str(seconds)])
        for i, policy in enumerate(pair)
    ]
    stamps = [_result(p) for p in processes]
    start, end = max(s[0][0] for s in stamps), min(s[-1][1] for s in stamps)
    inside = [[b - a for a, b in s if a >= start and b <= end] for s in stamps]
    return {
        "pair": list(pair),
        "seconds_per_step": [statistics.median(d) if d else None for d in inside],
        "steps_timed": [len(d) for d in inside],
        "overlap_s": end - start,
        "steps_from_overlap_start": [[(a - start, b - start) for a, b in s] for s in stamps],  # all, for a look
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="quickstart steps per process alone (the first untimed)")
    parser.add_argument("--alone", default="default,passive", help=f"policies timed alone, of {', '.join(POLICIES)}")
    parser.add_argument("--pairs", default=PAIRS, help="policies run side by side, a+b,c+d (none: '')")
    parser.add_argument("--pair-seconds", type=float, default=60.0, help="how long each pair trains side by side")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/omp_wait_policy.json"))
    args = parser.parse_args()
    arms = args.alone.split(",")
    load_before = os.getloadavg()
    rounds, pairs = [], []
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]  # each goes first in turn
            seconds = {name: alone(name, args.steps, Path(work)) for name in order}
            ratios = {name: seconds[name] / seconds["default"] for name in arms if name != "default"}
            rounds.append({**seconds, "ratios": ratios, "order": order, "loadavg": os.getloadavg()})
            print(f"round {r}: " + ", ".join(f"{n} {seconds[n]:.3f} s/step" for n in arms) + "; / default: "
                  + ", ".join(f"{n} {v:.3f}" for n, v in ratios.items()), flush=True)  # fmt: skip
        for pair in [tuple(p.split("+")) for p in args.pairs.split(",") if p]:
            pairs.append({**side_by_side(pair, args.pair_seconds, Path(work)), "loadavg": os.getloadavg()})
            row = pairs[-1]
            shown = ", ".join(
                f"{p} {s:.2f} s/step ({n} steps)"
                if s is not None
                else f"{p} no step wholly beside the other (its steps: {', '.join(f'{b - a:.1f}' for a, b in all_)} s)"
                for p, s, n, all_ in zip(
                    pair, row["seconds_per_step"], row["steps_timed"], row["steps_from_overlap_start"]
                )
            )
            print(f"side by side: {shown}", flush=True)
    others = [name for name in arms if name != "default"] if rounds else []
    ratio = {name: statistics.median(r["ratios"][name] for r in rounds) for name in others}
    result = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "steps": args.steps,
        "rounds": rounds,
        "median_ratio_to_default": ratio,
        "side_by_side": pairs,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    medians = ", ".join(f"{name} {value:.3f}" for name, value in ratio.items())
    print(f"median / default: {medians} (load {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after)")


if __name__ == "__main__":
    main()
