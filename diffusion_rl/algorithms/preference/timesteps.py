"""Which forward-process times each preference loss trains on. Every draw takes an explicit generator.

- dpo_timesteps: one continuous-schedule sigma per pair, logit-normal(0, 1) over the training schedule.
- nft_timestep_indices: a random subset of the rollout's step indices (DiffusionNFT trains on the rollout
  schedule's sigmas, sigma_0 = 1 included).
- awm_timestep_indices: stratified step indices, one per stratum, shared by a micro-batch (AWM's
  "discrete_wo_init": index 0, pure noise, is never drawn).
"""

import torch


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


def nft_timestep_indices(num_steps: int, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """LongTensor [K]: the first K = max(1, int(num_steps * fraction)) entries of a permutation of range(num_steps).

    The caller passes one generator per sample (seeded from (seed, step, sample index)) and trains at the rollout
    schedule's sigmas at these indices.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not 0 < fraction <= 1:
        raise ValueError(f"timestep fraction must be in (0, 1], got {fraction}")
    k = max(1, int(num_steps * fraction))
    return torch.randperm(num_steps, generator=generator, device=generator.device)[:k]


def awm_timestep_indices(num_timesteps: int, train_steps: int, generator: torch.Generator) -> torch.Tensor:
    """LongTensor [K = num_timesteps]: one step index drawn uniformly in each of K strata of 1, ..., train_steps - 1.

    train_steps = int(num_steps * timestep_fraction); the candidates are the M = train_steps - 1 indices
    1, ..., train_steps - 1 (the half-open [1, train_steps), as AWM's reference does: index 0 is pure noise and
    index train_steps is outside the trained fraction). Stratum k (k = 0, ..., K - 1) is the integers
    [1 + floor(k * M / K), 1 + floor((k + 1) * M / K)); when K does not divide M the strata sizes differ by one,
    the larger ones falling where the floors step twice (e.g. M = 9, K = 6: sizes 1, 2, 1, 2, 1, 2). Every stratum
    holds at least one index, so the K indices are distinct and increasing; K > M is an error (the reference then
    repeats indices silently).
    """
    k, m = num_timesteps, train_steps - 1
    if k < 1:
        raise ValueError(f"train_timesteps must be >= 1, got {k}")
    if k > m:
        raise ValueError(
            f"AWM draws train_timesteps={k} distinct step indices from 1..{m} (= int(num_steps * timestep_fraction)"
            f" - 1 = {train_steps} - 1): lower train_timesteps to <= {max(m, 0)} or raise num_steps or "
            "timestep_fraction"
        )
    strata = torch.arange(k + 1, dtype=torch.long)
    bounds = 1 + (strata * m) // k  # [K + 1] integer stratum edges
    lo_K, size_K = bounds[:-1], bounds[1:] - bounds[:-1]
    u_K = torch.rand(k, generator=generator, device=generator.device, dtype=torch.float64)
    offset_K = (u_K * size_K.to(u_K.device)).floor().long()
    return lo_K.to(u_K.device) + offset_K
