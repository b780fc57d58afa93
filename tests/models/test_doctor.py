"""`diffusion-rl doctor` and its memory estimate; `init-tiny --family`."""

from __future__ import annotations

import json

import pytest
import torch

from diffusion_rl.cli import main
from diffusion_rl.models.doctor import count_saved_tensors, estimate_memory, human_bytes


def test_count_saved_tensors_counts_what_backward_keeps():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    with count_saved_tensors() as saved:
        y = x @ w  # matmul saves both operands: (12 + 20) floats
    assert saved[0] == (12 + 20) * 4
    with count_saved_tensors() as saved:
        (x * 2).sum()  # a product with a constant saves no tensor of ours
        x.exp()  # exp saves its result: 12 floats
    assert saved[0] == 12 * 4
    del y


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3 GiB"


def test_memory_estimate_adds_weights_optimizer_state_and_buffers(flux_model_dir, load):
    model = load(flux_model_dir, lora=True)
    estimate = estimate_memory(
        model, height=32, width=32, micro_batch=4, rollout_batch=8, num_steps=3, guidance=3.5, kl_reference=True
    )
    pipe = model.pipeline
    weights = sum(
        p.numel() * 4
        for m in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2)
        for p in m.parameters()
    )
    assert estimate.weights == weights  # fp32: 4 bytes each, the LoRA tensors included
    lora = sum(p.numel() for p in model.trainable_parameters())
    assert estimate.training_state == 3 * 4 * lora  # gradient + two AdamW moments
    assert estimate.reference_copy == 0  # LoRA's reference is the base with the adapter off
    assert estimate.activations > 0 and estimate.activations % 4 == 0
    latent = 4 * 4 * 16 * 4  # the 32 px token grid, fp32
    cond = (16 * 32 + 32) * 4  # T5 tokens × width + CLIP pooled
    assert estimate.rollout_buffer == 8 * (3 * latent + 2 * latent + latent + cond)
    assert estimate.total == sum(n for label, n in estimate.rows() if label != "total")
    full = load(flux_model_dir)
    with_reference = estimate_memory(
        full, height=32, width=32, micro_batch=1, rollout_batch=1, num_steps=3, guidance=3.5, kl_reference=True
    )
    assert with_reference.reference_copy == sum(p.numel() * 4 for p in full.pipeline.transformer.parameters())


