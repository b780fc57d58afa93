"""The README's quickstart (configs/quickstart.yaml: AWM on the ShapesWorld model shipped in the package, rewarded by
shapes_geneval) learns what its prompts ask for, on every seed, and the reward-hacking guard stays quiet on it.

Its 80 steps as they are, validated before and after on its 32 validation prompts × 2 rather than × 4 (the same
first two images of each prompt, ODE, fixed seeds: a paired comparison), one torch thread. Measured on the 2-core
AMD EPYC without AMX (benchmarks/RESULTS.md, "The quickstart"): +0.042, +0.055 and +0.078 on seeds 0, 1 and 2 over
0.463, where 40 steps gained +0.074, −0.003 and −0.004 (too early to hold on every seed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.config import load
from diffusion_rl.trainer import make_trainer

ROOT = Path(__file__).resolve().parents[2]
STEPS = 80  # the config's own


def run_quickstart(seed: int, work: Path) -> list[dict]:
    shapes = work / "shapes"  # model.create_tiny_if_missing: shapes copies the shipped model here
    overrides = [
        f"run.dir={work / 'run'}",
        f"run.seed={seed}",
        f"model.path={shapes}",
        f"data.train={shapes / 'shapes_prompts/train.jsonl'}",
        f"val.prompts={shapes / 'shapes_prompts/val.jsonl'}",
        f"val.every={STEPS}",
        "val.n=2",
        "train.save_every=0",
        "engine.num_threads=1",
        "log.tensorboard=false",
        "log.progress_bar=false",
    ]
    return make_trainer(load(ROOT / "configs/quickstart.yaml", overrides)).train()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_quickstart_raises_the_validation_reward_on_every_seed_without_guard_alerts(seed, tmp_path):
    rows = run_quickstart(seed, tmp_path)
    val = [(r["step"], r["val/reward/mean"]) for r in rows if "val/reward/mean" in r]
    assert [step for step, _ in val] == [0, STEPS]
    assert val[-1][1] - val[0][1] > 0.02, val
    assert rows[-1]["guard/alerts_total"] == 0
