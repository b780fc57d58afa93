"""A weight sync that silently does nothing stops the run (engine/fingerprint.py): on Ray, rollout actors whose
weight loads are broken on purpose (a worker setup hook turns `PolicySet.load_state_dict_of` into a no-op in every
Ray worker process) must not sample the base model for the rest of the run, as verl-omni #552's LoRA sync did."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from diffusion_rl.errors import WeightsUnchanged  # noqa: E402
from tests.engine.conftest import SEPARATE  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _break_weight_loads():
    from diffusion_rl.models.policies import PolicySet

    PolicySet.load_state_dict_of = lambda self, name, tensors: None


@pytest.fixture(scope="module")
def ray_with_broken_weight_loads():
    from diffusion_rl.engine.ray_cluster import LOCAL_CLUSTER_ENV

    assert LOCAL_CLUSTER_ENV  # tests/conftest.py set it: loopback only
    ray.shutdown()  # the shared cluster (tests/engine/conftest.py): its workers must not get the hook
    # 7 CPUs, not the shared cluster's 8: the next module's ray_session sees another cluster and starts its own
    # the hook travels by reference (tests.engine.test_broken_sync): the workers find `tests` at the repository root
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    hook = {"worker_process_setup_hook": _break_weight_loads, "env_vars": {"PYTHONPATH": path}}
    ray.init(num_cpus=7, include_dashboard=False, logging_level="WARNING", runtime_env=hook)
    yield
    ray.shutdown()


def test_rollout_actors_whose_weight_loads_do_nothing_stop_the_run(
    ray_with_broken_weight_loads, make_config, run_trainer, ray_overrides, equal_overrides
):
    cfg = make_config(*equal_overrides, *ray_overrides, *SEPARATE, "engine.num_workers=1", "train.total_steps=3")
    with pytest.raises(WeightsUnchanged, match="did not reach this rollout actor's sampling policy"):
        run_trainer(cfg)
