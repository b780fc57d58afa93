"""Shared fixtures: the tiny models (small presets; the video and editing families too) saved once per session, and
fast configs that train them."""

from __future__ import annotations

import gc
import os
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# what the engine sets before it first imports Ray for a local cluster (engine/ray.py): here before any test module
# imports Ray, so every test's cluster listens on loopback only
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# README's test command runs the suite in two pytest-xdist workers, one per core: each worker's torch gets one thread,
# and its OpenMP threads sleep while they wait instead of spinning (two spinning torch processes on 2 cores slow each
# other 10-30x). Set before torch is imported, as OpenMP reads it when it loads. A plain `pytest` keeps 2 threads.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from diffusion_rl.config import load  # noqa: E402
from diffusion_rl.models.tiny import save_tiny  # noqa: E402

torch.set_num_threads(1 if XDIST_WORKER else 2)
# The suite's process holds ~600k long-lived objects (torch, transformers, diffusers, Ray): one full collection scans
# them all (~0.15 s), and the default thresholds (700, 10, 10) ran one every second or two of tests, 4-8 % of
# trainer test files' time (gc.callbacks, 32 trainer tests: 11 full collections, 1.8 s of 19 s). Ten times fewer:
# the young generations still collect every short-lived cycle; what survives waits at most ~10 s of tests (+16 MB).
gc.set_threshold(700, 10, 100)

ROOT = Path(__file__).resolve().parents[1]
# The fixtures that start a local Ray cluster (every one: tests/test_xdist_groups.py finds them): their tests run in
# one xdist worker, one after another (`--dist loadgroup`), so two clusters never share the 2 cores and the engine
# tests' shared cluster stays shared.
RAY_CLUSTER_FIXTURES = ("ray_session", "ray_for_module", "two_nodes", "ray_with_broken_weight_loads")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(name in item.fixturenames for name in RAY_CLUSTER_FIXTURES):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny SD3-format model (0.3M-parameter transformer) written with save_pretrained."""
    return save_tiny(tmp_path_factory.mktemp("tiny_model"), "sd3", "small", seed=0)


@pytest.fixture(scope="session")
def wan_model_dir(tmp_path_factory):
    """A tiny Wan 2.1-format text-to-video model (UMT5, AutoencoderKLWan 4× in time and space)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_wan"), "wan", "small", seed=0)


@pytest.fixture(scope="session")
def wan_ti2v_model_dir(tmp_path_factory):
    """A tiny Wan 2.2 TI2V-format model (residual VAE with a 2×2 pixel fold, expanded timesteps)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_wan_ti2v"), "wan", "ti2v", seed=0)


@pytest.fixture(scope="session")
def wan_i2v_model_dir(tmp_path_factory):
    """A tiny Wan 2.1 I2V-format image-to-video model (first-frame channels, a CLIP vision encoder)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_wan_i2v"), "wan_i2v", "small", seed=0)


@pytest.fixture(scope="session")
def wan_flf2v_model_dir(tmp_path_factory):
    """A tiny Wan 2.1 FLF2V-format model (the I2V layout reading a first and a last frame's CLIP tokens)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_wan_flf2v"), "wan_i2v", "flf2v", seed=0)


@pytest.fixture(scope="session")
def qwen_image_edit_model_dir(tmp_path_factory):
    """A tiny Qwen-Image-Edit-2509-format model (QwenImageEditPlusPipeline, a processor/ folder)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen_image_edit"), "qwen_image_edit", "small", seed=0)


@pytest.fixture(scope="session")
def qwen_image_edit_2511_model_dir(tmp_path_factory):
    """A tiny Qwen-Image-Edit-2511-format model (condition tokens at timestep 0: zero_cond_t)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen_image_edit_2511"), "qwen_image_edit", "2511", seed=0)


@pytest.fixture(scope="session")
def flux_kontext_model_dir(tmp_path_factory):
    """A tiny FLUX.1-Kontext-dev-format model (FluxKontextPipeline, guidance embedding)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_flux_kontext"), "flux_kontext", "small", seed=0)


@pytest.fixture(scope="session")
def flux2_model_dir(tmp_path_factory):
    """A tiny FLUX.2-klein-format model (Flux2KleinPipeline, step-distilled: CFG-free)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_flux2"), "flux2", "small", seed=0)


def fast_overrides(model_dir, run_dir) -> list[str]:
    """Overrides of configs/quickstart_flow_grpo.yaml that train the tiny model at `model_dir` fast, into `run_dir`."""
    return [
        f"run.dir={run_dir}",
        f"model.path={model_dir}",
        f"data.train={ROOT / 'configs/prompts/quickstart.txt'}",
        f"val.prompts={ROOT / 'configs/prompts/val.txt'}",
        "model.device=cpu",
        "model.max_sequence_length=16",
        "model.lora.enabled=false",
        "sampling.num_steps=4",
        "sampling.height=32",
        "sampling.width=32",
        "data.prompts_per_step=2",
        "data.group_size=2",
        "train.total_steps=2",
        "train.micro_batch_size=4",
        "train.save_every=0",
        "val.every=0",
        "val.before_train=false",
        "val.num_steps=4",
        "val.n=1",
        "log.tensorboard=false",
        "log.progress_bar=false",
        "algorithm.advantage.eps=1e-8",
    ]


@pytest.fixture
def model_must_not_load(monkeypatch):
    """Fails the test when anything loads a model. The loader's first step is patched, not `load_model` itself: a
    module imported while a patch of `load_model` is on would keep the stand-in for good (`from … import
    load_model`), and one imported before would call the real one past it."""
    import diffusion_rl.models.loader as loader

    monkeypatch.setattr(loader, "model_dir", lambda *a, **k: pytest.fail("the model was loaded"))


@pytest.fixture
def make_config(tiny_model_dir, tmp_path):
    """make_config(*overrides, config=quickstart) → a Config that trains the tiny model fast in tmp_path."""

    def make(*overrides: str, config: str | Path = ROOT / "configs/quickstart_flow_grpo.yaml"):
        return load(config, fast_overrides(tiny_model_dir, tmp_path / "run") + list(overrides))

    return make


@pytest.fixture
def train_argv(tiny_model_dir, tmp_path):
    """train_argv(*overrides) → `diffusion-rl train` arguments that train the tiny model fast in tmp_path/run."""

    def argv(*overrides: str) -> list[str]:
        quickstart = str(ROOT / "configs/quickstart_flow_grpo.yaml")
        return ["train", quickstart, *fast_overrides(tiny_model_dir, tmp_path / "run"), *overrides]

    return argv


@pytest.fixture(scope="session")
def z_image_model_dir(tmp_path_factory):
    """A tiny Z-Image(-Turbo)-format model (Qwen3 text encoder, ZImageTransformer2DModel, FLUX.1's VAE layout)."""
    return save_tiny(tmp_path_factory.mktemp("tiny_z_image"), "z_image", "small", seed=0)
