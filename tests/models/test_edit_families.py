"""Qwen-Image-Edit (Plus) and FLUX.1 Kontext: the tiny models round trip, the velocity with condition images equals
the pipelines' own way of computing it, each distinct image is encoded once, and bad batches are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_rl.errors import UserError
from diffusion_rl.models.packed import tokens_of
from diffusion_rl.models.tiny import build_tiny

EDITS = ["qwen_image_edit", "qwen_image_edit_2511", "flux_kontext"]
PRESET = {"qwen_image_edit": ("qwen_image_edit", "small"), "qwen_image_edit_2511": ("qwen_image_edit", "2511"),
          "flux_kontext": ("flux_kontext", "small")}  # fmt: skip


def sources(n: int, seed: int = 0, size: int = 32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]


def load_edit(path, load):
    return load(path, max_sequence_length=512)  # Qwen-Image-Edit: ~200 tokens of a 384 px picture with the text


@pytest.mark.parametrize("name", EDITS)
def test_saved_tiny_edit_model_loads_back_bit_identical_with_a_real_layout(edit_dirs, load, name):
    family, preset = PRESET[name]
    built, model = build_tiny(family, preset, seed=0), load_edit(edit_dirs[name], load)
    assert model.family == family
    for part in ("transformer", "vae", "text_encoder"):
        expected, actual = getattr(built, part).state_dict(), getattr(model.pipeline, part).state_dict()
        assert all(torch.equal(actual[k], v) for k, v in expected.items()), part
    index = json.loads((edit_dirs[name] / "model_index.json").read_text())
    if family == "qwen_image_edit":
        assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
        names = {p.name for p in (edit_dirs[name] / "processor").iterdir()}
        assert {"preprocessor_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
        assert model.pipeline.transformer.config.zero_cond_t is (preset == "2511")


def test_edit_tokenizer_makes_the_template_prefix_exactly_the_tokens_the_pipeline_drops(edit_dirs, load):
    pipeline = load_edit(edit_dirs["qwen_image_edit"], load).pipeline
    prefix = pipeline.prompt_template_encode.split("{}")[0]
    ids = pipeline.tokenizer(prefix).input_ids
    assert len(ids) == pipeline.prompt_template_encode_start_idx == 64
    assert pipeline.tokenizer.decode(ids) == prefix
    ids, config = pipeline.tokenizer.convert_tokens_to_ids, pipeline.text_encoder.config  # the ids it expects
    assert ids("<|image_pad|>") == config.image_token_id
    assert (ids("<|vision_start|>"), ids("<|vision_end|>")) == (
        config.vision_start_token_id,
        config.vision_end_token_id,
    )


def _kontext_reference(model, x, text, image, sigma, guidance):
    """FluxKontextPipeline's velocity, step by step as its __call__ does (prepare_latents with the image)."""
    pipe = model.pipeline
    embeds, pooled, text_ids = pipe.encode_prompt(
        prompt=[text], prompt_2=None, max_sequence_length=model.max_sequence_length
    )
    pixels = pipe.image_processor.preprocess(Image.fromarray(image), 32, 32)
    channels = pipe.transformer.config.in_channels // 4
    latents, image_latents, latent_ids, image_ids = pipe.prepare_latents(
        pixels, 1, channels, 32, 32, torch.float32, "cpu", None, latents=tokens_of(x)
    )
    v = pipe.transformer(
        hidden_states=torch.cat([latents, image_latents], dim=1),
        timestep=torch.tensor([sigma]),
        guidance=torch.tensor([guidance]),
        pooled_projections=pooled,
        encoder_hidden_states=embeds,
        txt_ids=text_ids,
        img_ids=torch.cat([latent_ids, image_ids]),
        return_dict=False,
    )[0]
    return v[:, : latents.shape[1]]


