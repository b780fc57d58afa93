"""Reward weights are checked at config load; `label` lets one reward appear twice, under two names in the metrics."""

from __future__ import annotations

import argparse
import textwrap

import numpy as np
import pytest

from diffusion_rl.cli import main
from diffusion_rl.config import load
from diffusion_rl.errors import UserError
from diffusion_rl.rewards import RewardCombiner, WeightedReward
from diffusion_rl.tracking import read_metrics
from diffusion_rl.trainer import make_trainer


def _config_file(tmp_path, rewards: str):
    path = tmp_path / "config.yaml"
    path.write_text(f"rewards:\n{textwrap.indent(textwrap.dedent(rewards), '  ')}")
    return path


@pytest.mark.parametrize("bad", ["-0.5", ".nan", ".inf", "-.inf"])
def test_a_negative_or_non_finite_weight_is_a_config_error_naming_the_key(tmp_path, bad):
    path = _config_file(
        tmp_path, f"- {{name: jpeg_incompressibility}}\n- {{name: jpeg_compressibility, weight: {bad}}}"
    )
    with pytest.raises(UserError) as info:
        load(path)
    got = {"-0.5": "-0.5", ".nan": "nan", ".inf": "inf", "-.inf": "-inf"}[bad]
    assert str(info.value) == f"{path}: config key 'rewards.1.weight' must be in [0, 1000000], got {got}"


def test_a_bad_weight_is_a_one_line_cli_error(tmp_path, capsys):
    path = _config_file(tmp_path, "- {name: jpeg_incompressibility, weight: -1}")
    assert main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffusion-rl: error: ")
    assert "config key 'rewards.0.weight' must be in [0, 1000000], got -1" in err[0]


