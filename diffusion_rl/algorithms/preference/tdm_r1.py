"""TDM-R1 (arXiv 2603.07700): RL for few-step generators with a non-differentiable reward, as its authors' code
trains it (Luo-Yihong/TDM-R1 `scripts/train_tdmr1_pub.py` at 1ee7d9f; docs/direct_preference.md, "TDM-R1", names
each convention taken with file and line, and every difference).

Three LoRA adapters of one transformer train together, each with its own AdamW settings (`optimizer_groups`):
the generator θ (the `default` policy, which samples), a fake score ψ (`fake`) that learns the generator's
distribution, and a surrogate φ (`surrogate`) that learns a reward-weighted denoiser from the rollouts (DGPO's group
preference); ψ and φ start as the base. The teacher T is the base with the adapters disabled (the frozen reference):
the many-step model when the generator is a LoRA on it. φ_old, an EMA of φ (decay min(0.3, 0.001 + 0.001·step)),
only bounds φ's step. There is no denoising (flow-matching) loss on the generator, which keeps few-step samples sharp.

The rollout is deterministic and recorded step by step (sampling.sde_type=sde at noise_level 0: Euler steps of the
ODE, kept in the trajectory), each state carrying its final image's advantage. The unit of the update is a prompt's
whole group (`GroupProcess`), and so is a draw's: per update each group draws `train_steps` distinct steps of the T,
one chunk each, and in each chunk its own j', τ, τ' and τ'' (below), which its rows share (theirs are drawn per
micro-batch and shared over the GPUs: the same expectation; ours do not depend on the micro-batch size or the
number of workers). At step j (states x_j at σ_j, σ' = σ_{j+1}), one chunk trains, from the same weights (the
optimizer steps once per mini-batch):

- ψ at x_τ = renoise(y, σ', τ, ε), y = x_j + (σ' − σ_j)·v_θ(x_j) the generator's Euler step, m = x_j − σ_j·v_θ;
- φ at a recorded state y' after step j' (drawn with weight j' + 1), re-noised with one ε per group to τ'' ≥
  `surrogate_min_sigma`, weighted (j' + 1)/T;
- θ through m, pulled by the teacher's CFG direction and the KL through ψ at another x_τ, and, on the rows whose
  step j < `reward_steps`, by φ at CFG against the teacher at x_τ' (y re-noised with one ε per group to τ' ≥
  `reward_min_sigma`; φ's and the teacher's forwards there run on those rows only).

algorithms/preference/tdm_r1_terms.py holds the formulas. Per row and trained step the chunk runs 13 forwards (10 on
a row whose step does not train the reward), 3 with gradient (θ, ψ, φ), as many as theirs: the teacher's CFG pair
costs one forward more (`velocity` returns the guided velocity only; its conditional half is computed beside it),
their θ one more (run without and with gradient). On a model that ignores guidance the pair is one forward.
Every draw (steps, j', τ, ε) comes from a generator seeded by (run seed, step, epoch, and the row's group or sample;
all but the steps' permutation also the chunk), drawn on the host, so a resumed run and any number of workers draw
the same, and which rows train the reward is known without reading the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.algorithms.base import LossOutput, LossSettings, OptimizerGroup, UpdatePosition, register_loss
from diffusion_rl.algorithms.preference.base import GroupProcess, GroupUnits, noise_like
from diffusion_rl.algorithms.preference.tdm_r1_terms import (
    FakeScoreInput,
    GeneratorInput,
    SurrogateInput,
    TdmR1Input,
    draw_tau,
    renoise,
    surrogate_target,
    tdm_r1_terms,
    x0_of,
)
from diffusion_rl.config.fields import MAX_STEPS, Range, check, opt
from diffusion_rl.errors import UserError
from diffusion_rl.utils.seeding import make_generator

FAKE, SURROGATE, SURROGATE_OLD = "fake", "surrogate", "surrogate_old"
OLD_DECAY_START, OLD_DECAY_RATE, OLD_DECAY_CAP = 0.001, 0.001, 0.3  # φ_old's decay (their ema_old_decay_min/max)


@dataclass
class TdmR1Settings(LossSettings):
    train_steps: int = opt(
        2, "Steps of the rollout trained per update, drawn afresh for each group, step and epoch (theirs: 2 of 4, "
        "drawn per micro-batch).",
        within=Range(1, MAX_STEPS),
    )  # fmt: skip
    reward_steps: int = opt(
        4, "The surrogate's reward trains the generator on steps j < this (their trunc_steps: 4 for OCR and GenEval, 2 "
        "for ImageReward and HPS); later steps train the teacher terms only.", within=Range(0, MAX_STEPS),
    )  # fmt: skip
    teacher_weight: float = opt(
        0.3, "w: the generator's loss is w·L_cfg + (1 − w)·L_reward + L_kl on a reward step, w·(L_cfg + L_kl) on the "
        "others (their tdm_weight).", within=Range(0, 1),
    )  # fmt: skip
    cfg_reward_scale: float = opt(
        3.5, "s: the CFG reward pulls the generator's x0-prediction by s·(x0_T,cond − x0_T,uncond) (theirs: 3.5).",
        within=Range(0, 100),
    )  # fmt: skip
    teacher_guidance: float = opt(
        4.5, "CFG scale of the teacher's x0-prediction that normalises the teacher terms (theirs: 4.5).",
        within=Range(1, 100, lo_open=True),
    )  # fmt: skip
    reward_guidance: float = opt(
        4.5, "CFG scale of the surrogate's x0-prediction in the reward term (their rl_cfg: 4.5 in their base config "
        "and OCR; 2.5 GenEval, whose σ bounds and β the defaults here take; 3.5 ImageReward and HPS).",
        within=Range(1, 100),
    )  # fmt: skip
    dpo_beta: float = opt(
        1.0, "β of the surrogate's group preference σ(β/G·Σ Â·(e − e_T)) (their beta_dpo: 1; 10 for OCR and HPS).",
        within=Range(0, 1e6, lo_open=True),
    )  # fmt: skip
    clip_range: float = opt(
        1e-3, "ε: a surrogate row stops training once exp(e_old − e) leaves 1 ± ε in its advantage's direction "
        "(theirs: 1e-3; 2e-3 ImageReward and HPS).", within=Range(0, 100, lo_open=True),
    )  # fmt: skip
    reg_threshold: float = opt(
        0.05, "While the surrogate's mean (v_φ − v_T)² exceeds this, a row whose error has passed the teacher's in "
        "its advantage's direction stops training.", within=Range(0, 1e6),
    )  # fmt: skip
    surrogate_reg: float = opt(0.001, "Weight of mean (v_φ − v_T)² in the surrogate's loss (their train.beta).",
                               within=Range(0, 1e4))  # fmt: skip
    fake_reg: float = opt(0.02, "Weight of mean (v_T − v_ψ)² in the fake score's loss (theirs: 0.02).",
                          within=Range(0, 1e4))  # fmt: skip
    reward_min_sigma: float = opt(
        0.25, "Lowest σ the reward term re-noises to (their t_min_dgpo / 1000: 0.25 GenEval, 0.3 OCR, 0.4 "
        "ImageReward and HPS).", within=Range(0, 0.99),
    )  # fmt: skip
    surrogate_min_sigma: float = opt(
        0.55, "Lowest σ the surrogate trains at (their t_min_dgpo_reward / 1000: 0.55; 0.3 OCR).",
        within=Range(0, 0.99),
    )  # fmt: skip
    time_weight: bool = opt(True, "The surrogate's loss at recorded step j' weighs (j' + 1)/T (their use_tweight).")
    adv_clip_max: float = opt(5.0, "Advantages are clamped to ±this in the surrogate's loss.",
                              within=Range(0, 1000, lo_open=True))  # fmt: skip
    fake_lr_scale: float = opt(4.0, "The fake score's lr is train.lr × this (theirs: 3e-4 against 7.5e-5).",
                               within=Range(0, 1e4, lo_open=True))  # fmt: skip
    fake_betas: tuple[float, float] = opt((0.0, 0.999), "The fake score's AdamW betas (theirs: 0, 0.999).",
                                          within=Range(0, 1))  # fmt: skip
    surrogate_lr_scale: float = opt(4.0, "The surrogate's lr is train.lr × this (theirs: 3e-4 against 7.5e-5).",
                                    within=Range(0, 1e4, lo_open=True))  # fmt: skip
    surrogate_betas: tuple[float, float] = opt((0.9, 0.999), "The surrogate's AdamW betas (theirs: 0.9, 0.999).",
                                               within=Range(0, 1))  # fmt: skip

    def check_config(self, algorithm, sampling) -> None:
        check(
            self.train_steps <= sampling.num_steps,
            f"algorithm.tdm_r1.train_steps={self.train_steps}: the rollout has sampling.num_steps="
            f"{sampling.num_steps} steps to draw from",
        )

    def check_run(self, cfg) -> None:
        check(
            cfg.model.lora.enabled,
            "algorithm.loss=tdm_r1 trains three LoRA adapters of one transformer (generator, fake score, surrogate): "
            "set model.lora.enabled=true",
        )


@dataclass
class GroupDraws:
    """One chunk's draws, one per group (`TdmR1._draws`)."""

    steps: list[int]  # j: the step the chunk trains
    recorded: list[int]  # j': the step after which the surrogate's recorded state lies
    uniforms: torch.Tensor  # [U, 3] float64 in [0, 1): the draws of τ, τ' (the reward's) and τ'' (the surrogate's)


