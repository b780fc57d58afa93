"""What a run is set up from, read once by the trainer: its prompts (the training set or the pairs of an offline
dataset, and the validation prompts when something scores them), the texts it encodes, and the narrow spec its
workers are built from (`WorkerSpec`, engine/spec.py). `diffusion-rl prepare embeddings` reads the same texts. And
how a run's config differs from the one a checkpoint was saved with (`changed_since`), for a resume that cannot load
it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from diffusion_rl.algorithms.base import AlgorithmInputs
from diffusion_rl.config import Config
from diffusion_rl.config.convert import changed_settings
from diffusion_rl.config.loading import load_yaml_text, to_yaml
from diffusion_rl.config.secrets import redact_secrets
from diffusion_rl.data.pairs import PreferencePair, load_pairs
from diffusion_rl.data.prompts import PromptRecord, load_prompts
from diffusion_rl.engine.spec import WorkerSpec
from diffusion_rl.models.checkpointing import CheckpointPlan

logger = logging.getLogger(__name__)

AUTO_FOLDER = "embedding_cache"  # model.embedding_cache=auto: <run.dir>/embedding_cache/


@dataclass
class RunPrompts:
    records: list[PromptRecord]  # the training prompts (offline: each pair's prompt)
    pairs: list[PreferencePair] | None  # an offline dataset's pairs (data.sample_source=offline), else None
    val_records: list[PromptRecord]  # validation prompts; none when nothing scores them

    def texts(self) -> list[str]:
        """Every text the run encodes, each once: its prompts and validation prompts and their negative prompts (a
        missing one is the empty text, as the sampler gives it)."""
        records = self.records + self.val_records
        return list(dict.fromkeys(text for r in records for text in (r.prompt, r.negative_prompt or "")))


# the settings that decide what a checkpoint holds: the trained weights and adapters (model.*), the named policies
# and optimizer groups of the loss (algorithm.*), the EMA's copy (train.ema.*). A longer run or another rate is not why
# a checkpoint fails to load.
_CHECKPOINT_SETTINGS = ("model.", "algorithm.", "train.ema.")


def changed_since(saved_config: Path, cfg: Config, most: int = 4) -> str:
    """'KEY (old → new), …' for the settings that decide what a checkpoint holds (`_CHECKPOINT_SETTINGS`) in which
    `cfg` differs from the checkpoint config file `saved_config` (as the trainer wrote it), or '' when it cannot be
    read or none differs."""
    try:
        saved = load_yaml_text(saved_config.read_bytes())
    except Exception:  # noqa: BLE001 - a hint to an error being raised; a damaged file is verify_checkpoint's to name
        return ""
    if not isinstance(saved, dict):
        return ""
    now = load_yaml_text(to_yaml(redact_secrets(cfg)))  # as it would be written: same types, same redactions
    changes = [c for c in changed_settings(saved, now) if c.startswith(_CHECKPOINT_SETTINGS)]
    if not changes:
        return ""
    return ", ".join(changes[:most]) + (f" and {len(changes) - most} more" if len(changes) > most else "")


def load_run_prompts(cfg: Config) -> RunPrompts:
    """The run's prompts, read once: data.train, or data.pairs offline; val.prompts when rewards score them (offline
    DPO may run without a reward: then nothing scores validation samples, so there is no validation)."""
    pairs = load_pairs(cfg.data.pairs) if cfg.data.sample_source == "offline" else None
    if pairs is not None:
        logger.info("loaded %d preference pairs from %s", len(pairs), cfg.data.pairs)
        records = [PromptRecord(p.prompt, p.negative_prompt) for p in pairs]
    else:
        records = load_prompts(cfg.data.train)
    val = load_prompts(cfg.val.prompts) if cfg.val.prompts and (cfg.rewards or cfg.val.rewards) else []
    return RunPrompts(records, pairs, val)


def cache_location(cfg: Config) -> Path | None:
    """Where the config's prompt-embedding cache lives (a folder, or a *.safetensors file); None when it has none."""
    where = cfg.model.embedding_cache
    if where is None:
        return None
    return Path(cfg.run.dir) / AUTO_FOLDER if where == "auto" else Path(where).expanduser()


def worker_spec(cfg: Config, texts: list[str] | None = None) -> WorkerSpec:
    """What the run's workers are built from: the model, sampler, optimizer and algorithm sections, and the run's
    texts (`RunPrompts.texts`; read here when None) when the model has an embedding cache to fill."""
    val_size = cfg.val.size(cfg.sampling) if cfg.val.prompts and (cfg.val.height or cfg.val.width) else None
    e, log, cache = cfg.engine, cfg.log, cache_location(cfg)
    if cache is not None and texts is None:
        texts = load_run_prompts(cfg).texts()
    return WorkerSpec(model=cfg.model, sampling=cfg.sampling, train=cfg.train, algorithm=AlgorithmInputs.of(cfg),
                      seed=cfg.run.seed, texts=tuple(texts) if cache else (), embedding_cache=cache, val_size=val_size,
                      val_guidance_low_noise=cfg.val.guidance_low_noise, rollout_dtype=e.rollout_dtype,
                      weight_change=log.weight_change, flops=log.flops, peak_tflops=log.peak_tflops,
                      checkpoint_plan=checkpoint_plan(cfg))  # fmt: skip


def checkpoint_plan(cfg: Config) -> CheckpointPlan | None:
    """model.gradient_checkpointing=auto: the step's memory by `estimate`'s model, which each worker weighs against
    its device's free memory (models/checkpointing.py); None for any other setting, or a model on the CPU."""
    m = cfg.model
    if m.gradient_checkpointing != "auto" or m.device == "cpu" or (m.device == "auto" and not cuda_visible(cfg)):
        return None
    from diffusion_rl.estimate.architectures import architecture_for

    return memory_plan(cfg, architecture_for(m))


def memory_plan(cfg: Config, arch) -> CheckpointPlan:
    """The plan `auto` weighs for a run of `cfg` training `arch` (an estimate Architecture), whatever the device and
    the setting: the GPU check's `checkpoint_ab` part, which builds its models without the worker, resolves `auto`
    from it too."""
    from diffusion_rl.estimate.devices import DEVICES
    from diffusion_rl.estimate.estimator import estimate

    gpus = cfg.engine.num_workers if cfg.engine.kind == "ray" else 1
    return estimate(cfg, arch, DEVICES["h200"], gpus).checkpoint_plan  # memory: any device's


def cuda_visible(cfg: Config) -> bool:
    """Whether the workers may have a CUDA device: Ray places them on GPUs this process may not see."""
    import torch

    return cfg.engine.kind == "ray" or torch.cuda.is_available()
