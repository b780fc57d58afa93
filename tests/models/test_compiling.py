"""The CUDA defaults (models/compiling.py): `model.compile_blocks` and `train.fused_adamw` are `auto` — on for a
network on CUDA, off on the CPU (so CPU runs compute what they did) — torch's compile caches go to the user's cache
folder, and the compile time is logged once."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from diffusion_rl.config import load
from diffusion_rl.config.model import LoraConfig, ModelConfig
from diffusion_rl.config.train import TrainConfig
from diffusion_rl.engine.optimizer import OptimizerStepper
from diffusion_rl.engine.parallel import SingleDevice
from diffusion_rl.errors import UserError
from diffusion_rl.models import compiling
from diffusion_rl.models.loader import load_model

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")  # device objects: no GPU needed to make them


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(compiling.CACHE_VARIABLE, raising=False)  # restored (removed) after the test
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.mark.parametrize(("setting", "device", "on"), [("auto", CUDA, True), ("auto", CPU, False), (True, CPU, True),
                                                       (False, CUDA, False)])  # fmt: skip
def test_auto_is_on_for_cuda_only(setting, device, on):
    assert compiling.on_cuda(setting, device) is on


def test_compiled_blocks_by_default_on_cuda_unless_model_compile_compiles_sampling():
    assert ModelConfig().compile_blocks == "auto"
    assert compiling.compile_blocks_on(ModelConfig(), CUDA) is True
    assert compiling.compile_blocks_on(ModelConfig(), CPU) is False
    assert compiling.compile_blocks_on(ModelConfig(compile=True), CUDA) is False  # auto gives way, no error
    assert compiling.compile_blocks_on(ModelConfig(compile_blocks=True), CPU) is True


def test_a_cpu_model_loads_eager_by_default(tiny_model_dir):
    model = load_model(ModelConfig(path=str(tiny_model_dir), device="cpu", max_sequence_length=16,
                                   lora=LoraConfig(enabled=False)))  # fmt: skip
    assert model.policies.compile_blocks is False


def test_the_options_take_auto_true_false_and_refuse_anything_else(make_config):
    cfg = make_config("model.compile_blocks=true", "train.fused_adamw=false")
    assert (cfg.model.compile_blocks, cfg.train.fused_adamw) == (True, False)
    assert make_config("model.compile_blocks=auto").model.compile_blocks == "auto"
    with pytest.raises(UserError, match="model.compile_blocks"):
        make_config("model.compile_blocks=maybe")


def test_fused_adamw_only_where_asked_or_on_cuda():
    weight = torch.nn.Parameter(torch.ones(3))
    default = OptimizerStepper([weight], TrainConfig(), SingleDevice())
    assert default.optimizer.defaults["fused"] is None  # on the CPU: torch's default, as before
    stepper = OptimizerStepper([weight], TrainConfig(fused_adamw=True), SingleDevice())
    assert stepper.optimizer.defaults["fused"] is True


def test_the_compile_cache_goes_to_the_user_cache_folder_unless_torch_is_told(monkeypatch, tmp_path):
    assert compiling.use_compile_cache() == str(tmp_path / "xdg" / "diffusion-rl" / "torchinductor")
    monkeypatch.setenv(compiling.CACHE_VARIABLE, str(tmp_path / "mine"))
    assert compiling.use_compile_cache() == str(tmp_path / "mine")
    monkeypatch.delenv(compiling.CACHE_VARIABLE)
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compiling.use_compile_cache() == str(Path(tmp_path / "home" / ".cache" / "diffusion-rl" / "torchinductor"))


def test_the_compile_time_is_logged_once_after_the_first_update(monkeypatch, caplog):
    monkeypatch.setattr(compiling, "compile_seconds", lambda: 42.4)
    monkeypatch.setenv(compiling.CACHE_VARIABLE, "/cache/here")
    report = compiling.CompileReport(True)
    with caplog.at_level(logging.INFO, logger=compiling.__name__):
        report.after_update()
        report.after_update()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "42 s compiling" in lines[0] and "/cache/here" in lines[0]
    with caplog.at_level(logging.INFO, logger=compiling.__name__):
        compiling.CompileReport(False).after_update()  # eager: nothing to say
    assert len(caplog.records) == 1


def test_compile_seconds_reads_dynamos_tally(monkeypatch):
    from torch._dynamo import utils

    monkeypatch.setattr(utils, "calculate_time_spent", lambda: {"total_wall_time": 7.5, "inductor_compile": 5.0})
    assert compiling.compile_seconds() == 7.5
    monkeypatch.delattr(utils, "calculate_time_spent")
    assert compiling.compile_seconds() == 0.0


def test_a_ready_config_loads_with_the_cuda_defaults():
    cfg = load(str(Path(__file__).resolve().parents[2] / "configs" / "sd35_ocr_lora.yaml"))
    assert (cfg.model.compile_blocks, cfg.train.fused_adamw) == ("auto", "auto")
