"""TDM-R1's formulas on tensors (algorithms/preference/tdm_r1.py runs them): the re-noising of a trajectory's state,
the draw of the σ it is re-noised to, and the three networks' losses. "L" is Luo-Yihong/TDM-R1
`scripts/train_tdmr1_pub.py` at 1ee7d9f, where the authors' code computes the same.

Notation: σ' the σ of a state y (a rollout's state after a step: σ_{j+1}); τ > σ' the σ it is re-noised to; ε ~ N(0, I);
a network's x0-prediction at (x, σ) is x − σ·v; means are over every element of a row unless said otherwise.

    renoise:  x_τ = α·y + β·ε,  α = (1 − τ)/(1 − σ'),  β = √(τ² − (σ'·α)²)   forward process σ' → τ (L1352-1355)
    fake score ψ:  ‖(x_τ − m)/τ − v_ψ(x_τ)‖² + c_ψ·‖v_T(x_τ) − v_ψ(x_τ)‖²          m the generator's x0 at x_j (L1345)
    surrogate φ:   at a recorded state y' and its re-noised x, target u = −y'/(1 − σ') + ε/β·(τ + σ'²·α/(1 − σ'))
                   (`target_v_dgpo`), e = mean (u − v_φ)², e_old and e_T the same for φ_old and the teacher;
                   per group of G rows
                   s = β_dpo/G·Σ Â·(e − e_T),  loss = mean over rows of σ(s)·Â·ẽ + c_φ·mean (v_φ − v_T)²  (L1402-1445)
                   with ẽ = e detached on a row whose ratio exp(e_old − e) left 1 ± ε in its advantage's direction, or,
                   while mean (v_φ − v_T)² > reg_threshold, whose exp(e_T − e) is past 1 the same way
    generator θ:   Δ_KL = x0_T,cond − x0_ψ and Δ_CFG = s·(x0_T,cond − x0_T,uncond) at x_τ, Δ_R = x0_φ at CFG
                   − x0_T,cond at x_τ' (y re-noised with the group's ε); err = ‖sg(m + Δ) − m‖² (value Δ², gradient
                   −2Δ·∂m); W = mean |m − x0_T at CFG| per row, W_R = mean |m − x0_φ at CFG| (L1463-1535)
                   loss = w·mean(err_CFG/W) + (1 − w)·mean(err_R/W_R) + mean(err_KL/W) on a row whose step trains the
                   reward, w·mean((err_CFG + err_KL)/W) on the others
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.algorithms.preference.base import group_errors, metric_mean, row_mean, weighted
from diffusion_rl.metrics import ROWS, declare_metrics

TAU_SHIFT = 3.0  # the shift of the σ scale on which the authors draw τ uniformly (their convert/inv_convert, s=3)
TAU_MARGIN = 0.02  # τ's lowest value sits this far above its lower bound on that scale (their "+ 20" of 1000)

# the share of a chunk's rows that trained the reward, over the update: each chunk weighed by its rows
declare_metrics({"tdm_r1/reward_fraction": ROWS})


def _column(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[N] → [N, 1, …] broadcasting over the rows of `like`, fp32."""
    return x.to(like.device, torch.float32).view(-1, *([1] * (like.ndim - 1)))


def shift(x: torch.Tensor, s: float = TAU_SHIFT) -> torch.Tensor:
    """s·x / (1 + (s − 1)·x): the time shift (SD3's), σ in [0, 1]."""
    return s * x / (1 + (s - 1) * x)


def unshift(y: torch.Tensor, s: float = TAU_SHIFT) -> torch.Tensor:
    """The inverse of `shift`: y / (s − (s − 1)·y)."""
    return y / (s - (s - 1) * y)


def draw_tau(sigma_next: torch.Tensor, u: torch.Tensor, lowest: float = 0.0) -> torch.Tensor:
    """[N]: the σ each row's state at σ' [N] is re-noised to, for its uniform draw u [N] in [0, 1) (one per group,
    shared by its rows; theirs: one per micro-batch): uniform on the shifted scale between unshift(max(σ', lowest)) +
    0.02 and 1, then shifted back, and never below max(σ', lowest) (their `tau_list` and `tau_list_dgpo`)."""
    lo = sigma_next.float().clamp_min(lowest)
    start = (unshift(lo) + TAU_MARGIN).clamp_max(1.0)
    return torch.maximum(shift(u.to(lo.device, lo.dtype) * (1 - start) + start), lo)


