"""The model card `export` writes (checkpoint/model_card.py): the Hub's front matter, and a diffusers snippet that runs
against the exported folder and samples with the run's validation settings."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from diffusion_rl.checkpoint.model_card import hub_commit, hub_id, pipeline_call
from diffusion_rl.cli import main
from diffusion_rl.models.registry import family_named
from diffusion_rl.models.tiny import save_tiny


def _card(out):
    """(front matter as YAML, the python snippet) of out/README.md."""
    text = (out / "README.md").read_text()
    front = re.match(r"---\n(.*?)\n---\n", text, re.S)
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert front and code, text
    return yaml.safe_load(front[1]), code[1]


def _run_snippet(code, pipeline_class, monkeypatch, tmp_path, writes: str = "sample.png"):
    """Execute the snippet in tmp_path; returns (the keywords it called the pipeline with, its namespace)."""
    calls = []
    original = pipeline_class.__call__
    monkeypatch.setattr(pipeline_class, "__call__", lambda self, **kw: calls.append(kw) or original(self, **kw))
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert len(calls) == 1 and (tmp_path / writes).is_file()
    return calls[0], namespace


def _train(train_model, model_dir, tmp_path, *overrides):
    trainer = train_model(model_dir, f"run.dir={tmp_path / 'run'}", "train.total_steps=1", "model.lora.rank=4",
                          "model.lora.alpha=8", "val.num_steps=2", "sampling.height=32", "sampling.width=48",
                          *overrides)  # fmt: skip
    trainer.train()
    return tmp_path / "run" / "checkpoints" / "step_000001"


def test_lora_export_writes_a_card_whose_snippet_samples_with_the_runs_settings(
    flux_model_dir, train_model, tmp_path, monkeypatch
):
    from diffusers import FluxPipeline

    checkpoint = _train(train_model, flux_model_dir, tmp_path, "model.lora.enabled=true", "val.guidance=3.5",
                        "model.max_sequence_length=12", "val.height=40")  # fmt: skip
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    front, code = _card(out)  # not peft's own README (library_name: peft)
    assert front["library_name"] == "diffusers" and front["pipeline_tag"] == "text-to-image"
    assert {"diffusion-rl", "lora", "text-to-image"} <= set(front["tags"])
    assert "base_model" not in front  # a local tiny directory names no Hub model
    text = (out / "README.md").read_text()
    assert "rank 4, alpha 8" in text and "at training step 1" in text and "`flow_grpo`" in text
    assert "`jpeg_compressibility` (weight 1)" in text
    assert "from_pretrained(" in code and "torch_dtype" not in code  # diffusers' `dtype` (torch_dtype is deprecated)

    call, namespace = _run_snippet(code, FluxPipeline, monkeypatch, tmp_path)
    # FLUX.1-dev (guidance embedded): the scale is guidance_scale; the pipeline's default text length is 512
    assert {k: v for k, v in call.items() if k not in ("prompt", "generator")} == {
        "num_inference_steps": 2, "height": 40, "width": 48, "guidance_scale": 3.5, "max_sequence_length": 12
    }  # fmt: skip
    assert any("lora" in name for name, _ in namespace["pipe"].transformer.named_parameters())
    assert "`max_sequence_length` (512 there)" in text and "`num_inference_steps` (28 there)" in text


def test_the_cards_snippet_draws_the_images_sample_draws_from_the_same_noise(tiny_model_dir, train_model, tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """SD3 (its pipeline's latents are ours, [C, h, w]): `sample --checkpoint` and the card's snippet on the exported
    LoRA, the snippet handed sample's initial noise, give the same image (1 level of 255: the VAE's factors undone,
    as test_sd35_layout measures); at the pipeline's default text length they differ."""
    from diffusers import StableDiffusion3Pipeline

    from diffusion_rl.sampling import rollout

    checkpoint = _train(train_model, tiny_model_dir, tmp_path, "model.lora.enabled=true", "train.lr=1e-2",
                        "val.guidance=4.5", "model.max_sequence_length=12")  # fmt: skip
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    noise, sampled = [], []
    original_noise, original_sample = rollout.initial_noise, rollout.sample_images
    monkeypatch.setattr(rollout, "initial_noise", lambda *a: noise.append(original_noise(*a)) or noise[-1])
    record = lambda *a, **k: sampled.append(original_sample(*a, **k)) or sampled[-1]  # noqa: E731
    monkeypatch.setattr(rollout, "sample_images", record)
    prompt = "a red fox in the snow"  # the snippet's
    argv = ["sample", "--model", str(tiny_model_dir), "--checkpoint", str(checkpoint), "--prompt", prompt, "--device"]
    argv += ["cpu", "--out"]
    assert main([*argv, str(tmp_path / "grid.png")]) == 0

    drawn = []
    call = StableDiffusion3Pipeline.__call__

    def with_sample_noise(self, **kwargs):
        drawn.append(call(self, **{**kwargs, "latents": noise[0].clone(), "generator": None}))
        return drawn[-1]

    monkeypatch.setattr(StableDiffusion3Pipeline, "__call__", with_sample_noise)
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(_card(out)[1], "README.md", "exec"), namespace)
    ours = sampled[0][0].numpy().astype(int)  # [H, W, 3] uint8
    assert ours.shape == (32, 48, 3)
    assert np.abs(np.asarray(drawn[0].images[0], dtype=int) - ours).max() <= 1
    at_default = call(namespace["pipe"], prompt=prompt, latents=noise[0].clone(), num_inference_steps=2, height=32,
                      width=48, guidance_scale=4.5, negative_prompt="", output_type="np").images[0]  # fmt: skip
    # the pipeline's max_sequence_length 256: other embeddings (20 levels off here; equal above on AMD EPYC)
    assert np.abs(at_default * 255 - ours).max() > 2


