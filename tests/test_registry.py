"""The one plugin mechanism: a registry imports every module of its packages on its first look-up, so a plugin is
its file alone; a name registers once; an unknown name lists the known ones."""

from __future__ import annotations

import sys
import types

import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.registry import Registry


@pytest.fixture
def things(tmp_path, monkeypatch):
    """A registry of things whose plugins are toy_plugins/: two modules and a subpackage that register into it, and
    no list of them anywhere."""
    registry = Registry("thing", plugins=("toy_plugins",))
    holder = types.ModuleType("toy_registry")
    holder.THINGS = registry
    monkeypatch.setitem(sys.modules, "toy_registry", holder)
    package = tmp_path / "toy_plugins"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    register = "from toy_registry import THINGS\nTHINGS.register({name!r})({value!r})\n"
    (package / "alpha.py").write_text(register.format(name="alpha", value="a"))
    (package / "beta.py").write_text(register.format(name="beta", value="b"))
    (package / "sub" / "__init__.py").write_text(register.format(name="gamma", value="c"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield registry
    for name in [m for m in sys.modules if m.startswith("toy_plugins")]:
        del sys.modules[name]


def test_a_registry_finds_its_plugins_on_first_look_up(things):
    assert "toy_plugins.alpha" not in sys.modules  # nothing imported them
    assert things.names() == ["alpha", "beta", "gamma"]
    assert things.get("beta") == "b"
    with pytest.raises(ValueError, match="thing 'alpha' is already registered"):
        things.register("alpha")("again")
    with pytest.raises(UserError, match="unknown thing 'alpah'.*did you mean 'alpha'.*known: alpha, beta, gamma"):
        things.get("alpah")


def test_the_built_in_registries_hold_every_plugin_file():
    from diffusion_rl.config.plugins import FAMILIES, LOSSES
    from diffusion_rl.rewards.base import REWARDS

    losses = {"flow_grpo", "grpo_guard", "flow_dppo", "tempflow_grpo", "flash_grpo", "gardo", "dpo", "nft", "awm"}
    assert losses <= set(LOSSES.names())
    assert {"sd3", "flux", "flux_kontext", "qwen_image", "qwen_image_edit", "wan"} <= set(FAMILIES.names())
    assert {"jpeg_compressibility", "hpsv2", "imagereward", "geneval", "remote"} <= set(REWARDS.names())
