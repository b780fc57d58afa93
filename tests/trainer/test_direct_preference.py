"""The direct-preference family on the tiny model: which policy each prediction comes from, the NFT `old`, AWM
`ema` and DGPO `old` adapter updates, exact resume, gradient accumulation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusion_rl.algorithms.preference.base import ramped_decay
from diffusion_rl.data.sampler import make_step_prompts
from diffusion_rl.models.guidance import GuidanceCost
from diffusion_rl.sampling.window import window_for_step
from diffusion_rl.trainer.trainer import Trainer
from tests.helpers import random_pair_file

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    mode: ROOT / f"configs/quickstart_{mode}.yaml" for mode in ("dpo", "nft", "awm", "dgpo", "crd", "dpo_offline")
}
DGPO_SHORT = "algorithm.dgpo.train_timesteps=3"  # 4 sampling steps: step indices 0..2
CRD_SHORT = "algorithm.crd.train_timesteps=2"


def _velocities(trainer) -> dict[str, torch.Tensor]:
    """v of every policy (and the reference) on one fixed input."""
    model = trainer.engine.model
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["a red apple", "a blue car"])
    out = {}
    with torch.no_grad():
        for name in _named(model.policies):
            with model.using(name):
                out[name] = model.velocity(x, torch.tensor([0.7, 0.4]), cond, 1.0)
        with model.reference():
            out["reference"] = model.velocity(x, torch.tensor([0.7, 0.4]), cond, 1.0)
    return out


def _named(policies) -> list[str]:
    return [n for n in policies.names() if not n.startswith("__")]  # "__reference__": full fine-tuning's frozen copy


def _rollout_images(trainer, step: int) -> torch.Tensor:
    prompts = make_step_prompts(trainer.records, trainer.sampler, step, trainer.cfg.data.group_size)
    window = window_for_step(trainer.cfg.sampling, trainer.cfg.run.seed, step)
    return trainer.engine.generate(prompts, step, window).images


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_nft_old_adapter_samples_and_differs_from_the_policy_only_when_it_lags(make_trainer, tmp_path, lora):
    options = ("sampling.guidance=1", "train.total_steps=1", f"model.lora.enabled={str(lora).lower()}")
    if lora:
        options += ("train.lr=1e-2",)  # LoRA B starts at 0: a larger step makes its effect visible
    fresh = make_trainer(*options, config=CONFIGS["nft"])
    v0 = _velocities(fresh)
    assert set(v0) == {"default", "old", "reference"}
    assert torch.equal(v0["old"], v0["default"]) and torch.equal(v0["reference"], v0["default"])

    fixed = ("algorithm.nft.old_decay=fixed", "algorithm.nft.old_decay_value=1.0")
    frozen = make_trainer(*options, *fixed, f"run.dir={tmp_path / 'frozen'}", config=CONFIGS["nft"])
    frozen.train()
    v = _velocities(frozen)
    assert not torch.allclose(v["default"], v0["default"])  # the policy trained
    assert torch.equal(v["old"], v0["old"]) and torch.equal(v["reference"], v0["reference"])  # old never moved
    # rollouts come from `old`: the same images as the untrained model's
    assert torch.equal(_rollout_images(frozen, 5), _rollout_images(fresh, 5))

    copied = make_trainer(
        *options, "algorithm.nft.old_decay=copy", f"run.dir={tmp_path / 'copied'}", config=CONFIGS["nft"]
    )
    copied.train()
    v = _velocities(copied)
    assert torch.equal(v["old"], v["default"])  # d = 0: old is the policy
    assert torch.equal(v["reference"], v0["reference"]) and not torch.allclose(v["default"], v0["default"])
    assert not torch.equal(_rollout_images(copied, 5), _rollout_images(fresh, 5))


def test_dpo_reference_stays_at_the_starting_weights(make_trainer):
    trainer = make_trainer("train.total_steps=2", config=CONFIGS["dpo"])
    v0 = _velocities(trainer)
    assert set(v0) == {"default", "reference"}  # DPO keeps no named adapters
    trainer.train()
    v = _velocities(trainer)
    assert torch.equal(v["reference"], v0["reference"]) and not torch.allclose(v["default"], v0["default"])


def _record_weights(trainer, names: tuple[str, ...]) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Wrap train_step to record the named policies' weights after every step (index 0: before training)."""
    policies = trainer.engine.model.policies
    snap = lambda: {n: policies.state_dict_of(n) for n in names}  # noqa: E731
    history = [snap()]
    step_fn = trainer.train_step
    trainer.train_step = lambda step: (step_fn(step), history.append(snap()))[0]
    return history


