"""configs/quickstart_tree.yaml (tree rollouts, BranchGRPO's depth-wise credit) runs from its config, reports its
NFE saving, refuses what it cannot do, and, reduced, makes the images compress better.

Learning settings: the reduced quickstart's (tests/trainer/conftest.py LEARNS: 16 steps of 4 prompts × 4, lr 1e-2,
32 px, 4 sampling steps) with trees that split at steps 1 and 2 (2 × 2 leaves) and an SDE window of those two steps.
Gains of the fixed-seed validation reward, run.seed 0-5 (7-12 s each on 2 shared cores):
+14.9/+5.3/+4.0/+4.0/+7.2/+10.2 % (benchmarks/RESULTS.md, "Tree rollouts")."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from .conftest import LEARNS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/quickstart_tree.yaml"
# the fast tests' 4 sampling steps: split at steps 1 and 2, both inside the SDE window 1..2
SMALL_TREE = ("data.group_size=4", "sampling.window.size=2", "sampling.window.lo=1", "sampling.window.hi=3",
              "sampling.tree.branch_at=[1,2]")  # fmt: skip


def test_the_quickstart_config_is_a_two_level_binary_tree():
    from diffusion_rl.config import load

    cfg = load(CONFIG)
    tree = cfg.sampling.tree
    assert (tree.branch_at, tree.branching, cfg.data.group_size) == ([2, 5], 2, 4)
    # n(j) = 1, 1, 1, 2, 2, 2, 4, 4, 4, 4 over the 10 steps: 25 evaluations per tree, 6.25 per image against 10
    from diffusion_rl.sampling.tree import TreeSpec, nfe_per_image

    assert nfe_per_image(10, TreeSpec.of(tree), 2, 4) == 12.5 and nfe_per_image(10, None, 2, 4) == 20.0


def test_the_tree_quickstart_trains_and_reports_its_nfe_saving(make_trainer, weights):
    trainer = make_trainer(*SMALL_TREE, config=CONFIG)
    before = weights(trainer)
    rows = trainer.train()
    assert len(rows) == 2
    for row in rows:
        # 4 steps, CFG: the tree takes 1 + 1 + 2 + 4 = 8 evaluations per tree, ×2 / 4 leaves = 4 per image; flat 8
        assert row["rollout/nfe_per_image"] == 4.0 and row["rollout/nfe_per_image_flat"] == 8.0
        assert row["rollout/nfe_saving"] == 0.5
        assert math.isfinite(row["loss"]) and row["advantage/depth_1/abs_mean"] > 0
    after = weights(trainer)
    assert any(not before[k].equal(after[k]) for k in before)


def test_a_pruned_tree_trains_only_the_kept_leaves_of_the_kept_depth(make_trainer, weights):
    trainer = make_trainer(*SMALL_TREE, "sampling.tree.prune.depths=[2]", "sampling.tree.prune.leaves=2",
                           config=CONFIG)  # fmt: skip
    before = weights(trainer)
    rows = trainer.train()
    assert all(row["tree/trained_leaf_fraction"] == 0.5 for row in rows)
    assert any(not before[k].equal(v) for k, v in weights(trainer).items())


def test_flat_rollouts_report_their_nfe_too(make_trainer):
    rows = make_trainer().train()
    assert rows[0]["rollout/nfe_per_image"] == 8.0 and "rollout/nfe_saving" not in rows[0]  # 4 steps × CFG 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("data.group_size=2",), "data.group_size=4"),
        (("engine.kind=ray",), "sampling.tree runs on engine.kind=local"),
        (("algorithm.loss=nft", "sampling.sde_type=ode", "sampling.window.kind=all"), "sampling.tree trains policy-"),
        (("sampling.tree.branch_at=[5,2]",), "strictly increasing"),
        (("sampling.tree.branching=[2,2,2]",), "one per branch_at"),
        (("sampling.tree.prune.depths=[3]",), "prune.depths"),
        (("sampling.score_chunks=3",), "score_chunks"),
        (("algorithm.advantage.combine=sum_advantages",), "sum_advantages is not implemented for trees"),
    ],
)
def test_impossible_tree_configs_are_refused_naming_the_key(overrides, message):
    from diffusion_rl.config import load

    with pytest.raises(Exception, match=message.replace("[", r"\[")):
        load(CONFIG, list(overrides))


def test_the_reduced_tree_quickstart_learns_to_compress(make_trainer):
    trainer = make_trainer(*LEARNS, *SMALL_TREE, "run.seed=0", config=CONFIG)
    rows = trainer.train()
    before, after = rows[0]["val/reward/mean"], rows[-1]["val/reward/mean"]
    # one byte of JPEG is 2e-6 of reward: ask for more than a few bytes of the ~1.5 kB
    assert after - before > 1e-5, f"val/reward/mean {before:.6g} -> {after:.6g}"


def test_a_resumed_tree_run_equals_a_straight_one(make_trainer, tmp_path, weights):
    # every tree draw is a function of (run seed, step, group, node): a resume repeats steps 3-4 exactly
    options = (*SMALL_TREE, "train.save_every=2")
    straight = make_trainer(*options, f"run.dir={tmp_path / 'straight'}", "train.total_steps=4", config=CONFIG)
    straight_rows = straight.train()
    resumed_dir = f"run.dir={tmp_path / 'resumed'}"
    make_trainer(*options, resumed_dir, "train.total_steps=2", config=CONFIG).train()
    resumed = make_trainer(*options, resumed_dir, "train.total_steps=4", "run.resume=auto", config=CONFIG)
    resumed_rows = resumed.train()
    keep = ("reward/mean", "loss", "advantage/depth_1/abs_mean", "rollout/nfe_per_image")
    assert [[r[k] for k in keep] for r in resumed_rows] == [[r[k] for k in keep] for r in straight_rows]
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
