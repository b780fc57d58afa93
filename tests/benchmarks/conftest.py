"""Loading a benchmark script (benchmarks/ is no package) as a module; a tiny pretrained ShapesWorld model."""

import importlib.util
import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_logging_levels():
    """A benchmark's setup_logging quiets the package's loggers for its own run; later tests in this process must
    not inherit that (a test reading an INFO line would see nothing)."""
    names = ("", "diffusion_rl", "diffusers", "transformers")
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark("learning") → benchmarks/learning.py as a module."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"{name}_benchmark", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="module")
def ranking(load_benchmark):
    """benchmarks/ranking.py as a module."""
    return load_benchmark("ranking")


@pytest.fixture(scope="session")
def shapes_model(tmp_path_factory):
    """A ShapesWorld model pretrained for a few steps at the small preset (32 px): the learning benchmarks' task."""
    from diffusion_rl.pretrain.config import load_pretrain_config
    from diffusion_rl.pretrain.trainer import PretrainTrainer

    tmp = tmp_path_factory.mktemp("shapes")
    cfg = load_pretrain_config(str(ROOT / "configs/shapes_pretrain.yaml"), [
        f"run.dir={tmp / 'run'}", f"run.out={tmp / 'model'}", "model.preset=small", "model.vae_channels=[8,16,16]",
        "vae.steps=3", "vae.batch_size=4", "vae.stats_images=16", "flow.steps=2", "flow.batch_size=4",
        "flow.latent_pool=16", "eval.every=0", "eval.prompts=4", "eval.n=1", "eval.num_steps=2",
        "log.tensorboard=false", "log.progress_bar=false", "log.console_every=0",
    ])  # fmt: skip
    PretrainTrainer(cfg).train()
    return tmp / "model"