def test_nft_old_adapter_follows_a_fixed_decay_every_second_step(make_trainer):
    trainer = make_trainer(
        "train.total_steps=4",
        "algorithm.nft.old_decay=fixed",
        "algorithm.nft.old_decay_value=0.5",
        "algorithm.nft.old_update_interval=2",
        config=CONFIGS["nft"],
    )
    history = _record_weights(trainer, ("default", "old"))
    rows = trainer.train()
    theta = [h["default"] for h in history]
    old = [h["old"] for h in history]
    for key in theta[0]:
        assert torch.equal(old[1][key], theta[0][key])  # step 1: no update (interval 2)
        expected2 = 0.5 * theta[0][key] + 0.5 * theta[2][key]
        torch.testing.assert_close(old[2][key], expected2)
        assert torch.equal(old[3][key], old[2][key])
        torch.testing.assert_close(old[4][key], 0.5 * expected2 + 0.5 * theta[4][key])
    assert [r.get("nft/old_decay") for r in rows] == [None, 0.5, None, 0.5]
    # the gap is logged before the step's own update: 0 at step 1 (old = the starting policy), then > 0
    assert rows[0]["nft/old_gap"] == 0 and rows[2]["nft/old_gap"] > 0


def test_awm_ema_adapter_follows_its_decay(make_trainer):
    trainer = make_trainer(
        "train.total_steps=3", "sampling.num_steps=8", "algorithm.awm.ema_beta=0.5", config=CONFIGS["awm"]
    )
    history = _record_weights(trainer, ("default", "ema"))
    rows = trainer.train()
    expected = dict(history[0]["default"])
    for k in (1, 2, 3):
        d = ramped_decay(k)  # 0.001·k
        expected = {n: d * expected[n] + (1 - d) * history[k]["default"][n] for n in expected}
        for n in expected:
            torch.testing.assert_close(history[k]["ema"][n], expected[n])
    assert [r["awm/ema_decay"] for r in rows] == pytest.approx([0.001, 0.002, 0.003])
    assert rows[0]["awm/ema_gap"] == 0 and rows[1]["awm/ema_gap"] > 0


def test_dgpo_old_policy_follows_its_decay_and_the_reference_stays(make_trainer):
    trainer = make_trainer("train.total_steps=3", DGPO_SHORT, "algorithm.dgpo.kl_beta=0.1", config=CONFIGS["dgpo"])
    assert set(_velocities(trainer)) == {"default", "old", "reference"}
    v0 = _velocities(trainer)
    history = _record_weights(trainer, ("default", "old"))
    rows = trainer.train()
    expected = dict(history[0]["default"])
    for k in (1, 2, 3):
        d = ramped_decay(k - 1)  # 0.001 × the optimizer steps before this update's: 0 at first (old ← θ)
        expected = {n: d * expected[n] + (1 - d) * history[k]["default"][n] for n in expected}
        for n in expected:
            torch.testing.assert_close(history[k]["old"][n], expected[n])
    assert [r["dgpo/old_decay"] for r in rows] == pytest.approx([0.0, 0.001, 0.002])
    assert all(r["train/units"] == 2 for r in rows)  # the units are the step's 2 groups
    assert torch.equal(_velocities(trainer)["reference"], v0["reference"])


def test_dgpo_without_clip_or_kl_keeps_no_old_policy(make_trainer):
    trainer = make_trainer("train.total_steps=1", DGPO_SHORT, "algorithm.dgpo.clip=false", config=CONFIGS["dgpo"])
    assert set(_velocities(trainer)) == {"default", "reference"}
    rows = trainer.train()
    assert "dgpo/old_decay" not in rows[0] and rows[0]["dgpo/clip_fraction"] == 0


def test_crd_old_and_sampling_policies_follow_their_schedules(make_trainer):
    schedules = ("algorithm.crd.old_decay_start=0.25", "algorithm.crd.old_decay_slope=0.25",
                 "algorithm.crd.sampling_delay=2", "algorithm.crd.sampling_decay_slope=0.5")  # fmt: skip
    trainer = make_trainer("train.total_steps=3", CRD_SHORT, *schedules, config=CONFIGS["crd"])
    assert set(_velocities(trainer)) == {"default", "old", "sampling", "reference"}
    assert trainer.engine.rollout_policy == "sampling"  # the `sampling` copy samples every rollout
    history = _record_weights(trainer, ("default", "old", "sampling"))
    rows = trainer.train()
    old, sampling = dict(history[0]["default"]), dict(history[0]["default"])
    for k, (d_old, d_sampling) in enumerate([(0.5, 0.0), (0.75, 0.0), (0.999, 0.5)], start=1):
        theta = history[k]["default"]
        old = {n: d_old * old[n] + (1 - d_old) * theta[n] for n in old}
        sampling = {n: d_sampling * sampling[n] + (1 - d_sampling) * theta[n] for n in sampling}
        for n in old:
            torch.testing.assert_close(history[k]["old"][n], old[n])
            torch.testing.assert_close(history[k]["sampling"][n], sampling[n])
    assert [r["crd/old_decay"] for r in rows] == pytest.approx([0.5, 0.75, 0.999])  # capped at old_decay_max
    assert [r["crd/sampling_decay"] for r in rows] == pytest.approx([0.0, 0.0, 0.5])


