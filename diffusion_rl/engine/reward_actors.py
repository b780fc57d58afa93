"""Rewards scored in Ray actors of their own: a model-based reward gets its own GPUs or CPUs, away from the policy.

`ActorReward` is an ordinary reward callable (rewards/base.py's contract), so the trainer's RewardCombiner uses it
like any other: it cuts the batch into one contiguous piece per actor and scores the pieces in parallel. The trainer
scores a chunk of a batch in a background thread while the engine samples the next chunk (sampling.score_chunks),
so with actors the scoring runs on the reward's own devices while the policy workers keep sampling.

Each actor builds its own copy of the reward (`make_reward` in its process). Rewards are stateless, so an actor
that dies is restarted by Ray and its piece scored again (`max_restarts` times); after that the call raises
RewardActorDied, naming the reward (by its label, the name it has in metrics and logs).

(Not to be confused with the `remote` reward, rewards/remote.py's RemoteReward: an HTTP client of a reward server.)
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from diffusion_rl.utils.omp import child_env
from diffusion_rl.utils.split import split_evenly

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # per actor; each restart rebuilds the reward (reloads its model)


class RewardActorDied(RuntimeError):
    """A reward actor died more often than it may be restarted."""


class RewardActor:
    """Holds one copy of a reward in a Ray actor process."""

    def __init__(self, name: str, kwargs: dict[str, Any], num_threads: int):
        import torch

        torch.set_num_threads(max(1, num_threads))  # a reused Ray worker process keeps an old torch setting
        from diffusion_rl.rewards import make_reward

        self.fn = make_reward(name, **kwargs)

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        return np.asarray(self.fn(images, prompts, metadata))

    def pid(self) -> int:
        return os.getpid()

    def takes_video(self) -> bool:
        from diffusion_rl.rewards.video import takes_video

        return takes_video(self.fn)


class ActorReward:
    """A reward callable whose batches are scored by `num_actors` Ray actors, each with its own copy of the reward.

    `name` is the reward to build (make_reward's name); `label` the reward's name in messages (default: name); `env`
    variables the actors' processes start with (utils/omp.py's child_env).
    """

    def __init__(
        self,
        name: str,
        kwargs: dict[str, Any],
        num_actors: int,
        num_cpus: float = 1.0,
        num_gpus: float = 0.0,
        max_restarts: int = MAX_RESTARTS,
        label: str | None = None,
        env: dict[str, str] | None = None,
    ):
        from diffusion_rl.engine.ray_cluster import import_ray

        ray = import_ray()
        if num_actors < 1:
            raise ValueError(f"ActorReward needs at least one actor, got {num_actors}")
        self.name = name
        self.label = label if label is not None else name
        actor = ray.remote(RewardActor).options(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            max_restarts=max_restarts,
            max_task_retries=max_restarts,  # a piece whose actor died is scored again by the restarted actor
            runtime_env={"env_vars": env} if env else None,  # set when the process starts (OpenMP's policy)
        )
        self.actors = [actor.remote(name, kwargs, max(1, int(num_cpus))) for _ in range(num_actors)]
        try:  # fail at start-up, not at the first score, when the reward cannot be built (bad kwargs, no model)
            ray.get([a.pid.remote() for a in self.actors])
        except ray.exceptions.RayActorError as e:
            self.close()
            raise RuntimeError(f"reward '{self.label}': its actors could not start:\n{e}") from None
        # a reward that scores whole videos gets them whole; any other is given frames (rewards/video.py)
        self.video = bool(ray.get(self.actors[0].takes_video.remote()))
        logger.info("reward '%s': %d actors (%s CPU, %s GPU each)", self.label, num_actors, num_cpus, num_gpus)

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        ray = _ray()
        pieces = [p for p in split_evenly(range(len(images)), len(self.actors)) if p]
        refs = [
            actor.score.remote(images[p], [prompts[i] for i in p], [metadata[i] for i in p])
            for actor, p in zip(self.actors, pieces)
        ]
        try:
            scores = ray.get(refs)
        except ray.exceptions.RayTaskError as e:
            # the reward itself raised: hand its own exception to the combiner (which retries sample by sample)
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, Exception) else e) from None
        except ray.exceptions.RayActorError as e:
            raise RewardActorDied(
                f"reward '{self.label}': an actor died and cannot be restarted again ({str(e).splitlines()[0]}); "
                "check its memory use and logs"
            ) from None
        return np.concatenate([np.asarray(s) for s in scores])  # dtype and shape are checked by the combiner

    def pids(self) -> list[int]:
        return _ray().get([a.pid.remote() for a in self.actors])

    def close(self) -> None:
        ray = _ray()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def _ray():
    from diffusion_rl.engine.ray_cluster import import_ray

    return import_ray()


def make_reward_fn(spec, engine_cfg):
    """The reward callable of a config `rewards` entry: in this process, or in `spec.actors` Ray actors."""
    from diffusion_rl.rewards import make_reward

    if spec.actors == 0:
        return make_reward(spec.name, **spec.kwargs)
    from diffusion_rl.engine.ray_cluster import ensure_ray

    ensure_ray(engine_cfg)
    return ActorReward(
        spec.name,
        dict(spec.kwargs),
        spec.actors,
        spec.actor_cpus,
        spec.actor_gpus,
        label=spec.metric_name,
        env=child_env(engine_cfg.omp_wait_policy),  # beside the policy's torch processes: utils/omp.py
    )
