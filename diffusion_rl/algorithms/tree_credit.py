"""Tree credit: the advantage of each trained step of tree rollouts (sampling/tree.py), per depth of the row's path,
with the weight of each step. `PolicyGradient` takes it in place of flat credit (algorithms/credit.py) when it is
built with `sampling.tree`, so the plain step walks past no tree. Like flat credit it has `targets(scored,
group_index)` on the driver (→ `Targets`, O(B) numbers) and `per_step(targets, traj, columns)` on the worker (→
advantages and step weights [B, K] of the trained window columns).

Tree credit, after BranchGRPO (arXiv 2509.06040, §3) and TreeGRPO (arXiv 2512.08153). For one prompt's tree with leaf
rewards r_l:

    V(node)       = mean of r_l over the valid leaves under the node            (reward fusion; NaN = failed leaf)
    A_d(node)     = (V(node) − mean_g V) / (std V + eps)   over the nodes of depth d: mean within the prompt's tree,
                    std as algorithm.advantage says (global_std: over every depth-d node of the batch, else within
                    the tree) — `compute_group_advantages` on one value per node, so every option of
                    algorithm.advantage means what it means for flat rows
    A_0           = 0                                      (the root has no sibling to compare with)

At the leaves (d = D) this is flat Flow-GRPO's advantage of the leaf reward. A sampler step j on a row's path leads
into the node of depth d(j) = #{i: k_i ≤ j} (k_i the branching steps), and trains with that node's A_d: the split
step into a child and every step after it until the next split. Row b's targets are therefore per depth:
advantages [B, D + 1] and step weights [B, D + 1]; the update picks column d(j) for each trained step j.

Step weights: a depth-d step is shared by the N / n_d leaf rows under its node (n_d = b_1 · … · b_d nodes of depth d
per tree, N leaves): each row weights it n_d / N, so every distinct transition counts once (the duplicates compute
the same log-prob, ratio and advantage). The root's prefix steps get weight 0 (advantage 0: nothing to learn; a
window that starts at k_1 does not compute them at all). Pruning (BranchGRPO's, which leaves sampling unchanged and
drops gradient work): `depths` keeps the listed depths' weights and zeroes the others; `leaves: n` keeps the leaf
depth's steps of the ⌈n/2⌉ highest- and ⌊n/2⌋ lowest-reward valid leaves of each tree and zeroes the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from diffusion_rl.algorithms.credit import GroupNorm, Targets, _advantage_metrics, compute_group_advantages
from diffusion_rl.sampling.trajectory import Trajectory
from diffusion_rl.sampling.tree import TreeSpec, leaf_positions


@dataclass
class DepthTargets:
    advantages: torch.Tensor  # float32 [B, D + 1]: A of the node of each depth on the row's path (column 0: root)
    step_weights: torch.Tensor  # float32 [B, D + 1]: the weight of the row's steps of each depth
    metrics: dict[str, float] = field(default_factory=dict)


def tree_credit(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    tree: TreeSpec,
    norm: GroupNorm | None = None,
    *,
    depths: list[int] | None = None,
    leaves: int | None = None,
) -> DepthTargets:
    """Targets of a step's rows: rewards [B] (NaN = failed), group_ids [B] in row order (row b is sample b), `norm`
    the options of algorithm.advantage (default: Flow-GRPO's)."""
    B, N, D = rewards.shape[0], tree.leaves, tree.depth
    _, group_B, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if bool((counts != N).any()):
        raise ValueError(f"tree credit: every group must hold one tree's {N} leaves; got groups of {counts.tolist()}")
    leaf_B = leaf_positions(torch.arange(B), group_ids.cpu()).to(rewards.device)
    group_B = group_B.to(rewards.device)
    r_B = rewards.detach().double()
    valid_B = torch.isfinite(r_B)
    advantages = torch.zeros(B, D + 1, dtype=torch.float64, device=rewards.device)
    weights = torch.zeros(B, D + 1, dtype=torch.float32, device=rewards.device)
    metrics: dict[str, float] = {}
    for d in range(1, D + 1):
        n_d = tree.nodes_at(d)
        node_B = group_B * n_d + leaf_B // (N // n_d)  # the row's depth-d node, numbered across the batch
        num_nodes = int(counts.numel()) * n_d
        zeros = torch.zeros(num_nodes, dtype=torch.float64, device=rewards.device)
        total = zeros.index_add(0, node_B, torch.where(valid_B, r_B, 0.0))
        count = zeros.index_add(0, node_B, valid_B.double())
        value = torch.where(count > 0, total / count.clamp_min(1), math.nan)  # reward fusion
        node_group = torch.arange(num_nodes, device=rewards.device) // n_d
        result = compute_group_advantages(value, node_group, norm or GroupNorm())
        advantages[:, d] = result.advantages.double()[node_B]
        weights[:, d] = n_d / N
        metrics[f"advantage/depth_{d}/abs_mean"] = float(advantages[:, d].abs().mean())
        if d == D:
            metrics.update({k: v for k, v in result.metrics.items() if "group_fraction" in k})
    if depths is not None:
        for d in range(1, D + 1):
            if d not in depths:
                weights[:, d] = 0.0
    if leaves is not None:
        weights[:, D] *= _extreme_leaves(r_B, group_B, leaves).float()
    metrics.update(_advantage_metrics("advantage", advantages[:, D]))
    metrics["tree/trained_leaf_fraction"] = float((weights[:, D] > 0).float().mean())
    return DepthTargets(advantages=advantages.float(), step_weights=weights, metrics=metrics)


def _extreme_leaves(r_B: torch.Tensor, group_B: torch.Tensor, keep: int) -> torch.Tensor:
    """bool [B]: per group, the ⌈keep/2⌉ highest and ⌊keep/2⌋ lowest valid rewards (ties: the later row among the
    highest, the earlier among the lowest)."""
    kept = torch.zeros_like(r_B, dtype=torch.bool)
    for g in group_B.unique():
        rows = torch.nonzero((group_B == g) & torch.isfinite(r_B)).flatten()
        order = rows[torch.argsort(r_B[rows], stable=True)]  # ascending reward
        high, low = (keep + 1) // 2, keep // 2
        kept[order[max(0, len(order) - high) :]] = True
        kept[order[: min(low, max(0, len(order) - high))]] = True
    return kept


class TreeCredit:
    """Per-depth advantages and step weights of tree rollouts (`tree_credit`), each trained step taking its depth's."""

    def __init__(self, tree: TreeSpec, prune, advantage):
        self.tree, self.prune, self.advantage = tree, prune, advantage

    def targets(self, scored, group_index: torch.Tensor) -> tuple[Targets, dict[str, float]]:
        credit = tree_credit(torch.from_numpy(scored.total), group_index, self.tree, self.advantage,
                             depths=self.prune.depths, leaves=self.prune.leaves)  # fmt: skip
        targets = Targets(advantages=credit.advantages, step_weights=credit.step_weights,
                          batch_size=[len(group_index)])  # fmt: skip
        return targets, credit.metrics

    def per_step(self, targets: Targets, traj: Trajectory, columns_BK: torch.Tensor):
        depth_BK = self.tree.depth_of_step(traj.step_index.gather(1, columns_BK))
        return targets.advantages.gather(1, depth_BK), targets.step_weights.gather(1, depth_BK)