def test_crd_with_the_reference_as_baseline_keeps_no_old_policy(make_trainer):
    options = ("train.total_steps=1", CRD_SHORT, "algorithm.crd.old_reference=false", "algorithm.crd.kl_beta=0")
    trainer = make_trainer(*options, config=CONFIGS["crd"])
    assert set(_velocities(trainer)) == {"default", "sampling", "reference"}
    rows = trainer.train()
    assert "crd/old_decay" not in rows[0] and rows[0]["kl_ref"] == 0


@pytest.mark.parametrize(
    ("options", "frozen"),
    [((), 3), (("algorithm.crd.reference_guidance=null",), 2),
     (("algorithm.crd.old_reference=false", "algorithm.crd.reference_guidance=null"), 1),
     (("algorithm.crd.old_reference=false", "algorithm.crd.reference_guidance=1.0"), 2),
     (("algorithm.crd.kl_beta=0",), 1)],
    ids=["defaults", "conditional-kl", "reference-shared", "reference-at-guidance-1", "no-kl"],
)  # fmt: skip
def test_crd_estimate_counts_the_forwards_its_loss_runs(make_trainer, options, frozen, monkeypatch):
    """Row-forwards per row of a CRD update: the trained one, the baseline (`old`, or the reference when
    old_reference is off), and the KL's reference (a CFG pair at reference_guidance > 1), which the baseline reuses
    only when both are the reference's conditional prediction (reference_guidance null): 1 + frozen_calls."""
    from diffusion_rl.algorithms.preference.crd import Crd

    trainer = make_trainer("train.total_steps=1", CRD_SHORT, *options, config=CONFIGS["crd"])
    algorithm, model = trainer.engine.algorithm, trainer.engine.model
    rows_in_loss, forwards, velocity, loss = [], [], model.velocity, algorithm.loss

    def counted_velocity(x, sigma, cond, guidance):
        forwards.append(x.shape[0] * (2 if guidance is not None and guidance > 1 else 1))
        return velocity(x, sigma, cond, guidance)

    def counted_loss(units, k, at):
        monkeypatch.setattr(model, "velocity", counted_velocity)
        try:
            rows_in_loss.append(units.batch_size[0] * trainer.cfg.data.group_size)
            return loss(units, k, at)
        finally:
            monkeypatch.setattr(model, "velocity", velocity)

    monkeypatch.setattr(algorithm, "loss", counted_loss)
    trainer.train_step(0)
    assert rows_in_loss and sum(forwards) == (1 + frozen) * sum(rows_in_loss)
    assert 1 + Crd.frozen_calls(trainer.cfg.algorithm, trainer.cfg.sampling, GuidanceCost()) == 1 + frozen


