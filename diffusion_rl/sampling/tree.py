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

Seeds (utils/seeding.py) come from (run seed, training step, group index, node): the root's initial noise from
("tree_init", g), node (d, i)'s SDE noise from ("tree_sde", g, d, i) — a row is the same sample whichever rows are
drawn with it, in whichever order.

A one-split tree (`branch_at: [k]`, branching N) with an SDE window of the single step k is TempFlow-GRPO's
rollout: the prefix 0 … k − 1 is computed once per prompt, the N children split at k and follow the ODE after it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from diffusion_rl.sampling.ode import OdeSolver
from diffusion_rl.sampling.storage import rounded, stored_step
from diffusion_rl.sampling.trajectory import SampleIds, Trajectory
from diffusion_rl.sampling.window import SdeWindow, step_types
from diffusion_rl.utils.seeding import make_generator

if TYPE_CHECKING:
    from diffusion_rl.models.base import FlowModel
    from diffusion_rl.sampling.rollout import SamplerSettings


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

    def check_steps(self, num_steps: int, window: SdeWindow | None) -> None:
        """Every split must be an SDE step (children must draw noise): inside the window, before the last step."""
        stochastic = [j for j in self.branch_at if window is not None and window.contains(j) and j < num_steps]
        if stochastic != list(self.branch_at):
            span = "no SDE step" if window is None else f"SDE steps {window.start}..{window.start + window.size - 1}"
            raise ValueError(
                f"sampling.tree.branch_at={list(self.branch_at)}: every branching step must be an SDE step, and this "
                f"training step's window has {span} (num_steps={num_steps}); move branch_at into sampling.window"
            )


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


@torch.no_grad()
def tree_rollout(
    model: FlowModel,
    cond: TensorDict,
    settings: SamplerSettings,
    window: SdeWindow | None,
    tree: TreeSpec,
    ids: SampleIds,
    *,
    seed: int,
    step: int,
) -> Trajectory:
    """The rows `ids` of training step `step`, sampled as trees: every group present must be complete (its N rows);
    returns the same fields as `rollout`, one leaf per row, in the order of `ids`."""
    B, N = ids.batch_size[0], tree.leaves
    groups, counts = torch.unique(ids.group_index.cpu(), return_counts=True)
    if bool((counts != N).any()):
        raise ValueError(
            f"tree rollout: each group must be sampled whole ({N} rows = the product of sampling.tree.branching); "
            f"got {dict(zip(groups.tolist(), counts.tolist()))} rows per group"
        )
    tree.check_steps(settings.num_steps, window)
    # sorted row r = g·N + l holds group groups[g]'s leaf l; `order[r]` is its row in the caller's batch
    leaf = leaf_positions(ids.sample_index.cpu(), ids.group_index.cpu())
    group_pos = torch.searchsorted(groups, ids.group_index.cpu())
    order = torch.empty(B, dtype=torch.long)
    order[group_pos * N + leaf] = torch.arange(B)

    sigmas = model.sigma_schedule(settings.num_steps, settings.height, settings.width, settings.frames)
    kinds = step_types(settings.num_steps, window, settings.sde_type)
    shape = model.latent_shape(settings.height, settings.width, settings.frames)
    G = len(groups)
    x = torch.stack([torch.randn(shape, generator=make_generator(seed, step, "tree_init", int(g))) for g in groups])
    x = x.to(model.device)
    # the live nodes: their group's position, depth-d index, generator; and the first sorted row under each (its cond)
    node_group, node_index, depth = torch.arange(G), torch.zeros(G, dtype=torch.long), 0
    generators = [make_generator(seed, step, "tree_sde", int(g), 0, 0) for g in groups]
    sorted_cond = cond[order.to(cond.device)]
    history: dict[str, list[torch.Tensor]] = {"latents": [], "log_probs": [], "means": [], "stds": []}
    index, evaluations = [], 0
    solver = OdeSolver(settings.ode_solver)
    dtype = settings.storage
    with model.eval_mode():
        for j, kind in enumerate(kinds):
            if kind != "ode":
                x = rounded(x, dtype)  # as in `rollout`: the window steps start from what is stored
            first_rows = (node_group * N + node_index * (N // tree.nodes_at(depth))).to(sorted_cond.device)
            v = model.velocity(x, sigmas[j].item(), sorted_cond[first_rows], settings.guidance)
            evaluations += x.shape[0]
            if j in tree.branch_at:  # split: the children share x_j and its velocity, then draw their own noise
                b = tree.branching[depth]
                depth += 1
                x, v = x.repeat_interleave(b, 0), v.repeat_interleave(b, 0)
                history = {k: [t.repeat_interleave(b, 0) for t in ts] for k, ts in history.items()}
                node_group = node_group.repeat_interleave(b)
                node_index = node_index.repeat_interleave(b) * b + torch.arange(b).repeat(len(node_index))
                generators = [make_generator(seed, step, "tree_sde", int(groups[g]), depth, int(i))
                              for g, i in zip(node_group, node_index)]  # fmt: skip
            if kind == "ode":  # splits are SDE steps, so the node count is fixed across the solver's history
                x = solver.step(x, v, sigmas[j].item(), sigmas[j + 1].item())
                continue
            out = stored_step(kind, x, v, sigmas[j].item(), sigmas[j + 1].item(), settings.noise_level, generators,
                              dtype)  # fmt: skip
            recorded = (x.to(dtype), out.log_prob, out.mean.to(dtype), out.std)
            for key, value in zip(("latents", "log_probs", "means", "stds"), recorded):
                history[key].append(value)
            index.append(j)
            if j + 1 == window.start + window.size:
                history["latents"].append(out.prev_sample.to(dtype))
            solver.reset()  # as in `rollout`: no multistep history across a stochastic step
            x = out.prev_sample
    # x holds the G·N leaves in sorted order; put the rows back in the caller's order
    inverse = torch.empty(B, dtype=torch.long)
    inverse[order] = torch.arange(B)
    inverse = inverse.to(x.device)
    x = x[inverse]
    device = x.device
    steps = {}
    if window is not None:
        step_index = torch.tensor(index, device=device)
        steps = {key: torch.stack(ts, dim=1)[inverse] for key, ts in history.items()}
        steps.update(
            sigmas=sigmas[step_index].to(device).expand(B, -1).clone(),
            sigmas_next=sigmas[step_index + 1].to(device).expand(B, -1).clone(),
            step_index=step_index.expand(B, -1).clone(),
        )
    forwards = evaluations * model.forwards_per_evaluation(settings.guidance) / N / G
    return Trajectory(
        final_latents=x.float(),
        cond=cond,
        ids=ids.to(device),
        images=model.decode(x).to(device),
        nfe=torch.full((B,), float(forwards), device=device),
        **steps,
        batch_size=[B],
        device=device,
    )