@pytest.mark.parametrize("name", ["sd3", "flux", "qwen_image"])
def test_doctor_reports_the_model_and_samples_one_image(family_dirs, tmp_path, capsys, name):
    out = tmp_path / "doctor.png"
    argv = ["doctor", "--model", str(family_dirs[name]), "--dtype", "fp32", "--device", "cpu", "--height", "32"]
    argv += ["--width", "32", "--steps", "2", "--micro-batch", "2", "--max-sequence-length", "16", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    family = {"sd3": "sd3", "flux": "flux", "qwen_image": "qwen_image"}[name]
    assert f"family     {family}" in text
    for component in ("transformer", "vae", "text_encoder"):
        assert f"  {component} " in text
    assert "trainable" in text and "LoRA r=32" in text
    assert "activations (micro-batch)" in text and "total" in text
    assert out.is_file() and out.stat().st_size > 0


def test_doctor_writes_no_file_unless_asked(family_dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["doctor", "--model", str(family_dirs["sd3"]), "--dtype", "fp32", "--device", "cpu", "--height", "32"]
    argv += ["--width", "32", "--steps", "2", "--micro-batch", "1", "--max-sequence-length", "16", "--no-activations"]
    assert main(argv) == 0
    assert list(tmp_path.iterdir()) == []
    assert "(not saved: --out FILE.png keeps it)" in capsys.readouterr().out


def test_doctor_on_a_directory_that_is_not_a_model_says_what_it_found(tmp_path, capsys):
    (tmp_path / "weights.bin").write_bytes(b"")
    assert main(["doctor", "--model", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "no model_index.json" in err and "weights.bin" in err


@pytest.mark.parametrize(
    ("family", "preset", "pipeline"),
    [
        ("flux", "small", "FluxPipeline"),
        ("flux", "schnell", "FluxPipeline"),
        ("qwen_image", "small", "QwenImagePipeline"),
    ],
)
def test_init_tiny_writes_each_family(tmp_path, family, preset, pipeline):
    out = tmp_path / "model"
    assert main(["init-tiny", str(out), "--family", family, "--preset", preset]) == 0
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == pipeline


def test_init_tiny_rejects_a_preset_the_family_lacks(tmp_path, capsys):
    assert main(["init-tiny", str(tmp_path / "m"), "--family", "qwen_image", "--preset", "schnell"]) == 2
    assert "presets: base, small" in capsys.readouterr().err


def test_doctor_defaults_to_the_models_native_size(tiny_model_dir, tmp_path, capsys):
    # no --height/--width: the tiny SD3 model's transformer sample_size 16 × VAE scale 4 = 64 px
    argv = ["doctor", "--model", str(tiny_model_dir), "--device", "cpu", "--steps", "2", "--micro-batch", "1"]
    assert main(argv + ["--max-sequence-length", "16", "--out", str(tmp_path / "d.png")]) == 0
    assert "memory estimate, 64×64," in capsys.readouterr().out


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("512", "512×512 is larger than this model takes: at most 256 px a side (pos_embed_max_size 32 × patch 2 × "
                "VAE scale 4); try --height 256 --width 256 (the model's native size is 64)"),
        ("60", "must be positive multiples of 8; try --height 56 --width 56"),
    ],
)  # fmt: skip
def test_doctor_refuses_a_size_the_model_cannot_make_in_one_line(tiny_model_dir, capsys, size, expected):
    argv = ["doctor", "--model", str(tiny_model_dir), "--device", "cpu", "--height", size, "--width", size]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert expected in err


def test_image_sizes_come_from_the_pipeline_configs(family_dirs, load):
    from diffusion_rl.models.image_size import image_sizes

    sd3 = image_sizes(load(family_dirs["sd3"]))
    assert (sd3.native, sd3.largest, sd3.multiple) == (64, 256, 8)
    flux = image_sizes(load(family_dirs["flux"]))  # rotary positions: no bound; the VAE's sample_size 64
    assert (flux.native, flux.largest, flux.multiple) == (64, None, 8)
    qwen = image_sizes(load(family_dirs["qwen_image"]))  # no size in its configs: diffusers' default 128 × 4
    assert (qwen.native, qwen.largest, qwen.multiple) == (512, None, 8)


def test_estimate_reads_a_model_directorys_size_limits_as_the_loaded_model_has_them(family_dirs, load):
    """`estimate` (and train's memory check before loading) checks sizes with the same size_problem, on sizes read from
    the directory's configs without weights: the same step and largest size as the loaded model's, every family."""
    from diffusion_rl.estimate.architectures import from_model_dir, image_sizes_of
    from diffusion_rl.models.image_size import image_sizes

    for name, folder in family_dirs.items():
        loaded, unloaded = image_sizes(load(folder)), image_sizes_of(from_model_dir(folder))
        assert (unloaded.multiple, unloaded.largest) == (loaded.multiple, loaded.largest), name


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--max-sequence-length", "0"], "--max-sequence-length must be ≥ 1 (as model.max_sequence_length"),
        (["--guidance", "nan"], "--guidance must be finite (as sampling.guidance"),
        (["--rollout-batch", "-4"], "--rollout-batch must be ≥ 1, got -4"),
        (["--height", "-5"], "--height must be ≥ 1 (as sampling.height"),
    ],
)
def test_doctors_flags_are_checked_before_the_model_loads(tmp_path, capsys, flags, said):
    assert main(["doctor", "--model", str(tmp_path / "no_model_here"), *flags]) == 2  # before it looks for one
    assert said in capsys.readouterr().err
