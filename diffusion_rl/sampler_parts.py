"""The registries of the sampler's named parts, at the ground: SDE step types and ODE solvers.

sampling/sde.py and sampling/ode.py register their parts here, and nothing else spells a part's name. The
registries sit below the config so that the config can check `sampling.sde_type` and `sampling.ode_solver` and its
reference can list the names (settings.OneOf) without importing the sampler; a lookup imports the sampler's modules
that register them, as every registry imports its plugins (registry.py).
"""

from __future__ import annotations

from typing import Any

from diffusion_rl.registry import Registry

STEP_TYPES: Registry[Any] = Registry("step type", plugins=("diffusion_rl.sampling.sde",))
ODE_SOLVERS: Registry[Any] = Registry("ODE solver", plugins=("diffusion_rl.sampling.ode",))
