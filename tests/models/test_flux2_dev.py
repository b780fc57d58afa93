"""FLUX.2-dev through the `flux2` family: the tiny Flux2Pipeline in the real layout (Mistral-3 text encoder behind a
PixtralProcessor folder), our sampler against the pipeline for the same noise with the guidance embedding, LoRA and
merged export to diffusers, and the estimate from the shipped architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffusion_rl.cli import main
from diffusion_rl.models.tiny import build_tiny, save_tiny
from diffusion_rl.sampling.rollout import SamplerSettings, anonymous_ids, initial_noise, rollout

PROMPTS = ["a red cube", "a lighthouse at night"]
TOKENS = 32


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "FLUX.2-dev", "flux2", "small_dev", seed=0)


def test_init_tiny_writes_a_dev_checkpoint_layout_that_loads_back_bit_identical(tmp_path, load):
    assert main(["init-tiny", str(tmp_path / "m"), "--family", "flux2", "--preset", "small_dev"]) == 0
    index = json.loads((tmp_path / "m" / "model_index.json").read_text())
    assert index["_class_name"] == "Flux2Pipeline" and "is_distilled" not in index
    assert index["text_encoder"] == ["transformers", "Mistral3ForConditionalGeneration"]
    assert index["tokenizer"] == ["transformers", "PixtralProcessor"]
    folder = tmp_path / "m" / "tokenizer"
    assert json.loads((folder / "processor_config.json").read_text())["processor_class"] == "PixtralProcessor"
    assert (folder / "preprocessor_config.json").is_file() and (folder / "tokenizer.json").is_file()
    model, built = load(tmp_path / "m"), build_tiny("flux2", "small_dev", seed=0)
    assert model.family == "flux2" and model.guidance_embeds and not model.distilled
    assert type(model.pipeline).__name__ == "Flux2Pipeline"
    for name in ("transformer", "vae", "text_encoder"):
        expected, actual = getattr(built, name).state_dict(), getattr(model.pipeline, name).state_dict()
        assert expected.keys() == actual.keys(), name
        assert all(torch.equal(actual[k], v) for k, v in expected.items()), name
    chat = [{"role": "system", "content": [{"type": "text", "text": "S"}]},
            {"role": "user", "content": [{"type": "text", "text": "a red cube"}]}]  # fmt: skip
    rendered = model.pipeline.tokenizer.apply_chat_template(chat, tokenize=False)
    assert rendered == "<s>[SYSTEM_PROMPT]S[/SYSTEM_PROMPT][INST]a red cube[/INST]"  # Mistral-Small-3's turns
    assert model.pipeline.text_encoder.config.text_config.num_hidden_layers == 30  # the pipeline reads layer 30


def test_ode_sampling_equals_flux2_pipelines_with_the_guidance_embedding(dev_dir, load):
    model = load(dev_dir, max_sequence_length=TOKENS)
    settings = SamplerSettings(num_steps=4, guidance=4.0, height=32, width=32)
    cond = model.encode_prompts(PROMPTS, ["ugly", "blurry"])  # guidance-distilled: negatives play no part
    assert set(cond.keys()) == {"prompt_embeds"}
    traj = rollout(model, cond, settings, None, init_seeds=[1, 2], noise_seeds=[1, 2], ids=anonymous_ids(PROMPTS))
    assert traj.nfe.tolist() == [4.0, 4.0]  # one forward per step
    noise = initial_noise(model, settings, [1, 2])

    def pipeline(output_type):
        return model.pipeline(prompt=PROMPTS, latents=noise.permute(0, 3, 1, 2), height=32, width=32,
                              num_inference_steps=4, guidance_scale=4.0, max_sequence_length=TOKENS,
                              output_type=output_type).images  # fmt: skip

    expected = pipeline("latent")  # its packed tokens [B, h·w, 4·C], batch-norm normalised
    # the same operations in the same order: equal here; 1e-5 leaves room for other CPUs' kernels
    assert (traj.final_latents.reshape(expected.shape) - expected).abs().max() <= 1e-5
    pixels = pipeline("pt")
    expected_uint8 = (pixels * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    assert (traj.images.int() - expected_uint8.int()).abs().max() <= 1


def test_the_guidance_scale_reaches_the_transformer_unscaled_in_one_forward(dev_dir, load):
    model = load(dev_dir)
    calls = []
    model.pipeline.transformer.register_forward_pre_hook(lambda _, a, kw: calls.append(kw), with_kwargs=True)
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(PROMPTS)
    with torch.no_grad():
        a, b = model.velocity(x, 0.5, cond, 1.0), model.velocity(x, 0.5, cond, 4.0)
    assert [c["guidance"].tolist() for c in calls] == [[1.0, 1.0], [4.0, 4.0]]  # the network scales it by 1000
    assert all(c["hidden_states"].shape[0] == 2 for c in calls) and model.forwards_per_evaluation(4.0) == 1
    assert not torch.equal(a, b)


def test_lora_and_merged_exports_load_with_diffusers_and_sample_identical_images(
    dev_dir, load, train_model, tmp_path, ode_images
):
    trainer = train_model(dev_dir, f"run.dir={tmp_path / 'run'}", "model.lora.enabled=true", "model.lora.rank=4",
                          "model.lora.alpha=8", "train.total_steps=1", "train.lr=1e-2",
                          "sampling.guidance=4")  # fmt: skip
    trainer.train()
    trained = trainer.engine.model
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "lora")]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--merge", "--out", str(tmp_path / "merged")]) == 0
    settings = SamplerSettings(num_steps=4, guidance=4.0, height=32, width=32)

    def images(model):
        return ode_images(model, PROMPTS, settings)

    fresh = load(dev_dir)
    before = images(fresh)
    fresh.pipeline.load_lora_weights(tmp_path / "lora")  # diffusers' own loader (Flux2LoraLoaderMixin)
    after, wanted = images(fresh), images(trained)
    assert not torch.equal(before, wanted)  # the update moved the images
    assert torch.equal(after, wanted)
    index = json.loads((tmp_path / "merged" / "model_index.json").read_text())
    assert index["tokenizer"] == ["transformers", "PixtralProcessor"]  # written back in the checkpoint's layout
    assert (tmp_path / "merged" / "tokenizer" / "processor_config.json").is_file()
    merged = images(load(tmp_path / "merged"))
    assert (merged.int() - wanted.int()).abs().max() <= 1  # merging rounds the adapted weights once


def test_estimate_reads_the_shipped_dev_architecture(capsys):
    from diffusion_rl.estimate.architectures import from_shipped
    from diffusion_rl.estimate.counting import build_on_meta

    arch = from_shipped("FLUX.2-dev")
    (mistral,) = arch.text_encoders
    # Mistral-Small-3.1-24B by hand: 40 layers of (q: 5120×4096, o: 4096×5120, k, v: 5120×1024, gated MLP
    # 3 × 5120×32768), the 131072 × 5120 embeddings and the untied LM head of the same shape (the pipeline loads
    # Mistral3ForConditionalGeneration whole)
    layer = 2 * 5120 * 4096 + 2 * 5120 * 1024 + 3 * 5120 * 32768
    assert mistral.kind == "mistral3" and mistral.params == 40 * layer
    assert mistral.weight_params == 40 * layer + 2 * 131072 * 5120 + mistral.vision_params
    # the Pixtral vision tower: 24 layers of (4 × 1024² attention + 3 × 1024×4096 gated MLP)
    assert mistral.vision_params == 24 * (4 * 1024**2 + 3 * 1024 * 4096)
    assert arch.transformer_config["joint_attention_dim"] == 3 * 5120  # three layers' hidden states side by side
    transformer = build_on_meta(arch.transformer_class, arch.transformer_config)
    assert 32.1e9 < sum(p.numel() for p in transformer.parameters()) < 32.3e9  # the model card's 32B
    config = str(Path(__file__).resolve().parents[2] / "configs/flux2_dev_pickscore_lora.yaml")
    assert main(["estimate", config, "--gpu", "h100", "--gpus", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["peak_memory_gib_per_gpu"] < 74.5 and out["step_seconds"] > 0 and out["fits"] is True


def test_doctor_reports_the_dev_model_and_an_unknown_pipeline_lists_flux2_dev(dev_dir, tmp_path, capsys):
    from diffusion_rl.config.model import ModelConfig
    from diffusion_rl.errors import UserError
    from diffusion_rl.models.loader import load_model

    argv = ["doctor", "--model", str(dev_dir), "--dtype", "fp32", "--device", "cpu", "--height", "32", "--width", "32",
            "--steps", "2", "--micro-batch", "2", "--max-sequence-length", "16", "--guidance", "4"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "family     flux2" in text and "  text_encoder " in text and "LoRA r=32" in text
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Flux2InpaintPipeline"}))
    with pytest.raises(UserError, match="Flux2InpaintPipeline") as info:
        load_model(ModelConfig(path=str(tmp_path), device="cpu"))
    assert "Flux2KleinPipeline (flux2)" in str(info.value) and "Flux2Pipeline (flux2)" in str(info.value)
