"""Diffusion-DPO on online pairs: prefer the chosen sample's denoising error over the rejected one's, relative
to a frozen reference.

For each pair p (cfg: dpo_beta), with both members noised at the same t and with the same eps by the caller:

    err^m_p   = mean over the non-batch dims of (v^m_p - u^m_p)^2       m in {theta, ref}, u = eps - x0
    inside_p  = -beta/2 * [(err^theta_w,p - err^ref_w,p) - (err^theta_l,p - err^ref_l,p)]
    loss      = mean_p of -log sigmoid(inside_p)

w is the chosen (higher-reward) member, l the rejected one. A lower error than the reference's on the chosen
sample, and a higher one on the rejected sample, raise inside_p. beta is in the thousands (2000 by default)
because per-sample error differences between policy and reference are small.

Metrics: dpo/implicit_acc (fraction of pairs with inside > 0), dpo/reward_chosen = mean of
-beta/2 * (err^theta_w - err^ref_w), dpo/reward_rejected (the same for l), dpo/margin = mean of inside.

The update (`Dpo`): pairs come from `prepare` (one per group: best vs worst reward, `online_pairs`;
offline data gives them ready-made); each pair is one unit of the update, with one logit-normal t and one eps per
pair and epoch, shared by its two members.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tensordict import tensorclass

from diffusion_rl.algorithms.base import LossOutput, LossSettings, TrainBatch, UpdatePosition, register_loss
from diffusion_rl.algorithms.credit import Targets
from diffusion_rl.algorithms.preference.base import (
    ForwardProcess,
    batch_rows,
    check_same_shape,
    check_vectors,
    detached,
    forward_noise,
    metric_mean,
    noise_like,
    row_mean,
    weighted,
)
from diffusion_rl.config.fields import Range, opt
from diffusion_rl.sampling.trajectory import Trajectory
from diffusion_rl.utils.seeding import make_generator

TRAIN_SCHEDULE_STEPS = 1000  # the training schedule DPO's logit-normal t indexes (SD3-style: 1000 timesteps)


@dataclass
class DpoInput:
    """One micro-batch of P pairs; every tensor is [P, ...] with the same shape."""

    v_chosen: torch.Tensor  # policy velocity on the chosen sample's x_t, with grad
    v_rejected: torch.Tensor  # policy velocity on the rejected sample's x_t, with grad
    v_ref_chosen: torch.Tensor  # reference velocity, no grad
    v_ref_rejected: torch.Tensor  # reference velocity, no grad
    target_chosen: torch.Tensor  # u = eps - x0 of the chosen sample
    target_rejected: torch.Tensor  # u = eps - x0 of the rejected sample
    weights: torch.Tensor | None = None  # [P] per pair (0: a pair that only pads a worker's share); None: all 1

    def __post_init__(self):
        check_vectors(batch_rows("v_chosen", self.v_chosen), weights=self.weights)
        check_same_shape(
            self.v_chosen,
            "v_chosen",
            v_rejected=self.v_rejected,
            v_ref_chosen=self.v_ref_chosen,
            v_ref_rejected=self.v_ref_rejected,
            target_chosen=self.target_chosen,
            target_rejected=self.target_rejected,
        )


def _error(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # fp32: the loss lives in differences of errors ~1e-3 apart, which bf16 rounds away
    return row_mean((v.float() - target.float()).pow(2))


@dataclass
class PreferencePairs:
    chosen: torch.Tensor  # int64 [P]: batch index of each pair's chosen (higher-reward) sample
    rejected: torch.Tensor  # int64 [P]: batch index of each pair's rejected sample
    metrics: dict[str, float] = field(default_factory=dict)


def online_pairs(rewards: torch.Tensor, group_ids: torch.Tensor) -> PreferencePairs:
    """One (best, worst) pair per group of rewards [B] (NaN = failed) grouped by group_ids [B] (any integers, e.g.
    prompt indices). Per group, in order of first appearance:
    - failed samples (reward NaN or inf) are left out;
    - chosen = the highest valid reward, the earliest index on ties; rejected = the lowest valid reward, the
      latest index on ties (so a group with distinct extremes never pairs a sample with itself);
    - a group with fewer than 2 valid samples is skipped, and so is a group whose valid rewards are all equal.
      flow_grpo's and verl-omni's DPO scripts pair such all-tie groups too (argmax and argmin pick two samples of
      equal reward); we skip them: a pair with no preference only pushes the two samples' errors apart at random.

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