def renoise(y: torch.Tensor, sigma_next: torch.Tensor, tau: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """x_τ = α·y + β·ε: a state at σ' [N] taken by the forward process to τ [N] (fp32)."""
    a, b = renoise_coefficients(_column(sigma_next, y), _column(tau, y))
    return a * y.float() + b * eps


def renoise_coefficients(sigma_next: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(α, β) = ((1 − τ)/(1 − σ'), √(τ² − (σ'·α)²))."""
    alpha = (1 - tau) / (1 - sigma_next)
    return alpha, (tau.pow(2) - (sigma_next * alpha).pow(2)).clamp_min(0).sqrt()


def surrogate_target(y: torch.Tensor, sigma_next: torch.Tensor, tau: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The surrogate's velocity target at renoise(y, σ', τ, ε): −y/(1 − σ') + ε/β·(τ + σ'²·α/(1 − σ'))."""
    s, t = _column(sigma_next, y), _column(tau, y)
    alpha, beta = renoise_coefficients(s, t)
    return -y.float() / (1 - s) + eps / beta * (t + s.pow(2) * alpha / (1 - s))


def x0_of(x: torch.Tensor, sigma: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A network's x0-prediction x − σ·v at (x, σ [N]), fp32."""
    return x.float() - _column(sigma, x) * v.float()


@dataclass
class FakeScoreInput:
    """ψ's step: at x_τ (the generator's Euler step re-noised), rows [N, …]."""

    v_fake: torch.Tensor  # ψ's velocity, with grad
    v_teacher: torch.Tensor  # the teacher's conditional velocity, no grad
    x_tau: torch.Tensor
    x0: torch.Tensor  # m: the generator's x0-prediction at the rollout's state (detached)
    tau: torch.Tensor  # [N]


@dataclass
class SurrogateInput:
    """φ's step: U groups of G rows at one recorded state re-noised with one ε per group, [U, G, …]."""

    v_surrogate: torch.Tensor  # φ's velocity, with grad
    v_old: torch.Tensor  # φ_old's, no grad
    v_teacher: torch.Tensor  # the teacher's conditional velocity, no grad
    target: torch.Tensor  # `surrogate_target`
    advantages: torch.Tensor  # [U, G]
    time_weight: torch.Tensor | float  # [U] each group's (j' + 1)/T, or one for all


@dataclass
class GeneratorInput:
    """θ's step at the rollout's states, rows [N, …]; the x0-predictions of the other networks are detached."""

    x0: torch.Tensor  # m, with grad
    fake_x0: torch.Tensor  # ψ's at x_τ
    teacher_x0: torch.Tensor  # the teacher's conditional one at x_τ
    teacher_guidance_dir: torch.Tensor  # x0_T,cond − x0_T,uncond at x_τ
    teacher_guided_x0: torch.Tensor  # the teacher's at its CFG scale at x_τ (W)
    # the reward term's rows [R] (None: every row) and, at them [R, …], φ's x0 at its CFG scale at x_τ' and the
    # teacher's conditional one (reward_x0 None: no row trains the reward)
    reward_rows: torch.Tensor | None = None
    reward_x0: torch.Tensor | None = None
    reward_ref_x0: torch.Tensor | None = None


@dataclass
class TdmR1Input:
    """One chunk: the three networks' inputs; `weights` [U] per group (0: a group that only pads); None: all 1."""

    fake: FakeScoreInput
    surrogate: SurrogateInput
    generator: GeneratorInput
    weights: torch.Tensor | None = None


def fake_score_loss(inp: FakeScoreInput, fake_reg: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] per row: ψ's denoising error towards the generator's x0 plus fake_reg × its distance to the teacher; and the
    denoising error alone [N] (a metric)."""
    target = (inp.x_tau.float() - inp.x0.detach().float()) / _column(inp.tau, inp.x_tau)
    v = inp.v_fake.float()
    error = row_mean((target - v).pow(2))
    return error + fake_reg * row_mean((inp.v_teacher.detach().float() - v).pow(2)), error.detach()


def surrogate_loss(inp: SurrogateInput, weights, *, beta: float, clip_range: float, reg_threshold: float,
                   reg: float, c: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """[U] per group: φ's time-weighted group preference against the teacher, with its two clips, plus reg × its
    distance to the teacher; and its metrics."""
    G = inp.v_surrogate.shape[1]
    adv = inp.advantages.detach().float().clamp(-c, c)
    e = group_errors(inp.v_surrogate, inp.target)
    distance = group_errors(inp.v_surrogate, inp.v_teacher.detach())  # [U, G]
    with torch.no_grad():
        e_old = group_errors(inp.v_old, inp.target)
        e_teacher = group_errors(inp.v_teacher, inp.target)
        moved = torch.where(adv > 0, torch.exp(e_old - e) > 1 + clip_range, torch.exp(e_old - e) < 1 - clip_range)
        far = metric_mean(distance.mean(dim=1), weights) > reg_threshold  # over the micro-batch (theirs: the GPU's)
        ahead = torch.where(adv > 0, torch.exp(e_teacher - e) > 1, torch.exp(e_teacher - e) < 1)
        stopped = moved | (far & ahead)
        s = beta / G * (adv * (e - e_teacher)).sum(dim=1)  # [U]
        group_weight = torch.sigmoid(s)
    trained = torch.where(stopped, e.detach(), e)
    per_group = inp.time_weight * ((group_weight[:, None] * adv * trained).mean(dim=1) + reg * distance.mean(dim=1))
    metrics = {
        "tdm_r1/surrogate_group_weight": metric_mean(group_weight, weights),
        "tdm_r1/surrogate_clip_fraction": metric_mean(moved.float().mean(dim=1), weights),
        "tdm_r1/surrogate_teacher_clip_fraction": metric_mean((far & ahead).float().mean(dim=1), weights),
        "tdm_r1/surrogate_distance": metric_mean(distance.detach().mean(dim=1), weights),
    }
    return per_group, metrics


def generator_loss(inp: GeneratorInput, *, teacher_weight: float, cfg_scale: float) -> tuple[torch.Tensor, dict]:
    """[N] per row: θ's loss (the module docstring: the reward's form on `reward_rows`, the teacher terms' on the
    others) and its terms' metrics, [N] each but the reward's, [R] at the reward's rows."""
    m = inp.x0.float()
    m_det = m.detach().double()
    W = (m_det - inp.teacher_guided_x0.double()).abs().flatten(1).mean(dim=1).float()  # [N]
    w_col = _column(W, m)

    def pulled(x0: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:  # ‖sg(x0 + Δ) − x0‖², elementwise
        return ((x0.detach() + delta.detach().float()) - x0).pow(2)

    err_kl = pulled(m, inp.teacher_x0.float() - inp.fake_x0.float())
    err_cfg = pulled(m, cfg_scale * inp.teacher_guidance_dir.float())
    kl, cfg = row_mean(err_kl / w_col), row_mean(err_cfg / w_col)
    metrics = {"tdm_r1/generator_kl": kl.detach(), "tdm_r1/generator_cfg": cfg.detach(), "tdm_r1/weight": W}
    teacher_terms = teacher_weight * (cfg + kl)
    if inp.reward_x0 is None:
        return teacher_terms, metrics
    rows = slice(None) if inp.reward_rows is None else inp.reward_rows
    m_r = m[rows]
    W_R = (m_det[rows] - inp.reward_x0.double()).abs().flatten(1).mean(dim=1).float()
    err_r = pulled(m_r, inp.reward_x0.float() - inp.reward_ref_x0.float())
    reward = row_mean(err_r / _column(W_R, m_r))
    metrics["tdm_r1/generator_reward"] = reward.detach()
    trained = teacher_weight * cfg[rows] + (1 - teacher_weight) * reward + kl[rows]
    return (trained if inp.reward_rows is None else teacher_terms.index_put((rows,), trained)), metrics


def tdm_r1_terms(inp: TdmR1Input, cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The chunk's loss: the mean over groups of the three networks' losses (each reaches only its own adapter's
    weights: every other network's output is detached), and the metrics (means over the groups that carry weight)."""
    U, G = inp.surrogate.advantages.shape
    w = inp.weights
    fake_N, fake_error = fake_score_loss(inp.fake, float(cfg.fake_reg))
    surrogate_U, metrics = surrogate_loss(
        inp.surrogate, w, beta=float(cfg.dpo_beta), clip_range=float(cfg.clip_range),
        reg_threshold=float(cfg.reg_threshold), reg=float(cfg.surrogate_reg), c=float(cfg.adv_clip_max),
    )  # fmt: skip
    generator_N, generator_metrics = generator_loss(
        inp.generator, teacher_weight=float(cfg.teacher_weight), cfg_scale=float(cfg.cfg_reward_scale)
    )

    reward = generator_metrics.pop("tdm_r1/generator_reward", None)

    def per_group(x_N: torch.Tensor) -> torch.Tensor:
        return x_N.view(U, G).mean(dim=1)

    parts = {"fake": per_group(fake_N), "surrogate": surrogate_U, "generator": per_group(generator_N)}
    loss = sum(weighted(part, w).mean() for part in parts.values())
    with torch.no_grad():
        metrics.update({f"tdm_r1/{name}_loss": metric_mean(part, w) for name, part in parts.items()})
        metrics["tdm_r1/fake_error"] = metric_mean(per_group(fake_error), w)
        metrics.update({k: metric_mean(per_group(v), w) for k, v in generator_metrics.items()})
        rows = slice(None) if inp.generator.reward_rows is None else inp.generator.reward_rows
        trains = torch.zeros(U * G, device=generator_N.device)
        if reward is not None:  # the mean over the rows that trained the reward; absent from a chunk without any
            trains[rows] = 1.0
            row_weights = None if w is None else w.repeat_interleave(G)[rows]
            metrics["tdm_r1/generator_reward"] = metric_mean(reward, row_weights)
        metrics["tdm_r1/reward_fraction"] = metric_mean(per_group(trains), w)
    return loss, {k: v.detach() for k, v in metrics.items()}
