"""The training step's hot path, where no call may make the host wait for the device (docs/architecture.md).

What runs once per sampler step or per trained step: every SDE/ODE step function (sampling/sde.py), the rollout's
per-step loop (sampling/rollout.py: the velocity, the step, the stored window) and the policy-gradient loss of each
trained step (`PolicyGradient.loss`: the recomputed step, the reference's, the registered loss, its metrics as
tensors). tests/sampling/test_no_host_sync.py runs a training step under `HostReads` within these regions; the GPU
check counts the real synchronisations of a step and which of them are in here (benchmarks/gpu_check/host_syncs.py).
"""

from __future__ import annotations

from diffusion_rl.algorithms.policy_gradient import PolicyGradient
from diffusion_rl.config.plugins import STEP_TYPES
from diffusion_rl.sampling import rollout
from diffusion_rl.sampling.sde import STEP_TYPE_NAMES
from diffusion_rl.utils.host_sync import Region


def hot_path() -> tuple[Region, ...]:
    """The regions of the hot path (module docstring)."""
    steps = tuple(Region.of(STEP_TYPES.get(name)) for name in STEP_TYPE_NAMES)
    return (*steps, Region.of(rollout.rollout, loop=True), Region.of(PolicyGradient.loss))
