"""The engine section: local or Ray, workers, FSDP2, separate rollout actors; and the checks that tie a Ray layout
to the batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from diffusion_rl.config.fields import MAX_COUNT, MAX_SECONDS, Range, check, opt


@dataclass
class EngineConfig:
    kind: Literal["local", "ray"] = opt(
        "local", "Where the work runs: local (this process) or ray (PolicyWorker actors, transformer FSDP2-sharded)."
    )
    num_threads: int | None = opt(
        None,
        "torch CPU threads of the trainer process (null = torch's default); Ray workers use cpus_per_worker.",
        within=Range(1, 1024),
    )
    omp_wait_policy: Literal["auto", "passive", "spin"] = opt(
        "auto",
        "Idle OpenMP threads: spin (OpenMP's default, fastest alone) or passive (sleep at once: torch processes on "
        "shared cores). auto: spin unless other work keeps this process's CPUs busy when the CLI starts; Ray "
        "trainers, rollout and reward actors sleep. OMP_WAIT_POLICY / GOMP_SPINCOUNT set in the environment win.",
    )
    cuda_expandable_segments: bool = opt(
        True,
        "CUDA's caching allocator grows segments in place (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) instead "
        "of holding fixed blocks: less device memory lost to fragmentation. Set by the CLI and for Ray's actors; "
        "PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF set in the environment win.",
    )
    num_workers: int = opt(
        2, "ray: PolicyWorker actors (one per GPU); each samples and trains on 1/N of the batch.", within=Range(1, 4096)
    )
    cpus_per_worker: float = opt(1.0, "ray: CPUs each worker reserves.", within=Range(0, 1024, lo_open=True))
    gpus_per_worker: float = opt(
        0.0, "ray: GPUs each worker reserves (1 on GPUs: NCCL; 0: CPU workers with gloo).", within=Range(0, 64)
    )
    address: str | None = opt(
        None, "ray: null starts Ray here; auto joins this node's cluster (`ray start`); ray://host:10001 a remote one."
    )
    mixed_precision: Literal["none", "bf16"] = opt(
        "none", "ray: FSDP2 mixed precision; bf16: bf16 compute and all-gathers, fp32 gradient reduction."
    )
    reshard_after_forward: bool = opt(
        False,
        "ray: FSDP2's ZeRO-3 schedule, the least memory: gather the weights for every forward and backward, reduce "
        "gradients after every backward. false: gather once and reduce once per optimizer step (full weights and "
        "gradients on each device during the update; far fewer collectives).",
    )
    fsdp_cpu_offload: bool = opt(
        False,
        "ray: memory saver: FSDP2's CPUOffloadPolicy; the transformer's shards, gradients and optimizer state live in "
        "host memory and each block is copied to the device when gathered (slower steps, least device memory).",
    )
    collective_timeout_s: float = opt(
        1800.0,
        "ray: a collective waiting this long for a lost or hung worker fails (the run stops, no checkpoint).",
        within=Range(0, MAX_SECONDS, lo_open=True),
    )
    start_timeout_s: float = opt(
        300.0,
        "ray: wait this long for the cluster to have the workers' CPUs and GPUs.",
        within=Range(0, MAX_SECONDS, lo_open=True),
    )
    rollout: Literal["colocated", "separate"] = opt(
        "colocated",
        "ray: colocated: the workers sample and train in turn; separate: rollout_workers inference-only actors sample "
        "while the num_workers trainers train, and get the new weights after each update (docs/distributed.md).",
    )
    rollout_workers: int = opt(
        1, "separate: rollout actors (one device each); each samples 1/R of the batch.", within=Range(1, 4096)
    )
    cpus_per_rollout_worker: float = opt(
        1.0, "separate: CPUs each rollout actor reserves.", within=Range(0, 1024, lo_open=True)
    )
    gpus_per_rollout_worker: float = opt(
        0.0, "separate: GPUs each rollout actor reserves (0 or 1).", within=Range(0, 1)
    )
    rollout_dtype: Literal["fp32", "bf16", "fp16"] | None = opt(
        None, "separate: the rollout actors' model dtype (null = model.dtype); rollout correction covers the gap."
    )
    weight_sync: Literal["object_store", "broadcast"] = opt(
        "object_store",
        "separate: how new weights reach the rollout actors: through Ray's object store, or a torch.distributed "
        "broadcast from trainer rank 0 (NCCL on GPUs, gloo on CPUs). LoRA: only the adapter moves.",
    )
    sync_every: int = opt(
        1, "separate: push the weights to the rollout actors after every this many steps.", within=Range(1, MAX_COUNT)
    )
    max_staleness: int = opt(
        0,
        "separate: rollouts of up to this many later steps are sampled while an update runs (0 = synchronous). Stale "
        "rows go through algorithm.rollout_correction, which is then set to decoupled if it was bypass.",
        within=Range(0, 1000),
    )
    max_failures: int = opt(
        3,
        "ray: worker deaths survived per run (fresh actors, resume from the latest checkpoint); then the run stops.",
        within=Range(0, 1000),
    )
    trainer_resources: dict[str, float] = opt(
        dict,
        "ray: extra Ray resources each trainer reserves, e.g. {trainer_node: 1} to pin them.",
        factory=True,
        within=Range(0, 1_000_000),
    )
    rollout_resources: dict[str, float] = opt(
        dict,
        "separate: extra Ray resources each rollout actor reserves, e.g. {rollout_node: 1}.",
        factory=True,
        within=Range(0, 1_000_000),
    )

    def __post_init__(self):
        check(
            self.rollout == "separate" or (self.max_staleness == 0 and self.sync_every == 1),
            "engine.max_staleness and engine.sync_every are for engine.rollout=separate (colocated workers always "
            "sample with the newest weights)",
        )
        check(
            self.rollout == "colocated" or self.kind == "ray",
            "engine.rollout=separate runs rollout actors beside the trainers: it needs engine.kind=ray",
        )
        check(
            self.kind == "ray" or not self.fsdp_cpu_offload,
            "engine.fsdp_cpu_offload offloads the FSDP2 shards of the Ray engine's trainers: it needs engine.kind=ray "
            "(the local engine does not shard; model.offload_frozen offloads its text encoders and VAE)",
        )
        check(
            self.address is None or self.address == "auto" or self.address.startswith("ray://") or ":" in self.address,
            f"engine.address={self.address!r}: use null (start Ray here), auto, ray://host:port or host:port",
        )

    @property
    def staleness_bound(self) -> int:
        """The most updates a training row's sampling weights can be behind the trained ones (0: always on-policy)."""
        return self.max_staleness + self.sync_every - 1 if self.rollout == "separate" else 0