def dpo_timesteps(num_pairs: int, generator: torch.Generator, sigmas_train: torch.Tensor) -> torch.Tensor:
    """[P] sigmas: u = sigmoid(n), n ~ N(0, 1); t = sigmas_train[min(floor(N * u), N - 1)] with N = len(sigmas_train).

    sigmas_train is the training schedule's [N] (N = 1000 for SD3-style models) shifted sigmas, in the
    scheduler's order; logit-normal(0, 1) is symmetric about 1/2, so the order does not change the distribution.
    The draw is on the generator's device; t comes back on sigmas_train's device.
    """
    if num_pairs < 0:
        raise ValueError(f"num_pairs must be >= 0, got {num_pairs}")
    if sigmas_train.ndim != 1 or sigmas_train.numel() == 0:
        raise ValueError(f"sigmas_train must be a non-empty [N] tensor; got {tuple(sigmas_train.shape)}")
    n = sigmas_train.numel()
    u_P = torch.sigmoid(torch.randn(num_pairs, generator=generator, device=generator.device, dtype=torch.float64))
    index_P = (u_P * n).floor().long().clamp(0, n - 1)
    return sigmas_train[index_P.to(sigmas_train.device)]


@dataclass
class DpoSettings(LossSettings):
    dpo_beta: float = opt(2000.0, "β of Diffusion-DPO (flow models use ~100–5000).", within=Range(0, 1e6, lo_open=True))


@tensorclass
class PairUnits:
    """The update's units: one row per pair, its chosen and its rejected sample."""

    chosen: Trajectory
    rejected: Trajectory
    weight: (
        torch.Tensor
    )  # [P] 1, or 0 for a pair that only pads this worker's share (engine/worker.py: the update loop)


