"""`hpsv2`: a tiny open_clip-layout checkpoint (the real key names of HPS_v2.1_compressed.pt), converted onto
transformers' CLIPModel, checked tensor by tensor and against a forward pass computed by hand from the open_clip
tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_rl.errors import UserError
from diffusion_rl.models.tiny.parts import build_tokenizers
from diffusion_rl.rewards import make_reward
from diffusion_rl.rewards.hps import LetterboxProcessor, openclip_to_clip

W, WT, E, HEADS, LAYERS, PATCH, SIZE, CONTEXT = 32, 24, 16, 2, 2, 8, 32, 77
OPENAI_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
OPENAI_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
PROMPTS = ["a red cube", "a photo of a dog on the beach", "text"]


def _block(prefix: str, width: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    return {
        f"{prefix}.ln_1.weight": 1 + r(width),
        f"{prefix}.ln_1.bias": r(width),
        f"{prefix}.attn.in_proj_weight": r(3 * width, width, scale=0.2),
        f"{prefix}.attn.in_proj_bias": r(3 * width),
        f"{prefix}.attn.out_proj.weight": r(width, width, scale=0.2),
        f"{prefix}.attn.out_proj.bias": r(width),
        f"{prefix}.ln_2.weight": 1 + r(width),
        f"{prefix}.ln_2.bias": r(width),
        f"{prefix}.mlp.c_fc.weight": r(4 * width, width, scale=0.2),
        f"{prefix}.mlp.c_fc.bias": r(4 * width),
        f"{prefix}.mlp.c_proj.weight": r(width, 4 * width, scale=0.1),
        f"{prefix}.mlp.c_proj.bias": r(width),
    }


def openclip_state(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random open_clip CLIP state dict with the key names and shapes of ViT-H-14 (tiny sizes)."""
    g = torch.Generator().manual_seed(seed)
    grid = SIZE // PATCH
    state = {
        "visual.class_embedding": torch.randn(W, generator=g) * 0.1,
        "visual.positional_embedding": torch.randn(grid * grid + 1, W, generator=g) * 0.1,
        "visual.proj": torch.randn(W, E, generator=g) * 0.2,
        "visual.conv1.weight": torch.randn(W, 3, PATCH, PATCH, generator=g) * 0.05,
        "visual.ln_pre.weight": 1 + torch.randn(W, generator=g) * 0.05,
        "visual.ln_pre.bias": torch.randn(W, generator=g) * 0.05,
        "visual.ln_post.weight": 1 + torch.randn(W, generator=g) * 0.05,
        "visual.ln_post.bias": torch.randn(W, generator=g) * 0.05,
        "positional_embedding": torch.randn(CONTEXT, WT, generator=g) * 0.1,
        "text_projection": torch.randn(WT, E, generator=g) * 0.2,
        "logit_scale": torch.tensor(4.6052),
        "token_embedding.weight": torch.randn(vocab, WT, generator=g) * 0.1,
        "ln_final.weight": 1 + torch.randn(WT, generator=g) * 0.05,
        "ln_final.bias": torch.randn(WT, generator=g) * 0.05,
    }
    for i in range(LAYERS):
        state.update(_block(f"visual.transformer.resblocks.{i}", W, g))
        state.update(_block(f"transformer.resblocks.{i}", WT, g))
    return state


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizers(32)[0]


