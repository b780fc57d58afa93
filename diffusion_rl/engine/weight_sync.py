"""How the trainers' new weights reach the rollout actors (engine.rollout=separate).

What moves: the weights of the policy that samples (`Algorithm.rollout_policy`: the trained one, DiffusionNFT's
`old`), named as `PolicySet.state_dict_of` names them (LoRA: only the adapter's tensors), in the trainers' dtype.
The rollout actor copies them into its own `default` policy, in its own dtype.

Two paths (engine.weight_sync):
- object_store: trainer rank 0 puts the gathered tensors into Ray's object store once; every rollout actor reads
  them from there. The driver only passes the reference. The trainers are free as soon as the put returns.
- broadcast: a torch.distributed group of trainer rank 0 and the R rollout actors, separate from the trainers'
  FSDP group (its own store and process group object, so no process needs a second default group): rank 0
  broadcasts each tensor in name order into buffers the actors allocated from the shapes and dtypes agreed at
  setup. NCCL between GPUs, gloo between CPUs. Both sides take part in every push, so a push waits for rollout
  actors that are busy sampling.

`WeightSender` (the trainers' side) and `WeightReceiver` (a rollout actor's) are the actors' methods for it; the
receiver's `generate` applies what was pushed when a step starts and its `_keep` stamps the rows with that version.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from datetime import timedelta

import torch

from diffusion_rl.data.sampler import StepPrompts
from diffusion_rl.engine.fingerprint import fingerprint
from diffusion_rl.errors import WeightsUnchanged
from diffusion_rl.models.policies import DEFAULT
from diffusion_rl.sampling.trajectory import Generated, Trajectory
from diffusion_rl.sampling.window import SdeWindow

logger = logging.getLogger(__name__)

WEIGHTS_PREFIX = "weights/"  # the channel's keys in its store


def weight_layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name → (shape, dtype) of the tensors a push sends, in the order they are sent (sorted by name)."""
    return {name: (tuple(tensors[name].shape), tensors[name].dtype) for name in sorted(tensors)}


def make_store(address: str, rank: int, world_size: int, timeout_s: float):
    """The rendezvous store of a channel: file://PATH (one machine) or tcp://HOST:PORT (rank 0 serves it)."""
    import torch.distributed as dist

    if address.startswith("file://"):
        return dist.FileStore(address[len("file://") :], world_size)
    host, port = address[len("tcp://") :].rsplit(":", 1)
    return dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))


