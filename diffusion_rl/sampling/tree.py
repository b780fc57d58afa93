"""Tree rollouts (BranchGRPO, arXiv 2509.06040; TreeGRPO, arXiv 2512.08153): a prompt's group sampled as a tree.

A tree is given by its branching steps k_1 < … < k_D (`sampling.tree.branch_at`) and branching factors b_1 … b_D.
Each prompt starts from ONE initial noise (the root); at step k_d every node of depth d − 1 splits into b_d children.
The split step's velocity is computed once, on the parent (its x_{k_d} is the children's too); each child then draws
its own SDE noise for that step, so the children diverge from x_{k_d + 1} on. Between splits every node steps on its
own (SDE inside the window, ODE outside). A group is the N = b_1 · … · b_D leaves: row l of a group (l = the row's
rank by sample index within its group) is leaf l, and the node of depth d on its path has index
l // (N / (b_1 · … · b_d)) among the group's depth-d nodes. Each leaf row carries its whole path (the shared prefix
is duplicated in the rows), so the update trains it like any flat row.

Cost, in transformer evaluations per group (guidance > 1 doubles it, as it doubles a flat rollout's):

    NFE_tree = Σ_{j=0}^{T−1} n(j),   n(j) = Π_{i: k_i < j} b_i   (nodes alive when step j's velocity is taken)
    NFE_flat = N · T

The one sampler loop samples trees (`sampling.rollout.rollout` with a `TreeSpec`: a flat rollout is a tree with no
split); this file holds the tree's geometry (`TreeSpec`) and its live nodes during a rollout (`TreeNodes`: each
node's root and index, its noise stream and conditioning, and what a split does to them). Seeds
(sampling/rollout.py `training_rollout`) come from (run seed, training step, group index, node), so a row is the
same sample whichever rows are drawn with it, in whichever order.

A one-split tree (`branch_at: [k]`, branching N) with an SDE window of the single step k is TempFlow-GRPO's
rollout: the prefix 0 … k − 1 is computed once per prompt, the N children split at k and follow the ODE after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from diffusion_rl.sampling.trajectory import SampleIds
from diffusion_rl.sampling.window import SdeWindow
from diffusion_rl.utils.seeding import generator_of


@dataclass(frozen=True)
class TreeSpec:
    """The tree's shape: children b_d at each branching step k_d (increasing)."""

    branch_at: tuple[int, ...]
    branching: tuple[int, ...]

    def __post_init__(self):
        if not self.branch_at or len(self.branch_at) != len(self.branching):
            raise ValueError(f"a tree needs one branching factor per branching step; got {self.branch_at} and "
                             f"{self.branching}")  # fmt: skip
        if any(b < 2 for b in self.branching):
            raise ValueError(f"every branching factor must be ≥ 2, got {list(self.branching)}")
        if any(a >= b for a, b in zip(self.branch_at, self.branch_at[1:])) or self.branch_at[0] < 0:
            raise ValueError(f"branching steps must be ≥ 0 and strictly increasing, got {list(self.branch_at)}")

    @classmethod
    def of(cls, tree) -> TreeSpec | None:
        """From the config's `sampling.tree` section (None: flat rollouts)."""
        if tree is None:
            return None
        b = tree.branching
        factors = [b] * len(tree.branch_at) if isinstance(b, int) else list(b)
        return cls(tuple(tree.branch_at), tuple(factors))

    @property
    def depth(self) -> int:
        """D: the number of splits (the leaves' depth)."""
        return len(self.branch_at)

    @property
    def leaves(self) -> int:
        """N: leaves per tree, the group size."""
        return math.prod(self.branching)

    def nodes_at(self, d: int) -> int:
        """Nodes of depth d in one tree: b_1 · … · b_d (1 for the root)."""
        return math.prod(self.branching[:d])

    @staticmethod
    def seeds(seed: int, step: int, group_index: torch.Tensor) -> tuple[list[tuple], list[tuple]]:
        """Training step `step`'s roots (run.seed `seed`), one per group: each group's initial noise from (seed, step,
        "tree_init", g) and its nodes' SDE noise from (seed, step, "tree_sde", g, …)."""
        groups = torch.unique(group_index.cpu()).tolist()
        return [(seed, step, "tree_init", g) for g in groups], [(seed, step, "tree_sde", g) for g in groups]

    def depth_of_step(self, step_index: torch.Tensor) -> torch.Tensor:
        """The depth of the node each sampler step leads into: #{d: k_d ≤ j} (0: the shared prefix)."""
        at = torch.tensor(self.branch_at, device=step_index.device)
        return (step_index[..., None] >= at).sum(-1)

    def alive(self, j: int) -> int:
        """n(j): nodes per tree whose velocity step j evaluates (a split step: the parents)."""
        return math.prod(b for k, b in zip(self.branch_at, self.branching) if k < j)

    def evaluations(self, num_steps: int) -> int:
        """Transformer evaluations per tree over a T-step rollout (without CFG's doubling)."""
        return sum(self.alive(j) for j in range(num_steps))

    def leaf_order(self, sample_index: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
        """long [B]: the batch row of sorted row g·N + l, leaf l of the g-th group present (groups sorted by index).
        Every group present must be whole (N rows)."""
        N, B = self.leaves, len(group_index)
        groups, counts = torch.unique(group_index, return_counts=True)
        if bool((counts != N).any()):
            raise ValueError(
                f"tree rollout: each group must be sampled whole ({N} rows = the product of sampling.tree.branching); "
                f"got {dict(zip(groups.tolist(), counts.tolist()))} rows per group"
            )
        order = torch.empty(B, dtype=torch.long)
        order[torch.searchsorted(groups, group_index) * N + leaf_positions(sample_index, group_index)] = torch.arange(B)
        return order

    def check_steps(self, num_steps: int, window: SdeWindow | None) -> None:
        """Every split must be an SDE step (children must draw noise): inside the window, before the last step."""
        stochastic = [j for j in self.branch_at if window is not None and window.contains(j) and j < num_steps]
        if stochastic != list(self.branch_at):
            span = "no SDE step" if window is None else f"SDE steps {window.start}..{window.start + window.size - 1}"
            raise ValueError(
                f"sampling.tree.branch_at={list(self.branch_at)}: every branching step must be an SDE step, and this "
                f"training step's window has {span} (num_steps={num_steps}); move branch_at into sampling.window"
            )


class TreeNodes:
    """The live nodes of a rollout's R trees, one per group present: the rows sorted so that row r·N + l is root r's
    leaf l (groups by index); each node's root, its index among its root's nodes of its depth, its SDE noise stream
    (from its root's noise seed followed by its depth and index) and its conditioning (its first leaf's)."""

    def __init__(self, tree: TreeSpec, ids: SampleIds, cond: TensorDict, noise_seeds, num_steps: int,
                 window: SdeWindow | None):  # fmt: skip
        tree.check_steps(num_steps, window)
        B, N = ids.batch_size[0], tree.leaves
        order = tree.leaf_order(ids.sample_index.cpu(), ids.group_index.cpu())
        self.tree, self.noise_seeds, self.depth = tree, noise_seeds, 0
        self.sorted_cond = cond[order.to(cond.device)]
        self.inverse = torch.empty(B, dtype=torch.long)  # sorted row → the caller's row
        self.inverse[order] = torch.arange(B)
        # every depth's nodes, worked out here on the host: a split then reads nothing back from the device
        self.levels, root, index = [], list(range(B // N)), [0] * (B // N)
        for depth in range(len(tree.branching) + 1):
            stride = N // tree.nodes_at(depth)
            rows = torch.tensor([r * N + i * stride for r, i in zip(root, index)], device=cond.device)
            self.levels.append((root, index, rows))  # each node's root, index among its depth's, first leaf
            if depth < len(tree.branching):  # each node's b children, in order
                b = tree.branching[depth]
                root, index = [r for r in root for _ in range(b)], [i * b + c for i in index for c in range(b)]
        self._place()

    def _place(self) -> None:
        root, index, rows = self.levels[self.depth]
        self.generators = [generator_of(self.noise_seeds[r], self.depth, i) for r, i in zip(root, index)]
        self.cond = self.sorted_cond[rows]

    def split(self, x: torch.Tensor, v: torch.Tensor, history: dict[str, list[torch.Tensor]]):
        """At a branching step: each node's b_d children share its x_j, its velocity and its history (then each draws
        its own noise); returns them repeated per child."""
        b = self.tree.branching[self.depth]
        self.depth += 1
        self._place()
        history = {k: [t.repeat_interleave(b, 0) for t in ts] for k, ts in history.items()}
        return x.repeat_interleave(b, 0), v.repeat_interleave(b, 0), history

    def in_order(self, t: torch.Tensor) -> torch.Tensor:
        """Sorted leaves [B, …] back in the caller's row order."""
        return t[self.inverse.to(t.device)]


def nfe_per_image(num_steps: int, tree: TreeSpec | None, forwards_per_evaluation: int, group_size: int) -> float:
    """Transformer forwards per image of a training rollout: flat T, a tree NFE_tree / N; times 2 with CFG."""
    if tree is None:
        return float(num_steps * forwards_per_evaluation)
    return tree.evaluations(num_steps) * forwards_per_evaluation / group_size


def leaf_positions(sample_index: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """long [B]: each row's rank by sample index among the rows of its group (its leaf in the group's tree)."""
    same = group_index[:, None] == group_index[None, :]
    before = sample_index[None, :] < sample_index[:, None]
    return (same & before).sum(1)
