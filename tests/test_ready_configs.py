"""The ready configs for real runs validate (`diffusion-rl config show`) and say what hardware they expect."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.cli import main

ROOT = Path(__file__).resolve().parents[1]
READY = ["sd35_ocr_lora.yaml", "sd35_pickscore_fast.yaml", "flux_pickscore_lora.yaml", "qwen_image_ocr_lora.yaml",
         "wan21_t2v_1_3b_ocr_lora.yaml", "wan22_ti2v_5b_dance_lora.yaml", "qwen_image_edit_2509_lora.yaml",
         "flux_kontext_counting_lora.yaml", "flux2_klein_pickscore_lora.yaml",
         "z_image_turbo_pickscore_lora.yaml", "wan21_i2v_lora.yaml", "qwen_image_2512_ocr_lora.yaml",
         "flux1_schnell_pickscore_lora.yaml", "flux2_dev_pickscore_lora.yaml", "wan22_i2v_a14b_lora.yaml",
         "wan22_t2v_a14b_ocr_lora.yaml", "wan21_flf2v_lora.yaml", "sd35_dgpo_lora.yaml", "qwen_image_dgpo_lora.yaml",
         "sd35_crd_lora.yaml", "sd35_flash_grpo_lora.yaml"]  # fmt: skip


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
    # flow_grpo pads T5 to 128 tokens (train_sd3.py:625, train_sd3_fast.py:631, train_flux.py:622 at 9745241)
    assert [c.model.max_sequence_length for c in (ocr, fast, flux)] == [128, 128, 128]
    # train_flux.py:411-429: r 64, α 128, our flux preset without the single blocks' proj_mlp
    from diffusion_rl.models.families.flux import FLUX_LORA_TARGETS

    assert (flux.model.lora.rank, flux.model.lora.alpha) == (64, 128)
    assert sorted(flux.model.lora.target_modules) == sorted(set(FLUX_LORA_TARGETS) - {"proj_mlp"})
    assert (ocr.val.before_train, fast.val.before_train, flux.val.before_train) == (True, True, True)  # epoch 0
    qwen = load(str(ROOT / "configs/qwen_image_ocr_lora.yaml"))
    assert (qwen.sampling.noise_level, qwen.sampling.guidance, qwen.sampling.window.size, qwen.sampling.window.hi) == (
        1.2, 4.0, 2, 5
    )  # fmt: skip
    assert (qwen.data.prompts_per_step, qwen.data.group_size, qwen.train.num_minibatches) == (32, 16, 2)
    assert (qwen.algorithm.settings.clip_range, qwen.model.lora.rank, qwen.model.lora.alpha) == (1e-5, 64, 128)


def test_video_and_edit_configs_keep_their_recipes_numbers():
    from diffusion_rl.config import load

    wan = load(str(ROOT / "configs/wan21_t2v_1_3b_ocr_lora.yaml"))  # flow_grpo's general_ocr_wan2_1
    s = wan.sampling
    assert (s.height, s.width, s.num_frames, s.num_steps, s.guidance) == (240, 416, 33, 20, 4.5)
    assert (wan.data.group_size, wan.train.lr, wan.algorithm.settings.kl_beta) == (4, 1e-4, 0.004)
    assert (wan.algorithm.settings.clip_range, wan.algorithm.advantage.global_std, wan.rewards[0].frames) == (
        1e-3, False, "mean"
    )  # fmt: skip
    dance = load(str(ROOT / "configs/wan22_ti2v_5b_dance_lora.yaml"))  # verl-omni's run_wan22_5b_t2v_hpsv3_auto.sh
    d, w = dance.sampling, dance.sampling.window
    assert (d.height, d.width, d.num_frames, d.num_steps, d.guidance) == (704, 1280, 9, 10, 5.0)
    assert (d.sde_type, d.noise_level, d.share_initial_noise, w.kind, w.size, w.lo, w.hi) == (
        "dance_sde", 1.2, True, "random", 2, 0, 5
    )  # fmt: skip
    assert (dance.data.prompts_per_step, dance.data.group_size, dance.train.num_minibatches) == (64, 8, 4)
    assert (dance.train.weight_decay, dance.train.total_steps, dance.algorithm.timestep_fraction) == (1e-4, 120, 1.0)
    correction = dance.algorithm.rollout_correction
    assert (correction.mode, correction.is_kind, dance.model.max_sequence_length) == ("decoupled", "none", 1024)
    assert (dance.model.lora.rank, dance.model.lora.alpha, dance.train.lr) == (64, 128, 3e-4)  # ours: LoRA
    edit = load(str(ROOT / "configs/qwen_image_edit_2509_lora.yaml"))  # flow_grpo's repairany_qwenimage_edit_plus_fast
    w = edit.sampling.window
    assert (edit.sampling.num_steps, edit.sampling.noise_level, w.kind, w.size, w.hi) == (10, 0.9, "random", 4, 5)
    assert [(r.name, r.weight) for r in edit.rewards] == [("source_preservation", 0.2), ("vlm", 0.8)]
    kontext = load(str(ROOT / "configs/flux_kontext_counting_lora.yaml"))  # flow_grpo's counting_flux_kontext
    k = kontext.sampling
    assert (k.num_steps, k.guidance, k.noise_level, kontext.data.group_size, kontext.data.prompts_per_step) == (
        6, 2.5, 0.9, 21, 48
    )  # fmt: skip
    assert [(r.name, r.weight) for r in kontext.rewards] == [("source_preservation", 0.5), ("geneval", 0.5)]
    # both read their condition images at the 512² output size, as flow_grpo trains them (train_flux_kontext.py:582;
    # its Qwen-Image-Edit-Plus pipeline's calculate_dimensions(512 * 512, ...)), not at their pipelines' ~1 MP
    assert (edit.model.condition_size, kontext.model.condition_size) == ("output", "output")
    assert (kontext.model.max_sequence_length, kontext.model.lora.rank, kontext.model.lora.alpha) == (128, 64, 128)
    assert (edit.val.before_train, kontext.val.before_train) == (True, True)  # flow_grpo evaluates at epoch 0
    # Wan 2.2 A14B: the release's (high-noise, low-noise) guidance, wan/configs/wan_{t2v,i2v}_A14B.py
    names = ("wan22_t2v_a14b_ocr_lora", "wan22_i2v_a14b_lora")
    pairs = [load(str(ROOT / f"configs/{name}.yaml")).sampling for name in names]
    assert [(s.guidance, s.guidance_low_noise) for s in pairs] == [(4.0, 3.0), (3.5, None)]


def test_dgpo_crd_and_flash_grpo_configs_keep_their_authors_numbers():
    from diffusion_rl.config import load

    for name in ("sd35_dgpo_lora", "qwen_image_dgpo_lora"):  # DGPO's general_ocr_sd3_4gpu (config/dgpo.py)
        cfg = load(str(ROOT / f"configs/{name}.yaml"))
        s, d = cfg.sampling, cfg.algorithm.settings
        assert (cfg.algorithm.loss, s.sde_type, s.ode_solver, s.num_steps, s.height) == ("dgpo", "ode", "dpm2", 10, 512)
        assert (cfg.data.prompts_per_step, cfg.data.group_size, cfg.train.num_minibatches) == (8, 16, 1)
        assert (d.dpo_beta, d.kl_beta, d.clip, d.clip_range, d.reference_guidance) == (100.0, 0.02, True, 0.01, None)
        assert (d.train_timesteps, d.timestep_fraction, d.shared_noise, d.ema_reference) == (4, 0.6, True, False)
        assert (cfg.train.lr, cfg.algorithm.advantage.global_std, cfg.train.ema.decay) == (3e-4, True, 0.9)
        assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.engine.num_workers) == (64, 128, 4)
    assert load(str(ROOT / "configs/sd35_dgpo_lora.yaml")).sampling.guidance == 4.5  # rollouts with CFG
    crd = load(str(ROOT / "configs/sd35_crd_lora.yaml"))  # Flow-Factory's examples/crd/lora/sd3_5/default.yaml
    c = crd.algorithm.settings
    assert (crd.sampling.sde_type, crd.sampling.guidance, crd.val.guidance, crd.val.num_steps) == ("ode", 1.0, 1.0, 40)
    assert (crd.data.prompts_per_step, crd.data.group_size, crd.train.num_minibatches) == (48, 24, 2)
    assert (c.train_timesteps, c.timestep_range, c.kl_beta, c.reference_guidance, c.crd_beta) == (20, 0.99, 0.1, 4.5, 1)
    assert (c.old_decay_start, c.old_decay_slope, c.sampling_delay, c.sampling_decay_slope) == (0.25, 0.005, 75, 0.0075)
    assert (crd.model.lora.rank, crd.model.lora.alpha, crd.train.lr, crd.engine.num_workers) == (32, 64, 3e-4, 8)
    flash = load(str(ROOT / "configs/sd35_flash_grpo_lora.yaml"))  # Flash-GRPO's wan2_1_flash (config/dgx.py)
    f, w = flash.algorithm.settings, flash.sampling.window
    assert (flash.algorithm.loss, w.kind, w.size, w.lo, w.hi, flash.sampling.num_steps) == (
        "flash_grpo", "random", 1, 0, 5, 10
    )  # fmt: skip
    assert (f.clip_range, f.kl_beta, f.rectify, flash.train.lr, flash.algorithm.advantage.global_std) == (
        1e-3, 0.0, True, 1e-4, True
    )  # fmt: skip


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


def test_flux2_klein_preset_adds_noise_below_sigma_next_and_keeps_the_last_step_ode():
    """The few-step preset's reasons (docs/models.md), on klein's own 4-step schedule at the config's size."""
    import math

    import torch

    from diffusion_rl.config import load
    from diffusion_rl.sampling.sde import cps_step, sde_step

    cfg = load(str(ROOT / "configs/flux2_klein_pickscore_lora.yaml"))
    s, w = cfg.sampling, cfg.sampling.window
    assert (s.num_steps, s.guidance, s.sde_type, s.noise_level) == (4, 1.0, "cps", 0.8)
    assert (w.kind, w.size, w.lo, w.hi) == ("random", 2, 0, 3)  # SDE steps among 0-2; step 3 (to σ = 0) is ODE
    assert (cfg.data.group_size, cfg.algorithm.settings.clip_range, cfg.algorithm.settings.kl_beta) == (18, 1e-5, 0.0)
    # Flux2KleinPipeline's schedule by hand: μ of its empirical fit at 32×32 tokens and 4 steps, exponential shift
    tokens = (s.height // 16) * (s.width // 16)
    m_10, m_200 = 8.73809524e-05 * tokens + 1.89833333, 0.00016927 * tokens + 0.45666666
    mu = (m_200 - m_10) / 190.0 * (4 - 200) + m_200
    sigmas = [math.exp(mu) / (math.exp(mu) + 1 / t - 1) for t in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    assert all(abs(a - b) < 1e-3 for a, b in zip(sigmas, [1.0, 0.958, 0.884, 0.718, 0.0]))
    x, v = torch.zeros(1, 4), torch.zeros(1, 4)
    for j in range(w.hi):  # the steps the window may cover
        sigma, sigma_next = sigmas[j], sigmas[j + 1]
        cps = cps_step(x, v, sigma, sigma_next, s.noise_level).std.item()
        sde = sde_step(x, v, sigma, sigma_next, s.noise_level).std.item() * math.sqrt(sigma - sigma_next)
        assert cps <= sigma_next  # cps re-noises within the marginal's own noise σ_next
        if j > 0:  # Flow-GRPO's sde adds more noise in one step than x at σ_next holds in all (σ_next)
            assert sde > sigma_next


def test_z_image_turbo_few_step_preset_keeps_its_window_in_the_high_noise_steps():
    from diffusion_rl.config import load

    turbo = load(str(ROOT / "configs/z_image_turbo_pickscore_lora.yaml"))
    s, w = turbo.sampling, turbo.sampling.window
    assert (s.num_steps, s.guidance, turbo.val.num_steps, turbo.val.guidance) == (8, 1.0, 8, 1.0)  # CFG-free
    assert (s.sde_type, s.noise_level, w.kind, w.size, w.lo, w.hi) == ("cps", 0.8, "random", 2, 0, 4)
    # Turbo's grid by hand: σ = 3u / (1 + 2u) for u = 1, 7/8, …, 1/8 (shift 3), then 0
    sigmas = [3 * u / (1 + 2 * u) for u in (1 - k / 8 for k in range(8))] + [0.0]
    # a window of `size` steps starts in [lo, hi − size]: it covers steps lo … hi − 1, σ 1 … 0.83
    assert min(sigmas[j] for j in range(w.lo, w.hi)) > 0.8  # only the steps that set the layout are stochastic
    assert sigmas[w.hi] == 0.75 and sigmas[6] == 0.5  # the distilled refinement steps stay deterministic


def test_qwen_image_2512_config_is_qwen_images_recipe_on_the_new_weights():
    from dataclasses import asdict

    from diffusion_rl.config import load

    same = ["model.path=./models/Qwen-Image", "run.dir=runs/qwen_image_ocr_lora"]
    assert load(str(ROOT / "configs/qwen_image_2512_ocr_lora.yaml")).model.path == "./models/Qwen-Image-2512"
    assert asdict(load(str(ROOT / "configs/qwen_image_2512_ocr_lora.yaml"), same)) == asdict(
        load(str(ROOT / "configs/qwen_image_ocr_lora.yaml"))
    )


@pytest.mark.parametrize(
    "name, shift", [("wan21_i2v_lora", 3.0), ("wan21_flf2v_lora", 16.0), ("wan22_i2v_a14b_lora", 5.0)]
)
def test_wan_image_to_video_configs_take_flow_grpos_wan_step_at_their_checkpoints_shift(name, shift):
    from diffusion_rl.config import load
    from diffusion_rl.models.families.wan import unipc_flow_sigmas

    cfg = load(str(ROOT / f"configs/{name}.yaml"))
    sigmas = unipc_flow_sigmas(cfg.sampling.num_steps, shift, 1000).float()
    assert cfg.sampling.sde_type == "sde_linear"
    assert cfg.sampling.noise_level == round(float(sigmas[1]), 4)


@pytest.mark.parametrize("name, shift", [("wan21_t2v_1_3b_ocr_lora", 3.0), ("wan22_t2v_a14b_ocr_lora", 12.0)])
def test_wan_ocr_configs_take_flow_grpos_wan_step_lora_targets_ema_and_no_first_validation(name, shift):
    from diffusion_rl.config import load
    from diffusion_rl.models.families.wan import WAN_LORA_TARGETS, unipc_flow_sigmas

    cfg = load(str(ROOT / f"configs/{name}.yaml"))
    # flow_grpo's Wan step: std_dev_t = σ_max·σ with σ_max = sigmas[1] of the run's schedule (σ_min = sigmas[-1] = 0)
    sigmas = unipc_flow_sigmas(cfg.sampling.num_steps, shift, 1000).float()
    assert cfg.sampling.sde_type == "sde_linear" and float(sigmas[-1]) == 0.0
    assert cfg.sampling.noise_level == round(float(sigmas[1]), 4)
    # train_wan2_1.py's LoRA: to_q, to_k, to_v, to_out.0 (and add_* projections the T2V model has not): attention only
    targets = cfg.model.lora.target_modules
    assert set(targets) < set(WAN_LORA_TARGETS) and len(targets) == 8
    assert {t.split(".", 1)[1] for t in targets} == {"to_q", "to_k", "to_v", "to_out.0"}
    ema = cfg.train.ema
    assert (ema.enabled, ema.decay, ema.update_every, ema.warmup, cfg.val.before_train) == (True, 0.9, 8, True, False)


OCR_TEXTS = [f"OPEN {i}" for i in range(40)]  # enough for a val share of 0.05 to be 2 prompts
PREPARE_LINE = "#   diffusion-rl prepare ocr "  # a complete command on a comment line of its own


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if PREPARE_LINE in p.read_text())
)
def test_ready_configs_prepare_ocr_commands_run_and_write_the_configs_data_files(name, tmp_path, monkeypatch):
    import shlex

    from diffusion_rl.config import load
    from diffusion_rl.data.prompts import load_prompts

    lines = [line[len("#   ") :] for line in (ROOT / "configs" / name).read_text().splitlines()]
    commands = [shlex.split(line, comments=True)[1:] for line in lines if line.startswith(PREPARE_LINE[len("#   ") :])]
    monkeypatch.chdir(tmp_path)
    for argv in commands:  # each command's input (the first path) stands in for flow_grpo's prompt file
        inputs = [a for a in argv[2:] if not a.startswith("-")][:1]
        for path in inputs:
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text("".join(f'A sign that says "{t}"\n' for t in OCR_TEXTS))
        assert main(argv) == 0, f"{name}: `diffusion-rl {' '.join(argv)}` failed"
    cfg = load(str(ROOT / "configs" / name))
    for path in (cfg.data.train, cfg.val.prompts):
        assert {r.ground_truth for r in load_prompts(path)} <= set(OCR_TEXTS), (name, path)
