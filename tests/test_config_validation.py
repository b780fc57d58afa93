"""Values the config refuses when it loads (not at the first training step), as one-line command-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.cli import main
from diffusion_rl.config import load

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/quickstart.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.advantage.std_ddof=-1",
            "invalid config in 'algorithm.advantage': algorithm.advantage.std_ddof must be an integer ≥ 0 "
            "(0: population std, 1: sample std), got -1",
        ),
        (
            "algorithm.advantage.eps=-1e-8",
            "invalid config in 'algorithm.advantage': algorithm.advantage.eps must be a finite number ≥ 0, got -1e-08",
        ),
        (
            "algorithm.advantage.eps=.inf",
            "invalid config in 'algorithm.advantage': algorithm.advantage.eps must be a finite number ≥ 0, got inf",
        ),
        (
            "algorithm.loss=flow_dppo algorithm.flow_dppo.kl_mask_threshold=-0.1",
            "invalid config in 'algorithm.flow_dppo': kl_mask_threshold must be ≥ 0, got -0.1",
        ),
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


GROUP_RELATIVE = ["quickstart.yaml", "quickstart_grpo_guard.yaml", "quickstart_flow_dppo.yaml", "quickstart_nft.yaml",
                  "quickstart_awm.yaml", "quickstart_dpo.yaml"]  # fmt: skip


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


def test_a_negative_save_every_is_refused(capsys):
    assert main(["config", "show", QUICKSTART, "train.save_every=-1"]) == 2
    err = capsys.readouterr().err
    assert "train.save_every must be ≥ 0 (0 = only at the end), got -1" in err
    assert load(QUICKSTART, ["train.save_every=0"]).train.save_every == 0
