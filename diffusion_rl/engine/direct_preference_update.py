"""The direct-preference / forward-process update (Diffusion-DPO, DiffusionNFT, AWM).

No per-step log-probs: each loss re-noises the rollouts' clean final latents x0 at fresh times,
x_t = (1 − t)·x0 + t·ε, and compares the velocity the policy predicts there (conditional: guidance 1) with the
flow-matching target u = ε − x0 or with the predictions of other policies (the reference, `old`, `ema`), which
are computed without gradient. Every ε and t comes from a generator seeded by (run seed, step, sample, …), so a
sample's draws never depend on the batch it is in, and a resumed run draws the same ones.

What differs between the losses (which units it trains on, which times, which other policies, what it keeps
between steps) is a `Method`, chosen by the registered loss's `input_type`; the loop over epochs, mini-batches,
micro-batches and timestep chunks is shared. Gradients accumulate so that each optimizer step sees the loss's
mean over its mini-batch's units (pairs or samples) and timestep chunks, whatever the micro-batch size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from diffusion_rl.algorithms.preference import (
    PREFERENCE_LOSSES,
    AwmInput,
    DpoInput,
    NftInput,
    awm_log_p,
    awm_timestep_indices,
    dpo_timesteps,
    ema_decay_awm,
    nft_timestep_indices,
    old_decay,
)
from diffusion_rl.algorithms.preference.base import row_mean
from diffusion_rl.models.policies import DEFAULT
from diffusion_rl.utils.seeding import make_generator

if TYPE_CHECKING:
    from diffusion_rl.engine.worker import PolicyWorker

TRAIN_SCHEDULE_STEPS = 1000  # the training schedule DPO's logit-normal t indexes (SD3-style: 1000 timesteps)


def _expand(t_B: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t_B.view(-1, *([1] * (like.ndim - 1)))


def noise_like(x0: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """ε [B, …] with row i drawn from generators[i] (on the CPU, so the draw is the same on every device)."""
    shape = tuple(x0.shape[1:])
    return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(x0.device, torch.float32)


def forward_noise(x0: torch.Tensor, eps: torch.Tensor, t_B: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·ε, fp32."""
    t = _expand(t_B.to(x0.device, torch.float32), x0)
    return (1 - t) * x0.float() + t * eps


class Method:
    """What one preference loss needs around the shared loop; subclasses set `input_type`."""

    input_type: type
    rollout_policy = DEFAULT  # the policy that samples the training rollouts

    def __init__(self, worker: PolicyWorker):
        self.worker, self.cfg, self.model = worker, worker.cfg, worker.model
        self.alg = self.cfg.algorithm
        s = self.cfg.sampling
        self.sigmas = self.model.sigma_schedule(s.num_steps, s.height, s.width)  # [T + 1], σ_0 = 1, σ_T = 0

    def velocity(self, x_t: torch.Tensor, t_B: torch.Tensor, cond: TensorDict) -> torch.Tensor:
        return self.model.velocity(x_t, t_B, cond, 1.0)  # conditional prediction: guidance 1

    @torch.no_grad()
    def velocity_of(self, policy: str, x_t: torch.Tensor, t_B: torch.Tensor, cond: TensorDict) -> torch.Tensor:
        if policy == "reference":
            with self.model.reference():
                return self.velocity(x_t, t_B, cond)
        with self.model.using(policy):
            return self.velocity(x_t, t_B, cond)

    def units(self, batch: TensorDict) -> torch.Tensor:
        """[U] batch rows (or pair indices) the update trains on."""
        return torch.arange(batch.batch_size[0], device=batch.device)

    def micro_size(self) -> int:
        return self.cfg.train.micro_batch_size

    def begin(self, batch: TensorDict, units: torch.Tensor, step: int) -> dict[str, float]:
        """Before any optimizer step of this update."""
        return {}

    def chunks(self) -> int:
        """Backward passes per micro-batch (timesteps trained one at a time keep activation memory flat)."""
        return 1

    def loss_input(self, batch: TensorDict, micro: torch.Tensor, k: int, m: int, epoch: int, step: int):
        raise NotImplementedError

    def after_update(self, step: int) -> dict[str, float]:
        """After the update of training step `step` (0-based): `step + 1` steps are complete."""
        return {}