def old_decay(step: int) -> float:
    """φ_old's decay after the update of training step `step` (0-based): min(0.3, 0.001 + 0.001·step)."""
    return min(OLD_DECAY_CAP, OLD_DECAY_START + OLD_DECAY_RATE * step)


class TdmR1(GroupProcess):
    @classmethod
    def check_rollout(cls, algorithm, sampling) -> None:
        check(
            sampling.sde_type == "sde" and sampling.noise_level == 0,
            "algorithm.loss=tdm_r1 trains on the states of a deterministic rollout, recorded step by step: set "
            f"sampling.sde_type=sde and sampling.noise_level=0 (got {sampling.sde_type}, {sampling.noise_level:g})",
        )

    @classmethod
    def needs_reference(cls, settings) -> bool:
        return True  # the teacher

    @classmethod
    def trained_calls(cls, algorithm, sampling) -> int:
        return 3 * algorithm.settings.train_steps  # θ, ψ and φ with gradient at each trained step

    @classmethod
    def frozen_calls(cls, algorithm, sampling, guidance_cost) -> float:
        # per row and trained step: ψ's teacher 1; φ's teacher and φ_old 2; θ's ψ 1, the teacher's conditional and
        # guided velocities (true CFG 1 + 2; one forward on a model that ignores guidance); and on a reward step
        # (j < reward_steps, a share reward_steps / T of the uniformly drawn steps) φ at reward_guidance and the
        # teacher — per trained call (three of them a step)
        s = algorithm.settings
        teacher_pair = 1 + (0 if guidance_cost.ignored else guidance_cost.forwards(s.teacher_guidance))
        reward_share = min(s.reward_steps, sampling.num_steps) / sampling.num_steps
        reward_forwards = guidance_cost.forwards(s.reward_guidance) + 1
        return (4 + teacher_pair + reward_forwards * reward_share) / 3

    @classmethod
    def optimizer_groups(cls, settings) -> tuple[OptimizerGroup, ...]:
        return (
            OptimizerGroup(),
            OptimizerGroup(FAKE, settings.fake_lr_scale, tuple(settings.fake_betas)),
            OptimizerGroup(SURROGATE, settings.surrogate_lr_scale, tuple(settings.surrogate_betas)),
        )

    def attach(self, model) -> None:
        s = self.settings
        if model.ignores_guidance():  # a step-distilled, CFG-free model: no unconditional prediction to guide with
            for key, wanted, why in (("reward_guidance", 1, "the surrogate's reward is its conditional prediction"),
                                     ("cfg_reward_scale", 0, "the teacher's CFG direction is 0")):  # fmt: skip
                value = getattr(s, key)
                if value != wanted:
                    raise UserError(f"algorithm.tdm_r1.{key}={value:g}: this model runs no CFG (step-distilled, "
                                    f"guidance ignored), so {why}: set {wanted}")  # fmt: skip
        super().attach(model)
        policies = model.policies
        policies.add(FAKE, trained=True, start=None)
        policies.add(SURROGATE, trained=True, start=None)
        policies.add(SURROGATE_OLD, start=SURROGATE)

    def chunks(self, units: GroupUnits) -> int:
        return self.settings.train_steps

    def _draws(self, at: UpdatePosition, k: int, groups: list[int]) -> GroupDraws:
        """Chunk k's draws for each of `groups` (their `group_index`), each from generators seeded by (run seed,
        step, epoch, chunk k, group): its step j, the k-th of a permutation of the T steps (so a group's chunks train
        distinct steps), the surrogate's recorded step j' (weight j' + 1) and three uniforms (τ, τ', τ'')."""
        T = self.sampler.num_steps
        weights = torch.arange(1, T + 1, dtype=torch.float64)
        steps, recorded, uniforms = [], [], []
        for group in groups:
            order = torch.randperm(T, generator=make_generator(self.seed, at.step, "tdm_r1_steps", at.epoch, group))
            g = make_generator(self.seed, at.step, "tdm_r1_draws", at.epoch, k, group)
            steps.append(int(order[k]))
            recorded.append(int(torch.multinomial(weights, 1, generator=g)))
            uniforms.append(torch.rand(3, generator=g, dtype=torch.float64))
        return GroupDraws(steps, recorded, torch.stack(uniforms))

    def _noise(self, like: torch.Tensor, keys: list[int], at: UpdatePosition, k: int, tag: str) -> torch.Tensor:
        return noise_like(like, [make_generator(self.seed, at.step, tag, at.epoch, k, i) for i in keys])

    @torch.no_grad()
    def _teacher_pair(self, x: torch.Tensor, t: torch.Tensor, cond, guidance: float):
        """The teacher's conditional velocity and its velocity guided at `guidance` (the same on a model that
        ignores guidance: one forward)."""
        with self.model.reference():
            v = self.velocity(x, t, cond)
            return v, (v if self.model.ignores_guidance() else self.model.velocity(x, t, cond, guidance))

    def loss(self, units: GroupUnits, k: int, at: UpdatePosition) -> LossOutput:
        s = self.settings
        U, G = units.advantages.shape
        traj = units.traj.reshape(U * G)
        T, N = self.sampler.num_steps, U * G
        if traj.latents is None or traj.latents.shape[1] != T:
            got = None if traj.latents is None else traj.latents.shape[1]
            raise ValueError(f"tdm_r1 needs the states before each of the {T} steps (window.kind=all); got {got}")
        ids = torch.stack([traj.ids.sample_index, traj.ids.group_index]).tolist()  # the chunk's one host read
        samples, groups = ids[0], ids[1]
        draws = self._draws(at, k, groups[::G])  # a unit is one group: its G rows share its draws
        cond, sigmas, device = traj.cond, self.sigmas.to(traj.device), traj.device

        def per_row(values: list[int]) -> torch.Tensor:  # a value per group → [N] long, on the device
            return torch.tensor(values, device=device).repeat_interleave(G)

        def state(step: torch.Tensor, last: int) -> torch.Tensor:  # each row's recorded state before its step
            x = traj.latents[torch.arange(N, device=device), step.clamp_max(T - 1)].float()
            if last < T:
                return x
            final = (step == T).view(-1, *[1] * (x.ndim - 1))  # step T: the final latents
            return torch.where(final, traj.final_latents.float(), x)

        j = per_row(draws.steps)
        u_tau, u_reward, u_surrogate = draws.uniforms.to(device, torch.float32).repeat_interleave(G, dim=0).unbind(1)
        x, sigma, sigma_next = state(j, max(draws.steps)), sigmas[j], sigmas[j + 1]
        v = self.velocity(x, sigma, cond)  # θ, with gradient
        m = x0_of(x, sigma, v)
        y = (x + (sigma_next - sigma).view(-1, *[1] * (x.ndim - 1)) * v).detach()
        tau = draw_tau(sigma_next, u_tau)

        # ψ's step: its denoising of the generator's re-noised Euler step
        x_fake = renoise(y, sigma_next, tau, self._noise(x, samples, at, k, "tdm_r1_fake_noise"))
        v_teacher_fake = self.velocity_of("reference", x_fake, tau, cond)
        with self.model.using(FAKE):
            v_fake = self.velocity(x_fake, tau, cond)
        fake = FakeScoreInput(v_fake=v_fake, v_teacher=v_teacher_fake, x_tau=x_fake, x0=m.detach(), tau=tau)

        # φ's step at a recorded state y' after each group's step j'
        recorded = per_row([jp + 1 for jp in draws.recorded])
        y_rec, sigma_rec = state(recorded, max(draws.recorded) + 1), sigmas[recorded]
        tau_rec = draw_tau(sigma_rec, u_surrogate, s.surrogate_min_sigma)
        eps_group = self._noise(x, groups, at, k, "tdm_r1_surrogate_noise")
        x_rec = renoise(y_rec, sigma_rec, tau_rec, eps_group)
        v_teacher_rec = self.velocity_of("reference", x_rec, tau_rec, cond)
        v_old = self.velocity_of(SURROGATE_OLD, x_rec, tau_rec, cond)
        with self.model.using(SURROGATE):
            v_surrogate = self.velocity(x_rec, tau_rec, cond)
        shape = (U, G, *x.shape[1:])
        time_weight = [(jp + 1) / T if s.time_weight else 1.0 for jp in draws.recorded]
        surrogate = SurrogateInput(
            v_surrogate=v_surrogate.view(shape), v_old=v_old.view(shape), v_teacher=v_teacher_rec.view(shape),
            target=surrogate_target(y_rec, sigma_rec, tau_rec, eps_group).view(shape), advantages=units.advantages,
            time_weight=torch.tensor(time_weight, device=device),
        )  # fmt: skip

        # θ's step: the teacher's CFG direction and the KL through ψ at x_τ; the reward through φ at x_τ'
        x_tau = renoise(y, sigma_next, tau, self._noise(x, samples, at, k, "tdm_r1_kl_noise"))
        fake_x0 = x0_of(x_tau, tau, self.velocity_of(FAKE, x_tau, tau, cond))
        v_cond, v_guided = self._teacher_pair(x_tau, tau, cond, s.teacher_guidance)
        teacher_x0 = x0_of(x_tau, tau, v_cond)
        guided_x0 = x0_of(x_tau, tau, v_guided)
        generator = GeneratorInput(
            x0=m, fake_x0=fake_x0, teacher_x0=teacher_x0, teacher_guided_x0=guided_x0,
            teacher_guidance_dir=(guided_x0 - teacher_x0) / (s.teacher_guidance - 1),  # x0_cond − x0_uncond
        )  # fmt: skip
        rows = [n for n in range(N) if draws.steps[n // G] < s.reward_steps]  # the rows whose step trains the reward
        # every worker runs the reward's forwards when any does (weights gathered per forward, engine.
        # reshard_after_forward, are collectives every worker joins): one without such rows runs them on one row
        if self.sum_over_workers(len(rows)) > 0:
            idx = torch.tensor(rows or [0], device=device)
            y_r, sigma_r, cond_r = y[idx], sigma_next[idx], cond[idx]
            tau_r = draw_tau(sigma_r, u_reward[idx], s.reward_min_sigma)
            eps_r = self._noise(y_r, [groups[n] for n in rows or [0]], at, k, "tdm_r1_reward_noise")
            x_r = renoise(y_r, sigma_r, tau_r, eps_r)
            with torch.no_grad(), self.model.using(SURROGATE):
                reward_x0 = x0_of(x_r, tau_r, self.model.velocity(x_r, tau_r, cond_r, s.reward_guidance))
            reward_ref_x0 = x0_of(x_r, tau_r, self.velocity_of("reference", x_r, tau_r, cond_r))
            if rows:
                generator.reward_rows, generator.reward_x0, generator.reward_ref_x0 = idx, reward_x0, reward_ref_x0
        return self.loss_fn(TdmR1Input(fake, surrogate, generator, units.weight), s)

    def end(self, step: int) -> dict[str, float]:
        decay = old_decay(step)
        self.model.policies.ema_update(SURROGATE_OLD, SURROGATE, decay)
        return {"tdm_r1/surrogate_old_decay": decay}


@register_loss("tdm_r1", settings=TdmR1Settings, algorithm=TdmR1)
def tdm_r1_loss(inp: TdmR1Input, cfg) -> LossOutput:
    """cfg: the TdmR1Settings fields the terms read (tdm_r1_terms.py)."""
    loss, metrics = tdm_r1_terms(inp, cfg)
    return LossOutput(loss=loss, metrics=metrics)
