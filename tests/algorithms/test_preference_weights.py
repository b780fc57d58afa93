"""Unit weights of the direct-preference losses: a weight-0 unit (one that only pads a worker's share of an update)
adds nothing to the loss or its gradient and stays in the mean's denominator; weights of 1 change nothing."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.preference.awm import AwmInput, awm_loss
from diffusion_rl.algorithms.preference.dpo import DpoInput, dpo_loss
from diffusion_rl.algorithms.preference.nft import NftInput, nft_loss


def _dpo(rows: slice = slice(None), weights=None) -> DpoInput:
    # pair 0: chosen error 0.5 vs ref 0.25, rejected 0 vs ref 1; pair 1: chosen 1 vs 0, rejected 2 vs 0
    t = lambda x: torch.tensor(x)[rows]  # noqa: E731
    return DpoInput(
        v_chosen=t([[1.0, 0.0], [0.0, 0.0]]).requires_grad_(True),
        v_rejected=t([[0.0, 0.0], [2.0, 0.0]]).requires_grad_(True),
        v_ref_chosen=t([[0.5, 0.5], [1.0, 1.0]]),
        v_ref_rejected=t([[1.0, 1.0], [0.0, 0.0]]),
        target_chosen=t([[0.0, 0.0], [1.0, 1.0]]),
        target_rejected=t([[0.0, 0.0], [0.0, 0.0]]),
        weights=weights,
    )


def test_dpo_weight_zero_pair_counts_in_the_denominator_only():
    cfg = SimpleNamespace(dpo_beta=2.0)
    # pair 0 alone, by hand: inside = -1·(0.5 − 0.25) + 1·(0 − 1) = −1.25; loss −log σ(−1.25)
    alone = -math.log(1 / (1 + math.exp(1.25)))
    padded = dpo_loss(_dpo(weights=torch.tensor([1.0, 0.0])), cfg)
    assert padded.loss.item() == pytest.approx(alone / 2, rel=1e-6)
    assert padded.metrics["dpo/implicit_acc"].item() == 0.0  # pair 0 only: inside < 0
    assert padded.metrics["dpo/margin"].item() == pytest.approx(-1.25)
    ones = dpo_loss(_dpo(weights=torch.ones(2)), cfg)
    plain = dpo_loss(_dpo(), cfg)
    assert ones.loss.item() == plain.loss.item()
    assert {k: v.item() for k, v in ones.metrics.items()} == {k: v.item() for k, v in plain.metrics.items()}


def test_nft_and_awm_weight_zero_rows_add_no_gradient():
    nft_cfg = SimpleNamespace(nft_beta=0.5, adv_clip_max=2.0, kl_beta=0.1, reward_mode="continuous", weight_floor=1e-5)
    awm_cfg = SimpleNamespace(clip_range=1.0, adv_clip_max=2.0, advantage_max=1.0, weighting="t", kl_beta=0.1,
                              ema_beta=0.0)  # fmt: skip
    v = torch.tensor([[2.0, 2.0], [-1.0, 3.0]], requires_grad=True)
    zero_second = torch.tensor([1.0, 0.0])

    def nft(weights):
        return NftInput(v=v, v_old=torch.tensor([[1.0, 1.0], [-2.0, 2.0]]),
                        v_ref=torch.tensor([[1.0, 2.0], [0.0, 0.0]]), x_t=torch.tensor([[1.0, 1.0], [0.0, 0.0]]),
                        x0=torch.tensor([[0.0, 0.0], [1.0, -1.0]]), t=torch.tensor([0.5, 0.5]),
                        advantages=torch.tensor([-2.0, 0.0]), weights=weights)  # fmt: skip

    def awm(weights):
        return AwmInput(v=v, target=torch.tensor([[1.0, 1.0], [0.0, 1.0]]), t=torch.tensor([0.5, 0.9]),
                        log_p_old=torch.tensor([-0.4, -2.0], dtype=torch.float64), advantages=torch.tensor([1.0, -1.0]),
                        v_ref=torch.tensor([[0.0, 0.0], [0.0, 0.0]]), weights=weights)  # fmt: skip

    for loss_fn, make, cfg in ((nft_loss, nft, nft_cfg), (awm_loss, awm, awm_cfg)):
        v.grad = None
        loss_fn(make(zero_second), cfg).loss.backward()
        assert torch.all(v.grad[1] == 0), loss_fn.__name__  # the padding row moves nothing
        assert torch.any(v.grad[0] != 0)
        first = v.grad[0].clone()
        v.grad = None
        loss_fn(make(torch.tensor([1.0, 1.0])), cfg).loss.backward()  # row 0's share of the mean is the same
        assert torch.allclose(v.grad[0], first), loss_fn.__name__
        assert loss_fn(make(None), cfg).loss.item() == loss_fn(make(torch.ones(2)), cfg).loss.item()