class DpoMethod(Method):
    """Diffusion-DPO: one t and ε per pair (per epoch), shared by its chosen and rejected members."""

    input_type = DpoInput

    def __init__(self, worker: PolicyWorker):
        super().__init__(worker)
        self.model.policies.keep_reference()
        s = self.cfg.sampling
        self.sigmas_train = self.model.sigma_schedule(TRAIN_SCHEDULE_STEPS, s.height, s.width)[:-1]  # [1000]

    def units(self, batch: TensorDict) -> torch.Tensor:
        """The chosen rows whose rejected partner (same `pair_id`, `pair_role` −1) is in this batch; each stands for
        its pair. `partner` [B]: the partner row of each such chosen row."""
        role_B, id_B = batch["pair_role"], batch["pair_id"]
        rejected_of = {int(i): row for row, i in enumerate(id_B.tolist()) if role_B[row] == -1}
        chosen = [row for row, i in enumerate(id_B.tolist()) if role_B[row] == 1 and int(i) in rejected_of]
        self.partner = torch.full_like(id_B, -1)
        self.partner[chosen] = torch.tensor([rejected_of[int(id_B[row])] for row in chosen], dtype=id_B.dtype)
        return torch.tensor(chosen, dtype=torch.long, device=batch.device)

    def micro_size(self) -> int:
        return max(1, self.cfg.train.micro_batch_size // 2)  # a pair is two forwards

    def loss_input(self, batch, micro, k, m, epoch, step):
        chosen, rejected = micro, self.partner[micro]
        seed = self.cfg.run.seed
        generators = [make_generator(seed, step, "dpo", epoch, int(i)) for i in batch["sample_index"][chosen]]
        t_P = torch.cat([dpo_timesteps(1, g, self.sigmas_train) for g in generators]).to(batch.device)
        x0_w, x0_l = batch["final_latents"][chosen], batch["final_latents"][rejected]
        eps = noise_like(x0_w, generators)
        rows = torch.cat([chosen, rejected])
        t_2P, x0 = torch.cat([t_P, t_P]), torch.cat([x0_w, x0_l])
        x_t = forward_noise(x0, torch.cat([eps, eps]), t_2P)
        cond = batch["cond"][rows]
        v = self.velocity(x_t, t_2P, cond)
        v_ref = self.velocity_of("reference", x_t, t_2P, cond)
        target = torch.cat([eps, eps]) - x0
        n = len(chosen)
        return DpoInput(
            v_chosen=v[:n],
            v_rejected=v[n:],
            v_ref_chosen=v_ref[:n],
            v_ref_rejected=v_ref[n:],
            target_chosen=target[:n],
            target_rejected=target[n:],
        )


class NftMethod(Method):
    """DiffusionNFT: the `old` adapter samples; each sample trains at a seeded subset of the rollout's σs."""

    input_type = NftInput
    rollout_policy = "old"

    def __init__(self, worker: PolicyWorker):
        super().__init__(worker)
        self.model.policies.add("old")
        if self.alg.kl_beta > 0:
            self.model.policies.keep_reference()
        self.num_trained = max(1, int(self.cfg.sampling.num_steps * self.alg.timestep_fraction))

    def begin(self, batch, units, step):
        seed, steps, fraction = self.cfg.run.seed, self.cfg.sampling.num_steps, self.alg.timestep_fraction
        self.indices_BK = torch.stack(
            [
                nft_timestep_indices(steps, fraction, make_generator(seed, step, "nft_timesteps", int(i)))
                for i in batch["sample_index"]
            ]
        )
        return {}

    def chunks(self) -> int:
        return self.num_trained

    def loss_input(self, batch, micro, k, m, epoch, step):
        seed = self.cfg.run.seed
        t_B = self.sigmas[self.indices_BK[micro.cpu(), k]].to(batch.device)
        x0 = batch["final_latents"][micro]
        generators = [make_generator(seed, step, "nft_noise", epoch, int(i), k) for i in batch["sample_index"][micro]]
        x_t = forward_noise(x0, noise_like(x0, generators), t_B)
        cond = batch["cond"][micro]
        v = self.velocity(x_t, t_B, cond)
        v_ref = self.velocity_of("reference", x_t, t_B, cond) if self.alg.kl_beta > 0 else None
        return NftInput(
            v=v,
            v_old=self.velocity_of("old", x_t, t_B, cond),
            v_ref=v_ref,
            x_t=x_t,
            x0=x0.float(),
            t=t_B,
            advantages=batch["advantages"][micro],
        )

    def after_update(self, step):
        completed, alg = step + 1, self.alg
        if completed % alg.old_update_interval:
            return {}
        fixed = alg.old_decay_value if alg.old_decay == "fixed" else None
        decay = old_decay(completed, alg.old_decay, fixed)
        self.model.policies.ema_update("old", DEFAULT, decay)
        return {"nft/old_decay": decay}


class AwmMethod(Method):
    """AWM: K stratified step indices per mini-batch; ε per (sample, index), the same in every epoch, so the
    ratio's log p̂_old (under the weights that sampled) stays valid across the update's optimizer steps."""

    input_type = AwmInput

    def __init__(self, worker: PolicyWorker):
        super().__init__(worker)
        if self.alg.kl_beta > 0:
            self.model.policies.keep_reference()
        if self.alg.ema_beta > 0:
            self.model.policies.add("ema")
        self.train_steps = int(self.cfg.sampling.num_steps * self.alg.timestep_fraction)

    def chunks(self) -> int:
        return self.alg.train_timesteps

    def begin(self, batch, units, step):
        t = self.cfg.train
        seed, minibatches = self.cfg.run.seed, t.num_minibatches
        self.indices_MK = [
            awm_timestep_indices(self.alg.train_timesteps, self.train_steps, make_generator(seed, step, "awm_t", m))
            for m in range(minibatches)
        ]
        self.log_p_old_BK = None
        if minibatches * t.ppo_epochs > 1:  # later optimizer steps see changed weights: keep the sampling ones'
            self.log_p_old_BK = torch.zeros(batch.batch_size[0], self.chunks(), dtype=torch.float64)
            with torch.no_grad():
                for m in range(minibatches):
                    rows = units[m::minibatches]
                    for micro in rows.split(self.micro_size()):
                        for k in range(self.chunks()):
                            x_t, t_B, eps, x0 = self._draw(batch, micro, k, m, step)
                            mse = row_mean((self.velocity(x_t, t_B, batch["cond"][micro]).double() - (eps - x0)) ** 2)
                            self.log_p_old_BK[micro.cpu(), k] = awm_log_p(mse, t_B, self.alg.weighting).cpu()
        return {}

    def _draw(self, batch, micro, k, m, step):
        t_B = self.sigmas[self.indices_MK[m][k]].expand(len(micro)).to(batch.device)
        x0 = batch["final_latents"][micro].float()
        seed = self.cfg.run.seed
        generators = [make_generator(seed, step, "awm_noise", int(i), k) for i in batch["sample_index"][micro]]
        eps = noise_like(x0, generators)
        return forward_noise(x0, eps, t_B), t_B, eps, x0

    def loss_input(self, batch, micro, k, m, epoch, step):
        x_t, t_B, eps, x0 = self._draw(batch, micro, k, m, step)
        cond = batch["cond"][micro]
        v = self.velocity(x_t, t_B, cond)
        target = eps - x0
        if self.log_p_old_BK is None:  # the only optimizer step: the current weights are the ones that sampled
            log_p_old = awm_log_p(row_mean((v.detach().double() - target.double()) ** 2), t_B, self.alg.weighting)
        else:
            log_p_old = self.log_p_old_BK[micro.cpu(), k]
        alg = self.alg
        return AwmInput(
            v=v,
            target=target,
            t=t_B,
            log_p_old=log_p_old.to(v.device),
            advantages=batch["advantages"][micro],
            v_ref=self.velocity_of("reference", x_t, t_B, cond) if alg.kl_beta > 0 else None,
            v_ema=self.velocity_of("ema", x_t, t_B, cond) if alg.ema_beta > 0 else None,
        )

    def after_update(self, step):
        if self.alg.ema_beta <= 0:
            return {}
        decay = ema_decay_awm(step + 1)
        self.model.policies.ema_update("ema", DEFAULT, decay)
        return {"awm/ema_decay": decay}


METHODS: dict[type, type[Method]] = {DpoInput: DpoMethod, NftInput: NftMethod, AwmInput: AwmMethod}


class DirectPreferenceUpdate:
    def __init__(self, worker: PolicyWorker):
        self.worker = worker
        self.cfg = worker.cfg
        self.loss_fn = PREFERENCE_LOSSES.get(self.cfg.algorithm.loss)
        self.method = METHODS[self.loss_fn.input_type](worker)
        self.rollout_policy = self.method.rollout_policy

    def __call__(self, batch: TensorDict, step: int) -> dict[str, float]:
        w, t, method = self.worker, self.cfg.train, self.method
        units = method.units(batch)
        # counts summed over the workers (engine/parallel.py): each scales by the global count, so the summed
        # gradients are the global mean. Every worker needs rows in every mini-batch (DPO: pairs; see the report).
        total = w.parallel.sum(len(units))
        out: dict[str, float] = {"train/units": float(total)}
        sums: dict[str, float] = {}
        counts, grad_norms = 0, []
        if total > 0:
            out.update(method.begin(batch, units, step))
            K = method.chunks()
            for epoch in range(t.ppo_epochs):
                for m in range(t.num_minibatches):
                    rows = units[m :: t.num_minibatches]  # interleaved: mixes groups
                    n_rows = w.parallel.sum(len(rows))
                    if n_rows == 0:
                        continue
                    micros = rows.split(method.micro_size())
                    for i, micro in enumerate(micros):
                        for k in range(K):
                            w.parallel.sync_gradients(last_before_step=(i, k) == (len(micros) - 1, K - 1))
                            inp = method.loss_input(batch, micro, k, m, epoch, step)
                            loss_out = self.loss_fn(inp, self.cfg.algorithm)
                            (loss_out.loss * (len(micro) / (n_rows * K))).backward()
                            for name, value in {"loss": loss_out.loss.detach(), **loss_out.metrics}.items():
                                sums[name] = sums.get(name, 0.0) + float(value)
                            counts += 1
                    grad_norms.append(w.optimizer_step())
        out.update({name: value / counts for name, value in sums.items()})
        out.update(method.after_update(step))
        out.update(w.optimizer_metrics(grad_norms))
        return out
