"""The direct-preference math on video latents [B, C, F, H, W]: noising and the per-sample errors reduce over every
non-batch dimension, with the numbers worked out by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from diffusion_rl.algorithms.preference.base import forward_noise, row_mean
from diffusion_rl.algorithms.preference.dpo import DpoInput
from diffusion_rl.config.plugins import LOSSES


def video(rows):
    """[B, 2] numbers as video latents [B, C=1, F=2, H=1, W=1]: two 'frames' of one pixel each."""
    return torch.tensor(rows).reshape(len(rows), 1, 2, 1, 1)


def test_forward_noise_of_a_video_by_hand():
    x0, eps = video([[1.0, -1.0], [2.0, 0.0]]), video([[0.0, 4.0], [-2.0, 2.0]])
    x_t = forward_noise(x0, eps, torch.tensor([0.25, 0.5]))
    # row 0: 0.75·(1, −1) + 0.25·(0, 4) = (0.75, 0.25); row 1: 0.5·(2, 0) + 0.5·(−2, 2) = (0, 1)
    assert x_t.shape == x0.shape
    assert x_t.flatten(1).tolist() == [[0.75, 0.25], [0.0, 1.0]]
    assert row_mean(x_t).tolist() == [0.5, 0.5]


def test_dpo_loss_on_video_latents_by_hand():
    # per-sample errors (mean over the 2 elements): chosen 0.5 / ref 0.25; rejected 0 / ref 1 → inside −1.25 (β 2)
    inp = DpoInput(
        v_chosen=video([[1.0, 0.0]]).requires_grad_(),
        v_rejected=video([[0.0, 0.0]]).requires_grad_(),
        v_ref_chosen=video([[0.5, 0.5]]),
        v_ref_rejected=video([[1.0, 1.0]]),
        target_chosen=video([[0.0, 0.0]]),
        target_rejected=video([[0.0, 0.0]]),
    )
    out = LOSSES.get("dpo")(inp, SimpleNamespace(dpo_beta=2.0))
    assert out.loss.item() == pytest.approx(math.log(1 + math.exp(1.25)), rel=1e-6)
    out.loss.backward()
    assert inp.v_chosen.grad.shape == (1, 1, 2, 1, 1)