def test_merged_export_card_runs_from_the_folder_with_true_cfg(qwen_image_model_dir, train_model, tmp_path,
                                                               monkeypatch):  # fmt: skip
    from diffusers import QwenImagePipeline

    checkpoint = _train(train_model, qwen_image_model_dir, tmp_path, "model.lora.enabled=false",
                        "sampling.guidance=2.5")  # fmt: skip
    out = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(checkpoint), "--merge", "--out", str(out)]) == 0
    front, code = _card(out)
    assert "lora" not in front["tags"] and "full fine-tuning" in (out / "README.md").read_text()
    call, _ = _run_snippet(code, QwenImagePipeline, monkeypatch, tmp_path)
    # its CFG is true_cfg_scale (default 4), run only with a negative prompt
    assert call["true_cfg_scale"] == 2.5 and call["negative_prompt"] == "" and "guidance_scale" not in call
    assert call["max_sequence_length"] == 16 and (call["height"], call["width"]) == (32, 48)


def test_a_video_familys_card_snippet_loads_the_lora_and_writes_the_video(wan_model_dir, train_model, tmp_path,
                                                                          monkeypatch):  # fmt: skip
    from diffusers import WanPipeline

    checkpoint = _train(train_model, wan_model_dir, tmp_path, "model.lora.enabled=true", "sampling.num_frames=5")
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    front, code = _card(out)
    assert "text-to-video" in front["tags"] and "export_to_video" in code
    call, namespace = _run_snippet(code, WanPipeline, monkeypatch, tmp_path, writes="sample.mp4")
    assert (call["num_frames"], call["height"], call["width"], call["num_inference_steps"]) == (5, 32, 48, 2)
    assert any("lora" in name for name, _ in namespace["pipe"].transformer.named_parameters())
    assert (tmp_path / "sample.mp4").stat().st_size > 0


def test_export_keeps_a_users_readme_without_force(flux_model_dir, train_model, tmp_path):
    checkpoint = _train(train_model, flux_model_dir, tmp_path, "model.lora.enabled=true")
    out = tmp_path / "lora"
    out.mkdir()
    (out / "README.md").write_text("mine")
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 2
    assert (out / "README.md").read_text() == "mine"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out), "--force"]) == 0
    assert _card(out)[0]["library_name"] == "diffusers"


