"""Online preference pairs for Diffusion-DPO: one (best, worst) pair per group of samples of one prompt.

Rules, per group (groups taken in order of first appearance in group_ids):
- failed samples (reward NaN or inf) are left out;
- chosen = the highest valid reward, the earliest index on ties; rejected = the lowest valid reward, the
  latest index on ties (so a group with distinct extremes never pairs a sample with itself);
- a group with fewer than 2 valid samples is skipped, and so is a group whose valid rewards are all equal.
  flow_grpo's and verl-omni's DPO scripts pair such all-tie groups too (argmax and argmin pick two samples of
  equal reward); we skip them: a pair with no preference only pushes the two samples' errors apart at random.
"""

import math
from dataclasses import dataclass, field

import torch


@dataclass
class PreferencePairs:
    chosen: torch.Tensor  # int64 [P]: batch index of each pair's chosen (higher-reward) sample
    rejected: torch.Tensor  # int64 [P]: batch index of each pair's rejected sample
    metrics: dict[str, float] = field(default_factory=dict)


def online_pairs(rewards: torch.Tensor, group_ids: torch.Tensor) -> PreferencePairs:
    """Pairs from rewards [B] (NaN = failed) grouped by group_ids [B] (any integers, e.g. prompt indices).

    Metrics: pairs/count, pairs/groups, pairs/skipped_groups (= pairs/too_small_groups + pairs/tied_groups),
    pairs/failed_samples, pairs/reward_gap (mean chosen - rejected reward; 0 with no pair).
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B]; got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    values = rewards.detach().double().cpu().tolist()
    groups = group_ids.detach().cpu().tolist()
    valid = [math.isfinite(r) for r in values]

    members: dict[int, list[int]] = {}  # dicts keep insertion order: first-appearance order of the groups
    for i, g in enumerate(groups):
        members.setdefault(g, [])
        if valid[i]:
            members[g].append(i)

    chosen, rejected = [], []
    too_small = tied = 0
    for indices in members.values():
        if len(indices) < 2:
            too_small += 1
            continue
        best = max(values[i] for i in indices)
        worst = min(values[i] for i in indices)
        if best == worst:
            tied += 1
            continue
        chosen.append(min(i for i in indices if values[i] == best))
        rejected.append(max(i for i in indices if values[i] == worst))

    gaps = [values[c] - values[r] for c, r in zip(chosen, rejected)]
    metrics = {
        "pairs/count": float(len(chosen)),
        "pairs/groups": float(len(members)),
        "pairs/skipped_groups": float(too_small + tied),
        "pairs/too_small_groups": float(too_small),
        "pairs/tied_groups": float(tied),
        "pairs/failed_samples": float(len(values) - sum(valid)),
        "pairs/reward_gap": sum(gaps) / len(gaps) if gaps else 0.0,
    }
    device = rewards.device
    return PreferencePairs(
        chosen=torch.tensor(chosen, dtype=torch.long, device=device),
        rejected=torch.tensor(rejected, dtype=torch.long, device=device),
        metrics=metrics,
    )
