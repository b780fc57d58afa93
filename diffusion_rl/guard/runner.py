"""The guard in a training run: statistics per step, alerts, files for the report, and stop / rollback.

Files under <run.dir>/guard/:
    alerts.jsonl   one row per alert: step, stat, value, baseline, rule, threshold, message, act
    reference_val.npz   the reference validation images (shrunk) and their step: val_drift's reference. Also kept
                   on disk because the validation of a checkpoint's step runs after that checkpoint is written
    summary.json   the statistics watched, their baselines, noise floors and allowed changes, the action, and
                   what the action did (stopped / rolled back to which checkpoint); `ended`: the step a guard
                   stop or rollback ended the run at and a digest of the settings it ran with (`repeat_key`)

A run the guard ended is not run again with the same settings: every random draw is seeded by (seed, step), so it
would take the same steps to the same end. A rerun in that folder whose settings (the config but for run.resume,
run.val_only, train.total_steps and log) are the ones that ended is refused in one line, before anything is loaded
or written, saying how to go on: resume at a lower train.lr, or start a new run with another run.seed (a resume
keeps the seed: the prompt order depends on it), or change the guard's settings.

Warnings: a statistic that leaves its range is warned about once, then reminded of every `remind_every` steps
while it stays out, and said to be back when it returns; every alert still goes to alerts.jsonl, the console line
counts them (`guard/alerts_total`), and `log_summary` sums them up at the end of the run.

A video is watched through its middle frame (`still_of`): the statistics are those of single images.

Which policy an alert blames: the rollout logged at step t was sampled by the policy after t − 1 updates, and the
validation at step t by the policy after t updates (the checkpoint `step_t`). A rollback loads the newest kept
checkpoint older than the first policy of the alert's streak.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffusion_rl.config.guard import ROLLOUT_STATS, GuardConfig
from diffusion_rl.errors import UserError
from diffusion_rl.guard.detector import NOISE_FLOOR, Alert, Detector
from diffusion_rl.guard.stats import RolloutStats, measure_rollout, shrink, val_drift
from diffusion_rl.utils.files import naming
from diffusion_rl.utils.json_input import json_lines

logger = logging.getLogger(__name__)

GUARD_DIR = "guard"
ALERTS_FILE = "alerts.jsonl"
SUMMARY_FILE = "summary.json"
REFERENCE_FILE = "reference_val.npz"


GO_ON = (
    "to go on, resume with a lower train.lr (the same settings take the same steps to the same end), start a new "
    "run (another run.dir) with another run.seed, or change the guard's settings"
)


def repeat_key(cfg) -> str | None:
    """A digest of what a run's steps depend on: the config but for run.resume, run.val_only, train.total_steps and
    log (None for a validation-only run, which trains nothing)."""
    from diffusion_rl.config.secrets import redact_secrets

    if cfg.run.val_only:
        return None
    settings = redact_secrets(cfg)
    settings.pop("log", None)
    for section, key in (("run", "resume"), ("run", "val_only"), ("train", "total_steps")):
        settings[section].pop(key, None)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def still_of(images: np.ndarray) -> np.ndarray:
    """uint8 [B, H, W, 3]: the images themselves, or each video's middle frame (videos [B, F, H, W, 3])."""
    return images[:, images.shape[1] // 2] if images.ndim == 5 else images


class RunGuard:
    """Holds the guard's state over a run. Every method is a no-op returning {} / False when disabled."""

    def __init__(self, cfg: GuardConfig, run_dir: str | Path, repeat: str | None = None):
        """`repeat`: the run's `repeat_key`; a run the guard ended with the same key is refused (None: no check)."""
        self.cfg = cfg
        self.dir = Path(run_dir) / GUARD_DIR
        self.repeat = repeat
        self.ended = self._earlier_end()  # {"step", "outcome", "repeat"} of the last run here the guard ended
        self.detector = Detector(cfg)
        self.reference_val: np.ndarray | None = None  # the first validation's images (shrunk), for val_drift
        self.reference_step: int | None = None
        self.pending: Alert | None = None  # an alert whose action is due after this step's metrics are logged
        self.bad_policy: int | None = None  # first policy (updates done) of the streak that acted
        self.outcome: str | None = None
        self._resumed_at: int | None = None  # the checkpoint step load_state_dict restored, if any
        self.alert_counts: dict[str, int] = {}  # stat -> alerts so far (a resumed run's kept ones included)
        self.first_alert: dict[str, int] = {}  # stat -> step of its first alert
        self.out_since: dict[str, int] = {}  # stat -> step it left its range, while it stays out
        self.warned_at: dict[str, int] = {}  # stat -> step of its last logged warning, while it stays out
        self._files_ready = False

    # -- measuring -------------------------------------------------------------------------------------------
    def on_rollout(self, step: int, images_BHW3: np.ndarray, group_index: Any, scored: Any = None) -> dict[str, float]:
        """Metrics `guard/<stat>` of the rollout logged at `step` (sampled by the policy after step − 1 updates).
        `scored` (the step's RewardResult): given the rows' statistics as `image_stats` (with each row's `drift`),
        for an algorithm that reads them: the statistics are computed once, here."""
        if not self.cfg.enabled:
            return {}
        self._prepare_files()
        names = tuple(s for s in self.cfg.watched if s in ROLLOUT_STATS)
        groups = np.asarray(group_index)
        measured = measure_rollout(still_of(images_BHW3), groups, names, self.cfg.max_side)
        if scored is not None:
            measured.drift = self.drift(measured)
            scored.image_stats = measured
        return self._record(step, measured.batch_values(), policy=step - 1, prompts=len(np.unique(groups)))

    def drift(self, measured: RolloutStats) -> np.ndarray:
        """float64 [B]: each row's mean over the per-image statistics s of |x_s − b_s| / (|b_s| + f_s), with b_s
        the statistic's baseline (before it is known: this batch's mean) and f_s its noise floor: how far the row's
        images are from the run's start, in the units the relative rule uses."""
        terms = []
        for stat, values in measured.values.items():
            baseline = self.detector.baseline(stat)
            baseline = float(values.mean()) if baseline is None else baseline
            terms.append(np.abs(values - baseline) / (abs(baseline) + NOISE_FLOOR[stat]))
        return np.mean(terms, axis=0) if terms else np.zeros(len(measured.group_index))

    def on_validation(self, step: int, images_BHW3: np.ndarray) -> dict[str, float]:
        """Metrics of the validation at `step`: val_drift from the first validation's images (its reference)."""
        if not self.cfg.enabled or "val_drift" not in self.cfg.watched:
            return {}
        self._prepare_files()
        images = shrink(still_of(images_BHW3), self.cfg.max_side)
        if self.reference_val is None or self.reference_val.shape != images.shape:
            if self.reference_val is not None:
                logger.warning("guard: the validation images changed shape; step %d is the new reference", step)
            self.reference_val, self.reference_step = images.copy(), step
            self.dir.mkdir(parents=True, exist_ok=True)
            np.savez(self.dir / REFERENCE_FILE, images=self.reference_val, step=step)
            self._write_summary()
        values = {"val_drift": val_drift(images, self.reference_val)}
        return self._record(step, values, policy=step, alerts_key="guard/val_alerts")

    def _record(
        self, step: int, values: dict[str, float], policy: int, alerts_key: str = "guard/alerts", prompts: int = 1
    ) -> dict:
        alerts = self.detector.update(step, values, prompts)
        for alert in alerts:
            self._append(alert)
        self._warn(step, values, alerts)
        acting = [a for a in alerts if a.act]
        if acting and self.cfg.action != "warn" and self.pending is None:
            self.pending = acting[0]
            streak = self.detector.streak[acting[0].stat]
            # the streak's first check blames the first policy of the steps its value was a mean over
            self.bad_policy = policy - (streak - 1) - (acting[0].span - 1)
        if any(len(self.detector.history.get(k, [])) == self.detector.baseline_span(k) for k in values):
            self._write_summary()  # a baseline was just established
        metrics = {f"guard/{k}": v for k, v in values.items()}
        metrics[alerts_key] = float(len(alerts))
        metrics["guard/alerts_total"] = float(sum(self.alert_counts.values()))
        return metrics

    # -- warning -----------------------------------------------------------------------------------------------
    def _warn(self, step: int, values: dict[str, float], alerts: list[Alert]) -> None:
        """Log when a statistic leaves its range, a reminder every remind_every steps while it stays out, and when it
        is back; count every alert."""
        by_stat = {a.stat: a for a in alerts}
        for stat in values:
            alert = by_stat.get(stat)
            if alert is None:
                if stat in self.out_since:
                    logger.info("guard: %s is back in range at step %d (out since step %d)", stat, step,
                                self.out_since.pop(stat))  # fmt: skip
                    self.warned_at.pop(stat)
                continue
            self.alert_counts[stat] = self.alert_counts.get(stat, 0) + 1
            self.first_alert.setdefault(stat, step)
            if stat not in self.out_since:
                self.out_since[stat] = self.warned_at[stat] = step
                logger.warning("%s; warned once while it stays out (a reminder every %d steps; every alert is in %s)",
                               alert.message, self.cfg.remind_every, self.dir / ALERTS_FILE)  # fmt: skip
            elif step - self.warned_at[stat] >= self.cfg.remind_every:
                self.warned_at[stat] = step
                logger.warning("guard: %s still out of range at step %d (since step %d, %d alerts in all): %s", stat,
                               step, self.out_since[stat], self.alert_counts[stat], alert.message)  # fmt: skip

    def log_summary(self) -> None:
        """At the end of a run: the alerts per statistic, once (nothing when there were none)."""
        if not self.alert_counts:
            return
        parts = [f"{stat} {n} (first at step {self.first_alert[stat]})" for stat, n in self.alert_counts.items()]
        logger.warning("guard: %d alerts in this run: %s; see %s and docs/guard.md",
                       sum(self.alert_counts.values()), ", ".join(parts), self.dir / ALERTS_FILE)  # fmt: skip

    # -- acting ----------------------------------------------------------------------------------------------
    def should_stop(self, step: int, checkpoints: Any, load_checkpoint: Callable[[Path], None]) -> bool:
        """After step `step` is logged: True when the guard ends the run (action stop, or rollback after loading
        the last in-range checkpoint into the trainer)."""
        if self.pending is None:
            return False
        alert, self.pending = self.pending, None
        if self.cfg.action == "stop":
            self.outcome = f"Stopped at step {step} ({alert.stat})"
            logger.error("%s; stopping the run at step %d", alert.message, step)
        else:
            self.outcome = self._rollback(step, alert, checkpoints, load_checkpoint)
        self.ended = {"step": step, "outcome": self.outcome, "repeat": self.repeat}
        self._write_summary()
        return True

    def ending(self) -> str | None:
        """What the guard did to this run and how to go on (the CLI's last line), or None when it let it run."""
        if self.outcome is None:
            return None
        return f"guard: {self.outcome} (guard/summary.json); {GO_ON}"

    def _earlier_end(self) -> dict | None:
        """The end an earlier run in this folder was given by the guard; a UserError when this run would repeat it."""
        file = self.dir / SUMMARY_FILE
        try:
            ended = json.loads(file.read_text(encoding="utf-8")).get("ended") if file.is_file() else None
        except (ValueError, AttributeError):  # not ours, or cut short: nothing to compare with
            return None
        if ended and self.repeat is not None and ended.get("repeat") == self.repeat:
            raise UserError(
                f"the guard ended this run at step {ended['step']} ({ended['outcome']}), and these settings would "
                f"take the same steps to the same end; {GO_ON} (or delete {file} to repeat it anyway)"
            )
        return ended

    def _rollback(self, step: int, alert: Alert, checkpoints: Any, load_checkpoint: Callable[[Path], None]) -> str:
        good = [(s, path) for s, path in checkpoints.list() if s < self.bad_policy]
        if not good:
            logger.error(
                "%s; no kept checkpoint predates the policy after %d updates (the first out of range), so "
                "there is nothing to roll back to: stopping at step %d",
                alert.message,
                self.bad_policy,
                step,
            )
            return f"Stopped at step {step} ({alert.stat}); no in-range checkpoint to roll back to"
        good_step, path = good[-1]
        load_checkpoint(path)
        checkpoints.point_latest_at(path)
        logger.error(
            "%s; rolled back to %s (step %d, the newest checkpoint before the policy after %d updates) and "
            "stopped; checkpoints/latest points at it",
            alert.message,
            path,
            good_step,
            self.bad_policy,
        )
        return f"Rolled back at step {step} ({alert.stat}) to checkpoint step {good_step}"

    # -- files and state ---------------------------------------------------------------------------------------
    def _prepare_files(self) -> None:
        """Once per process: a fresh run drops an earlier run's files; a resumed one the alerts after its step."""
        if self._files_ready:
            return
        self._files_ready = True
        if self._resumed_at is None:
            for name in (ALERTS_FILE, SUMMARY_FILE, REFERENCE_FILE):
                (self.dir / name).unlink(missing_ok=True)
            return
        alerts = self.dir / ALERTS_FILE
        if alerts.is_file():  # a damaged line is kept as it is, and not counted
            lines = json_lines(alerts, ("step", "stat"))
            kept = [(x, row) for x, row in lines if row is None or row["step"] <= self._resumed_at]
            with naming(alerts):
                alerts.write_text("".join(x + "\n" for x, _ in kept), encoding="utf-8")
            for row in (row for _, row in kept if row is not None):  # the count goes on from the resumed step
                self.alert_counts[row["stat"]] = self.alert_counts.get(row["stat"], 0) + 1
                self.first_alert.setdefault(row["stat"], row["step"])

    def _append(self, alert: Alert) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with naming(self.dir / ALERTS_FILE), open(self.dir / ALERTS_FILE, "a", encoding="utf-8") as file:
            file.write(json.dumps(alert.to_dict(), allow_nan=False) + "\n")

    def summary(self) -> dict[str, Any]:
        stats = {}
        for stat in self.cfg.watched:
            stats[stat] = {
                "baseline": self.detector.baseline(stat),
                "noise_floor": NOISE_FLOOR[stat],
                "allowed_change": self.detector.allowed_change(stat),
                "max": self.cfg.max_val_drift if stat == "val_drift" else None,
            }
        return {
            "action": self.cfg.action,
            "baseline_steps": self.cfg.baseline_steps,
            "min_prompts": self.cfg.min_prompts,
            "max_relative_change": self.cfg.max_relative_change,
            "max_zscore": self.cfg.max_zscore,
            "window": self.cfg.window,
            "reference_validation_step": self.reference_step,
            "stats": stats,
            "outcome": self.outcome,
            "ended": self.ended,
        }

    def _write_summary(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with naming(self.dir / SUMMARY_FILE):
            (self.dir / SUMMARY_FILE).write_text(json.dumps(self.summary(), indent=2) + "\n", encoding="utf-8")

    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            # a tensor, not an array: a checkpoint's state.pt is read with torch's weights_only loader
            "reference_val": None if self.reference_val is None else torch.from_numpy(self.reference_val),
            "reference_step": self.reference_step,
        }

    def load_state_dict(self, state: dict[str, Any] | None, step: int) -> None:
        """Restore the state saved with the checkpoint of `step` (None: a checkpoint from before the guard)."""
        self._resumed_at = step
        if state:
            self.detector.load_state_dict(state["detector"])
            reference = state["reference_val"]
            self.reference_val = None if reference is None else reference.numpy()
            self.reference_step = state["reference_step"]
        file = self.dir / REFERENCE_FILE
        if self.reference_val is None and file.is_file():  # taken by the validation right after the checkpoint
            with np.load(file) as saved:
                if int(saved["step"]) <= step:
                    self.reference_val, self.reference_step = saved["images"], int(saved["step"])