# how each pipeline spells guidance 3 and the text length 16, where it is not guidance_scale=3, max_sequence_length=16:
# classifier-free guidance as true_cfg_scale (FLUX.1 without a guidance embedding, Qwen-Image), Z-Image's scale one
# below ours, Wan 2.1 I2V's context of 512 (its CLIP image tokens are split off 512 from the end)
SPELLING = {"flux_schnell": ("true_cfg_scale", 16), "qwen_image": ("true_cfg_scale", 16),
            "qwen_image_edit": ("true_cfg_scale", 16), "qwen_image_edit_2511": ("true_cfg_scale", 16),
            "wan_i2v": ("guidance_scale", 512), "wan_flf2v": ("guidance_scale", 512)}  # fmt: skip
GUIDANCE = {"z_image": 2.0}
# guidance-distilled (FLUX.1-dev and its Kontext: the scale is an input) or step-distilled (FLUX.2-klein: no CFG, nor
# a negative_prompt keyword): no negative prompt
NO_CFG = ("flux", "flux_kontext", "flux2")


@pytest.fixture
def every_family(family_dirs, edit_dirs, wan_i2v_model_dir, wan_flf2v_model_dir, tmp_path):
    dirs = {**family_dirs, **edit_dirs, "wan_i2v": wan_i2v_model_dir, "wan_flf2v": wan_flf2v_model_dir}
    dirs["wan_a14b"] = save_tiny(tmp_path / "a14b", "wan", "a14b", seed=0)
    return dirs


def test_every_familys_pipeline_takes_the_keywords_the_card_writes(every_family, load, make_config):
    seen = set()
    for name, path in every_family.items():
        model = load(path, family="wan_i2v" if name == "wan_ti2v" else "auto")
        cfg = make_config(f"model.path={path}", "sampling.guidance=3", "val.num_steps=7",
                          *(["sampling.guidance_low_noise=2"] if name == "wan_a14b" else []))  # fmt: skip
        takes = inspect.signature(type(model.pipeline).__call__).parameters
        wanted = model.pipeline_call_settings(3.0, 2.0 if name == "wan_a14b" else None)
        assert set(wanted) <= set(takes), (name, set(wanted) - set(takes))  # the family's own spelling is real
        call = pipeline_call(model, cfg)
        assert call["num_inference_steps"] == 7 and (call["height"], call["width"]) == (32, 32), name
        assert "max_sequence_length" in call and {"guidance_scale", "true_cfg_scale"} & set(call), name
        assert ("num_frames" in call) == model.video, name
        guidance_key, text = SPELLING.get(name, ("guidance_scale", 16))
        assert (call[guidance_key], call["max_sequence_length"]) == (GUIDANCE.get(name, 3.0), text), name
        assert ("negative_prompt" in call) == (name not in NO_CFG), name
        assert ("last_image" in call) == (name == "wan_flf2v"), name  # FLF2V samples from a first and a last frame
        # Kontext rescales any size to max_area (1024² by default); a run of text prompts reads no condition image
        assert call.get("max_area") == (32 * 32 if name == "flux_kontext" else None), name
        assert "_auto_resize" not in call, name
        seen.add(model.family)
    call = pipeline_call(model, cfg)  # the last: Wan 2.2 A14B, whose low-noise expert has a guidance of its own
    assert (call["guidance_scale"], call["guidance_scale_2"]) == (3.0, 2.0)
    from diffusion_rl.models.registry import load_families

    assert seen == set(load_families().names())


