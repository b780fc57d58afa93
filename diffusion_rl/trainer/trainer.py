"""The trainer: one loop and one training step for every algorithm.

    train_step:  collect (sample the step's prompts and score them; or load offline pairs)
                 → prepare (the algorithm turns scores into targets: advantages, pairs)
                 → update (the engine trains on the trajectories it kept, with those targets)
    the loop:    train_step → validate when due → log the step's metrics → checkpoint when due and healthy

Where a step's batch comes from, and its scores (the `collect` phase): a source of trainer/sources.py.

Steps count completed training steps: checkpoint `step_000010` holds the state after 10 steps, and metrics,
validation grids and checkpoints of a step are all numbered by it. A step's metrics and validation are written
before its checkpoint is published, so a resumed run ends with every row and file a straight run writes.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from diffusion_rl.algorithms import make_algorithm
from diffusion_rl.checkpoint.paths import step_dir_name, step_of
from diffusion_rl.checkpoint.state import CONFIG_FILE, STATE_FILE, read_state, state_fits, write_state
from diffusion_rl.checkpoint.store import CheckpointManager
from diffusion_rl.config import Config
from diffusion_rl.config.loading import to_yaml
from diffusion_rl.config.secrets import redact_secrets, refuse_redacted
from diffusion_rl.data.condition_images import (
    check_condition_images,
    count_mismatch,
    fit_rows,
    with_condition_images,
)
from diffusion_rl.data.sampler import PromptSampler
from diffusion_rl.engine import make_engine
from diffusion_rl.engine.ray_cluster import WorkerDied
from diffusion_rl.engine.reward_actors import make_reward_fn
from diffusion_rl.errors import RunInterrupted, RunStopped, UserError
from diffusion_rl.guard import RunGuard, repeat_key
from diffusion_rl.models.loader import resolve_device
from diffusion_rl.models.tiny import save_tiny
from diffusion_rl.models.tiny.shipped import shipped_dir
from diffusion_rl.rewards import RewardCombiner
from diffusion_rl.rewards.build import build_combiner, console_rewards
from diffusion_rl.rewards.video import takes_video
from diffusion_rl.sampling.rollout import SamplerSettings
from diffusion_rl.sampling.window import window_for_step
from diffusion_rl.tracking import make_trackers, plot_metrics, read_metrics
from diffusion_rl.tracking.console import bar_shown
from diffusion_rl.tracking.media import log_sheet, sample_sheet, save_sample
from diffusion_rl.tracking.val_images import write_validation_images
from diffusion_rl.trainer.galleries import ROLLOUTS_DIR, validation_caption, write_rollout_dump
from diffusion_rl.trainer.profiling import StepProfiler
from diffusion_rl.trainer.setup import changed_since, load_run_prompts, worker_spec
from diffusion_rl.trainer.sources import Collected, RolloutDiverged, make_source
from diffusion_rl.trainer.timing import PhaseTimer, StepMetrics
from diffusion_rl.utils.files import naming
from diffusion_rl.utils.omp import check_effective
from diffusion_rl.utils.rng import capture_rng_state, restore_rng_state
from diffusion_rl.utils.seeding import seed_for

logger = logging.getLogger(__name__)


def ensure_model(cfg: Config) -> None:
    """Create the tiny model (of model.family; sd3 when auto) at model.path when asked to and it is absent (a shipped
    pretrained preset is copied out: models/tiny/shipped.py); never where model.path could name a Hub repository."""
    path, m = Path(cfg.model.path).expanduser(), cfg.model
    if path.exists() or not m.create_tiny_if_missing:
        return
    if m.tiny_to_create is None:
        logger.warning("model.path '%s' names a Hub repository, loaded from the Hub: create_tiny_if_missing writes "
                       "no tiny model at such a path (a local folder is written ./%s)", m.path, m.path)  # fmt: skip
        return
    if shipped_dir(m.tiny_family, m.tiny_to_create) is not None:
        logger.info("copying the pretrained %s model shipped in the package (%s preset) to %s", m.tiny_family,
                    m.tiny_to_create, path)  # fmt: skip
    else:
        logger.info("creating the tiny %s model (%s preset, random weights) at %s", m.tiny_family, m.tiny_to_create,
                    path)  # fmt: skip
    save_tiny(path, m.tiny_family, m.tiny_to_create)


def build_rewards(cfg: Config, specs=None, where: str = "rewards") -> RewardCombiner:
    """The config's rewards (or `specs`, e.g. val.rewards), each keyed in metrics and logs by its label."""
    specs = cfg.rewards if specs is None else specs
    for i, spec in enumerate(specs):  # e.g. a run's own config.yaml given back to `train`
        refuse_redacted(spec.kwargs, f"{where}.{i}.kwargs")
    combiner = build_combiner(specs, lambda s: make_reward_fn(s, cfg.engine), where)
    frames = cfg.sampling.num_frames
    for reward in combiner.rewards:  # it would fail every sample: before the first is sampled
        if takes_video(reward.fn) and frames < 2:
            raise UserError(f"{where}: '{reward.name}' scores videos of at least 2 frames, but this run samples "
                            f"images (sampling.num_frames={frames}); use it with a video model")  # fmt: skip
    return combiner


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        check_effective(cfg.engine.omp_wait_policy)  # this process's OpenMP read its variables when torch loaded
        if cfg.engine.num_threads:
            torch.set_num_threads(cfg.engine.num_threads)
        self.run_dir = Path(cfg.run.dir)
        ensure_model(cfg)  # first: a shipped model brings its prompt files (the ShapesWorld quickstart reads them)
        run_prompts = load_run_prompts(cfg)
        self.records, self.val_records = run_prompts.records, run_prompts.val_records
        self.sampler = PromptSampler(len(self.records), cfg.data.prompts_per_step, cfg.run.seed, cfg.data.shuffle)
        s = cfg.sampling  # an edit dataset's images all exist, fit the output size and decode: before any work
        decoded = set()  # each image decoded once, whether the training or the validation set (or both) holds it
        counts = (
            check_condition_images(self.records, s.height, s.width, str(cfg.data.train), decoded),
            check_condition_images(self.val_records, *cfg.val.size(s), str(cfg.val.prompts), decoded),
        )
        if self.val_records and (mismatch := count_mismatch(*counts, str(cfg.data.train), str(cfg.val.prompts))):
            logger.warning(mismatch)  # once, before step 0
        self.rewards = build_rewards(cfg) if cfg.rewards else None
        # rewards that score validation: val.rewards, else the training rewards
        self.val_rewards = build_rewards(cfg, cfg.val.rewards, "val.rewards") if cfg.val.rewards else self.rewards
        self.guard = RunGuard(cfg.guard, self.run_dir, repeat_key(cfg))  # first: it refuses a rerun the guard ended
        self.checkpoints = CheckpointManager(self.run_dir, cfg.train.keep_last)
        if cfg.run.resume == "never" and not cfg.run.val_only and self.checkpoints.set_aside_earlier_run():
            self.guard = RunGuard(cfg.guard, self.run_dir, repeat_key(cfg))  # the earlier run's end went aside too
        self.resume_from = self.checkpoints.resolve_resume(cfg.run.resume)  # before the model loads: a bad path
        self.algorithm = make_algorithm(cfg)  # its `prepare`: scores → targets, here on the driver
        self.engine = make_engine(cfg.engine, worker_spec(cfg, run_prompts.texts()))
        e = cfg.engine  # devices of a step: the trainers (they count FLOPs), and the rollout actors beside them
        trainer_devices = e.num_workers if e.kind == "ray" else 1
        devices = trainer_devices + (e.rollout_workers if e.rollout == "separate" else 0)
        flat_nfe = None  # tree rollouts (local engine): what flat rollouts of the same group size would cost
        if cfg.sampling.tree is not None:
            flat_nfe = float(
                cfg.sampling.num_steps * self.engine.model.forwards_per_evaluation(SamplerSettings.of(s).scales)
            )
        self.metrics = StepMetrics(devices, trainer_devices, flat_nfe)
        self.source = make_source(cfg, self.records, self.sampler, self.engine, self.rewards, run_prompts.pairs)
        device = resolve_device(cfg.model.device)
        self.profiler = StepProfiler(cfg.profile.steps, cfg.profile.memory, self.run_dir, device)
        self.step = 0
        self.trackers = None
        self.failures = 0  # worker deaths survived (engine.max_failures)
        self.recovered: dict[str, float] = {}  # logged with the first step after a recovery

    # -- the loop --------------------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        cfg, resume_from = self.cfg, self.resume_from
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        if cfg.run.val_only:
            return self.validate_only(resume_from)
        if resume_from is not None:  # an earlier checkpoint resumed on purpose: the later ones are kept aside
            self.checkpoints.set_aside_later(step_of(resume_from))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with naming(self.run_dir / CONFIG_FILE):
            (self.run_dir / CONFIG_FILE).write_text(to_yaml(redact_secrets(cfg)))  # no inline api_key on disk
        self.trackers = make_trackers(
            self.run_dir,
            jsonl=cfg.log.jsonl,
            tensorboard=cfg.log.tensorboard,
            console_every=cfg.log.console_every,
            total_steps=cfg.train.total_steps,
            wandb=self._wandb_settings(),
            config=redact_secrets(cfg),
            console_rewards=console_rewards(cfg.rewards),  # a win rate's mean is always ½: show a readable one
            console_early=not bar_shown(cfg.log.progress_bar),  # a log: early lines in place of the bar
        )
        # a resume keeps the rows up to its checkpoint; a start from scratch (-1) none of an earlier run's here
        self.trackers.resume_from(self.step if resume_from is not None else -1)
        try:
            with logging_redirect_tqdm():
                self._loop()
        except RunStopped as e:  # divergence, every sample failing: no checkpoint of it, so say which one is good
            latest, note = self.checkpoints.latest(), ""
            if isinstance(e, RolloutDiverged) and latest is not None and step_of(latest) == self.step:
                aside, latest = self.checkpoints.set_aside_latest()  # its weights sampled the NaN
                note = f" (the weights that sampled it are set aside as {aside})"
            raise type(e)(f"{e}; latest checkpoint (the last healthy one): {latest or 'none'}{note}") from e
        except KeyboardInterrupt:  # Ctrl-C: how far the run got and what holds it, one line (not a traceback)
            raise RunInterrupted(self._interrupted()) from None
        finally:
            self.trackers.close()
            self.trackers = None  # a later validate() (evaluation) must not write to closed trackers
        return self.finish()

    def _loop(self) -> None:
        cfg = self.cfg
        if cfg.val.before_train and self.step == 0 and self.val_records:
            self.trackers.log_metrics(self.validate(), 0)
        self.start_state = self._plain_state()  # what a recovery with no checkpoint yet goes back to
        bar = tqdm(total=cfg.train.total_steps, initial=self.step, desc="train",
                   disable=not bar_shown(cfg.log.progress_bar), dynamic_ncols=True)  # fmt: skip
        self.carried: dict[str, float] = {}  # the previous step's checkpoint time, logged with this step
        while self.step < cfg.train.total_steps:
            try:
                stop = self._iteration(bar)
            except WorkerDied as died:
                self._recover(died)
                bar.reset(total=cfg.train.total_steps)
                bar.update(self.step)
                continue
            if stop:
                break
        bar.close()
        self.guard.log_summary()

    def _iteration(self, bar) -> bool:
        """One step, then its validation, metrics row, guard check and checkpoint; True when the guard stops."""
        cfg = self.cfg
        start = time.perf_counter()
        with self.profiler.step(self.step + 1):  # numbered as in metrics: the first step is 1
            metrics = self.train_step(self.step)
        self.step += 1
        last = self.step == cfg.train.total_steps
        timer = PhaseTimer()
        if self.val_records and cfg.val.every > 0 and (last or self.step % cfg.val.every == 0):
            with timer("validate"):
                metrics.update(self.validate())
        metrics.update(
            {**timer.metrics(), **self.carried, **self.recovered, "timing/step": time.perf_counter() - start}
        )
        self.trackers.log_metrics(metrics, self.step)
        self.recovered = {}
        bar.update(1)
        shown = {"reward": "reward/mean", "val": "val/reward/mean", "s/step": "timing/step"}
        bar.set_postfix({k: f"{metrics[m]:.4g}" for k, m in shown.items() if m in metrics}, refresh=False)
        if self.guard.should_stop(self.step, self.checkpoints, self.load_checkpoint):  # no checkpoint of it
            return True
        self.carried = {}
        if last or (cfg.train.save_every > 0 and self.step % cfg.train.save_every == 0):
            started = time.perf_counter()
            if self.save_checkpoint() is not None:
                self.carried["timing/checkpoint"] = time.perf_counter() - started
        return False

    def _recover(self, died: WorkerDied) -> None:
        """A worker process died: fresh actors, and the run goes on without a person (engine.max_failures times).
        A rollout actor: new rollout actors, and the step whose rows were lost is sampled again. A trainer: a new
        engine, resumed from the latest checkpoint (or from the start), its later metrics rows dropped."""
        limit = self.cfg.engine.max_failures
        if self.failures >= limit:
            raise RunStopped(f"{died}; engine.max_failures={limit} worker deaths were survived already") from died
        self.failures += 1
        started = time.perf_counter()
        self.source.discard_ahead()
        if died.group == "rollout":
            logger.warning("%s; new rollout actors, step %d is sampled again (failure %d of %d survived)", died,
                           self.step + 1, self.failures, limit)  # fmt: skip
            self.engine.restart_rollouts()
        else:
            latest = self.checkpoints.latest()
            logger.warning("%s; a new engine resumes from %s (failure %d of %d survived)", died,
                           latest or "the start", self.failures, limit)  # fmt: skip
            self.engine.restart()
            if latest is not None:
                self.load_checkpoint(latest)
            else:
                self._load_plain_state(self.start_state)
            self.trackers.resume_from(self.step)
            self.carried = {}
        self.recovered = {"engine/failures": float(self.failures), "timing/recovery": time.perf_counter() - started}

    def train_step(self, step: int) -> dict[str, float]:
        """One training step (0-based): collect → prepare → update. Returns its metrics."""
        timer = PhaseTimer()
        window = window_for_step(self.cfg.sampling, self.cfg.run.seed, step)
        batch = self.source.collect(step, window, timer)
        if batch.images is not None:  # image statistics no reward optimises (diffusion_rl/guard), with the rewards'
            with timer("guard"):
                groups = batch.prompts.group_index.numpy()
                batch.scored.metrics.update(self.guard.on_rollout(step + 1, batch.images, groups, batch.scored))
        with timer("prepare"):
            targets, prepared = self.algorithm.prepare(batch.scored, batch.prompts.group_index)
        with timer("update"):
            update = self.engine.update(targets, step)
        metrics = self.metrics.row([batch.scored.metrics, prepared, update], timer, len(batch.prompts),
                                   window.start if window is not None else None)  # fmt: skip
        every = self.cfg.log.rollout_every  # a rollout dump (rollouts/) every log.rollout_every steps
        if every > 0 and (step + 1) % every == 0 and batch.images is not None:
            with timer("dump"):
                self.dump_rollout(step, batch, targets.advantages)
            metrics["timing/dump"] = timer.seconds["dump"]
        return metrics

    def _interrupted(self) -> str:
        latest, done = self.checkpoints.latest(), f"{self.step} of {self.cfg.train.total_steps} steps done"
        if latest is None:
            return f"interrupted (Ctrl-C) with {done}; no checkpoint was saved yet (train.save_every)"
        return (f"interrupted (Ctrl-C) with {done}; the last checkpoint is {latest} (step {step_of(latest)}): run the "
                "same command to resume from it")  # fmt: skip

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

    # -- validation -------------------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """ODE samples of the fixed validation prompts with fixed seeds; rewards, best@n and an image grid."""
        cfg, val = self.cfg, self.cfg.val
        records = [r for r in self.val_records for _ in range(val.n)]
        seeds = [seed_for(val.seed, "validation", i) for i in range(len(records))]
        s = cfg.sampling
        guidance, low_noise = val.guidance_scales(s)
        height, width = val.size(s)  # val.height/width: e.g. train small, validate at full size
        solver = val.ode_solver or s.ode_solver
        settings = SamplerSettings(val.num_steps, guidance, height, width, frames=s.num_frames, ode_solver=solver,
                                   guidance_low_noise=low_noise)  # fmt: skip
        condition = [r.images for r in records]  # an edit's sources (references, fitted where they are used)
        images = self.engine.sample_images([r.prompt for r in records], [r.negative_prompt for r in records], seeds,
                                           settings, images=condition if any(condition) else None).numpy()  # fmt: skip
        groups = np.arange(len(self.val_records)).repeat(val.n)  # a prompt's val.n samples: one group
        metadata = with_condition_images([r.reward_metadata() for r in records], condition, height, width)
        result = self.val_rewards(images, [r.prompt for r in records], metadata, group_index=groups,
                                  batch=f"the validation batch (val.prompts: {val.prompts})")  # fmt: skip
        metrics = {f"val/{k}": v for k, v in result.metrics.items()}
        metrics.update(self.guard.on_validation(self.step, images))  # guard hook: drift from the first validation
        per_prompt = result.total.reshape(len(self.val_records), val.n)
        scored = ~np.isnan(per_prompt).all(axis=1)  # a prompt whose samples all failed has no best (not -inf, not 0)
        metrics["val/reward/best@n"] = float(np.nanmax(per_prompt[scored], axis=1).mean())
        captions = [f"{r.prompt} | {score:.4g}" for r, score in zip(records, result.total)]
        sheet = sample_sheet(images, captions, val.n * min(4, len(self.val_records)),
                             fit_rows(condition, height, width))  # fmt: skip
        save_sample(sheet, self.run_dir / "samples" / step_dir_name(self.step))
        prompts = [r.prompt for r in records]  # per-image files, for the HTML report (tracking/val_images.py):
        write_validation_images(self.run_dir / "samples", self.step, images, prompts, val.n, result.total,
                                fit_rows(condition, height, width))  # fmt: skip
        if self.trackers is not None:  # None when called outside train(), e.g. to evaluate a loaded checkpoint
            caption = validation_caption(self.step, [r.prompt for r in self.val_records], per_prompt)
            log_sheet(self.trackers, "val/samples", sheet, self.step, caption)
        return metrics

    def validate_only(self, checkpoint: Path | None) -> list[dict]:
        """run.val_only: validate the loaded checkpoint (or the initial model), write the numbers next to the grid."""
        metrics = self.validate()
        path = self.run_dir / "samples" / f"{step_dir_name(self.step)}.json"
        record = {"step": self.step, "checkpoint": str(checkpoint) if checkpoint else None, **metrics}
        with naming(path):
            path.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        shown = ", ".join(f"{k} {metrics[k]:.5g}" for k in ("val/reward/mean", "val/reward/best@n") if k in metrics)
        logger.info("validation of step %d: %s (%s)", self.step, shown, path)
        return [{"step": self.step, **metrics}]

    # -- rollout dumps ----------------------------------------------------------------------------------------
    def dump_rollout(self, step: int, batch: Collected, advantages: torch.Tensor | None) -> None:
        """Write training step `step`'s rollout under <run.dir>/rollouts/ and show its sheet in the trackers, with
        each row's advantage (`Targets.advantages`: [B]; a tree's [B, D + 1], whose leaf depth's is the one to compare
        with flat rollouts; None for an algorithm without advantages, DPO's pairs)."""
        prompts = batch.prompts
        if advantages is None:
            advantages_B = torch.full((len(prompts),), float("nan"))
        else:
            advantages_B = advantages[:, -1] if advantages.ndim == 2 else advantages
        folder, sheet = write_rollout_dump(
            self.run_dir / ROLLOUTS_DIR,
            step + 1,  # numbered as in metrics and checkpoints: after step + 1 completed steps
            batch.images,
            prompts.records,
            prompts.uids,
            prompts.group_index.tolist(),
            batch.scored,
            np.asarray(advantages_B, dtype=np.float64),
            self.cfg.log.rollout_max_images,
            prompts.group_size,
            self._sources(prompts.condition_images),
        )
        if sheet is not None and self.trackers is not None:
            log_sheet(self.trackers, "train/rollout", sheet, step + 1, f"step {step + 1}: {folder}")

    def _sources(self, rows) -> list[list[np.ndarray]] | None:
        """Each row's condition images at the output size, for sheets; None for a text-only batch."""
        s = self.cfg.sampling
        return fit_rows(rows, s.height, s.width)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Publish the state after self.step steps; None (and a warning) when the model is not healthy: updates
        are being skipped or its weights are not finite, so `latest` stays on the last healthy checkpoint."""
        problem = self.engine.health_problem()
        if problem is not None:
            logger.warning("step %d: no checkpoint (%s); the latest stays %s", self.step, problem,
                           self.checkpoints.latest())  # fmt: skip
            return None

        def write(directory: Path) -> None:
            engine_state = self.engine.save(directory)
            write_state(directory, {**self._plain_state(), "engine": engine_state})
            with naming(directory / CONFIG_FILE):
                (directory / CONFIG_FILE).write_text(to_yaml(redact_secrets(self.cfg)))

        return self.checkpoints.save(self.step, write)

    def _plain_state(self) -> dict:
        """The trainer's own state beside the engine's: step, data order, RNG, guard (a checkpoint's state.pt)."""
        return {"step": self.step, "sampler": self.sampler.state_dict(), "rng": capture_rng_state(),
                "guard": self.guard.state_dict(), "algorithm": self.algorithm.state_dict()}  # fmt: skip

    def _load_plain_state(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.step = state["step"]
        self.guard.load_state_dict(state.get("guard"), state["step"])
        self.algorithm.load_state_dict(state.get("algorithm") or {})
        restore_rng_state(state["rng"])

    def load_checkpoint(self, path: Path) -> None:
        state = read_state(path)  # verified against its manifest first, on the driver only
        if state["step"] != step_of(path):
            raise UserError(f"checkpoint {path} holds step {state['step']}, not the step its name says")
        try:
            self.engine.load(path, state["engine"])
        except UserError as e:  # a checkpoint that does not fit this run: the settings it was saved with, first
            changed = changed_since(path / CONFIG_FILE, self.cfg)
            if not changed:
                raise
            raise UserError(
                f"checkpoint {path} was saved with another config: this one differs in {changed}; resume with its "
                f"settings, or start over with run.resume=never (loading it: {e})"
            ) from None
        with state_fits(path / STATE_FILE):
            self._load_plain_state(state)
        logger.info("resumed from %s (step %d)", path, self.step)
