"""A rollout actor (engine.rollout=separate): a PolicyWorker that does not train and samples training rollouts.

It holds the whole model (no optimizer, no gradients, no sharding), in engine.rollout_dtype if set, and samples
with whatever weights the trainers last pushed (engine/weight_sync.py), stamping each row with their version. Its
rows stay here until the trainers fetch the ones they train on, worker to worker (`export_rows`, which runs in its
own concurrency group, so that the trainers can fetch step t while this actor samples step t + 1).

A Ray actor (engine/ray.py); every method's exception reaches the driver as a WorkerError naming this actor.
"""

from __future__ import annotations

import torch

from diffusion_rl.engine.sharded_worker import RayActor, reported_methods
from diffusion_rl.engine.weight_sync import BroadcastChannel, WeightReceiver
from diffusion_rl.engine.worker import PolicyWorker

IO_GROUP = "io"  # the concurrency group of the calls that may run while the actor samples


@reported_methods
class RolloutWorker(RayActor, WeightReceiver, PolicyWorker):
    role = "rollout actor"

    def __init__(self, rank: int, num_threads: int):
        self._start(rank, num_threads, f"rollout {rank}")
        self.channel: BroadcastChannel | None = None

    def setup(self, cfg) -> None:
        """Load the model (LoRA configured as the trainers', so that adapter names match) in the rollout dtype."""
        from diffusion_rl.models.loader import resolve_device

        device = resolve_device(cfg.model.device)
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        PolicyWorker.__init__(self, cfg, trains=False)