def test_dpo_takes_no_step_when_every_group_ties(make_trainer, user_reward, weights):
    constant = user_reward("return np.full(len(images), 0.5, dtype=np.float32)")
    trainer = make_trainer(f"rewards.0.name={constant}", "train.total_steps=1", config=CONFIGS["dpo"])
    before = weights(trainer)
    rows = trainer.train()
    assert rows[0]["pairs/count"] == 0 and rows[0]["pairs/tied_groups"] == 2 and rows[0]["train/units"] == 0
    assert rows[0]["train/optimizer_steps"] == 0 and "loss" not in rows[0]
    after = weights(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("dpo", ()),
        ("nft", ("algorithm.nft.old_decay=fixed", "algorithm.nft.old_decay_value=0.3")),
        ("awm", ("sampling.num_steps=8", "algorithm.awm.ema_beta=0.5", "algorithm.awm.kl_beta=0.1")),
        ("dgpo", (DGPO_SHORT, "algorithm.dgpo.kl_beta=0.1")),
        ("crd", (CRD_SHORT,)),
    ],
)
def test_gradient_accumulation_matches_one_big_micro_batch(make_trainer, weights, tmp_path, mode, options):
    def run(micro: int):
        trainer = make_trainer(
            *options, f"train.micro_batch_size={micro}", f"run.dir={tmp_path / str(micro)}", config=CONFIGS[mode]
        )
        trainer.train()
        return weights(trainer)

    small, big = run(2), run(8)  # dpo: 1 pair vs 4 pairs; dgpo: 1 group vs 2; others 2 rows vs 4 (the whole batch)
    # dgpo and crd train every row of a chunk at one t: some timestep-embedding gradients are ~1e-8, about Adam's eps,
    # where its first step lr·g/(|g| + eps) turns float rounding into ~1e-6 (measured 4e-6 and 3e-6 on one element)
    atol = 1e-5 if mode in ("dgpo", "crd") else 1e-6
    for key in big:
        torch.testing.assert_close(small[key], big[key], rtol=1e-4, atol=atol)


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/")) and k != "images_per_second"}


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("nft", ("model.lora.enabled=true", "train.lr=1e-2", "algorithm.nft.old_decay=linear_to_0_5")),
        ("nft", ("algorithm.nft.old_decay=fixed", "algorithm.nft.old_decay_value=0.5")),
        ("awm", ("sampling.num_steps=8", "algorithm.awm.ema_beta=0.5", "train.num_minibatches=2")),
        ("dpo", ("sampling.sde_type=sde",)),
        ("dgpo", (DGPO_SHORT, "train.num_minibatches=2", "train.ppo_epochs=2")),
        ("crd", (CRD_SHORT, "algorithm.crd.sampling_delay=1", "algorithm.crd.sampling_decay_slope=0.5")),
    ],
    ids=["nft-lora", "nft-full", "awm-ema-minibatches", "dpo-sde", "dgpo-minibatches-epochs", "crd-lagging-sampler"],
)
def test_resumed_run_equals_a_straight_run(make_trainer, tmp_path, mode, options):
    common = (*options, "train.save_every=2", "val.every=2", "train.warmup_steps=3")
    straight = make_trainer(*common, f"run.dir={tmp_path / 'straight'}", "train.total_steps=4", config=CONFIGS[mode])
    straight_rows = straight.train()
    resumed_dir = f"run.dir={tmp_path / 'resumed'}"
    make_trainer(*common, resumed_dir, "train.total_steps=2", config=CONFIGS[mode]).train()
    resumed = make_trainer(*common, resumed_dir, "train.total_steps=4", config=CONFIGS[mode])
    assert isinstance(resumed, Trainer)
    ran = []
    step_fn = resumed.train_step
    resumed.train_step = lambda step: ran.append(step) or step_fn(step)
    resumed_rows = resumed.train()

    assert ran == [2, 3]
    assert [_comparable(r) for r in resumed_rows] == [_comparable(r) for r in straight_rows]
    a, b = straight.engine.model.policies, resumed.engine.model.policies
    assert _named(a) == _named(b) and len(_named(a)) == {"dpo": 1, "crd": 3}.get(mode, 2)
    for name in _named(a):  # the trained policy and the `old` / `ema` / `sampling` adapters
        wa, wb = a.state_dict_of(name), b.state_dict_of(name)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name


def test_offline_dpo_without_a_reward_trains_and_resumes_exactly(make_trainer, tmp_path):
    pairs = random_pair_file(tmp_path, 3)
    offline = (f"data.pairs={pairs}", "rewards=[]", "data.prompts_per_step=2", "train.save_every=2")
    config = CONFIGS["dpo_offline"]
    straight = make_trainer(*offline, f"run.dir={tmp_path / 'straight'}", "train.total_steps=4", config=config)
    assert straight.rewards is None and straight.val_records == []  # nothing to score validation samples with
    straight_rows = straight.train()
    assert [r["pairs/count"] for r in straight_rows] == [2, 2, 2, 2]
    assert straight_rows[-1]["data/cached_pairs"] == 3  # 8 pair visits, 3 encodings

    resumed_dir = f"run.dir={tmp_path / 'resumed'}"
    make_trainer(*offline, resumed_dir, "train.total_steps=2", config=config).train()
    resumed = make_trainer(*offline, resumed_dir, "train.total_steps=4", config=config)
    resumed_rows = resumed.train()
    assert [r["step"] for r in resumed_rows] == [1, 2, 3, 4]
    # the resumed process encodes its pairs again: only the cache count differs
    strip = lambda r: {k: v for k, v in _comparable(r).items() if k != "data/cached_pairs"}  # noqa: E731
    assert [strip(r) for r in resumed_rows] == [strip(r) for r in straight_rows]
    a, b = (
        straight.engine.model.policies.state_dict_of("default"),
        resumed.engine.model.policies.state_dict_of("default"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
