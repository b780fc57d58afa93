"""model.device and the --device flags: a name torch does not know, or a CUDA device this machine lacks, is one line
naming it, status 2, before the model loads (not torch's traceback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffusion_rl.cli import main
from diffusion_rl.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs/quickstart_flow_grpo.yaml")


def error_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if "error:" in line]


@pytest.mark.parametrize("device", ["foo", "cuda:x", "gpu"])
def test_a_model_device_that_is_no_device_is_refused_when_the_config_loads(device, capsys):
    assert main(["config", "show", QUICKSTART, f"model.device={device}"]) == 2
    (line,) = error_lines(capsys)
    assert f"model.device '{device}' is not a device: auto, cpu, cuda or cuda:N" in line


@pytest.mark.parametrize("command", ["sample", "doctor", "eval", "export"])
def test_a_device_flag_that_is_no_device_is_refused_before_the_model_loads(
    command, tmp_path, capsys, model_must_not_load
):
    needed = {"sample": ["--model", "m", "--prompt", "a"], "doctor": ["--model", "m"], "export": ["--checkpoint", "c",
              "--out", "o"], "eval": ["--model", "m", "--prompts", "p.txt", "--out", "o"]}  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main([command, *needed[command], "--device", "foo"])
    assert exit_.value.code == 2
    (line,) = error_lines(capsys)
    assert "argument --device: 'foo' is not a device: auto, cpu, cuda or cuda:N" in line


def test_train_on_cuda_without_cuda_is_one_line_before_the_model_is_created(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    overrides = [f"model.path={tmp_path / 'tiny'}", f"run.dir={tmp_path / 'run'}", "model.device=cuda"]
    assert main(["train", QUICKSTART, *overrides]) == 2
    (line,) = error_lines(capsys)
    assert line == "diffusion-rl: error: model.device=cuda but no CUDA device is available; use model.device=cpu"
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "run").exists()


def test_a_cuda_index_past_the_machines_devices_names_those_it_has(monkeypatch):
    from diffusion_rl.models.loader import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(UserError, match=r"^model.device=cuda:2 but this machine has 2 CUDA devices \(cuda:0 to cuda:1"):
        resolve_device("cuda:2")
