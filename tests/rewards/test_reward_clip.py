"""CLIP-family rewards on a tiny random CLIPModel saved with save_pretrained; expected values computed by hand."""

import json

import numpy as np
import pytest
import torch
from transformers import CLIPConfig, CLIPModel

from diffusion_rl.errors import UserError
from diffusion_rl.models.tiny.parts import build_tokenizers
from diffusion_rl.rewards import make_reward

SIZE = 32  # the tiny model's input size: images of this size go in without resizing
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
PROMPTS = ["a red cube", "a photo of a dog on the beach", "text"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_clip")
    tokenizer, _ = build_tokenizers(32)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=512,
        eos_token_id=513,
        pad_token_id=513,
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=SIZE, patch_size=8
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CLIPModel(
            CLIPConfig(text_config=text, vision_config=vision, projection_dim=16, logit_scale_init_value=3.0)
        )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    preprocessor = {
        "size": {"shortest_edge": SIZE},
        "crop_size": {"height": SIZE, "width": SIZE},
        "image_mean": MEAN,
        "image_std": STD,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return directory


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).integers(0, 256, size=(3, SIZE, SIZE, 3), dtype=np.uint8)


def _hand_cosines(clip_dir, images, prompts):
    """cos(image, text) from get_image_features/get_text_features, with pixels normalised by hand."""
    model = CLIPModel.from_pretrained(clip_dir).eval()
    tokenizer, _ = build_tokenizers(32)
    pixels = (images.astype(np.float32) / 255 - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    pixels_BCHW = torch.from_numpy(pixels).permute(0, 3, 1, 2)
    tokens = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        image = model.get_image_features(pixel_values=pixels_BCHW).pooler_output
        text = model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        text = text.pooler_output
        cos = (image * text).sum(-1) / (image.norm(dim=-1) * text.norm(dim=-1))
        logit_scale = float(model.logit_scale.exp())
    return cos.numpy(), logit_scale, image.numpy()


def test_clip_score_is_100_times_the_clipped_cosine(clip_dir, images):
    cos, _, _ = _hand_cosines(clip_dir, images, PROMPTS)
    assert (cos > 0).any() and (cos < 0).any()  # both sides of the clipping are exercised
    scores = make_reward("clip_score", path=str(clip_dir), device="cpu", batch_size=2)(images, PROMPTS, [{}] * 3)
    assert scores.dtype == np.float32 and scores.shape == (3,)
    np.testing.assert_allclose(scores, 100 * np.maximum(cos, 0), atol=1e-4)


def test_pickscore_is_logit_scale_times_the_cosine(clip_dir, images):
    cos, logit_scale, _ = _hand_cosines(clip_dir, images, PROMPTS)
    assert logit_scale == pytest.approx(np.exp(3.0), rel=1e-5)
    scores = make_reward("pickscore", path=str(clip_dir), device="cpu")(images, PROMPTS, [{}] * 3)
    np.testing.assert_allclose(scores, logit_scale * cos, atol=1e-5)


def test_pickscore_s_logit_scale_is_read_before_the_weights_are_cast(clip_dir):
    from diffusion_rl.rewards.clip import ClipEncoder

    # log scale 3.0: e³ = 20.0855 in fp32; in bf16 it would be 20.0 (PickScore's ~100: 99)
    encoder = ClipEncoder(str(clip_dir), device="cpu", dtype="bfloat16")
    assert encoder.model.dtype == torch.bfloat16
    assert encoder.logit_scale == pytest.approx(np.exp(3.0), rel=1e-6)


def _aesthetic_state(embed_dim: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sizes = {"0": (1024, embed_dim), "2": (128, 1024), "4": (64, 128), "6": (16, 64), "7": (1, 16)}
    state = {}
    for index, (out_features, in_features) in sizes.items():
        state[f"layers.{index}.weight"] = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
        state[f"layers.{index}.bias"] = torch.randn(out_features, generator=generator) * 0.1
    return state


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_aesthetic_is_the_mlp_on_normalised_image_embeddings(clip_dir, images, tmp_path, suffix):
    state = _aesthetic_state(embed_dim=16)
    head_path = tmp_path / f"head{suffix}"
    if suffix == ".pth":
        torch.save(state, head_path)
    else:
        from safetensors.torch import save_file

        save_file(state, str(head_path))
    _, _, image_features = _hand_cosines(clip_dir, images, PROMPTS)
    # By hand: the LAION MLP is five affine layers with no activation in between (dropout is off at inference).
    x = image_features / np.linalg.norm(image_features, axis=-1, keepdims=True)
    for index in ("0", "2", "4", "6", "7"):
        x = x @ state[f"layers.{index}.weight"].numpy().T + state[f"layers.{index}.bias"].numpy()
    reward = make_reward("aesthetic", path=str(clip_dir), head_path=str(head_path), device="cpu")
    np.testing.assert_allclose(reward(images, PROMPTS, [{}] * 3), x[:, 0], rtol=1e-4, atol=1e-5)


def test_aesthetic_head_for_another_embedding_size_is_a_clear_error(clip_dir, tmp_path):
    head_path = tmp_path / "vit_l14_head.pth"
    torch.save(_aesthetic_state(embed_dim=768), head_path)
    with pytest.raises(UserError, match=r"does not fit the LAION aesthetic MLP on 16-d.*layers\.0\.weight"):
        make_reward("aesthetic", path=str(clip_dir), head_path=str(head_path), device="cpu")


def test_missing_model_directory_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        make_reward("clip_score", path=str(tmp_path / "nope"))
    with pytest.raises(UserError) as pick:
        make_reward("pickscore", path=str(tmp_path / "pick"))
    assert str(pick.value).endswith(
        f"`huggingface-cli download yuvalkirstain/PickScore_v1 --local-dir {tmp_path}/pick`"
    )
    with pytest.raises(UserError) as processor:
        make_reward("pickscore", path=str(tmp_path), processor_path=str(tmp_path / "proc"))
    hint = f"`huggingface-cli download laion/CLIP-ViT-H-14-laion2B-s32B-b79K --local-dir {tmp_path}/proc`"
    assert str(processor.value).endswith(hint)
    for name, kwargs in (("clip_score", {}), ("aesthetic", {"head_path": "h.pth"})):
        with pytest.raises(UserError) as clip:
            make_reward(name, path=str(tmp_path / "clip"), **kwargs)
        assert f"download openai/clip-vit-large-patch14 --local-dir {tmp_path}/clip" in str(clip.value)
    with pytest.raises(UserError, match="unknown dtype"):
        make_reward("clip_score", path=str(tmp_path), dtype="fp8")


# ---- preprocessing: transformers' CLIPImageProcessorPil, checked against normalisation and resizing by hand ----


def _by_hand(image_HW3: np.ndarray) -> np.ndarray:
    """Shorter side to SIZE (PIL bicubic), centre crop SIZE × SIZE, /255, normalise: [3, SIZE, SIZE]."""
    from PIL import Image

    h, w = image_HW3.shape[:2]
    if min(h, w) != SIZE:
        new = (SIZE, int(SIZE * w / h)) if h <= w else (int(SIZE * h / w), SIZE)
        image_HW3 = np.asarray(Image.fromarray(image_HW3).resize((new[1], new[0]), Image.Resampling.BICUBIC))
        h, w = image_HW3.shape[:2]
    top, left = (h - SIZE) // 2, (w - SIZE) // 2
    crop = image_HW3[top : top + SIZE, left : left + SIZE].astype(np.float32) / 255
    return ((crop - np.array(MEAN, np.float32)) / np.array(STD, np.float32)).transpose(2, 0, 1)


@pytest.mark.parametrize("shape", [(SIZE, SIZE), (SIZE, 48), (56, SIZE), (48, 48), (40, 72)])
def test_pixel_values_are_the_pil_clip_preprocessing(clip_dir, shape):
    from diffusion_rl.rewards.clip import ClipEncoder

    images = np.random.default_rng(1).integers(0, 256, size=(2, *shape, 3), dtype=np.uint8)
    pixels = ClipEncoder(str(clip_dir), device="cpu").pixel_values(images).numpy()
    expected = np.stack([_by_hand(image) for image in images])
    # no resize (model size, or a crop only): exact up to float rounding, as the torch preprocessing it replaced;
    # after a resize PIL's bicubic is the reference (the old torch resize differed by ≤ 0.2 % in the scores)
    np.testing.assert_allclose(pixels, expected, atol=1e-6 if min(shape) == SIZE else 1e-5)