class BroadcastChannel:
    """Rank 0 (trainer rank 0) sends, ranks 1..R (rollout actors) receive; `backend` gloo or nccl."""

    def __init__(self, address: str, rank: int, world_size: int, backend: str, device: torch.device,
                 timeout_s: float):  # fmt: skip
        import torch.distributed as dist

        self.rank, self.device = rank, device
        store = dist.PrefixStore(WEIGHTS_PREFIX, make_store(address, rank, world_size, timeout_s))
        timeout = timedelta(seconds=timeout_s)
        if backend == "nccl":
            self.group = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout=timeout)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def send(self, tensors: dict[str, torch.Tensor]) -> int:
        """Rank 0: broadcast every tensor in name order; returns the bytes sent."""
        sent = 0
        for name in sorted(tensors):
            tensor = tensors[name].detach().to(self.device).contiguous()
            self._broadcast(tensor)
            sent += tensor.numel() * tensor.element_size()
        return sent

    def receive(self, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
        """Ranks 1..R: the tensors rank 0 sends, received into new buffers of the agreed shapes and dtypes."""
        received = {}
        for name, (shape, dtype) in layout.items():
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            self._broadcast(buffer)
            received[name] = buffer
        return received


class WeightSender:
    """A trainer's side (mixed into the Ray engine's ShardedWorker, a PolicyWorker): every rank gathers the sampling
    policy's weights, rank 0 sends them."""

    def _rollout_policy_weights(self) -> dict[str, torch.Tensor]:
        """The sampling policy's whole weights on rank 0 (empty elsewhere): a collective over the ranks."""
        tensors = self.model.policies.state_dict_of(self.rollout_policy)
        return self.parallel.full_tensors(tensors, keep=self.rank == 0)

    def put_rollout_weights(self) -> list | None:
        """Rank 0: [a reference to the sampling policy's weights in the object store, their bytes] (a list, so that
        the driver receives the reference, not the tensors); None on the other ranks."""
        import ray

        weights = self._rollout_policy_weights()
        if self.rank != 0:
            return None
        return [ray.put(weights), sum(t.numel() * t.element_size() for t in weights.values())]

    def join_channel(self, address: str, world_size: int, backend: str, timeout_s: float) -> dict:
        """Rank 0 only: join the broadcast group as its sender; returns the layout (name → shape, dtype) a push
        sends, which the rollout actors allocate."""
        tensors = self.model.policies.state_dict_of(self.rollout_policy)
        self.channel = BroadcastChannel(address, 0, world_size, backend, self.parallel.device, timeout_s)
        return weight_layout(tensors)  # a DTensor's shape is the whole tensor's

    def broadcast_rollout_weights(self) -> int:
        """Every rank gathers the sampling policy's weights; rank 0 broadcasts them. Returns the bytes sent."""
        weights = self._rollout_policy_weights()
        return self.channel.send(weights) if self.rank == 0 else 0


class WeightReceiver:
    """A rollout actor's side (mixed into its PolicyWorker that does not train): the pushed weights go into its
    `default` policy, in its own dtype, as the version (training steps taken) the driver names.

    A push is received at once but applied when the actor starts sampling a step (`apply_pushed_weights`, called by
    `generate` on a step's first chunk): a push that lands between two score chunks of a step sampled ahead would
    otherwise give that step's rows two versions."""

    pushed: tuple[dict[str, torch.Tensor], int] | None = None

    def generate(self, prompts: StepPrompts, step: int, window: SdeWindow | None,
                 rows: Sequence[int] | None = None) -> Generated:  # fmt: skip
        """PolicyWorker.generate with the weights pushed last: a step's first chunk applies them (never mid-step)."""
        if not self.kept.holds(step):
            self.apply_pushed_weights()
        if self.version is None:
            raise RuntimeError("no weights were pushed to this rollout actor yet")
        return super().generate(prompts, step, window, rows)

    def _keep(self, traj: Trajectory, step: int) -> None:
        """Keep a step's rows stamped with the version of the weights that sampled them, the one received; earlier
        steps' rows stay until the trainers fetch them (a step sampled ahead does not drop the one before)."""
        traj.ids.policy_version.fill_(self.version)
        self.kept.add(step, traj)

    def load_weights(self, refs: list, version: int) -> None:
        """The rollout policy's weights from the object store (`refs`: one reference, in a list so Ray passes it
        unresolved), as version `version`."""
        import ray

        self._take(ray.get(refs[0]), version)

    def join_channel(self, address: str, world_size: int, backend: str, timeout_s: float) -> None:
        """Join the broadcast group of trainer rank 0 (rank 0) and the rollout actors (ranks 1..R)."""
        if address.startswith("file://"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.channel = BroadcastChannel(address, self.rank + 1, world_size, backend, self.model.device, timeout_s)

    def expect_weights(self, layout: dict) -> None:
        """The names, shapes and dtypes every broadcast push sends (what trainer rank 0 said when it joined)."""
        self.layout = layout

    def receive_weights(self, version: int) -> None:
        """The rollout policy's weights broadcast by trainer rank 0, as version `version`."""
        self._take(self.channel.receive(self.layout), version)

    def _take(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.pushed = (tensors, version)

    def apply_pushed_weights(self) -> None:
        """Load the newest pushed weights, if any came since the last load. Pushed weights that differ from the
        sampling policy's (in its dtypes) must change it: a load that leaves it as it was stops the run
        (WeightsUnchanged), as a LoRA sync that loads into nothing would otherwise sample the base model for ever."""
        if self.pushed is None:
            return
        (tensors, version), self.pushed = self.pushed, None
        live = self.model.policies.tensors_of(DEFAULT)
        before = fingerprint(live.values())
        self.model.policies.load_state_dict_of(DEFAULT, tensors)
        if fingerprint(live.values()) == before != fingerprint(tensors[n].to(t.dtype) for n, t in live.items()):
            raise WeightsUnchanged(
                f"the weights of version {version} did not reach this rollout actor's sampling policy: it is "
                "exactly as before the load, though the pushed weights differ from it"
            )
        self.version = version
        logger.info("weights of version %d loaded", version)
