"""The registries whose names the config checks: losses, model families, SDE step types and ODE solvers.

They sit here, in the config layer at the ground, so that the config can check `algorithm.loss`, `model.family`,
`sampling.sde_type` and `*.ode_solver`, find a loss's settings section and list the names in its reference with no
import of the layers above: a plugin registers itself into its registry where it is defined (a loss with
`register_loss` in algorithms/base.py, a family with `register_family` in models/registry.py, a step type or
solver in sampling/sde.py and sampling/ode.py), and nothing else spells its name. Each registry names, as dotted
strings, the packages its plugins live in; their modules are imported on its first look-up (registry.py), so a
config is checked against every plugin however it is loaded, and adding a plugin is adding its file. An entry is
what its layer registers (a `LossSpec`, a `ModelFamily`, a step function): this layer reads only the facts the
checks need (a loss's `settings`, `family`, `sde_only`, `algorithm.check_config`).
"""

from __future__ import annotations

from typing import Any

from diffusion_rl.errors import UserError
from diffusion_rl.registry import Registry
from diffusion_rl.user_code import is_user_function_spec, load_user_code

LOSSES: Registry[Any] = Registry(
    "loss", plugins=("diffusion_rl.algorithms.losses", "diffusion_rl.algorithms.preference")
)
FAMILIES: Registry[Any] = Registry("model family", plugins=("diffusion_rl.models.families",))
STEP_TYPES: Registry[Any] = Registry("step type", plugins=("diffusion_rl.sampling.sde",))
ODE_SOLVERS: Registry[Any] = Registry("ODE solver", plugins=("diffusion_rl.sampling.ode",))


def loss_spec(name: str) -> Any:
    """The `LossSpec` of the loss `name` names: a registered one, or a user's own, "package.module:fn" or
    "path/to/file.py:fn", whose function is registered with `register_loss` (importing its module registers it).
    Only the user's own config names one: a checkpoint's config is loaded refusing user code (user_code.py)."""
    if not is_user_function_spec(name):
        return LOSSES.get(name)
    fn = load_user_code(name, "loss")
    for _, spec in LOSSES.items():
        if spec.fn is fn:
            return spec
    raise UserError(
        f"user loss '{name}': '{name.rpartition(':')[2]}' is not a loss; decorate it with @register_loss(NAME, "
        f"settings=..., algorithm=...) from diffusion_rl.algorithms (docs/policy_gradient.md)"
    )
