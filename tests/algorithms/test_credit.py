"""Credit (algorithms/credit.py, algorithms/tree_credit.py): tree credit on hand-built trees: reward fusion,
depth-wise advantages, step weights, pruning; and the depth each sampler step leads into."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_rl.algorithms.credit import GroupNorm, compute_group_advantages
from diffusion_rl.algorithms.tree_credit import tree_credit
from diffusion_rl.sampling.tree import TreeSpec

TREE = TreeSpec(branch_at=(1, 3), branching=(2, 2))  # leaves 0,1 under depth-1 node 0; leaves 2,3 under node 1
# two prompts' trees, rows in step order; group 1's last leaf failed
REWARDS = torch.tensor([1.0, 3.0, 6.0, 10.0, 2.0, 4.0, 4.0, math.nan])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def test_depthwise_advantages_by_hand_with_each_trees_own_std():
    credit = tree_credit(REWARDS, GROUPS, TREE, GroupNorm(global_std=False, eps=0.0))
    # group 0, depth 1: V = mean(1, 3) = 2 and mean(6, 10) = 8; mean 5, std 3 → −1, +1
    # group 0, depth 2: mean 5, deviations −4 −2 1 5, std √(46/4) = √11.5
    s = math.sqrt(11.5)
    # group 1, depth 1: V = mean(2, 4) = 3 and mean(4) = 4 (the failed leaf left out); mean 3.5, std 0.5 → −1, +1
    # group 1, depth 2: valid 2 4 4, mean 10/3, deviations −4/3 2/3 2/3, std √(24/27); the failed leaf 0
    t = math.sqrt(24 / 27)
    expected = [
        [0.0, -1.0, -4 / s], [0.0, -1.0, -2 / s], [0.0, 1.0, 1 / s], [0.0, 1.0, 5 / s],
        [0.0, -1.0, -4 / 3 / t], [0.0, -1.0, 2 / 3 / t], [0.0, 1.0, 2 / 3 / t], [0.0, 1.0, 0.0],
    ]  # fmt: skip
    assert credit.advantages.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]
    # a depth-d step is held by N / n_d rows: weight n_d / N (depth 1: 2 of 4; leaves: 1); the root prefix: 0
    assert credit.step_weights.tolist() == [[0.0, 0.5, 1.0]] * 8
    assert credit.metrics["advantage/depth_1/abs_mean"] == pytest.approx(1.0)


def test_global_std_normalises_each_depth_over_the_batch_in_a_plain_loop():
    credit = tree_credit(REWARDS, GROUPS, TREE, GroupNorm(global_std=True, eps=1e-4))
    r = REWARDS.tolist()
    for depth, size in ((1, 2), (2, 1)):  # leaves under a depth-d node
        nodes = {}  # (group, node) → valid rewards
        for row in range(8):
            nodes.setdefault((row // 4, (row % 4) // size), []).append(r[row])
        value = {k: sum(x for x in v if not math.isnan(x)) / max(1, sum(not math.isnan(x) for x in v))
                 if any(not math.isnan(x) for x in v) else math.nan for k, v in nodes.items()}  # fmt: skip
        valid = [v for v in value.values() if not math.isnan(v)]
        mu = sum(valid) / len(valid)
        std = math.sqrt(sum((v - mu) ** 2 for v in valid) / len(valid))
        for row in range(8):
            key = (row // 4, (row % 4) // size)
            mine = [value[k] for k in value if k[0] == key[0] and not math.isnan(value[k])]
            want = 0.0 if math.isnan(value[key]) else (value[key] - sum(mine) / len(mine)) / (std + 1e-4)
            assert credit.advantages[row, depth].item() == pytest.approx(want, abs=1e-5), (row, depth)


def test_the_leaf_depth_is_flat_grpo_of_the_leaf_rewards():
    credit = tree_credit(REWARDS, GROUPS, TREE)
    flat = compute_group_advantages(REWARDS, GROUPS)
    assert torch.equal(credit.advantages[:, 2], flat.advantages)


def test_pruning_zeroes_the_weights_of_pruned_depths_and_leaves():
    credit = tree_credit(REWARDS, GROUPS, TREE, depths=[2], leaves=2)
    # depth 1 pruned; leaves: each tree's highest and lowest valid reward (group 0: rows 3, 0; group 1: rows 5, 6
    # tie at 4 → the later in ascending order is the highest, row 6; the lowest is row 4)
    assert credit.step_weights[:, 1].tolist() == [0.0] * 8
    assert credit.step_weights[:, 2].tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert credit.metrics["tree/trained_leaf_fraction"] == 0.5
    three = tree_credit(REWARDS, GROUPS, TREE, leaves=3)  # 2 highest + 1 lowest
    assert three.step_weights[:, 2].tolist() == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_each_step_leads_into_the_node_of_its_depth():
    # splits at steps 1 and 3: step 0 stays at the root, steps 1-2 go into depth 1, steps 3-4 into the leaves
    assert TREE.depth_of_step(torch.arange(5)).tolist() == [0, 1, 1, 2, 2]
    assert [TREE.alive(j) for j in range(5)] == [1, 1, 2, 2, 4]


def test_incomplete_trees_are_refused():
    with pytest.raises(ValueError, match="4 leaves"):
        tree_credit(REWARDS[:6], GROUPS[:6], TREE)


def test_the_update_gives_each_trained_step_the_advantage_and_weight_of_its_depth():
    from pathlib import Path
    from types import SimpleNamespace

    from diffusion_rl.algorithms.base import make_algorithm
    from diffusion_rl.algorithms.credit import FlatCredit, Targets
    from diffusion_rl.algorithms.tree_credit import TreeCredit
    from diffusion_rl.config import load

    root = Path(__file__).resolve().parents[2]
    cfg = load(root / "configs/quickstart_tree.yaml", ["sampling.num_steps=5", "sampling.window.kind=all",
                                                       "sampling.tree.branch_at=[1,3]"])  # fmt: skip
    algorithm = make_algorithm(cfg)
    credit = tree_credit(REWARDS, GROUPS, TREE, GroupNorm(global_std=False, eps=0.0))
    targets = Targets(advantages=credit.advantages, step_weights=credit.step_weights, batch_size=[8])
    traj = SimpleNamespace(step_index=torch.arange(4).expand(8, 4))  # window: steps 0..3
    columns = torch.tensor([[0, 1, 2, 3]] * 4 + [[3, 2, 1, 0]] * 4)  # rows 4-7 in reverse (a random selection)
    assert isinstance(algorithm.credit, TreeCredit)
    adv, weight = algorithm.credit.per_step(targets, traj, columns)
    # steps 0 / 1, 2 / 3 lead into the root / depth 1 / depth 2
    assert adv[0].tolist() == pytest.approx([0.0, -1.0, -1.0, -4 / math.sqrt(11.5)])
    assert weight[0].tolist() == [0.0, 0.5, 0.5, 1.0] and weight[4].tolist() == [1.0, 0.5, 0.5, 0.0]
    assert adv[4].tolist() == pytest.approx([credit.advantages[4, 2].item(), -1.0, -1.0, 0.0])
    flat = Targets(advantages=REWARDS.nan_to_num(0.0), batch_size=[8])  # flat rows: the row's advantage on every step
    adv, weight = FlatCredit(cfg.algorithm.advantage, {}).per_step(flat, traj, columns)
    assert torch.equal(adv, REWARDS.nan_to_num(0.0)[:, None].expand(8, 4)) and bool((weight == 1).all())
