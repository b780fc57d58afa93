"""Tree rollouts on the tiny SD3 model: shared prefixes, divergent branches, the NFE count, order-free seeding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.models.loader import load_model
from diffusion_rl.sampling.rollout import SamplerSettings, training_rollout
from diffusion_rl.sampling.trajectory import SampleIds
from diffusion_rl.sampling.tree import TreeSpec, nfe_per_image
from diffusion_rl.sampling.window import SdeWindow, default_window

STEPS = 5
TREE = TreeSpec(branch_at=(1, 3), branching=(2, 2))  # 4 leaves: split at step 1, then each child at step 3
SETTINGS = SamplerSettings(num_steps=STEPS, guidance=4.5, height=32, width=32, sde_type="sde", noise_level=0.7,
                           tree=TREE)  # fmt: skip
PROMPTS = ["a red cube"] * 4 + ["a blue ball"] * 4


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    cfg = ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16, lora=LoraConfig(enabled=False))
    return load_model(cfg)


def _ids(rows):
    rows = torch.as_tensor(rows)
    return SampleIds(sample_index=rows, group_index=rows // 4, prompt=[PROMPTS[i] for i in rows.tolist()],
                     policy_version=torch.zeros_like(rows), batch_size=[len(rows)])  # fmt: skip


def _roll(model, rows=range(8), window=None, settings=SETTINGS, step=3):
    rows = list(rows)
    return training_rollout(model, settings, [PROMPTS[i] for i in rows], [None] * len(rows), _ids(rows), step,
                            window or default_window(STEPS), seed=7, share_initial_noise=False)  # fmt: skip


@pytest.fixture(scope="module")
def traj(model):
    return _roll(model)


def test_branches_share_exactly_the_prefix_and_differ_after_each_split(traj):
    # window = steps 0..3, so latents column c is x before step c (column 4: after step 3)
    lat = traj.latents
    for g in (0, 4):
        a, b, c, d = (lat[g + i] for i in range(4))  # leaves 0,1 under child 0; leaves 2,3 under child 1
        # before the first split (x_0, x_1): one root per prompt
        for other in (b, c, d):
            assert torch.equal(a[:2], other[:2])
        # the split at step 1: siblings of the first depth share x_1 only, then x_2 differs between the two subtrees
        assert not torch.equal(a[2], c[2])
        assert torch.equal(a[2:4], b[2:4]) and torch.equal(c[2:4], d[2:4])  # x_2, x_3 shared within a subtree
        # the split at step 3: the leaves under one depth-1 node differ from x_4 on
        assert not torch.equal(a[4], b[4]) and not torch.equal(c[4], d[4])
        assert not torch.equal(traj.final_latents[g], traj.final_latents[g + 1])
    # the shared steps' log-probs are the same numbers in every row that holds them
    assert torch.equal(traj.log_probs[0, :3], traj.log_probs[1, :3])
    assert torch.equal(traj.log_probs[0, :1], traj.log_probs[2, :1])
    assert not torch.equal(traj.log_probs[0, 1], traj.log_probs[2, 1])
    # two prompts: two different trees
    assert not torch.equal(lat[0, 0], lat[4, 0])


def test_seeding_is_independent_of_batch_order_and_of_the_other_groups(model, traj):
    order = [5, 2, 7, 0, 4, 1, 6, 3]
    shuffled = _roll(model, order)
    for pos, row in enumerate(order):
        assert torch.equal(shuffled.final_latents[pos], traj.final_latents[row])
        assert torch.equal(shuffled.latents[pos], traj.latents[row])
    alone = _roll(model, range(4, 8))  # the second prompt's tree without the first (another batch size: float noise)
    assert torch.allclose(alone.final_latents, traj.final_latents[4:], atol=1e-5)
    other_step = _roll(model, step=4)  # another training step draws other noise
    assert not torch.allclose(other_step.final_latents, traj.final_latents, atol=1e-3)


def test_a_group_must_be_sampled_whole(model):
    with pytest.raises(ValueError, match="whole"):
        _roll(model, range(6))


def test_a_split_outside_the_sde_window_is_refused(model):
    with pytest.raises(ValueError, match="branch_at"):
        _roll(model, window=SdeWindow(start=2, size=2))


def test_nfe_is_counted_and_matches_the_formula(model, traj):
    calls = []
    velocity = model.velocity

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return velocity(x, *args, **kwargs)

    model.velocity = counting
    try:
        tree = _roll(model)
        flat = _roll(model, settings=dataclasses.replace(SETTINGS, tree=None))
    finally:
        del model.velocity
    # n(j) nodes per tree at step j: 1, 1 (the split's velocity on the parent), 2, 2, 4 → 10 per tree, 2 trees
    assert calls[:STEPS] == [2, 2, 4, 4, 8] and sum(calls[:STEPS]) == 20
    assert TREE.evaluations(STEPS) == 10
    # CFG doubles both: tree 2 · 10 / 4 = 5 forwards per image, flat 2 · 5 = 10
    assert nfe_per_image(STEPS, TREE, 2, 4) == 5.0 and nfe_per_image(STEPS, None, 2, 4) == 10.0
    assert tree.nfe.tolist() == [5.0] * 8 and flat.nfe.tolist() == [10.0] * 8
    assert sum(calls[STEPS:]) == 8 * STEPS


def test_a_one_split_tree_with_a_one_step_window_is_the_tempflow_rollout(model):
    # TempFlow-GRPO: ODE everywhere but the split step k = 2, where the N = 4 children draw their noise
    settings = dataclasses.replace(SETTINGS, tree=TreeSpec(branch_at=(2,), branching=(4,)))
    traj = _roll(model, window=SdeWindow(start=2, size=1), settings=settings)
    assert traj.latents.shape[1] == 2 and traj.step_index[0].tolist() == [2]
    assert all(torch.equal(traj.latents[0, 0], traj.latents[i, 0]) for i in range(4))  # x_2: the one ODE prefix
    ends = traj.latents[:4, 1]
    assert all(not torch.equal(ends[i], ends[j]) for i in range(4) for j in range(i))
    assert traj.nfe[0].item() == 2 * (3 + 4 * 2) / 4  # steps 0-2 once per prompt, 3-4 per leaf


def test_the_ode_steps_between_splits_use_the_configured_solver(model):
    # a one-split tree at k = 2: the shared prefix x_2 is two ab2 steps from the root noise (the second one
    # second-order), which differ from two Euler steps
    from diffusion_rl.sampling.ode import OdeSolver
    from diffusion_rl.utils.seeding import make_generator

    settings = dataclasses.replace(SETTINGS, tree=TreeSpec(branch_at=(2,), branching=(4,)), ode_solver="ab2")
    traj = _roll(model, rows=range(4), window=SdeWindow(start=2, size=1), settings=settings)
    shape = model.latent_shape(32, 32, 1)
    sigmas = model.sigma_schedule(STEPS, 32, 32, 1)
    cond = model.encode_prompts(["a red cube"], [""])
    by_solver = {}
    for name in ("ab2", "euler"):
        solver = OdeSolver(name)
        x = torch.randn(shape, generator=make_generator(7, 3, "tree_init", 0))[None]
        with torch.no_grad(), model.eval_mode():
            for j in range(2):
                x = solver.step(
                    x, model.velocity(x, sigmas[j].item(), cond, 4.5), sigmas[j].item(), sigmas[j + 1].item()
                )
        by_solver[name] = x[0]
    torch.testing.assert_close(traj.latents[0, 0], by_solver["ab2"], atol=1e-5, rtol=1e-5)
    assert (by_solver["ab2"] - by_solver["euler"]).abs().max() > 1e-4
