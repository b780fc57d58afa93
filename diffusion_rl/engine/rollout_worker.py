"""A rollout actor (engine.rollout=separate): an inference-only copy of the policy that samples training rollouts.

It holds the whole model (no optimizer, no gradients, no sharding), in engine.rollout_dtype if set, and samples
with whatever weights the trainers last pushed (engine/weight_sync.py), stamping each row with their version. Its
rows stay here until the trainers fetch the ones they train on, worker to worker (`export_rows`, which runs in its
own concurrency group, so that the trainers can fetch step t while this actor samples step t + 1).

A Ray actor (engine/ray.py); every method's exception reaches the driver as a WorkerError naming this actor.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Sequence

import torch

from diffusion_rl.data.condition_images import ConditionImage, fit_rows
from diffusion_rl.engine.kept import KeptRollouts
from diffusion_rl.engine.sharded_worker import actor_info, reported
from diffusion_rl.engine.weight_sync import BroadcastChannel
from diffusion_rl.models.policies import DEFAULT
from diffusion_rl.sampling.rollout import SamplerSettings, training_rollout
from diffusion_rl.sampling.trajectory import Generated, SampleIds, Trajectory
from diffusion_rl.sampling.window import SdeWindow

logger = logging.getLogger(__name__)

IO_GROUP = "io"  # the concurrency group of the calls that may run while the actor samples


class RolloutWorker:
    role = "rollout actor"

    def __init__(self, rank: int, num_threads: int):
        self.rank, self.host, self.pid = rank, socket.gethostname(), os.getpid()
        torch.set_num_threads(max(1, num_threads))
        logging.basicConfig(level=logging.INFO, format=f"[rollout {rank}] %(levelname)s %(name)s: %(message)s")
        self.version: int | None = None  # the training steps the pushed weights had taken; None: none pushed yet
        self.kept = KeptRollouts()
        self.channel: BroadcastChannel | None = None

    def info(self) -> dict:
        return actor_info(self)

    @reported
    def setup(self, cfg) -> None:
        """Load the model (LoRA configured as the trainers', so that adapter names match) in the rollout dtype."""
        from diffusion_rl.engine.embeddings import attach_embedding_cache
        from diffusion_rl.models.loader import load_model, resolve_device

        self.cfg = cfg
        model_cfg = dataclasses.replace(cfg.model, dtype=cfg.engine.rollout_dtype or cfg.model.dtype)
        device = resolve_device(model_cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        self.model = load_model(model_cfg, text_encoders=model_cfg.embedding_cache is None)
        attach_embedding_cache(self.model, dataclasses.replace(cfg, model=model_cfg))  # in the rollout dtype
        s = cfg.sampling
        self.settings = SamplerSettings.of(s)

    # -- sampling -------------------------------------------------------------------------------------------------
    @reported
    def generate(
        self,
        prompts: Sequence[str],
        negative: Sequence[str | None],
        ids: SampleIds,
        step: int,
        window: SdeWindow | None,
        images: Sequence[Sequence[ConditionImage]] | None = None,
    ) -> Generated:
        """Rows of training step `step` (the same samples any worker draws for them, with their condition images),
        kept here; their images."""
        if self.version is None:
            raise RuntimeError("no weights were pushed to this rollout actor yet")
        s = self.cfg.sampling
        traj = training_rollout(self.model, self.settings, prompts, negative, ids, step, window,
                                fit_rows(images, s.height, s.width),
                                seed=self.cfg.run.seed, share_initial_noise=s.share_initial_noise)  # fmt: skip
        traj.ids.policy_version.fill_(self.version)
        self.kept.add(step, traj)
        return traj.generated()

    @reported
    def export_rows(self, step: int, positions: list[int]) -> Trajectory:
        """Rows of step `step` (by position among this actor's rows of it) that a trainer trains on."""
        return self.kept.export(step, positions)

    @reported
    def release(self, step: int) -> None:
        """Forget step `step`'s rows: the trainers have them."""
        self.kept.release(step)

    # -- weights --------------------------------------------------------------------------------------------------
    @reported
    def load_weights(self, refs: list, version: int) -> None:
        """The rollout policy's weights from the object store (`refs`: one reference, in a list so Ray passes it
        unresolved), as version `version`."""
        import ray

        self._take(ray.get(refs[0]), version)

    @reported
    def join_channel(self, address: str, world_size: int, backend: str, timeout_s: float) -> None:
        """Join the broadcast group of trainer rank 0 (rank 0) and the rollout actors (ranks 1..R)."""
        if address.startswith("file://"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.channel = BroadcastChannel(address, self.rank + 1, world_size, backend, self.model.device, timeout_s)

    @reported
    def expect_weights(self, layout: dict) -> None:
        """The names, shapes and dtypes every broadcast push sends (what trainer rank 0 said when it joined)."""
        self.layout = layout

    @reported
    def receive_weights(self, version: int) -> None:
        """The rollout policy's weights broadcast by trainer rank 0, as version `version`."""
        self._take(self.channel.receive(self.layout), version)

    def _take(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.model.policies.load_state_dict_of(DEFAULT, tensors)
        self.version = version
        logger.info("weights of version %d loaded", version)