@pytest.fixture(scope="module")
def hps_files(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("hps")
    state = openclip_state(len(tokenizer))
    torch.save({"state_dict": state}, root / "HPS_v2.1_compressed.pt")  # the authors' file layout
    tokenizer.save_pretrained(root / "tokenizer")
    return root, state


def test_conversion_moves_every_tensor_to_its_place(hps_files):
    _, state = hps_files
    config, converted = openclip_to_clip(state, HEADS, HEADS)
    expected = {
        "vision_model.embeddings.patch_embedding.weight": state["visual.conv1.weight"],
        "vision_model.embeddings.class_embedding": state["visual.class_embedding"],
        "vision_model.embeddings.position_embedding.weight": state["visual.positional_embedding"],
        "vision_model.pre_layrnorm.weight": state["visual.ln_pre.weight"],
        "vision_model.post_layernorm.bias": state["visual.ln_post.bias"],
        "visual_projection.weight": state["visual.proj"].T,
        "text_projection.weight": state["text_projection"].T,
        "text_model.embeddings.token_embedding.weight": state["token_embedding.weight"],
        "text_model.embeddings.position_embedding.weight": state["positional_embedding"],
        "text_model.final_layer_norm.weight": state["ln_final.weight"],
        "logit_scale": state["logit_scale"],
    }
    for tower, source, width in (("vision_model", "visual.transformer", W), ("text_model", "transformer", WT)):
        for i in range(LAYERS):
            src, dst = f"{source}.resblocks.{i}", f"{tower}.encoder.layers.{i}"
            for j, name in enumerate("qkv"):
                rows = slice(j * width, (j + 1) * width)
                expected[f"{dst}.self_attn.{name}_proj.weight"] = state[f"{src}.attn.in_proj_weight"][rows]
                expected[f"{dst}.self_attn.{name}_proj.bias"] = state[f"{src}.attn.in_proj_bias"][rows]
            pairs = [("ln_1", "layer_norm1"), ("ln_2", "layer_norm2"), ("attn.out_proj", "self_attn.out_proj"),
                     ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")]  # fmt: skip
            for a, b in pairs:
                for kind in ("weight", "bias"):
                    expected[f"{dst}.{b}.{kind}"] = state[f"{src}.{a}.{kind}"]
    assert set(expected) <= set(converted)
    for key, tensor in expected.items():
        assert torch.equal(converted[key], tensor), key
    assert len(converted) == len(state) + 4 * (2 * LAYERS)  # per block: in_proj weight, bias (2) -> q, k, v (6)
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (SIZE, PATCH)
    assert (config.text_config.hidden_size, config.projection_dim, config.text_config.num_hidden_layers) == (WT, E, 2)
    assert config.vision_config.hidden_act == config.text_config.hidden_act == "gelu"


def _hand_score(state, images_BHW3, prompts, tokenizer, hand) -> np.ndarray:
    """HPS = cos(image, text), every step from the open_clip tensors (eps 1e-5, exact GELU, causal text mask)."""
    pixels = (images_BHW3.astype(np.float32) / 255 - OPENAI_MEAN) / OPENAI_STD
    x = hand.patches(torch.from_numpy(pixels).permute(0, 3, 1, 2), state["visual.conv1.weight"])
    cls = state["visual.class_embedding"].expand(len(x), 1, W)
    x = torch.cat([cls, x], dim=1) + state["visual.positional_embedding"]
    x = hand.layer_norm(x, state["visual.ln_pre.weight"], state["visual.ln_pre.bias"], 1e-5)

    def block(prefix):
        return {
            "ln1": (state[f"{prefix}.ln_1.weight"], state[f"{prefix}.ln_1.bias"]),
            "qkv": (state[f"{prefix}.attn.in_proj_weight"], state[f"{prefix}.attn.in_proj_bias"]),
            "proj": (state[f"{prefix}.attn.out_proj.weight"], state[f"{prefix}.attn.out_proj.bias"]),
            "ln2": (state[f"{prefix}.ln_2.weight"], state[f"{prefix}.ln_2.bias"]),
            "fc1": (state[f"{prefix}.mlp.c_fc.weight"], state[f"{prefix}.mlp.c_fc.bias"]),
            "fc2": (state[f"{prefix}.mlp.c_proj.weight"], state[f"{prefix}.mlp.c_proj.bias"]),
        }

    for i in range(LAYERS):
        x = hand.prenorm_block(x, block(f"visual.transformer.resblocks.{i}"), HEADS, 1e-5)
    image = hand.layer_norm(x[:, 0], state["visual.ln_post.weight"], state["visual.ln_post.bias"], 1e-5)
    image = image @ state["visual.proj"]

    ids = tokenizer(prompts, padding="max_length", max_length=CONTEXT, return_tensors="pt")["input_ids"]
    t = state["token_embedding.weight"][ids] + state["positional_embedding"]
    causal = torch.full((CONTEXT, CONTEXT), float("-inf")).triu(1)
    for i in range(LAYERS):
        t = hand.prenorm_block(t, block(f"transformer.resblocks.{i}"), HEADS, 1e-5, causal)
    t = hand.layer_norm(t, state["ln_final.weight"], state["ln_final.bias"], 1e-5)
    text = t[torch.arange(len(ids)), ids.argmax(-1)] @ state["text_projection"]  # open_clip: the EOT (largest id)
    cos = (image * text).sum(-1) / (image.norm(dim=-1) * text.norm(dim=-1))
    return cos.numpy()


def test_score_equals_a_forward_pass_by_hand(hps_files, tokenizer, hand):
    root, state = hps_files
    images = np.random.default_rng(0).integers(0, 256, (3, SIZE, SIZE, 3), dtype=np.uint8)
    files = {"checkpoint": str(root / "HPS_v2.1_compressed.pt"), "tokenizer_path": str(root / "tokenizer")}
    reward = make_reward("hpsv2", **files, device="cpu", batch_size=2, vision_heads=HEADS, text_heads=HEADS)
    with torch.no_grad():
        expected = _hand_score(state, images, PROMPTS, tokenizer, hand)
    scores = reward(images, PROMPTS, [{}] * 3)
    assert scores.dtype == np.float32 and np.ptp(expected) > 0.05  # distinct scores, not a degenerate match
    np.testing.assert_allclose(scores, expected, atol=2e-5)


def test_letterbox_is_hpsv2s_preprocessing():
    image = np.zeros((64, 32, 3), dtype=np.uint8)  # tall: resized to 32 × 16, centred on a 32 × 32 black square
    image[:, :, 0] = 200
    out = LetterboxProcessor(32).letterbox(image)
    assert out.shape == (32, 32, 3)
    assert (out[:, :8] == 0).all() and (out[:, 24:] == 0).all() and (out[:, 8:24, 0] == 200).all()
    same = np.zeros((32, 32, 3), dtype=np.uint8)
    assert LetterboxProcessor(32).letterbox(same) is same
    pixels = LetterboxProcessor(32)([same], return_tensors="pt")["pixel_values"][0].numpy()
    np.testing.assert_allclose(pixels[:, 0, 0], -OPENAI_MEAN / OPENAI_STD, rtol=1e-6)
    wide = np.asarray(Image.new("RGB", (48, 24), (10, 20, 30)))
    assert LetterboxProcessor(32).letterbox(wide).shape == (32, 32, 3)


def test_wrong_checkpoints_are_errors_naming_what(hps_files, tmp_path):
    root, state = hps_files
    with pytest.raises(UserError, match="checkpoint keys with no place in CLIPModel: \\['visual.extra'\\]"):
        openclip_to_clip({**state, "visual.extra": torch.zeros(1)}, HEADS, HEADS)
    with pytest.raises(UserError, match="not an open_clip CLIP state dict"):
        openclip_to_clip({"weight": torch.zeros(1)})
    with pytest.raises(UserError, match="huggingface-cli download xswu/HPSv2"):
        make_reward("hpsv2", checkpoint=str(tmp_path / "missing.pt"), tokenizer_path=str(root / "tokenizer"))
    with pytest.raises(UserError, match="not divisible by vision_heads=5"):
        openclip_to_clip(state, 5, HEADS)
