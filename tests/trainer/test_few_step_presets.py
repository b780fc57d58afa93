"""The few-step presets (docs/models.md, "RL on few-step distilled models"): the doc's table is each ready config's
sampling, its σ grids and `sde` excess noise are those computed here by hand, and each tiny model trains one step
with its preset's sampling, CFG-free, its window where the table puts it, log-probabilities replayed exactly."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from diffusion_rl.config import load
from diffusion_rl.models.tiny import save_tiny
from diffusion_rl.sampling.sde import cps_step, sde_step

ROOT = Path(__file__).resolve().parents[2]
PRESETS = {  # config → the tiny model's fixture
    "flux1_schnell_pickscore_lora.yaml": "flux_schnell_dir",
    "flux2_klein_pickscore_lora.yaml": "flux2_model_dir",
    "z_image_turbo_pickscore_lora.yaml": "z_image_model_dir",
}


def klein_grid_at_512() -> list[float]:
    """Flux2KleinPipeline's 4 steps at 32×32 tokens: its empirical μ, the exponential shift of t = 1, ¾, ½, ¼."""
    m_10, m_200 = 8.73809524e-05 * 1024 + 1.89833333, 0.00016927 * 1024 + 0.45666666
    mu = (m_200 - m_10) / 190.0 * (4 - 200) + m_200
    return [math.exp(mu) / (math.exp(mu) + 1 / t - 1) for t in (1.0, 0.75, 0.5, 0.25)] + [0.0]


GRIDS = {  # each pipeline's σ grid, by hand
    "flux1_schnell_pickscore_lora.yaml": [1 - k / 4 for k in range(5)],  # no shift
    "flux2_klein_pickscore_lora.yaml": klein_grid_at_512(),
    "z_image_turbo_pickscore_lora.yaml": [3 * u / (1 + 2 * u) for u in (1 - k / 8 for k in range(8))] + [0.0],
}


def doc_table() -> dict[str, list[str]]:
    """The rows of docs/models.md's preset table, by config name: the cells after the first."""
    text = (ROOT / "docs/models.md").read_text(encoding="utf-8")
    section = text[text.index("## RL on few-step distilled models") :]
    rows = re.findall(r"^\| `(\w+\.yaml)` \|(.*)\|$", section, flags=re.M)
    return {name: [cell.strip() for cell in cells.split("|")] for name, cells in rows}


def numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", cell)]


def excess_noise(step, sigma: float, sigma_next: float, noise_level: float) -> tuple[float, float]:
    """(signal coefficient, noise std / σ_next) of x_{j+1} after `step` from x = (1−σ)·x0 + σ·ε with the exact
    velocity ε − x0: the mean's coefficients of x0 and ε, and the step's fresh noise added in quadrature."""
    x = torch.tensor([[1 - sigma, sigma]])  # coordinates (x0, ε)
    out = step(x, torch.tensor([[-1.0, 1.0]]), sigma, sigma_next, noise_level, generator=None)
    fresh = out.std.item() * (math.sqrt(sigma - sigma_next) if step is sde_step else 1.0)
    return out.mean[0, 0].item(), math.hypot(out.mean[0, 1].item(), fresh) / sigma_next


def test_the_docs_table_is_the_presets_settings_grids_and_excess_noise():
    table = doc_table()
    assert sorted(table) == sorted(PRESETS)
    for name, row in table.items():
        cfg = load(str(ROOT / "configs" / name))
        s, w = cfg.sampling, cfg.sampling.window
        _, steps, grid, guidance, step, window, excess = row
        assert int(steps) == s.num_steps == cfg.val.num_steps == len(GRIDS[name]) - 1, name
        assert float(guidance) == s.guidance == cfg.val.guidance == 1.0, name  # CFG-free
        assert step == f"{s.sde_type}, {s.noise_level}" == "cps, 0.8", name
        size, lo, hi, start_lo, start_hi = numbers(window)
        assert (w.kind, w.size, w.lo, w.hi) == ("random", size, lo, hi), name
        assert (start_lo, start_hi) == (w.lo, w.hi - w.size), name  # a window's start is drawn in [lo, hi − size]
        assert w.hi < s.num_steps, name  # the last step, into σ = 0, stays ODE
        assert numbers(grid) == pytest.approx(GRIDS[name], abs=5e-4), name
        assert s.height == s.width == 512  # the size the grid column is for (klein's depends on it)
        shown = numbers(excess)
        assert len(shown) == w.hi, name  # one per step the window may cover
        for j, value in enumerate(shown):
            sigma, sigma_next = GRIDS[name][j], GRIDS[name][j + 1]
            signal, sde_excess = excess_noise(sde_step, sigma, sigma_next, s.noise_level)
            assert signal == pytest.approx(1 - sigma_next, abs=1e-6)  # the sde step keeps the signal...
            assert sde_excess == pytest.approx(value, abs=5e-3), (name, j)  # ...and leaves more noise than σ_next
            signal, cps_excess = excess_noise(cps_step, sigma, sigma_next, s.noise_level)
            assert (signal, cps_excess) == pytest.approx((1 - sigma_next, 1.0), abs=1e-6)  # cps: exactly on the grid


@pytest.fixture(scope="module")
def flux_schnell_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny_flux_schnell"), "flux", "schnell", seed=0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_trains_its_tiny_model_one_step_cfg_free_with_exact_log_probs(make_trainer, request, name):
    cfg = load(str(ROOT / "configs" / name))
    s, w = cfg.sampling, cfg.sampling.window
    preset = [f"sampling.{key}={getattr(s, key)}" for key in ("num_steps", "guidance", "sde_type", "noise_level")]
    preset += [f"sampling.window.{key}={getattr(w, key)}" for key in ("kind", "size", "lo", "hi")]
    model_dir = request.getfixturevalue(PRESETS[name])
    trainer = make_trainer(f"model.path={model_dir}", *preset, "train.total_steps=1")
    (row,) = trainer.train()
    if name.startswith("flux1_schnell"):  # the schedule of the tiny schnell is the real one: no shift at any size
        sigmas = trainer.engine.model.sigma_schedule(s.num_steps, 32, 32)
        assert sigmas.tolist() == pytest.approx(GRIDS[name], abs=1e-6)
    assert row["rollout/nfe_per_image"] == s.num_steps  # one forward per step: no CFG
    assert w.lo <= row["window/start"] <= w.hi - w.size
    assert row["train/logp_diff_max"] == 0.0 and row["ratio_mean"] == 1.0
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0