def test_a_kontext_cards_snippet_samples_at_the_runs_size(flux_kontext_model_dir, train_model, tmp_path, monkeypatch):
    """FluxKontextPipeline rescales any height × width to max_area (1024² by default): the snippet passes the run's
    area, so it samples at the run's 32 × 48, from the source resized as the run read it."""
    from diffusers import FluxKontextPipeline
    from PIL import Image

    edits = Path(__file__).resolve().parents[2] / "configs/prompts/shapes_edits"
    checkpoint = _train(train_model, flux_kontext_model_dir, tmp_path, "model.lora.enabled=true",
                        f"data.train={edits / 'train.jsonl'}", f"val.prompts={edits / 'val.jsonl'}")  # fmt: skip
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    Image.fromarray(np.full((96, 64, 3), 90, dtype=np.uint8)).save(tmp_path / "input.png")
    call, _ = _run_snippet(_card(out)[1], FluxKontextPipeline, monkeypatch, tmp_path)
    assert (call["height"], call["width"], call["max_area"], call["_auto_resize"]) == (32, 48, 32 * 48, False)
    assert call["image"].size == (48, 32)  # resized to the output size, as the run (condition_size output) read it
    assert Image.open(tmp_path / "sample.png").size == (48, 32)


def test_a_flux2_cards_snippet_passes_the_runs_references(flux2_model_dir, train_model, tmp_path, monkeypatch):
    """A FLUX.2 run on ShapesWorld edits (a reference per prompt, read at the output size): its card's snippet hands
    Flux2KleinPipeline the reference resized to the run's 64 × 96, which the pipeline keeps (it refuses images under
    64 px a side, so this run is not at 32 × 48)."""
    from diffusers import Flux2KleinPipeline
    from PIL import Image

    edits = Path(__file__).resolve().parents[2] / "configs/prompts/shapes_edits"
    checkpoint = _train(train_model, flux2_model_dir, tmp_path, "model.lora.enabled=true", "sampling.guidance=1",
                        "sampling.height=64", "sampling.width=96", f"data.train={edits / 'train.jsonl'}",
                        f"val.prompts={edits / 'val.jsonl'}")  # fmt: skip
    out = tmp_path / "lora"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    Image.fromarray(np.full((200, 120, 3), 90, dtype=np.uint8)).save(tmp_path / "input.png")
    seen, encode = [], Flux2KleinPipeline.prepare_image_latents

    def spy(self, images, *args, **kwargs):  # the reference pixels the pipeline hands its VAE
        seen.append(images[0].shape)
        return encode(self, images, *args, **kwargs)

    monkeypatch.setattr(Flux2KleinPipeline, "prepare_image_latents", spy)
    call, _ = _run_snippet(_card(out)[1], Flux2KleinPipeline, monkeypatch, tmp_path)
    assert call["image"].size == (96, 64) and (call["height"], call["width"]) == (64, 96)
    assert seen and tuple(seen[0][-2:]) == (64, 96)  # the pipeline's VAE reads the reference at the run's size
    assert Image.open(tmp_path / "sample.png").size == (96, 64)


