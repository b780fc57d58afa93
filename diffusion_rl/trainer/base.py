"""The trainer skeleton shared by every algorithm family: data, rewards, engine, checkpoints, validation, logging.

A family subclasses `Trainer` and implements `train_step(step) -> metrics`; the loop in `train()` is the same
for all. Steps count completed training steps: checkpoint `step_000010` holds the state after 10 steps.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from diffusion_rl.config import Config
from diffusion_rl.config_io import redact_secrets, refuse_redacted, to_yaml
from diffusion_rl.data.prompts import PromptRecord, load_prompts
from diffusion_rl.data.sampler import PromptSampler
from diffusion_rl.engine.local import make_engine
from diffusion_rl.engine.reward_actors import make_reward_fn
from diffusion_rl.models.loader import resolve_device
from diffusion_rl.models.tiny import TINY_PRESETS, save_tiny_model
from diffusion_rl.rewards import RewardCombiner, WeightedReward
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.tracking import image_grid, make_trackers, plot_metrics, read_metrics, save_png
from diffusion_rl.trainer.checkpoint import CheckpointManager, step_dir_name, step_of
from diffusion_rl.trainer.galleries import ROLLOUTS_DIR, validation_caption, write_rollout_dump
from diffusion_rl.trainer.profiling import StepProfiler
from diffusion_rl.trainer.timing import PhaseTimer
from diffusion_rl.utils.rng import capture_rng_state, restore_rng_state
from diffusion_rl.utils.seeding import seed_for

logger = logging.getLogger(__name__)


def ensure_model(cfg: Config) -> None:
    """Create the tiny model at model.path when asked to and it is absent."""
    path = Path(cfg.model.path)
    if cfg.model.create_tiny_if_missing and not path.exists():
        logger.info("creating the tiny model (%s preset) at %s", cfg.model.create_tiny_if_missing, path)
        save_tiny_model(path, TINY_PRESETS[cfg.model.create_tiny_if_missing])


def build_rewards(cfg: Config) -> RewardCombiner:
    """The config's rewards, each keyed in metrics and logs by its label (else its name)."""
    for i, spec in enumerate(cfg.rewards):  # e.g. a run's own config.yaml given back to `train`
        refuse_redacted(spec.kwargs, f"rewards.{i}.kwargs")
    return RewardCombiner(
        [WeightedReward(s.metric_name, s.weight, make_reward_fn(s, cfg.engine), s.required) for s in cfg.rewards]
    )


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        if cfg.engine.num_threads:
            torch.set_num_threads(cfg.engine.num_threads)
        self.run_dir = Path(cfg.run.dir)
        self.records = self.training_records()
        self.sampler = PromptSampler(len(self.records), cfg.data.prompts_per_step, cfg.run.seed, cfg.data.shuffle)
        # offline DPO may run without a reward: then nothing scores validation samples, so there is no validation
        self.val_records = load_prompts(cfg.val.prompts) if cfg.val.prompts and cfg.rewards else []
        self.rewards = build_rewards(cfg) if cfg.rewards else None
        # scores chunks of a batch while the next chunk samples (sampling.score_chunks); one thread keeps the
        # rewards' own order and state simple
        self.reward_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        ensure_model(cfg)
        self.engine = make_engine(cfg)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.train.keep_last)
        device = resolve_device(cfg.model.device)
        self.profiler = StepProfiler(cfg.profile.steps, cfg.profile.memory, self.run_dir, device)
        self.step = 0
        self.trackers = None

    # -- the loop --------------------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        cfg = self.cfg
        resume_from = self.checkpoints.resolve_resume(cfg.run.resume)
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        if cfg.run.val_only:
            return self.validate_only(resume_from)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(redact_secrets(cfg)))  # no inline api_key on disk
        self.trackers = make_trackers(
            self.run_dir,
            jsonl=cfg.log.jsonl,
            tensorboard=cfg.log.tensorboard,
            console_every=0,
            wandb=self._wandb_settings(),
            config=redact_secrets(cfg),
        )
        self.trackers.resume_from(self.step)
        try:
            with logging_redirect_tqdm():
                self._loop()
        finally:
            self.trackers.close()
            self.trackers = None  # a later validate() (evaluation) must not write to closed trackers
        return self.finish()

    def _loop(self) -> None:
        cfg = self.cfg
        if cfg.val.before_train and self.step == 0 and self.val_records:
            self.trackers.log_metrics(self.validate(), 0)
        bar = tqdm(
            total=cfg.train.total_steps,
            initial=self.step,
            desc="train",
            disable=None if cfg.log.progress_bar else True,
            dynamic_ncols=True,
        )
        while self.step < cfg.train.total_steps:
            start = time.perf_counter()
            with self.profiler.step(self.step + 1):  # numbered as in metrics: the first step is 1
                metrics = self.train_step(self.step)
            self.step += 1
            timer = PhaseTimer()
            last = self.step == cfg.train.total_steps
            if last or (cfg.train.save_every > 0 and self.step % cfg.train.save_every == 0):
                with timer("checkpoint"):
                    self.save_checkpoint()
            if self.val_records and (last or (cfg.val.every > 0 and self.step % cfg.val.every == 0)):
                with timer("validate"):
                    metrics.update(self.validate())
            metrics.update(timer.metrics())
            metrics["timing/step"] = time.perf_counter() - start
            self.trackers.log_metrics(metrics, self.step)
            self._console(metrics, bar)
        bar.close()

    def train_step(self, step: int) -> dict[str, float]:
        raise NotImplementedError

    def training_records(self) -> list[PromptRecord]:
        """The records the prompt sampler draws from each step (a family may read other training data)."""
        return load_prompts(self.cfg.data.train)

    def _console(self, metrics: dict, bar) -> None:
        bar.update(1)
        shown = {"reward": "reward/mean", "val": "val/reward/mean", "loss": "loss", "s/step": "timing/step"}
        bar.set_postfix({k: f"{metrics[m]:.4g}" for k, m in shown.items() if m in metrics}, refresh=False)
        every = self.cfg.log.console_every
        if every and self.step % every == 0:
            text = " ".join(f"{k}={metrics[m]:.4g}" for k, m in shown.items() if m in metrics)
            logger.info("step %d/%d %s", self.step, self.cfg.train.total_steps, text)

    def finish(self) -> list[dict]:
        rows = read_metrics(self.run_dir / "metrics.jsonl") if self.cfg.log.jsonl else []
        if rows:
            plot_metrics(rows, self.run_dir / "reward.png")
        return rows

    def _wandb_settings(self) -> dict | None:
        w = self.cfg.log.wandb
        if not w.enabled:
            return None
        return {"project": w.project, "mode": w.mode, "tags": list(w.tags), "name": self.cfg.run.name}

    # -- validation -----------------------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """ODE samples of the fixed validation prompts with fixed seeds; rewards, best@n and an image grid."""
        cfg, val = self.cfg, self.cfg.val
        records = [r for r in self.val_records for _ in range(val.n)]
        seeds = [seed_for(val.seed, "validation", i) for i in range(len(records))]
        guidance = val.guidance if val.guidance is not None else cfg.sampling.guidance
        settings = SamplerSettings(val.num_steps, guidance, cfg.sampling.height, cfg.sampling.width)
        images = []
        for start in range(0, len(records), cfg.train.micro_batch_size):
            chunk = records[start : start + cfg.train.micro_batch_size]
            images.append(
                self.engine.sample_images(
                    [r.prompt for r in chunk],
                    [r.negative_prompt for r in chunk],
                    seeds[start : start + len(chunk)],
                    settings,
                )
            )
        images = torch.cat(images).numpy()
        metadata = [{**r.metadata, "ground_truth": r.ground_truth, "data_source": r.data_source} for r in records]
        result = self.rewards(images, [r.prompt for r in records], metadata)
        metrics = {f"val/{k}": v for k, v in result.metrics.items()}
        per_prompt = result.total.reshape(len(self.val_records), val.n)
        scored = ~np.isnan(per_prompt).all(axis=1)  # a prompt whose samples all failed has no best (not -inf, not 0)
        metrics["val/reward/best@n"] = float(np.nanmax(per_prompt[scored], axis=1).mean())
        captions = [f"{r.prompt} | {s:.4g}" for r, s in zip(records, result.total)]
        grid = image_grid(images, captions, ncols=val.n * min(4, len(self.val_records)))
        save_png(grid, self.run_dir / "samples" / f"{step_dir_name(self.step)}.png")
        if self.trackers is not None:  # None when called outside train(), e.g. to evaluate a loaded checkpoint
            caption = validation_caption(self.step, [r.prompt for r in self.val_records], per_prompt)
            self.trackers.log_images("val/samples", grid, self.step, caption=caption)
        return metrics

    def validate_only(self, checkpoint: Path | None) -> list[dict]:
        """run.val_only: validate the loaded checkpoint (or the initial model), write the numbers next to the grid."""
        metrics = self.validate()
        path = self.run_dir / "samples" / f"{step_dir_name(self.step)}.json"
        record = {"step": self.step, "checkpoint": str(checkpoint) if checkpoint else None, **metrics}
        path.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        shown = ", ".join(f"{k} {metrics[k]:.5g}" for k in ("val/reward/mean", "val/reward/best@n") if k in metrics)
        logger.info("validation of step %d: %s (%s)", self.step, shown, path)
        return [{"step": self.step, **metrics}]

    # -- rollout dumps ----------------------------------------------------------------------------------------
    def rollout_due(self, step: int) -> bool:
        """Whether training step `step` (0-based, as train_step gets it) dumps its rollout (log.rollout_every)."""
        every = self.cfg.log.rollout_every
        return every > 0 and (step + 1) % every == 0

    def dump_rollout(self, step: int, prompts, images_BHW3: np.ndarray, scored, advantages_B) -> None:
        """Write training step `step`'s rollout under <run.dir>/rollouts/ and show its sheet in the trackers."""
        folder, sheet = write_rollout_dump(
            self.run_dir / ROLLOUTS_DIR,
            step + 1,  # numbered as in metrics and checkpoints: after step + 1 completed steps
            images_BHW3,
            prompts.records,
            prompts.uids,
            prompts.group_index.tolist(),
            scored,
            np.asarray(advantages_B, dtype=np.float64),
            self.cfg.log.rollout_max_images,
            prompts.group_size,
        )
        if sheet is not None and self.trackers is not None:
            self.trackers.log_images("train/rollout", sheet, step + 1, caption=f"step {step + 1}: {folder}")

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        def write(directory: Path) -> None:
            self.engine.save(directory)
            torch.save(
                {
                    "step": self.step,
                    "sampler": self.sampler.state_dict(),
                    "rng": capture_rng_state(),
                    "trainer": self.extra_state(),
                },
                directory / "run_state.pt",
            )
            (directory / "config.yaml").write_text(to_yaml(redact_secrets(self.cfg)))

        return self.checkpoints.save(self.step, write)

    def load_checkpoint(self, path: Path) -> None:
        state = torch.load(path / "run_state.pt", map_location="cpu", weights_only=False)
        self.sampler.load_state_dict(state["sampler"])
        self.engine.load(path)
        self.step = state["step"]
        if self.step != step_of(path):
            raise RuntimeError(f"checkpoint {path} holds step {self.step}, not the step its name says")
        self.load_extra_state(state["trainer"])
        restore_rng_state(state["rng"])
        logger.info("resumed from %s (step %d)", path, self.step)

    def extra_state(self) -> dict:
        """State a family keeps beyond the engine's (e.g. a window schedule); saved with each checkpoint."""
        return {}

    def load_extra_state(self, state: dict) -> None:
        pass
