"""Values the config refuses when it loads (not at the first training step), as one-line command-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.cli import main
from diffusion_rl.config import load

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/quickstart_flow_grpo.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.loss=grpo_guard algorithm.timestep_selection=random",
            "invalid config at top level: algorithm.loss=grpo_guard needs algorithm.timestep_selection=first: its "
            "scale s = mean(√dt)·mean(std) over a micro-batch's rows assumes they are all at one step, and random "
            "trains a different subset of steps per sample",
        ),
    ],
)
def test_bad_value_is_a_one_line_error_naming_the_key(override, message, capsys):
    assert main(["config", "show", QUICKSTART, *override.split()]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"diffusion-rl: error: {QUICKSTART}: {message}"], err


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.advantage.std_ddof=2", "algorithm.advantage.eps=0"],  # what compute_advantages accepts
        ["algorithm.flow_dppo.kl_mask_threshold=0", "algorithm.loss=flow_dppo"],
        ["algorithm.loss=grpo_guard", "algorithm.timestep_selection=first", "algorithm.timestep_fraction=0.5"],
        ["algorithm.loss=flow_grpo", "algorithm.timestep_selection=random"],
    ],
)
def test_boundary_values_load(overrides):
    load(QUICKSTART, overrides)


GROUP_RELATIVE = ["quickstart_flow_grpo.yaml", "quickstart_grpo_guard.yaml", "quickstart_flow_dppo.yaml",
                  "quickstart_nft.yaml", "quickstart_awm.yaml", "quickstart_dpo.yaml"]  # fmt: skip


@pytest.mark.parametrize("name", GROUP_RELATIVE)
def test_a_group_of_one_is_refused_for_every_group_relative_loss(name, capsys):
    path = str(ROOT / "configs" / name)
    assert main(["config", "show", path, "data.group_size=1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    loss = load(path).algorithm.loss
    assert f"data.group_size=1: algorithm.loss={loss} compares the samples of each prompt's group" in line
    assert "set data.group_size to 2 or more" in line


def test_offline_dpo_needs_no_group():
    cfg = load(str(ROOT / "configs/quickstart_dpo_offline.yaml"), ["data.group_size=1"])
    assert (cfg.data.sample_source, cfg.data.group_size) == ("offline", 1)


def test_a_negative_save_every_is_refused():
    assert load(QUICKSTART, ["train.save_every=0"]).train.save_every == 0  # -1: test_sizes_counts_and_rates_…


@pytest.mark.parametrize(
    ("override", "key", "allowed"),
    [
        ("sampling.height=-64", "sampling.height", "[1, 8192]"),  # was a traceback from the family's size check
        ("sampling.width=65536", "sampling.width", "[1, 8192]"),  # was a 4 GiB allocation traceback
        ("sampling.num_steps=1000000000", "sampling.num_steps", "[2, 1000]"),  # was a NumPy MemoryError
        ("sampling.noise_level=-0.1", "sampling.noise_level", "[0, 10]"),  # checked here only, not by each step
        ("data.group_size=100000", "data.group_size", "[1, 1024]"),  # ran for minutes
        ("train.lr=.inf", "train.lr", "(0, 1000000]"),  # was accepted: the run exited 0 with no checkpoint
        ("train.lr=.nan", "train.lr", "(0, 1000000]"),
        ("train.lr=0", "train.lr", "(0, 1000000]"),
        ("train.keep_last=-1", "train.keep_last", "[0, 1000000]"),  # silently kept every checkpoint
        ("train.save_every=-1", "train.save_every", "[0, 100000000]"),
        ("train.betas=[0.9,1.5]", "train.betas", "[0, 1]"),
        ("algorithm.advantage.std_ddof=-1", "algorithm.advantage.std_ddof", "[0, 1024]"),
        ("algorithm.advantage.eps=.inf", "algorithm.advantage.eps", "[0, 1]"),
        ("val.height=0", "val.height", "[1, 8192]"),
        ("rewards.0.timeout_s=0", "rewards.0.timeout_s", "(0, 10000000]"),
        ("engine.max_failures=-1", "engine.max_failures", "[0, 1000]"),
    ],
)
def test_sizes_counts_and_rates_outside_their_range_are_one_line_errors(override, key, allowed, capsys):
    assert main(["config", "show", QUICKSTART, override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    value = override.partition("=")[2]
    assert len(err) == 1 and f"config key '{key}' must be in {allowed}, got" in err[0], err
    assert err[0].startswith(f"diffusion-rl: error: command-line override '{override}'"), (err, value)


# values chosen per key: negative, zero where not allowed, inf/nan for floats, absurd sizes (issue 26 item 5: the
# guard's settings, each loss's section and rollout correction's were checked after load, some not at all)
SECTION_RANGES = [
    ("guard.baseline_steps=0", "guard.baseline_steps", "[1, 100000000]"),
    ("guard.max_relative_change=-0.5", "guard.max_relative_change", "(0, 1000000]"),
    ("guard.max_relative_change=.inf", "guard.max_relative_change", "(0, 1000000]"),  # was accepted
    ("guard.relative_change.brightness=.nan", "guard.relative_change.brightness", "(0, 1000000]"),
    ("guard.max_zscore=0", "guard.max_zscore", "(0, 1000000]"),
    ("guard.window=2", "guard.window", "[3, 100000]"),
    ("guard.window=1000000000", "guard.window", "[3, 100000]"),  # was accepted
    ("guard.max_val_drift=.nan", "guard.max_val_drift", "(0, 1]"),
    ("guard.patience=-1", "guard.patience", "[1, 100000000]"),
    ("guard.remind_every=0", "guard.remind_every", "[1, 100000000]"),
    ("guard.max_side=100000", "guard.max_side", "[8, 8192]"),  # was accepted
    ("algorithm.flow_grpo.kl_beta=-0.01", "algorithm.flow_grpo.kl_beta", "[0, 10000]"),
    ("algorithm.flow_grpo.kl_beta=.inf", "algorithm.flow_grpo.kl_beta", "[0, 10000]"),  # was accepted
    ("algorithm.flow_grpo.clip_range=0", "algorithm.flow_grpo.clip_range", "(0, 100]"),
    ("algorithm.flow_grpo.adv_clip_max=.nan", "algorithm.flow_grpo.adv_clip_max", "(0, 1000]"),
    ("algorithm.grpo_guard.clip_range=-2e-6", "algorithm.grpo_guard.clip_range", "(0, 100]"),
    ("algorithm.tempflow_grpo.noise_weight_scale=.inf", "algorithm.tempflow_grpo.noise_weight_scale", "(0, 1000]"),
    ("algorithm.flow_dppo.kl_mask_threshold=-0.1", "algorithm.flow_dppo.kl_mask_threshold", "[0, 1000000]"),
    ("algorithm.dpo.dpo_beta=0", "algorithm.dpo.dpo_beta", "(0, 1000000]"),
    ("algorithm.dpo.dpo_beta=.inf", "algorithm.dpo.dpo_beta", "(0, 1000000]"),  # was accepted
    ("algorithm.nft.nft_beta=-1", "algorithm.nft.nft_beta", "(0, 1000]"),
    ("algorithm.nft.timestep_fraction=1.5", "algorithm.nft.timestep_fraction", "(0, 1]"),
    ("algorithm.nft.old_update_interval=0", "algorithm.nft.old_update_interval", "[1, 100000000]"),
    ("algorithm.nft.old_decay_value=2", "algorithm.nft.old_decay_value", "[0, 1]"),
    ("algorithm.nft.weight_floor=0", "algorithm.nft.weight_floor", "(0, 1]"),
    ("algorithm.awm.train_timesteps=100000", "algorithm.awm.train_timesteps", "[1, 1000]"),
    ("algorithm.awm.ema_beta=-1", "algorithm.awm.ema_beta", "[0, 10000]"),
    ("algorithm.awm.advantage_max=.inf", "algorithm.awm.advantage_max", "(0, 1000]"),  # was accepted
    ("algorithm.rollout_correction.threshold=0.5", "algorithm.rollout_correction.threshold", "[1, 100000000]"),
    ("algorithm.rollout_correction.threshold=.inf", "algorithm.rollout_correction.threshold", "[1, 100000000]"),
    ("algorithm.rollout_correction.icepop_lo=0", "algorithm.rollout_correction.icepop_lo", "(0, 1]"),
    ("algorithm.rollout_correction.icepop_hi=0.9", "algorithm.rollout_correction.icepop_hi", "[1, 100000000]"),
    ("algorithm.rollout_correction.rs_bound=-1", "algorithm.rollout_correction.rs_bound", "(0, 100000000]"),
    ("algorithm.rollout_correction.rs_bound=[.nan,2]", "algorithm.rollout_correction.rs_bound", "(0, 100000000]"),
    (
        "algorithm.rollout_correction.rs_chain=[{stat: k3, bound: .inf}]",  # was accepted
        "algorithm.rollout_correction.rs_chain.0.bound",
        "(0, 100000000]",
    ),
]


@pytest.mark.parametrize(("override", "key", "allowed"), SECTION_RANGES)
def test_guard_loss_and_rollout_correction_settings_outside_their_range_are_one_line_errors(
    override, key, allowed, capsys
):
    test_sizes_counts_and_rates_outside_their_range_are_one_line_errors(override, key, allowed, capsys)


def test_every_size_count_and_rate_of_the_config_has_a_range():
    """Each int or float key of the whole config tree (every section, each registered loss's algorithm.<loss>, the
    guard, rollout correction, list entries) carries `within` (fields.Range), except seeds and the reward weights
    (any finite number ≥ 0, checked with their own hint in config/data.py)."""
    import typing

    from diffusion_rl.config import Config
    from diffusion_rl.config.convert import walk

    unbounded = {"run.seed", "val.seed", "rewards.*.weight"}
    missing = []
    for key, f, tp in walk(Config):
        kinds = set(typing.get_args(tp) or (tp,))
        kinds |= {b for a in kinds for b in typing.get_args(a)}  # list[int], tuple[float, float], float | None
        if kinds & {int, float} and "within" not in f.metadata and key not in unbounded:
            missing.append(key)
    assert not missing, missing


def test_the_reference_shows_each_range():
    from diffusion_rl.config import Config
    from diffusion_rl.config.reference import describe

    assert "sampling.height: int in [1, 8192] = 64" in describe(Config)
    assert "train.lr: float in (0, 1000000] = 0.001" in describe(Config)


def test_a_config_that_needs_more_memory_than_the_machine_has_is_refused_before_anything_loads(tmp_path, capsys):
    """4096 prompts × 1024 samples at 2048² on the tiny FLUX.1: petabytes of kept trajectories. `train` says so in one
    line with the estimate's own peak (estimate/estimator.py), before it creates the model or the run directory."""
    from diffusion_rl.estimate.architectures import architecture_for
    from diffusion_rl.estimate.devices import device_named
    from diffusion_rl.estimate.estimator import estimate

    overrides = [f"model.path={tmp_path / 'tiny'}", "model.family=flux", f"run.dir={tmp_path / 'run'}",
                 "sampling.height=2048", "sampling.width=2048", "data.prompts_per_step=4096", "data.group_size=1024",
                 "train.micro_batch_size=4096"]  # fmt: skip
    assert main(["train", QUICKSTART, *overrides]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("diffusion-rl")]
    cfg = load(QUICKSTART, overrides)
    device = device_named("cpu").with_overrides(peak_tflops=1.0, bandwidth_gbs=1.0)
    result = estimate(cfg, architecture_for(cfg.model), device, 1)
    need = result.peak_memory_gib_per_gpu - result.memory_gib["context"]  # no CUDA context on a CPU
    assert len(err) == 1 and f"this config needs about {need:.3g} GiB at its peak (trajectories" in err[0], err
    assert "more than this machine's RAM has" in err[0] and "data.prompts_per_step × data.group_size" in err[0]
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "run").exists()