def _qwen_edit_reference(model, x, text, negative, images, sigma, guidance):
    """QwenImageEditPlusPipeline's velocity (true CFG, norm rescale), step by step as its __call__ does."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    pipe = model.pipeline
    pictures = [Image.fromarray(image) for image in images]
    shown = []
    for picture in pictures:
        w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, picture.width / picture.height)
        shown.append(pipe.image_processor.resize(picture, h, w))
    vae_images = [pipe.image_processor.preprocess(picture, 32, 32).unsqueeze(2) for picture in pictures]
    channels = pipe.transformer.config.in_channels // 4
    latents, image_latents = pipe.prepare_latents(
        vae_images, 1, channels, 32, 32, torch.float32, "cpu", None, latents=tokens_of(x)
    )
    h, w = x.shape[1:3]
    img_shapes = [[(1, h, w)] + [(1, h, w)] * len(images)]
    velocities = []
    for prompt in (text, negative):
        embeds, mask = pipe.encode_prompt(image=shown, prompt=[prompt])
        v = pipe.transformer(
            hidden_states=torch.cat([latents, image_latents], dim=1),
            timestep=torch.tensor([sigma]),
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=img_shapes,
            return_dict=False,
        )[0]
        velocities.append(v[:, : latents.shape[1]])
    cond, uncond = velocities
    combined = uncond + guidance * (cond - uncond)
    return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))


@pytest.mark.parametrize("name", EDITS)
def test_velocity_with_condition_images_is_the_pipelines(edit_dirs, load, name):
    model = load_edit(edit_dirs[name], load)
    two = name != "flux_kontext"  # Qwen-Image-Edit Plus takes several images; Kontext one
    images = sources(2 if two else 1, seed=4)
    x = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode_prompts(["make the circle blue"], ["blurry"], [images])
    with torch.no_grad():
        if name == "flux_kontext":
            expected = _kontext_reference(model, x, "make the circle blue", images[0], 0.6, 3.5)
            v = model.velocity(x, 0.6, cond, 3.5)
        else:
            expected = _qwen_edit_reference(model, x, "make the circle blue", "blurry", images, 0.6, 4.0)
            v = model.velocity(x, 0.6, cond, 4.0)
    assert v.shape == x.shape
    assert torch.allclose(v.reshape(1, -1, x.shape[-1]), expected, atol=2e-5), (v.flatten()[:4], expected.flatten()[:4])
    with torch.no_grad():  # the condition image matters: another source gives another velocity
        other = model.velocity(x, 0.6, model.encode_prompts(["make the circle blue"], ["blurry"], [sources(
            len(images), seed=5)]), 4.0)  # fmt: skip
    assert (other - v).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["qwen_image_edit", "flux_kontext"])
def test_each_distinct_condition_image_is_encoded_once(edit_dirs, load, name):
    model = load_edit(edit_dirs[name], load)
    a, b = sources(2, seed=7)
    encoded = []
    encode = model.encode
    model.encode = lambda images: encoded.append(len(images)) or encode(images)
    rows = [[a], [a.copy()], [b], [a]]  # the same pixels twice over: one image
    cond = model.encode_prompts(["edit", "edit", "edit", "other"], None, rows)
    assert encoded == [2]
    latents = cond["image_latents"]
    assert latents.shape[:2] == (4, 1)
    assert torch.equal(latents[0], latents[1]) and torch.equal(latents[0], latents[3])
    assert not torch.equal(latents[0], latents[2])
    if name == "qwen_image_edit":  # the text encoder sees (text, images): 3 distinct prompts + the negative ""
        embeds = cond["prompt_embeds"]
        assert torch.equal(embeds[0], embeds[1]) and not torch.equal(embeds[0], embeds[2])


def test_bad_condition_batches_are_refused(edit_dirs, family_dirs, load):
    qwen = load_edit(edit_dirs["qwen_image_edit"], load)
    with pytest.raises(UserError, match="needs a condition image"):
        qwen.encode_prompts(["edit"], None, None)
    with pytest.raises(UserError, match="same number of condition images"):
        qwen.encode_prompts(["edit", "edit"], None, [sources(1), sources(2)])
    kontext = load_edit(edit_dirs["flux_kontext"], load)
    with pytest.raises(UserError, match="at most 1 condition image"):
        kontext.encode_prompts(["edit"], None, [sources(2)])
    assert kontext.encode_prompts(["a red circle"]).get("image_latents", None) is None  # no image: plain FLUX
    readers = r"\(flux2, flux_kontext, qwen_image_edit, wan_i2v\)"
    with pytest.raises(UserError, match=r"takes no condition images.*" + readers):
        load(family_dirs["sd3"]).encode_prompts(["edit"], None, [sources(1)])


def test_too_long_a_prompt_with_its_pictures_names_the_setting(edit_dirs, load):
    model = load(edit_dirs["qwen_image_edit"], max_sequence_length=64)
    with pytest.raises(UserError, match="model.max_sequence_length=64"):
        model.encode_prompts(["edit"], None, [sources(1)])
