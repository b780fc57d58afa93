"""Plugins' names are checked against config/plugins.py's registries, which the plugins register into from their own
layers. Step types and ODE solvers are named once, where they register: the config, its
reference and the command line take their names from there, so a new part is accepted with no list to edit."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.config import Config, load
from diffusion_rl.config.plugins import FAMILIES, ODE_SOLVERS, STEP_TYPES
from diffusion_rl.config.reference import describe, describe_markdown
from diffusion_rl.errors import UserError
from diffusion_rl.sampling.ode import Multistep, OdeSolver


@pytest.fixture
def halfway_solver():
    """A toy multistep solver: adds half of (this step's velocity − the previous one's) to the Euler step."""
    ODE_SOLVERS.register("halfway")(Multistep(lambda x, v, sigma: v.float(), lambda sp, s, sn: 0.5))
    try:
        yield "halfway"
    finally:
        ODE_SOLVERS.remove("halfway")


def test_a_registered_solver_is_a_valid_config_value_with_no_list_edited(halfway_solver):
    cfg = load(None, [f"sampling.ode_solver={halfway_solver}", f"val.ode_solver={halfway_solver}"])
    assert (cfg.sampling.ode_solver, cfg.val.ode_solver) == ("halfway", "halfway")
    assert "sampling.ode_solver: one of 'ab2', 'dpm2', 'euler', 'halfway' = euler" in describe(Config)
    assert "| `val.ode_solver` | one of 'ab2', 'dpm2', 'euler', 'halfway' \\| null | `null` |" in describe_markdown(
        Config, "t"
    )


def test_the_solver_runs_what_its_registration_says(halfway_solver):
    solver = OdeSolver(halfway_solver)
    x = torch.zeros(1, 1)
    first = solver.step(x, torch.tensor([[1.0]]), 0.8, 0.6)  # no history: Euler, 0 + (0.6 − 0.8)·1
    second = solver.step(first, torch.tensor([[3.0]]), 0.6, 0.4)  # Euler −0.2 + (0.4 − 0.6)·3, then + 0.5·(3 − 1)
    assert first.item() == pytest.approx(-0.2)
    assert second.item() == pytest.approx(-0.2 - 0.6 + 1.0)


@pytest.mark.parametrize(
    "override, names",
    [
        ("sampling.sde_type=sdee", "'cps', 'dance_sde', 'ode', 'sde', 'sde_linear'"),
        ("val.ode_solver=ab3", "'ab2', 'dpm2', 'euler'"),
    ],
)
def test_an_unknown_name_is_one_line_listing_the_registered_ones(override, names):
    key, _, value = override.partition("=")
    with pytest.raises(UserError) as e:
        load(None, [override])
    message = str(e.value)
    assert f"config key '{key}' must be one of {names}; got str '{value}' (did you mean" in message
    assert "\n" not in message


def test_the_registries_are_what_the_sampler_registers():
    assert STEP_TYPES.names() == ["cps", "dance_sde", "ode", "sde", "sde_linear"]
    assert ODE_SOLVERS.names() == ["ab2", "dpm2", "euler"]


def test_a_model_family_is_checked_against_the_registry_with_auto_beside_it():
    FAMILIES.register("toy_family")(object())  # the config reads only the name
    try:
        assert load(None, ["model.family=toy_family"]).model.family == "toy_family"
        assert load(None, ["model.family=auto"]).model.family == "auto"
        assert "model.family: one of 'auto', 'flux', " in describe(Config)
        with pytest.raises(UserError) as e:
            load(None, ["model.family=sd4"])
    finally:
        FAMILIES.remove("toy_family")
    message = str(e.value)
    assert "config key 'model.family' must be one of 'auto', 'flux', " in message
    assert "'toy_family'" in message and "got str 'sd4' (did you mean 'sd3'?)" in message and "\n" not in message
