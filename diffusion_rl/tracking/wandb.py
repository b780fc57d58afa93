"""Weights & Biases. Optional: `pip install "diffusion-rl[wandb]"`. Offline mode needs no network or account."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from diffusion_rl.config.secrets import redact_secrets
from diffusion_rl.errors import UserError
from diffusion_rl.tracking.base import check_image, to_scalar
from diffusion_rl.tracking.video import check_video, save_video

MODES = ("online", "offline", "disabled")


def import_wandb() -> Any:
    """The wandb module, or a UserError that says how to install it."""
    try:
        import wandb
    except ImportError as error:
        raise UserError(
            'W&B logging needs the wandb package: pip install "diffusion-rl[wandb]" (or turn W&B logging off)'
        ) from error
    return wandb


class WandbTracker:
    """One W&B run whose local files (`<run_dir>/wandb/...`) live inside the run directory.

    Offline runs can be uploaded later with `wandb sync <run_dir>/wandb/offline-run-*`.
    """

    def __init__(
        self,
        project: str,
        name: str | None = None,
        run_dir: str | os.PathLike[str] = ".",
        config: Mapping[str, Any] | None = None,
        mode: str = "online",
        tags: Iterable[str] = (),
    ) -> None:
        if mode not in MODES:
            raise UserError(f"wandb mode {mode!r} is not one of {', '.join(MODES)}")
        self._wandb = import_wandb()
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with _redacted_argv():  # W&B records the command line, where a secret may be a dotted override
            self._run = self._wandb.init(
                project=project,
                name=name,
                dir=str(run_dir),
                config=redact_secrets(dict(config)) if config is not None else None,  # secrets never leave
                mode=mode,
                tags=([tags] if isinstance(tags, str) else list(tags)) or None,
                # our runs are independent objects; never hand back or silently finish another tracker's run
                reinit="create_new",
            )

    @property
    def run(self) -> Any:
        """The underlying `wandb.Run`, for callers that need something this class does not wrap."""
        return self._run

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        # wandb stores NaN/inf itself, so values pass through unchanged
        self._run.log({name: to_scalar(name, value) for name, value in metrics.items()}, step=step)

    def log_images(self, tag: str, image: np.ndarray, step: int, caption: str = "") -> None:
        picture = self._wandb.Image(check_image(tag, image), caption=caption or None)
        self._run.log({tag: picture}, step=step)

    def log_video(self, tag: str, video: np.ndarray, step: int, caption: str = "", fps: float = 8) -> None:
        """As an animated GIF file under the run's wandb folder (wandb.Video of an array would need moviepy)."""
        path = Path(self._run.dir) / "media_videos" / f"{tag.replace('/', '_')}_{step:06d}.gif"
        save_video(check_video(tag, video), path, fps)
        self._run.log({tag: self._wandb.Video(str(path), caption=caption or None, format="gif")}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def redact_overrides(args: Sequence[str]) -> list[str]:
    """Command-line arguments with the value of every secret-named dotted override hidden (`….api_key=X`, and
    secret-named keys inside a YAML value such as `rewards.0.kwargs={api_key: X}`) and every URL's credentials, as
    config.yaml hides them."""
    import yaml

    from diffusion_rl.config.loading import load_yaml_text
    from diffusion_rl.config.secrets import REDACTED, is_secret_key, redact_text

    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and is_secret_key(key.rsplit(".", 1)[-1]):
            arg = f"{key}={REDACTED}"
        elif sep and value.lstrip().startswith(("{", "[")):
            try:
                parsed = load_yaml_text(value)  # bounded: a YAML bomb is no secret, but must not hang here
            except yaml.YAMLError:
                parsed = None
            if parsed is not None and redact_secrets(parsed) != parsed:
                arg = f"{key}={yaml.safe_dump(redact_secrets(parsed), default_flow_style=True, width=1 << 30).strip()}"
        out.append(redact_text(arg))
    return out


@contextlib.contextmanager
def _redacted_argv() -> Iterator[None]:
    saved = sys.argv
    sys.argv = [*saved[:1], *redact_overrides(saved[1:])]
    try:
        yield
    finally:
        sys.argv = saved
