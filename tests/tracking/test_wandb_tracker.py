import sys

import numpy as np
import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.tracking import WandbTracker, make_trackers


def test_missing_wandb_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(UserError, match=r'pip install "diffusion-rl\[wandb\]"'):
        WandbTracker(project="p", name="r", run_dir=tmp_path, mode="offline")


def test_unknown_mode_lists_the_valid_ones(tmp_path):
    with pytest.raises(UserError, match="online, offline, disabled"):
        WandbTracker(project="p", run_dir=tmp_path, mode="offlin")


def test_offline_run_writes_its_files_inside_the_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = WandbTracker(
        project="diffusion-rl-test", name="offline", run_dir=tmp_path, config={"lr": 1e-4}, mode="offline", tags=["t"]
    )
    tracker.log_metrics({"reward/mean": 0.5, "loss": float("nan")}, step=1)
    tracker.log_images("samples", np.full((16, 16, 3), 200, dtype=np.uint8), step=1, caption="grey")
    tracker.close()
    tracker.close()  # closing twice is harmless

    (run_folder,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run_folder.glob("*.wandb")), "the offline run's data file is missing"
    assert list(run_folder.rglob("*.png")), "the logged image was not written"


def test_make_trackers_rejects_unknown_wandb_option_with_a_suggestion(tmp_path):
    with pytest.raises(UserError, match="did you mean 'project'"):
        make_trackers(tmp_path, wandb={"projct": "p"})
    with pytest.raises(UserError, match="project"):
        make_trackers(tmp_path, wandb={"mode": "offline"})


def test_the_command_line_handed_to_wandb_hides_secret_overrides():
    from diffusion_rl.config.secrets import REDACTED
    from diffusion_rl.tracking.wandb import redact_overrides

    args = ["configs/q.yaml", "rewards.0.kwargs.api_key=sk-1", "rewards.0.kwargs={api_key: sk-2, max_tokens: 7}",
            "log.wandb.tags=[a, b]", "train.lr=1e-3", "rewards.0.kwargs.api_key_env=KEY", "--verbose"]  # fmt: skip
    assert redact_overrides(args) == [
        "configs/q.yaml", f"rewards.0.kwargs.api_key={REDACTED}",
        f"rewards.0.kwargs={{api_key: '{REDACTED}', max_tokens: 7}}",
        "log.wandb.tags=[a, b]", "train.lr=1e-3", "rewards.0.kwargs.api_key_env=KEY", "--verbose",
    ]  # fmt: skip
