"""Numbers given on the command line get the ranges of the config keys they stand for (declared once, on the config
dataclasses), and sizes the model cannot make are refused: one line, status 2, before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_rl.cli import main

ROOT = Path(__file__).resolve().parents[1]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "1000000000"], "--steps must be ≤ 1000 (as val.num_steps: [1, 1000]), got 1000000000"),
        (["--n", "100000000"], "--n must be ≤ 1024 (as val.n: [1, 1024]), got 100000000"),
        (["--height", "100000"], "--height must be ≤ 8192 (as val.height: [1, 8192])"),
        (["--noise-level", "50"], "--noise-level must be ≤ 10 (as sampling.noise_level: [0, 10])"),
        (["--guidance", "nan"], "--guidance must be finite (as val.guidance: [1, 100])"),
        (["--max-sequence-length", "100000000"], "--max-sequence-length must be ≤ 8192 (as model.max_sequence_length"),
    ],
)
def test_sample_flags_out_of_their_config_keys_range_are_refused_before_the_model_loads(
    flags, message, tiny_model_dir, capsys, model_must_not_load
):
    assert main(["sample", "--model", str(tiny_model_dir), "--prompt", "a", *flags]) == 2
    assert message in one_error_line(capsys)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "1000000000"], "--steps must be ≤ 1000 (as val.num_steps"),
        (["--n", "100000000"], "--n must be ≤ 1024 (as val.n"),
        (["--batch-size", "100000000"], "--batch-size must be ≤ 4096 (as train.micro_batch_size"),
    ],
)
def test_eval_flags_out_of_their_config_keys_range_are_refused(flags, message, tiny_model_dir, tmp_path, capsys):
    argv = ["eval", "--model", str(tiny_model_dir), "--prompts", str(ROOT / "configs/prompts/val.txt"),
            "--reward", "jpeg_compressibility", "--out", str(tmp_path / "eval"), *flags]  # fmt: skip
    assert main(argv) == 2
    assert message in one_error_line(capsys)
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpus", "100000000"], "--gpus must be ≤ 4096 (as engine.num_workers: [1, 4096]), got 100000000"),
        (["--gpus", "0"], "--gpus must be ≥ 1"),
        (["--efficiency", "50"], "--efficiency is a fraction of the device's peak and bandwidth, in (0, 1]; got 50"),
        (["--prompt-tokens", "100000000"], "--prompt-tokens must be ≤ 8192 (as model.max_sequence_length"),
        (["--memory-gib", "inf"], "--memory-gib must be > 0 and finite"),
    ],
)
def test_estimate_flags_out_of_range_are_refused(flags, message, capsys):
    assert main(["estimate", str(ROOT / "configs/quickstart_flow_grpo.yaml"), *flags]) == 2
    assert message in one_error_line(capsys)


def test_estimate_refuses_a_size_past_the_models_position_table_in_one_line(capsys):
    argv = ["estimate", str(ROOT / "configs/sd35_ocr_lora.yaml"), "sampling.height=8192", "sampling.width=8192"]
    assert main(argv) == 2
    assert (
        "sampling.height/width do not fit stable-diffusion-3.5-medium: 8192×8192 is larger than this model takes: "
        "at most 6144 px a side (pos_embed_max_size 384 × patch 2 × VAE scale 8); try sampling.height 6144 "
        "sampling.width 6144"
    ) in one_error_line(capsys)


def test_train_refuses_a_size_the_model_cannot_make_before_loading_it(train_argv, capsys, monkeypatch):
    """512 px is within sampling.height's range but past the tiny SD3's pos_embed_max_size: the memory check's
    estimate, run before anything loads, says so with a size that works."""
    import diffusion_rl.trainer as trainer

    monkeypatch.setattr(trainer, "make_trainer", lambda cfg: pytest.fail("the trainer was built"))
    assert main(train_argv("sampling.height=512", "sampling.width=512")) == 2
    line = one_error_line(capsys)
    assert "sampling.height/width do not fit" in line and "try sampling.height 256 sampling.width 256" in line
