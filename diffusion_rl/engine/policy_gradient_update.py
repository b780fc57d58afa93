"""The policy-gradient update (Flow-GRPO, GRPO-Guard, Flow-DPPO; with rollout correction).

For every trained window step j of every sample: recompute log π_θ(x_{j+1} | x_j) and the step mean with the
same guided velocity used in sampling, and hand them with the rollout's (or recomputed old) values to the
registered loss. Gradients accumulate over micro-batches and trained steps so that each optimizer step sees
the mean over (kept samples × trained steps) of its mini-batch, whatever the micro-batch size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tensordict import TensorDict

from diffusion_rl.algorithms.losses import LOSSES, PolicyLossInput
from diffusion_rl.algorithms.rollout_correction import correction_weights
from diffusion_rl.sampling.rollout import recompute_step
from diffusion_rl.utils.seeding import make_generator

if TYPE_CHECKING:
    from diffusion_rl.engine.worker import PolicyWorker


def trained_columns(batch: TensorDict, cfg, step: int) -> torch.Tensor:
    """[B, K] window columns each sample trains on this step (`first` K, or a seeded per-sample subset)."""
    alg = cfg.algorithm
    B, W = batch["log_probs"].shape
    K = max(1, int(W * alg.timestep_fraction))
    if alg.timestep_selection == "first":
        return torch.arange(K).expand(B, K)
    rows = [
        torch.randperm(W, generator=make_generator(cfg.run.seed, step, "timesteps", int(i)))[:K]
        for i in batch["sample_index"].tolist()
    ]
    return torch.stack(rows)


def _gather_step(mb: TensorDict, cols: torch.Tensor) -> TensorDict:
    """A one-step trajectory holding, per row, window column cols[row] of the micro-batch."""
    rows = torch.arange(mb.batch_size[0], device=mb.device)
    return TensorDict(
        {
            "latents": torch.stack([mb["latents"][rows, cols], mb["latents"][rows, cols + 1]], dim=1),
            "sigmas": mb["sigmas"][rows, cols].unsqueeze(1),
            "sigmas_next": mb["sigmas_next"][rows, cols].unsqueeze(1),
        },
        batch_size=mb.batch_size,
    )


class PolicyGradientUpdate:
    rollout_policy = "default"  # the named policy the worker samples training rollouts with

    def __init__(self, worker: PolicyWorker):
        self.worker = worker
        self.cfg = worker.cfg
        self.loss_fn = LOSSES.get(self.cfg.algorithm.loss)

    def __call__(self, batch: TensorDict, step: int) -> dict[str, float]:
        w, t, alg = self.worker, self.cfg.train, self.cfg.algorithm
        B = batch.batch_size[0]
        columns_BK = trained_columns(batch, self.cfg, step).to(batch.device)
        K = columns_BK.shape[1]
        keep_B = (batch["advantages"] != 0) if alg.drop_zero_advantage else torch.ones(B, dtype=torch.bool)
        keep_B = keep_B.to(batch.device)
        rows_B = torch.arange(B, device=batch.device)
        batch["train_old_log_probs"] = batch["log_probs"][rows_B[:, None], columns_BK]  # [B, K]
        batch["train_old_means"] = batch["means"][rows_B[:, None], columns_BK]
        batch["train_weights"] = torch.ones(B, K, device=batch.device)
        # loss metrics: summed over backward passes, then their mean; rollout_corr/* of the bypass rejection: summed
        # weighted by the micro-batch's rows, then divided by all rows of all passes, i.e. the share of the update's
        # (sample, trained step) entries, the value decoupled mode computes once over [B, K]
        sums: dict[str, float] = {}
        entry_sums: dict[str, float] = {}
        correction: dict[str, float] = {}
        if alg.rollout_correction.mode == "decoupled":
            correction = self._decoupled_old_policy(batch, columns_BK)
        counts, entries, grad_norms = 0, 0, []
        for _epoch in range(t.ppo_epochs):
            for m in range(t.num_minibatches):
                rows = torch.arange(m, B, t.num_minibatches, device=batch.device)  # interleaved: mixes groups
                n_kept = w.parallel.sum(int(keep_B[rows].sum()))  # over all workers: the global mean
                if n_kept == 0:
                    continue
                micros = rows.split(t.micro_batch_size)
                for i, micro in enumerate(micros):
                    for k in range(K):
                        w.parallel.sync_gradients(last_before_step=(i, k) == (len(micros) - 1, K - 1))
                        scale = len(micro) / (n_kept * K)
                        metrics = self._backward_step(batch[micro], columns_BK[micro, k], k, keep_B[micro], scale)
                        for name, value in metrics.items():
                            if name.startswith("rollout_corr/"):
                                entry_sums[name] = entry_sums.get(name, 0.0) + float(value) * len(micro)
                            else:
                                sums[name] = sums.get(name, 0.0) + float(value)
                        counts += 1
                        entries += len(micro)
                grad_norms.append(w.optimizer_step())
        out = {name: value / max(counts, 1) for name, value in sums.items()}
        out.update({name: value / max(entries, 1) for name, value in entry_sums.items()})
        out.update(correction)
        out.update(w.optimizer_metrics(grad_norms))
        out["train/kept_fraction"] = float(keep_B.float().mean())
        return out

    @torch.no_grad()
    def _decoupled_old_policy(self, batch: TensorDict, columns_BK: torch.Tensor) -> dict[str, float]:
        """Recompute old log-probs and means with the weights before this update; IS/rejection weights [B, K]."""
        w, B = self.worker, batch.batch_size[0]
        logps, means = [], []
        for micro in torch.arange(B, device=batch.device).split(self.cfg.train.micro_batch_size):
            mb = batch[micro]
            cols_logp, cols_mean = [], []
            for k in range(columns_BK.shape[1]):
                out = recompute_step(w.model, _gather_step(mb, columns_BK[micro, k]), mb["cond"], 0, w.settings)
                cols_logp.append(out.log_prob)
                cols_mean.append(out.mean)
            logps.append(torch.stack(cols_logp, dim=1))
            means.append(torch.stack(cols_mean, dim=1))
        rollout_BK = batch["train_old_log_probs"]  # still the rollout's values here
        batch["train_old_log_probs"] = torch.cat(logps)
        batch["train_old_means"] = torch.cat(means)
        corrected = correction_weights(batch["train_old_log_probs"], rollout_BK, self.cfg.algorithm.rollout_correction)
        batch["train_weights"] = corrected.weights_BW
        return {name: float(value) for name, value in corrected.metrics.items()}

    def _backward_step(self, mb: TensorDict, cols: torch.Tensor, k: int, keep: torch.Tensor, scale: float) -> dict:
        w, alg = self.worker, self.cfg.algorithm
        step_mb = _gather_step(mb, cols)
        out = recompute_step(w.model, step_mb, mb["cond"], 0, w.settings)
        ref_mean = None
        if alg.kl_beta > 0:
            with torch.no_grad(), w.model.reference():
                ref_mean = recompute_step(w.model, step_mb, mb["cond"], 0, w.settings).mean
        weights = keep.float() * mb["train_weights"][:, k]
        metrics: dict[str, torch.Tensor] = {}
        rc = alg.rollout_correction
        if rc.mode == "bypass" and rc.rs_stat is not None:
            # rejection from the current policy's log-probs of this step against the rollout's
            corrected = correction_weights(out.log_prob.detach()[:, None], mb["train_old_log_probs"][:, k : k + 1], rc)
            weights = weights * corrected.weights_BW[:, 0]
            # of this micro-batch's rows; __call__ turns these into the share over all the update's entries
            metrics["rollout_corr/rejected_fraction"] = corrected.metrics["rollout_corr/rejected_fraction"]
        inp = PolicyLossInput(
            log_prob=out.log_prob,
            old_log_prob=mb["train_old_log_probs"][:, k],
            advantages=mb["advantages"],
            mean=out.mean,
            old_mean=mb["train_old_means"][:, k],
            ref_mean=ref_mean,
            std=out.std,
            sqrt_dt=(step_mb["sigmas"][:, 0] - step_mb["sigmas_next"][:, 0]).sqrt(),
            weights=weights,
        )
        loss_out = self.loss_fn(inp, alg)
        (loss_out.loss * scale).backward()
        return {"loss": loss_out.loss.detach(), **loss_out.metrics, **metrics}
