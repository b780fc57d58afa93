"""Adding a loss is one file: its settings, its function, one registration. Here, a toy policy-gradient loss —
the plain REINFORCE-with-ratio term −A·ratio, scaled — trained for two steps from the config alone; and the same
loss in a user's own file, named by `algorithm.loss: file.py:fn` or `module:fn` as a reward is."""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from diffusion_rl.algorithms import LossOutput, register_loss
from diffusion_rl.algorithms.policy_gradient import PolicyGradient, PolicyLossInput, PolicyLossSettings
from diffusion_rl.config import Config
from diffusion_rl.config.fields import opt
from diffusion_rl.config.plugins import LOSSES
from diffusion_rl.config.reference import field_help
from diffusion_rl.errors import UserError


@dataclass
class ToySettings(PolicyLossSettings):
    scale: float = opt(1.0, "Multiplies the loss.")


def toy_loss(inp: PolicyLossInput, cfg) -> LossOutput:
    ratio_B = torch.exp(inp.log_prob - inp.old_log_prob)
    per_sample_B = -inp.advantages * ratio_B * cfg.scale
    if inp.weights is not None:
        per_sample_B = per_sample_B * inp.weights
    return LossOutput(per_sample_B.mean(), {"toy/ratio_mean": ratio_B.detach().mean()})


@pytest.fixture
def toy():
    register_loss("toy", settings=ToySettings, algorithm=PolicyGradient)(toy_loss)
    try:
        yield
    finally:
        LOSSES.remove("toy")


def test_a_loss_registered_in_one_place_trains_from_the_config(toy, make_trainer, weights):
    trainer = make_trainer("algorithm.loss=toy", "algorithm.toy.scale=2.0", "train.total_steps=2")
    before = weights(trainer)
    rows = trainer.train()
    assert trainer.cfg.algorithm.settings == ToySettings(scale=2.0)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/optimizer_steps"] == r["step"] for r in rows)
    assert rows[0]["toy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy: the rollout's own log-probs
    after = weights(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_its_keys_are_documented_and_checked_like_every_other(toy, make_config):
    assert field_help(Config)["algorithm.toy.scale"] == "Multiplies the loss."
    with pytest.raises(UserError, match=r"key 'algorithm.toy.scal' .*did you mean 'algorithm.toy.scale'"):
        make_config("algorithm.loss=toy", "algorithm.toy.scal=2")


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="loss 'flow_grpo' is already registered"):
        register_loss("flow_grpo", settings=ToySettings, algorithm=PolicyGradient)(toy_loss)


USER_LOSS = """
import pathlib
from dataclasses import dataclass

import torch

from diffusion_rl.algorithms import LossOutput, register_loss
from diffusion_rl.algorithms.policy_gradient import PolicyGradient, PolicyLossSettings
from diffusion_rl.config.fields import opt

pathlib.Path(__file__).with_name("imported").write_text("yes")


@dataclass
class MineSettings(PolicyLossSettings):
    scale: float = opt(1.0, "Multiplies the loss.")


@register_loss("{name}", settings=MineSettings, algorithm=PolicyGradient)
def mine(inp, cfg):
    ratio_B = torch.exp(inp.log_prob - inp.old_log_prob)
    return LossOutput((-inp.advantages * ratio_B * cfg.scale).mean(), {{"mine/ratio_mean": ratio_B.detach().mean()}})


def plain(inp, cfg):
    return None
"""


@pytest.fixture
def user_loss(tmp_path):
    """user_loss(name) → the folder of a file my_loss_<name>.py registering loss `name` when imported."""
    made = []

    def write(name: str):
        (tmp_path / f"my_loss_{name}.py").write_text(textwrap.dedent(USER_LOSS.format(name=name)))
        made.append(name)
        return tmp_path

    yield write
    for name in made:
        if name in LOSSES:
            LOSSES.remove(name)


def test_a_loss_in_the_users_own_file_trains_from_the_config(user_loss, make_trainer):
    folder = user_loss("mine_file")
    trainer = make_trainer(f"algorithm.loss={folder}/my_loss_mine_file.py:mine", "algorithm.mine_file.scale=2.0",
                           "train.total_steps=1")  # fmt: skip
    assert trainer.cfg.algorithm.settings.scale == 2.0 and trainer.cfg.algorithm.spec.name == "mine_file"
    rows = trainer.train()
    assert rows[0]["mine/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # its own metric: its function ran
    # the run's config.yaml keeps the name as the user wrote it
    assert f"loss: {folder}/my_loss_mine_file.py:mine" in Path(trainer.cfg.run.dir, "config.yaml").read_text()


def test_a_loss_in_a_users_module_is_named_module_colon_fn(user_loss, make_config, monkeypatch):
    monkeypatch.syspath_prepend(str(user_loss("mine_module")))
    cfg = make_config("algorithm.loss=my_loss_mine_module:mine", "algorithm.mine_module.scale=3")
    assert cfg.algorithm.settings.scale == 3.0 and cfg.algorithm.spec.fn is sys.modules["my_loss_mine_module"].mine
    with pytest.raises(
        UserError, match=r"key 'algorithm.mine_module.scal' .*did you mean 'algorithm.mine_module.scale'"
    ):
        make_config("algorithm.loss=my_loss_mine_module:mine", "algorithm.mine_module.scal=3")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{d}/absent.py:mine", "user loss file '{d}/absent.py' does not exist"),
        ("{d}/my_loss_bad.py:mien", "user loss '{d}/my_loss_bad.py:mien': '{d}/my_loss_bad.py' has no attribute 'mien' "
                                    "(did you mean 'mine'?)"),
        ("{d}/my_loss_bad.py:plain", "user loss '{d}/my_loss_bad.py:plain': 'plain' is not a loss; decorate it with "
                                     "@register_loss"),
        ("no_such_module_xyz:mine", "user loss module 'no_such_module_xyz' not found"),
    ],
)  # fmt: skip
def test_a_bad_user_loss_is_one_line_naming_it(user_loss, make_config, spec, message):
    folder = user_loss("bad")
    with pytest.raises(UserError) as e:
        make_config(f"algorithm.loss={spec.format(d=folder)}")
    assert message.format(d=folder) in str(e.value) and "\n" not in str(e.value)


def test_a_user_loss_that_fails_to_import_is_one_line_naming_its_file_and_line(tmp_path, make_config, monkeypatch):
    path = tmp_path / "my_broken_loss.py"
    path.write_text("import torch\nimport no_such_package_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cause = f"({path}, line 2: ModuleNotFoundError: No module named 'no_such_package_xyz'); install "
    for spec, what in ((f"{path}:mine", f"file '{path}'"), ("my_broken_loss:mine", "module 'my_broken_loss'")):
        with pytest.raises(UserError) as e:
            make_config(f"algorithm.loss={spec}")
        assert str(e.value).startswith(f"user loss {what} failed to import {cause}") and "\n" not in str(e.value)
