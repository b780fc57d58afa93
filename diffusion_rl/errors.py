"""Errors the CLI prints as one line, without a traceback (`-v` adds it): the user's to fix, or a run's stop."""

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """Bad input from the user (config, file, CLI argument). The message says what and where, and what to do."""


class RunStopped(RuntimeError):
    """A run stopped itself on a condition it checks (the model diverged, every sample failed its rewards); the
    message says why and which checkpoint is the last good one."""

    exit_code = 1  # the CLI's exit status


class RunInterrupted(RunStopped):
    """The user stopped the run (Ctrl-C, SIGINT); the message says how far it got and which checkpoint holds it."""

    exit_code = 130  # 128 + SIGINT: what a shell reports for a process Ctrl-C ended


class TrainingDiverged(RunStopped):
    """Too many consecutive updates had a non-finite loss or gradient norm."""


class WeightsUnchanged(RunStopped):
    """An optimizer step with a gradient and a learning rate, or a rollout actor's load of pushed weights, left every
    weight exactly as it was (engine/fingerprint.py): the update or the sync does not reach the model."""


class GuardStopped(RunStopped):
    """The reward-hacking guard ended the run (guard.action stop or rollback); the message says how to go on."""

    exit_code = 3


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest option, or '' when nothing is close."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
