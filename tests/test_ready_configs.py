"""The ready configs for real runs validate (`diffusion-rl config show`) and say what hardware they expect."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.cli import main

ROOT = Path(__file__).resolve().parents[1]
READY = ["sd35_ocr_lora.yaml", "sd35_pickscore_fast.yaml", "flux_pickscore_lora.yaml", "qwen_image_ocr_lora.yaml"]


@pytest.mark.parametrize("name", READY)
def test_ready_config_validates_and_names_its_gpus_source_and_deviations(name, capsys):
    path = ROOT / "configs" / name
    assert main(["config", "show", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "model:" in shown and "lora:" in shown
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    assert "GPUs with 80 GB" in header
    assert "recipe" in header and "Deviations" in header


def test_ready_configs_keep_their_recipes_numbers():
    from diffusion_rl.config import load

    ocr = load(str(ROOT / "configs/sd35_ocr_lora.yaml"))
    assert (ocr.sampling.height, ocr.sampling.num_steps, ocr.sampling.guidance, ocr.sampling.noise_level) == (
        512, 10, 4.5, 0.7
    )  # fmt: skip
    assert (ocr.data.prompts_per_step, ocr.data.group_size, ocr.train.num_minibatches) == (48, 24, 2)
    assert (ocr.algorithm.settings.kl_beta, ocr.algorithm.settings.clip_range, ocr.train.lr) == (0.04, 1e-4, 3e-4)
    assert (ocr.model.lora.rank, ocr.model.lora.alpha, ocr.train.ema.enabled, ocr.val.num_steps) == (32, 64, True, 40)
    fast = load(str(ROOT / "configs/sd35_pickscore_fast.yaml"))
    assert (fast.sampling.sde_type, fast.sampling.noise_level, fast.sampling.guidance) == ("cps", 0.8, 1.0)
    assert (fast.sampling.window.kind, fast.sampling.window.size, fast.sampling.window.lo, fast.sampling.window.hi) == (
        "random", 3, 0, 5
    )  # fmt: skip
    fast_loss = fast.algorithm.settings
    assert (fast.data.group_size, fast_loss.clip_range, fast_loss.kl_beta) == (18, 1e-5, 0.0)
    flux = load(str(ROOT / "configs/flux_pickscore_lora.yaml"))
    assert (flux.sampling.num_steps, flux.sampling.guidance, flux.sampling.noise_level, flux.model.dtype) == (
        6, 3.5, 0.9, "bf16"
    )  # fmt: skip
    qwen = load(str(ROOT / "configs/qwen_image_ocr_lora.yaml"))
    assert (qwen.sampling.noise_level, qwen.sampling.guidance, qwen.sampling.window.size, qwen.sampling.window.hi) == (
        1.2, 4.0, 2, 5
    )  # fmt: skip
    assert (qwen.data.prompts_per_step, qwen.data.group_size, qwen.train.num_minibatches) == (32, 16, 2)
    assert (qwen.algorithm.settings.clip_range, qwen.model.lora.rank, qwen.model.lora.alpha) == (1e-5, 64, 128)


def test_readme_flow_grpo_fast_example_is_the_presets_window():
    import re

    from diffusion_rl.config import load

    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    sentence = readme[readme.index("Flow-GRPO-Fast is a window:") :].split(";")[0]
    shown = dict(re.findall(r"sampling\.window\.(\w+)=(\w+)", sentence))
    window = load(str(ROOT / "configs/quickstart_fast.yaml")).sampling.window
    assert shown and "quickstart_fast.yaml" in sentence
    assert shown == {key: str(getattr(window, key)) for key in shown}
    lo, hi = re.search(r"random step in \[(\d+), (\d+)\]", sentence).groups()
    assert (int(lo), int(hi)) == (window.lo, window.hi - window.size)  # the start is drawn from [lo, hi − size]
