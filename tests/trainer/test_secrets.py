"""An inline secret in a reward's kwargs (e.g. the vlm judge's api_key) is in no config the run writes (config.yaml
of the run and of each checkpoint, the trackers' config, eval's metrics.json), and what reads a written config back
(resume, eval --checkpoint) still works."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import diffusion_rl.trainer.trainer as trainer_module
from diffusion_rl.cli import main
from diffusion_rl.config import load
from diffusion_rl.config.secrets import REDACTED
from diffusion_rl.errors import UserError
from diffusion_rl.trainer import make_trainer as trainer_for

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sk-never-write-me"
# a judge that fails (raises) unless it was given the real key
JUDGE = f"""
import logging

import numpy as np


def reward(images, prompts, metadata, api_key=None, **others):
    if api_key != {SECRET!r}:
        raise ValueError("bad api key")
    if "url" in others:  # a URL is said in a log line (as the remote reward says its server's)
        logging.getLogger("diffusion_rl.judge").info("judging at %s", others["url"])
    return images.reshape(len(images), -1).mean(axis=1).astype(np.float32) / 255
"""
# every kind of secret: a secret-named key (api_key, private_key) and a URL's credentials
SECRETS = {"api_key": SECRET, "private_key": SECRET, "url": f"http://user:{SECRET}@127.0.0.1:9"}


def test_an_inline_api_key_is_redacted_in_everything_the_run_writes(make_trainer, tiny_model_dir, tmp_path,
                                                                    monkeypatch, caplog):  # fmt: skip
    judge = tmp_path / "judge.py"
    judge.write_text(JUDGE)
    kwargs = (
        f"{{api_key: {SECRET}, headers: {{Authorization: Bearer {SECRET}}}, api_key_env: JUDGE_KEY, max_tokens: 7}}"
    )
    overrides = [f"rewards.0.name={judge}:reward", "rewards.0.label=judge", f"rewards.0.kwargs={kwargs}"]
    tracker_configs = []
    make_trackers = trainer_module.make_trackers
    monkeypatch.setattr(
        trainer_module, "make_trackers", lambda *a, **k: tracker_configs.append(k["config"]) or make_trackers(*a, **k)
    )

    rows = make_trainer(*overrides, "train.total_steps=1").train()
    assert rows[-1]["reward/failed_fraction"] == 0  # the reward itself got the real key
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000001"
    for written in (run / "config.yaml", checkpoint / "config.yaml"):
        text = written.read_text()
        assert SECRET not in text and text.count(REDACTED) == 2  # api_key and headers.Authorization
        assert "api_key_env: JUDGE_KEY" in text and "max_tokens: 7" in text  # not secrets: kept
    (config,) = tracker_configs
    assert SECRET not in json.dumps(config) and config["rewards"][0]["kwargs"]["api_key"] == REDACTED

    # resume reads the checkpoint's state, not its config: the next step scores with the key of the given config
    rows = make_trainer(*overrides, "train.total_steps=2").train()
    assert rows[-1]["step"] == 2 and rows[-1]["reward/failed_fraction"] == 0

    # the run's own config.yaml given back to train: the redacted key is refused, not sent
    with pytest.raises(UserError, match=r"rewards\.0\.kwargs: api_key, headers\.Authorization are '\*\*\*redacted"):
        trainer_for(load(str(run / "config.yaml")))

    # eval takes the checkpoint's rewards without the redacted kwargs, says so, and takes the key again
    out = tmp_path / "eval"
    argv = ["eval", "--model", str(tiny_model_dir), "--checkpoint", str(checkpoint), "--out", str(out), "--prompts",
            str(ROOT / "configs/prompts/val.txt"), "--n", "1", "--steps", "2", "--height", "32", "--width", "32",
            "--reward-kwargs", json.dumps({"judge": {"api_key": SECRET}}), "--trust-checkpoint-rewards"]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert main(argv) == 0
    assert "rewards.0.kwargs api_key, headers.Authorization redacted" in caplog.text
    metrics = (out / "metrics.json").read_text()
    assert SECRET not in metrics
    (column,) = json.loads(metrics)["columns"]
    assert column["rewards"]["judge"]["failed"] == 0


def _files_holding(folder: Path, secret: str) -> list[str]:
    return [str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.parametrize("given_as", ["override", "yaml"])
def test_a_secret_is_in_no_file_the_run_writes_nor_in_its_wandb_run_or_console(
    given_as, train_argv, tmp_path, monkeypatch, capsys, caplog
):
    import sys

    import yaml

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    judge = tmp_path / "judge.py"
    judge.write_text(JUDGE)
    reward = {"name": f"{judge}:reward", "kwargs": SECRETS}
    argv = train_argv("train.total_steps=1", "train.save_every=1", "log.wandb.enabled=true", "log.tensorboard=true")
    if given_as == "override":
        argv += [f"rewards.0.name={reward['name']}", *(f"rewards.0.kwargs.{k}={v}" for k, v in SECRETS.items())]
    else:
        config = yaml.safe_load((ROOT / "configs/quickstart_flow_grpo.yaml").read_text())
        config["rewards"] = [reward]
        argv[1] = str(tmp_path / "with_key.yaml")
        Path(argv[1]).write_text(yaml.safe_dump(config))
    monkeypatch.setattr(sys, "argv", ["diffusion-rl", *argv])  # the command line W&B records
    with caplog.at_level(logging.DEBUG, logger="diffusion_rl"):
        assert main(argv) == 0
    run = tmp_path / "run"
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["reward/failed_fraction"] == 0  # key used
    assert list((run / "wandb").glob("offline-run-*/*.wandb")) and list((run / "tensorboard").iterdir())
    assert list((run / "wandb").glob("offline-run-*/logs/debug.log"))
    assert _files_holding(run, SECRET) == []  # config.yaml (the run's, the checkpoint's), .wandb, debug.log, …
    config = (run / "config.yaml").read_text()
    assert f"private_key: '{REDACTED}'" in config and f"url: http://{REDACTED}@127.0.0.1:9" in config
    printed = capsys.readouterr()
    assert SECRET not in printed.out + printed.err + caplog.text
    assert f"judging at http://{REDACTED}@127.0.0.1:9" in caplog.text
    if given_as == "override":  # W&B recorded the command line, with the key's value hidden
        (data,) = (run / "wandb").glob("offline-run-*/*.wandb")
        for arg in (f"api_key={REDACTED}", f"private_key={REDACTED}", f"url=http://{REDACTED}@127.0.0.1:9"):
            assert f"rewards.0.kwargs.{arg}".encode() in data.read_bytes()