class Dpo(ForwardProcess):
    offline = True

    @classmethod
    def needs_reference(cls, settings) -> bool:
        return True  # the loss is relative to the reference's errors

    @classmethod
    def trained_share(cls, algorithm, group_size: int) -> float:
        return min(1.0, 2 / group_size)  # one pair per group: its best and its worst sample

    def prepare(self, scored, group_index: torch.Tensor) -> tuple[Targets, dict[str, float]]:
        """One pair per group (best vs worst valid reward), stored per row so that it survives splitting the batch."""
        pairs = online_pairs(torch.from_numpy(scored.total), group_index)
        B = len(group_index)
        pair_id = torch.full((B,), -1, dtype=torch.long)
        role = torch.zeros(B, dtype=torch.long)
        index = torch.arange(len(pairs.chosen))
        pair_id[pairs.chosen], role[pairs.chosen] = index, 1
        pair_id[pairs.rejected], role[pairs.rejected] = index, -1
        return Targets(pair_id=pair_id, pair_role=role, batch_size=[B]), pairs.metrics

    def attach(self, model) -> None:
        super().attach(model)
        s = self.sampler
        self.sigmas_train = model.sigma_schedule(TRAIN_SCHEDULE_STEPS, s.height, s.width, s.frames)[:-1]  # [1000]

    def begin(self, batch: TrainBatch, step: int) -> tuple[PairUnits, dict[str, float]]:
        """The chosen rows whose rejected partner (same pair_id, role −1) is in this batch, each with its partner."""
        role_B, id_B = batch.targets.pair_role, batch.targets.pair_id
        rejected_of = {int(i): row for row, i in enumerate(id_B.tolist()) if role_B[row] == -1}
        chosen = [row for row, i in enumerate(id_B.tolist()) if role_B[row] == 1 and int(i) in rejected_of]
        rejected = [rejected_of[int(id_B[row])] for row in chosen]
        chosen_t = torch.tensor(chosen, dtype=torch.long, device=batch.device)
        rejected_t = torch.tensor(rejected, dtype=torch.long, device=batch.device)
        weight = torch.ones(len(chosen), device=batch.device)
        units = PairUnits(chosen=batch.traj[chosen_t], rejected=batch.traj[rejected_t], weight=weight,
                          batch_size=[len(chosen)])  # fmt: skip
        return units, {}

    def unit_rows(self, targets: Targets) -> list[list[int]]:
        """Each pair's (chosen, rejected) rows, in pair order: the rows a worker needs to train the pair."""
        role, pair = targets.pair_role.tolist(), targets.pair_id.tolist()
        rows: dict[int, list[int]] = {}
        for row in sorted(range(len(role)), key=lambda r: -role[r]):  # chosen (1) first, rejected (−1) last
            if role[row]:
                rows.setdefault(pair[row], []).append(row)
        return [rows[p] for p in sorted(rows) if len(rows[p]) == 2]

    @property
    def micro_size(self) -> int:
        return max(1, self.micro_batch_size // 2)  # a pair is two forwards

    def loss(self, units: PairUnits, k: int, at: UpdatePosition) -> LossOutput:
        chosen, rejected = units.chosen, units.rejected
        generators = [make_generator(self.seed, at.step, "dpo", at.epoch, int(i)) for i in chosen.ids.sample_index]
        t_P = torch.cat([dpo_timesteps(1, g, self.sigmas_train) for g in generators]).to(chosen.device)
        x0_w, x0_l = chosen.final_latents, rejected.final_latents
        eps = noise_like(x0_w, generators)
        t_2P, x0 = torch.cat([t_P, t_P]), torch.cat([x0_w, x0_l])
        x_t = forward_noise(x0, torch.cat([eps, eps]), t_2P)
        cond = torch.cat([chosen.cond, rejected.cond])
        # the reference first: its forward then never coincides with the trained forward's saved activations (the
        # device peak), which is what model.offload_reference's copy on the device for this forward relies on
        v_ref = self.velocity_of("reference", x_t, t_2P, cond)
        v = self.velocity(x_t, t_2P, cond)
        target = torch.cat([eps, eps]) - x0
        n = len(chosen)
        inp = DpoInput(
            v_chosen=v[:n],
            v_rejected=v[n:],
            v_ref_chosen=v_ref[:n],
            v_ref_rejected=v_ref[n:],
            target_chosen=target[:n],
            target_rejected=target[n:],
            weights=units.weight,
        )
        return self.loss_fn(inp, self.settings)


@register_loss("dpo", settings=DpoSettings, algorithm=Dpo, metrics=("dpo", "pairs"))
def dpo_loss(inp: DpoInput, cfg) -> LossOutput:
    """cfg needs dpo_beta."""
    beta = float(cfg.dpo_beta)
    err_w_P = _error(inp.v_chosen, inp.target_chosen)
    err_l_P = _error(inp.v_rejected, inp.target_rejected)
    with torch.no_grad():
        err_ref_w_P = _error(inp.v_ref_chosen, inp.target_chosen)
        err_ref_l_P = _error(inp.v_ref_rejected, inp.target_rejected)

    reward_w_P = -0.5 * beta * (err_w_P - err_ref_w_P)
    reward_l_P = -0.5 * beta * (err_l_P - err_ref_l_P)
    inside_P = reward_w_P - reward_l_P
    loss = -weighted(F.logsigmoid(inside_P), inp.weights).mean()

    with torch.no_grad():
        w = inp.weights
        metrics = {
            "dpo/implicit_acc": metric_mean((inside_P > 0).float(), w),
            "dpo/reward_chosen": metric_mean(reward_w_P, w),
            "dpo/reward_rejected": metric_mean(reward_l_P, w),
            "dpo/margin": metric_mean(inside_P, w),
        }
    return LossOutput(loss=loss, metrics=detached(metrics))