@pytest.mark.parametrize("key", ["rewards.0.weight", "val.rewards.0.weight"])
def test_a_bad_weight_from_the_command_line_is_the_overrides_error(tmp_path, capsys, key):
    path = _config_file(tmp_path, "- {name: jpeg_incompressibility}")
    overrides = ["val.rewards=[{name: jpeg_incompressibility}]"] if key.startswith("val.") else []
    assert main(["config", "show", str(path), *overrides, f"{key}=.nan"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"diffusion-rl: error: command-line override '{key}=.nan': config key '{key}' must be in [0, "
                   "1000000], got nan"]  # fmt: skip


@pytest.mark.parametrize(
    "rewards",
    [
        "- {name: remote, kwargs: {url: 'http://a:1'}}\n- {name: jpeg_compressibility}\n- {name: remote}",
        "- {name: remote, label: judge}\n- {name: jpeg_compressibility}\n- {name: remote, label: judge}",
        "- {name: judge}\n- {name: jpeg_compressibility}\n- {name: remote, label: judge}",
    ],
)
def test_a_repeated_label_or_name_is_a_config_error_naming_both_entries(tmp_path, rewards):
    path = _config_file(tmp_path, rewards)
    with pytest.raises(UserError) as info:
        load(path)
    key = "remote" if "label" not in rewards else "judge"
    assert str(info.value) == (
        f"{path}: invalid config at top level: rewards.0 and rewards.2 are both '{key}' in metrics and logs (the "
        f"label, else the name, must be unique): give one of them its own label, e.g. rewards.2.label={key}_2"
    )


def test_labels_make_two_entries_of_one_reward_valid(tmp_path):
    path = _config_file(tmp_path, "- {name: remote, label: judge_a}\n- {name: remote, label: judge_b}")
    cfg = load(path)
    assert [(r.name, r.label, r.metric_name) for r in cfg.rewards] == [
        ("remote", "judge_a", "judge_a"),
        ("remote", "judge_b", "judge_b"),
    ]
    with pytest.raises(UserError, match="label must be a non-blank name"):
        load(path, ["rewards.1.label=' '"])


def test_the_combiner_names_both_entries_of_a_repeated_name():
    def fn(images, prompts, metadata):
        return np.zeros(len(images), np.float32)

    rewards = [WeightedReward("a", 1.0, fn), WeightedReward("b", 1.0, fn), WeightedReward("a", 1.0, fn)]
    with pytest.raises(ValueError) as info:
        RewardCombiner(rewards)
    assert str(info.value) == (
        "rewards 0 and 2 are both named 'a'; the names key the metrics and must be unique (in a config, give one of "
        "them its own `label`)"
    )


@pytest.fixture
def scaled_brightness(tmp_path):
    """A `file.py:reward` user function: scale × the mean pixel value / 255."""
    path = tmp_path / "brightness.py"
    path.write_text(
        "import numpy as np\n\n\ndef reward(images, prompts, metadata, scale=1.0):\n"
        "    return (scale * images.reshape(len(images), -1).mean(axis=1) / 255).astype(np.float32)\n"
    )
    return f"{path}:reward"


def test_two_user_rewards_of_one_name_with_labels_are_both_logged(make_config, scaled_brightness, tmp_path):
    rewards = (
        f'rewards=[{{name: "{scaled_brightness}", label: judge_a, kwargs: {{scale: 1.0}}}}, '
        f'{{name: "{scaled_brightness}", label: judge_b, kwargs: {{scale: 2.0}}}}]'
    )
    trainer = make_trainer(make_config(rewards))
    rows = trainer.train()
    assert [r["step"] for r in rows] == [1, 2]
    logged = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert logged == rows
    for row in logged:
        a, b = row["reward/judge_a/mean"], row["reward/judge_b/mean"]
        assert 0 < a < 1
        assert b == pytest.approx(2 * a, rel=1e-5)  # the same function, its kwargs kept apart per entry
        assert row["reward/mean"] == pytest.approx(a + b, rel=1e-5)  # weights 1 and 1
        assert row["reward/judge_a/failed_fraction"] == row["reward/judge_b/failed_fraction"] == 0.0
        assert not any(key.startswith(f"reward/{scaled_brightness}") for key in row)


def test_eval_takes_a_checkpoint_configs_rewards_by_label(tmp_path, scaled_brightness):
    from diffusion_rl.commands.eval import _reward_choices
    from diffusion_rl.evaluation.evaluate import build_scorer

    path = _config_file(
        tmp_path,
        f'- {{name: "{scaled_brightness}", label: judge_a}}\n'
        f'- {{name: "{scaled_brightness}", label: judge_b, kwargs: {{scale: 2.0}}}}',
    )
    args = argparse.Namespace(reward=None, reward_kwargs='{"judge_b": {"scale": 3.0}}', trust_checkpoint_rewards=True)
    choices = _reward_choices(args, load(path))
    assert [(c.name, c.label, c.kwargs) for c in choices] == [
        (scaled_brightness, "judge_a", {}),
        (scaled_brightness, "judge_b", {"scale": 3.0}),
    ]
    images = np.full((2, 4, 4, 3), 51, dtype=np.uint8)  # 51 / 255 = 0.2
    per_reward = build_scorer(choices)(images, ["p", "q"], [{}, {}]).per_reward
    assert sorted(per_reward) == ["judge_a", "judge_b"]
    np.testing.assert_allclose(per_reward["judge_a"], [0.2, 0.2], rtol=1e-6)
    np.testing.assert_allclose(per_reward["judge_b"], [0.6, 0.6], rtol=1e-6)


def test_reward_actors_are_built_from_the_name_and_report_under_the_label(monkeypatch):
    from diffusion_rl.engine import ray_cluster as ray_module
    from diffusion_rl.engine import reward_actors
    from diffusion_rl.engine.ray_cluster import actor_env

    assert not hasattr(reward_actors, "RemoteReward")  # the `remote` reward's class name, in rewards/remote.py only
    built = []
    monkeypatch.setattr(ray_module, "ensure_ray", lambda engine_cfg: None)
    monkeypatch.setattr(reward_actors, "ActorReward", lambda *args, **kwargs: built.append((args, kwargs)))
    cfg = load(
        None, ["rewards=[{name: remote, label: judge_a, actors: 2, actor_gpus: 0.5, kwargs: {url: 'http://a:1'}}]"]
    )
    reward_actors.make_reward_fn(cfg.rewards[0], cfg.engine)
    env = actor_env(cfg.engine)  # OpenMP's policy beside the policy's torch processes, CUDA's allocator
    assert built == [(("remote", {"url": "http://a:1"}, 2, 1.0, 0.5), {"label": "judge_a", "env": env})]
