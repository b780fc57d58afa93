"""The processes a run starts beside its own torch processes get OpenMP's wait policy and CUDA's allocator setting when
they start (engine/ray_cluster.py's actor_env, through Ray's runtime_env): the Ray trainers and the reward actors; the
user's variables are forwarded."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from diffusion_rl.engine.ray import RayEngine  # noqa: E402
from diffusion_rl.engine.reward_actors import make_reward_fn  # noqa: E402
from diffusion_rl.trainer.setup import worker_spec  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_session")


def _environ(actor) -> dict[str, str]:
    return ray.get(actor.__ray_call__.remote(lambda self: dict(os.environ)))


def test_ray_trainers_and_reward_actors_start_with_the_policy_the_driver_gives_them(
    make_config, ray_overrides, monkeypatch
):
    monkeypatch.setenv("GOMP_SPINCOUNT", "12345")  # the user's: forwarded (the local cluster started without it)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    cfg = make_config(*ray_overrides, "engine.num_workers=1", "rewards=[{name: jpeg_compressibility, actors: 1}]")
    engine = RayEngine(cfg.engine, worker_spec(cfg))
    reward = make_reward_fn(cfg.rewards[0], cfg.engine)
    try:
        assert _environ(engine.trainers.actors[0]).get("GOMP_SPINCOUNT") == "12345"
        assert _environ(reward.actors[0]).get("GOMP_SPINCOUNT") == "12345"
        for actor in (engine.trainers.actors[0], reward.actors[0]):  # engine.cuda_expandable_segments' default
            assert _environ(actor).get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"
    finally:
        reward.close()
        engine.close()
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    reward = make_reward_fn(cfg.rewards[0], cfg.engine)  # auto, nothing set by the user: sleep beside the policy
    try:
        assert _environ(reward.actors[0]).get("OMP_WAIT_POLICY") == "PASSIVE"
        assert "GOMP_SPINCOUNT" not in _environ(reward.actors[0])
    finally:
        reward.close()