@pytest.mark.parametrize("name", ["flux_kontext", "qwen_image_edit", "flux2"])
def test_the_snippet_reads_the_source_at_the_size_the_run_read_it(edit_dirs, flux2_model_dir, load, make_config,
                                                                  tmp_path, name):  # fmt: skip
    """At model.condition_size output the snippet resizes the source to the output size (Kontext: and turns its
    own resize off; FLUX.2's pipelines keep a reference's size; Qwen-Image-Edit's cannot be told, which the card
    says); at `pipeline` it hands the pipeline the file; a run of text prompts gets no image."""
    from diffusion_rl.checkpoint.model_card import _snippet

    model_dir = flux2_model_dir if name == "flux2" else edit_dirs[name]
    model = load(model_dir, max_sequence_length=512)
    family, pipeline = family_named(model.family), type(model.pipeline).__name__
    edits = Path(__file__).resolve().parents[2] / "configs/prompts/shapes_edits/train.jsonl"
    first_two = [str(edits.parent / json.loads(line)["images"][0]) for line in edits.read_text().splitlines()[:2]]
    (tmp_path / "two.jsonl").write_text(json.dumps({"prompt": "swap them", "images": first_two}) + "\n")

    def snippet(sizing, data=edits):
        cfg = make_config(f"model.path={model_dir}", f"model.condition_size={sizing}", "sampling.height=32",
                          "sampling.width=48", f"data.train={data}")  # fmt: skip
        return "\n".join(_snippet(model, cfg, family, pipeline, Path("out"), "base", True))

    texts = {sizing: snippet(sizing) for sizing in ("output", "pipeline")}
    assert 'image=load_image("input.png").resize((48, 32)),' in texts["output"]
    assert 'image=load_image("input.png"),' in texts["pipeline"] and ".resize(" not in texts["pipeline"]
    assert ("_auto_resize=False" in texts["output"]) == (name == "flux_kontext")
    assert "_auto_resize" not in texts["pipeline"]
    note = "resizes them to 832×1248 for its VAE whatever it is given"  # w / h 1.5: 1248 × 832
    assert (note in texts["output"]) == (name == "qwen_image_edit") and note not in texts["pipeline"]
    if name != "flux_kontext":  # several condition images per prompt: a list, each resized as the run read it
        two = 'image=[load_image("input_1.png").resize((48, 32)), load_image("input_2.png").resize((48, 32))],'
        assert two in snippet("output", tmp_path / "two.jsonl")
    if name != "qwen_image_edit":  # text prompts (the quickstart's): plain text-to-image, as the run sampled
        text = snippet("output", edits.parents[1] / "quickstart.txt")
        assert "image=" not in text and "load_image" not in text and "_auto_resize" not in text


def test_the_card_names_the_runs_own_negative_prompts(tiny_model_dir, load, make_config, tmp_path):
    from diffusion_rl.checkpoint.model_card import _snippet

    model = load(tiny_model_dir)  # SD3: classifier-free guidance, so the snippet passes negative_prompt=""
    family, pipeline = family_named(model.family), type(model.pipeline).__name__
    rows = [{"prompt": "a cat", "negative_prompt": "blurry"}, {"prompt": "a dog", "negative_prompt": "blurry"},
            {"prompt": "a fox", "negative_prompt": "text, watermark"}, {"prompt": "an owl"}]  # fmt: skip
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def card(*overrides):
        cfg = make_config("sampling.guidance=4.5", *overrides)
        return "\n".join(_snippet(model, cfg, family, pipeline, Path("out"), "base", True))

    text = card(f"val.prompts={tmp_path / 'val.jsonl'}")
    assert 'negative_prompt="",' in text
    assert 'negative prompts of their own (2 distinct, e.g. "blurry")' in text
    assert "of their own" not in card()  # the tiny run's prompt files carry none
    assert "of their own" not in card(f"val.prompts={tmp_path / 'gone.jsonl'}")  # a file not here: no note


def test_hub_id_only_for_hub_names_and_cache_snapshots(tmp_path):
    snapshot = "/root/.cache/huggingface/hub/models--black-forest-labs--FLUX.1-dev/snapshots/0ef5fff"
    assert hub_id(snapshot) == "black-forest-labs/FLUX.1-dev" and hub_commit(snapshot) is None  # not a commit
    assert hub_commit(snapshot.replace("0ef5fff", "0ef5fff" + "a" * 33)) == "0ef5fff" + "a" * 33
    assert hub_id("owner/not-here") == "owner/not-here" and hub_id("./owner/not-here") is None  # ./: never one
    assert hub_id("Qwen/Qwen-Image") == "Qwen/Qwen-Image"
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    assert hub_id(tmp_path / "models" / "tiny") is None and hub_id("/data/flux") is None and hub_id(None) is None


def test_an_image_argument_is_loaded_in_the_snippet():
    from diffusion_rl.checkpoint.model_card import _py
    from diffusion_rl.models.base import SnippetImage

    assert _py(SnippetImage("last.png")) == 'load_image("last.png")'
    assert (_py("a/b"), _py(2.5), _py(None)) == ('"a/b"', "2.5", "None")
