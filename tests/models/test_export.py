"""Trained weights out of a checkpoint: load_lora_weights, `export` (LoRA folder or merged model), `sample`."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.checkpoint import weights
from diffusion_rl.cli import main
from diffusion_rl.models.export import DIFFUSERS_LORA_FILE

GUIDANCE = 4.0


def _trained(train_model, model_dir, tmp_path, lora: bool):
    """A 1-step run (lr 1e-2 so the weights visibly move); returns (its model, its checkpoint directory)."""
    trainer = train_model(
        model_dir,
        f"run.dir={tmp_path / 'run'}",
        f"model.lora.enabled={str(lora).lower()}",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "train.total_steps=1",
        "train.lr=1e-2",
    )
    trainer.train()
    return trainer.engine.model, tmp_path / "run" / "checkpoints" / "step_000001"


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_checkpoint_adapter_loads_with_diffusers_load_lora_weights(
    family_dirs, load, train_model, velocity_of, tmp_path, name
):
    model, checkpoint = _trained(train_model, family_dirs[name], tmp_path, lora=True)
    adapter = checkpoint / "adapter"
    assert {"adapter_model.safetensors", "adapter_config.json", DIFFUSERS_LORA_FILE} <= {
        p.name for p in adapter.iterdir()
    }
    v_trained = velocity_of(model, GUIDANCE)

    fresh = load(family_dirs[name])
    v_base = velocity_of(fresh, GUIDANCE)
    fresh.pipeline.load_lora_weights(adapter)  # diffusers' own loader, alpha/rank from the file's metadata
    v_loaded = velocity_of(fresh, GUIDANCE)
    assert (v_trained - v_base).abs().max() > 1e-5
    assert torch.allclose(v_loaded, v_trained, atol=1e-6)


@pytest.mark.parametrize("name", ["sd3", "flux", "qwen_image", "z_image"])
def test_export_merge_writes_a_model_that_loads_and_matches_the_trained_policy(
    family_dirs, load, train_model, velocity_of, tmp_path, name
):
    model, checkpoint = _trained(train_model, family_dirs[name], tmp_path, lora=True)
    v_trained = velocity_of(model, GUIDANCE)
    out = tmp_path / "merged"
    argv = ["export", "--checkpoint", str(checkpoint), "--model", str(family_dirs[name]), "--merge", "--out", str(out)]
    assert main(argv) == 0
    merged = load(out)
    assert merged.family == model.family
    assert not any("lora" in n for n, _ in merged.pipeline.transformer.named_parameters())
    assert torch.allclose(velocity_of(merged, GUIDANCE), v_trained, atol=1e-5)


def test_export_without_merge_writes_the_lora_in_both_formats(family_dirs, load, train_model, velocity_of, tmp_path):
    model, checkpoint = _trained(train_model, family_dirs["flux"], tmp_path, lora=True)
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(out)]) == 0  # a run dir: its latest
    assert {DIFFUSERS_LORA_FILE, "adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in out.iterdir()}
    fresh = load(family_dirs["flux"])
    fresh.pipeline.load_lora_weights(out)
    assert torch.allclose(velocity_of(fresh, GUIDANCE), velocity_of(model, GUIDANCE), atol=1e-6)
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 2  # not empty: needs --force


def test_full_finetuning_checkpoint_exports_only_merged(family_dirs, load, train_model, velocity_of, tmp_path, capsys):
    model, checkpoint = _trained(train_model, family_dirs["qwen_image"], tmp_path, lora=False)
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "lora")]) == 2
    assert "full fine-tuning checkpoint" in capsys.readouterr().err
    out = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(checkpoint), "--merge", "--out", str(out)]) == 0
    assert torch.equal(velocity_of(load(out), GUIDANCE), velocity_of(model, GUIDANCE))


def test_sample_with_a_checkpoint_uses_the_trained_weights(family_dirs, train_model, tmp_path, monkeypatch):

    model, checkpoint = _trained(train_model, family_dirs["flux"], tmp_path, lora=True)
    loaded = []
    original = weights.load_checkpoint_model
    record = lambda *a, **k: loaded.append(original(*a, **k)) or loaded[-1]  # noqa: E731
    monkeypatch.setattr(weights, "load_checkpoint_model", record)
    out = tmp_path / "grid.png"
    argv = ["sample", "--model", str(family_dirs["flux"]), "--checkpoint", str(checkpoint), "--prompt", "a cat"]
    argv += ["--steps", "2", "--height", "32", "--width", "32", "--max-sequence-length", "16", "--device", "cpu"]
    assert main([*argv, "--out", str(out)]) == 0
    assert out.is_file() and out.stat().st_size > 0
    sampled, _, which = loaded[0]
    assert which == "trained" and sampled.policies.lora is not None
    trained, applied = model.policies.trainable_state_dict(), sampled.policies.trainable_state_dict()
    assert trained.keys() == applied.keys() and all(torch.equal(trained[k], applied[k]) for k in trained)


def test_sample_with_a_missing_checkpoint_says_so(family_dirs, tmp_path, capsys):
    argv = ["sample", "--model", str(family_dirs["flux"]), "--checkpoint", str(tmp_path / "nope"), "--prompt", "a"]
    assert main(argv) == 2
    assert "nope" in capsys.readouterr().err


def test_sample_with_a_checkpoint_reads_the_runs_text_length(tiny_model_dir, train_model, tmp_path, monkeypatch):
    # eval reads model.max_sequence_length from the checkpoint; sample must too, or the two sample other images
    from diffusion_rl.checkpoint import weights as export

    trainer = train_model(tiny_model_dir, f"run.dir={tmp_path / 'run'}", "train.total_steps=1",
                          "model.max_sequence_length=12")  # fmt: skip
    trainer.train()
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    lengths = []
    original = export.load_checkpoint_model

    def spy(*args, **kwargs):
        loaded = original(*args, **kwargs)
        lengths.append(loaded[0].max_sequence_length)
        return loaded

    monkeypatch.setattr(export, "load_checkpoint_model", spy)
    argv = ["sample", "--model", str(tiny_model_dir), "--checkpoint", str(checkpoint), "--prompt", "a cat", "--steps"]
    argv += ["2", "--height", "32", "--width", "32", "--device", "cpu", "--out", str(tmp_path / "grid.png")]
    assert main(argv) == 0
    assert main([*argv, "--max-sequence-length", "8"]) == 0  # an explicit flag still wins
    assert lengths == [12, 8]


def test_sample_with_a_checkpoint_samples_as_the_run_validated(tiny_model_dir, train_model, tmp_path, monkeypatch):
    from diffusion_rl.sampling import rollout

    trainer = train_model(tiny_model_dir, f"run.dir={tmp_path / 'run'}", "train.total_steps=1", "sampling.height=32",
                          "sampling.width=32", "sampling.guidance=2.5", "val.num_steps=3")  # fmt: skip
    trainer.train()
    used = []
    original = rollout.sample_images
    monkeypatch.setattr(rollout, "sample_images", lambda m, p, n, settings, **k: used.append(settings) or original(
        m, p, n, settings, **k))  # fmt: skip
    argv = ["sample", "--model", str(tiny_model_dir), "--checkpoint", str(tmp_path / "run"), "--prompt", "a cat"]
    argv += ["--device", "cpu", "--out", str(tmp_path / "grid.png")]
    assert main(argv) == 0  # a 32-px run samples at 32 px (it sampled the default 64 px)
    assert main([*argv, "--height", "48", "--steps", "2"]) == 0  # flags still win
    assert [(s.height, s.width, s.num_steps, s.guidance) for s in used] == [(32, 32, 3, 2.5), (48, 32, 2, 2.5)]
