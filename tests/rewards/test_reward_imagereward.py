"""`imagereward`: a tiny ImageReward.pt written with the authors' key names (BLIP timm-style ViT, med.py BERT with
cross-attention, MLP head) and med_config.json, loaded through transformers' BLIP classes, and checked against a
forward pass written by hand from the checkpoint's tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import BertTokenizer

from diffusion_rl.errors import UserError
from diffusion_rl.rewards import make_reward
from diffusion_rl.rewards.imagereward import MEAN, STD, map_imagereward_state

VW, TW, HEADS, LAYERS, PATCH, SIZE = 32, 48, 2, 2, 8, 32  # ViT width, BERT width, ...
OPENAI_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
OPENAI_STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
WORDS = ["a", "red", "cube", "photo", "of", "dog", "on", "the", "beach", "text", "sign"]
PROMPTS = ["a red cube", "a photo of a dog on the beach", "text on a sign"]
MED = {  # the keys of ImageReward's med_config.json (a BertConfig), tiny sizes
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": TW,
    "initializer_range": 0.02,
    "intermediate_size": 2 * TW,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 40,
    "model_type": "bert",
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": 5 + len(WORDS) + 2,  # + [DEC] and [ENC], which BLIP adds to bert-base-uncased's vocabulary
    "encoder_width": 768,
    "add_cross_attention": True,
}


def _r(g, *shape, scale=0.1):
    return torch.randn(*shape, generator=g) * scale


def imagereward_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random ImageReward state dict with the key names of the published ImageReward.pt (tiny sizes)."""
    g = torch.Generator().manual_seed(seed)
    grid = SIZE // PATCH
    v = "blip.visual_encoder"
    state = {
        f"{v}.cls_token": _r(g, 1, 1, VW),
        f"{v}.pos_embed": _r(g, 1, grid * grid + 1, VW),
        f"{v}.patch_embed.proj.weight": _r(g, VW, 3, PATCH, PATCH, scale=0.05),
        f"{v}.patch_embed.proj.bias": _r(g, VW),
        f"{v}.norm.weight": 1 + _r(g, VW),
        f"{v}.norm.bias": _r(g, VW),
        "blip.vision_proj.weight": _r(g, 16, VW),  # unused by ImageReward: present in the real file
        "blip.vision_proj.bias": _r(g, 16),
        "blip.text_proj.weight": _r(g, 16, TW),
        "blip.text_proj.bias": _r(g, 16),
    }
    for i in range(LAYERS):
        b = f"{v}.blocks.{i}"
        state.update({
            f"{b}.norm1.weight": 1 + _r(g, VW), f"{b}.norm1.bias": _r(g, VW),
            f"{b}.attn.qkv.weight": _r(g, 3 * VW, VW, scale=0.2), f"{b}.attn.qkv.bias": _r(g, 3 * VW),
            f"{b}.attn.proj.weight": _r(g, VW, VW, scale=0.2), f"{b}.attn.proj.bias": _r(g, VW),
            f"{b}.norm2.weight": 1 + _r(g, VW), f"{b}.norm2.bias": _r(g, VW),
            f"{b}.mlp.fc1.weight": _r(g, 4 * VW, VW, scale=0.2), f"{b}.mlp.fc1.bias": _r(g, 4 * VW),
            f"{b}.mlp.fc2.weight": _r(g, VW, 4 * VW, scale=0.1), f"{b}.mlp.fc2.bias": _r(g, VW),
        })  # fmt: skip
    t = "blip.text_encoder"
    state.update({
        f"{t}.embeddings.position_ids": torch.arange(MED["max_position_embeddings"])[None],
        f"{t}.embeddings.word_embeddings.weight": _r(g, MED["vocab_size"], TW),
        f"{t}.embeddings.position_embeddings.weight": _r(g, MED["max_position_embeddings"], TW),
        f"{t}.embeddings.LayerNorm.weight": 1 + _r(g, TW), f"{t}.embeddings.LayerNorm.bias": _r(g, TW),
    })  # fmt: skip
    for i in range(LAYERS):
        b = f"{t}.encoder.layer.{i}"
        for part, kv_width in (("attention", TW), ("crossattention", VW)):
            state.update({
                f"{b}.{part}.self.query.weight": _r(g, TW, TW, scale=0.2), f"{b}.{part}.self.query.bias": _r(g, TW),
                f"{b}.{part}.self.key.weight": _r(g, TW, kv_width, scale=0.2), f"{b}.{part}.self.key.bias": _r(g, TW),
                f"{b}.{part}.self.value.weight": _r(g, TW, kv_width, scale=0.2),
                f"{b}.{part}.self.value.bias": _r(g, TW),
                f"{b}.{part}.output.dense.weight": _r(g, TW, TW, scale=0.2), f"{b}.{part}.output.dense.bias": _r(g, TW),
                f"{b}.{part}.output.LayerNorm.weight": 1 + _r(g, TW), f"{b}.{part}.output.LayerNorm.bias": _r(g, TW),
            })  # fmt: skip
        state.update({
            f"{b}.intermediate.dense.weight": _r(g, 2 * TW, TW, scale=0.2),
            f"{b}.intermediate.dense.bias": _r(g, 2 * TW),
            f"{b}.output.dense.weight": _r(g, TW, 2 * TW, scale=0.1), f"{b}.output.dense.bias": _r(g, TW),
            f"{b}.output.LayerNorm.weight": 1 + _r(g, TW), f"{b}.output.LayerNorm.bias": _r(g, TW),
        })  # fmt: skip
    for index, (out_f, in_f) in {
        "0": (1024, TW),
        "2": (128, 1024),
        "4": (64, 128),
        "6": (16, 64),
        "7": (1, 16),
    }.items():
        state[f"mlp.layers.{index}.weight"] = _r(g, out_f, in_f, scale=1 / in_f**0.5)
        state[f"mlp.layers.{index}.bias"] = _r(g, out_f)
    return state


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagereward")
    state = imagereward_state()
    torch.save(state, root / "ImageReward.pt")
    (root / "med_config.json").write_text(json.dumps(MED))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (root / "bert").mkdir()
    (root / "bert" / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return root, state


def _hand_reward(state, images_BHW3, prompts, tokenizer, hand) -> np.ndarray:
    """ImageReward's forward, every step from the checkpoint's tensors."""
    s = state
    pixels = (images_BHW3.astype(np.float32) / 255 - OPENAI_MEAN) / OPENAI_STD
    x = hand.patches(torch.from_numpy(pixels).permute(0, 3, 1, 2), s["blip.visual_encoder.patch_embed.proj.weight"],
                     s["blip.visual_encoder.patch_embed.proj.bias"])  # fmt: skip
    x = torch.cat([s["blip.visual_encoder.cls_token"].expand(len(x), 1, VW), x], 1) + s["blip.visual_encoder.pos_embed"]
    for i in range(LAYERS):
        b = f"blip.visual_encoder.blocks.{i}"
        pairs = {
            "ln1": "norm1",
            "qkv": "attn.qkv",
            "proj": "attn.proj",
            "ln2": "norm2",
            "fc1": "mlp.fc1",
            "fc2": "mlp.fc2",
        }
        x = hand.prenorm_block(
            x, {k: (s[f"{b}.{n}.weight"], s[f"{b}.{n}.bias"]) for k, n in pairs.items()}, HEADS, 1e-6
        )
    image = hand.layer_norm(x, s["blip.visual_encoder.norm.weight"], s["blip.visual_encoder.norm.bias"], 1e-6)

    tokens = tokenizer(prompts, padding="max_length", max_length=35, return_tensors="pt")
    ids, mask = tokens["input_ids"], tokens["attention_mask"]
    t = "blip.text_encoder"
    h = s[f"{t}.embeddings.word_embeddings.weight"][ids] + s[f"{t}.embeddings.position_embeddings.weight"][:35]
    h = hand.layer_norm(h, s[f"{t}.embeddings.LayerNorm.weight"], s[f"{t}.embeddings.LayerNorm.bias"], 1e-12)
    padding = ((1 - mask) * -1e9)[:, None, None, :].float()  # [B, 1, 1, T]: no attention to padding

    def wb(name):
        return s[f"{name}.weight"], s[f"{name}.bias"]

    for i in range(LAYERS):  # post-norm BERT layers: self-attention, cross-attention to the image, feed-forward
        b = f"{t}.encoder.layer.{i}"
        for part, source, mask_ in (("attention", None, padding), ("crossattention", image, None)):
            kv = h if source is None else source
            a = hand.attention(h, kv, wb(f"{b}.{part}.self.query"), wb(f"{b}.{part}.self.key"),
                               wb(f"{b}.{part}.self.value"), wb(f"{b}.{part}.output.dense"), HEADS, mask_)  # fmt: skip
            h = hand.layer_norm(h + a, *wb(f"{b}.{part}.output.LayerNorm"), 1e-12)
        f = hand.gelu(h @ s[f"{b}.intermediate.dense.weight"].T + s[f"{b}.intermediate.dense.bias"])
        h = hand.layer_norm(h + f @ s[f"{b}.output.dense.weight"].T + s[f"{b}.output.dense.bias"],
                            *wb(f"{b}.output.LayerNorm"), 1e-12)  # fmt: skip
    z = h[:, 0]
    for index in ("0", "2", "4", "6", "7"):  # the MLP: linear layers only (dropout is off)
        z = z @ s[f"mlp.layers.{index}.weight"].T + s[f"mlp.layers.{index}.bias"]
    return ((z[:, 0] - MEAN) / STD).numpy()


def test_reward_equals_a_forward_pass_by_hand(files, hand):
    root, state = files
    reward = make_reward("imagereward", checkpoint=str(root / "ImageReward.pt"), tokenizer_path=str(root / "bert"),
                         device="cpu", batch_size=2, vision_heads=HEADS)  # fmt: skip
    images = np.random.default_rng(0).integers(0, 256, (3, SIZE, SIZE, 3), dtype=np.uint8)
    with torch.no_grad():
        expected = _hand_reward(state, images, PROMPTS, BertTokenizer(str(root / "bert" / "vocab.txt")), hand)
    scores = reward(images, PROMPTS, [{}] * 3)
    assert scores.dtype == np.float32 and np.ptp(expected) > 0.01  # distinct scores
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)


def test_reward_in_bfloat16_is_the_fp32_reward_within_bf16_rounding(files):
    root, _ = files
    kwargs = dict(checkpoint=str(root / "ImageReward.pt"), tokenizer_path=str(root / "bert"), device="cpu",
                  batch_size=2, vision_heads=HEADS)  # fmt: skip
    images = np.random.default_rng(0).integers(0, 256, (3, SIZE, SIZE, 3), dtype=np.uint8)
    fp32 = make_reward("imagereward", **kwargs)(images, PROMPTS, [{}] * 3)
    bf16 = make_reward("imagereward", dtype="bfloat16", **kwargs)(images, PROMPTS, [{}] * 3)
    assert bf16.dtype == np.float32
    # bf16 keeps 8 bits of mantissa: the tiny model's scores (spread > 0.01) agree to a few of its steps
    np.testing.assert_allclose(bf16, fp32, atol=0.05 * max(1.0, float(np.abs(fp32).max())))


def test_every_checkpoint_tensor_is_used_but_the_itc_projections(files):
    _, state = files
    mapped, unused = map_imagereward_state(state)
    itc = [f"blip.{m}_proj.{k}" for m in ("text", "vision") for k in ("bias", "weight")]
    assert sorted(unused) == ["blip.text_encoder.embeddings.position_ids", *itc]  # position_ids: rebuilt
    assert len(mapped) == len(state) - len(unused)
    pairs = [
        ("vision.encoder.layers.1.self_attn.projection.weight", "blip.visual_encoder.blocks.1.attn.proj.weight"),
        ("vision.encoder.layers.0.layer_norm2.bias", "blip.visual_encoder.blocks.0.norm2.bias"),
        ("vision.post_layernorm.weight", "blip.visual_encoder.norm.weight"),
        ("text.encoder.layer.0.crossattention.self.key.weight",
         "blip.text_encoder.encoder.layer.0.crossattention.self.key.weight"),
        ("head.layers.6.weight", "mlp.layers.6.weight"),
    ]  # fmt: skip
    for target, source in pairs:
        assert torch.equal(mapped[target], state[source]), target


def test_missing_files_and_tensors_are_errors_naming_them(files, tmp_path):
    root, state = files
    with pytest.raises(UserError, match="huggingface-cli download THUDM/ImageReward ImageReward.pt med_config.json"):
        make_reward("imagereward", checkpoint=str(tmp_path / "none.pt"), tokenizer_path=str(root / "bert"))
    broken = {k: v for k, v in state.items() if "blocks.1.mlp.fc2.bias" not in k}
    torch.save(broken, tmp_path / "ImageReward.pt")
    (tmp_path / "med_config.json").write_text(json.dumps(MED))
    with pytest.raises(UserError, match="missing \\['vision.encoder.layers.1.mlp.fc2.bias'\\]"):
        make_reward("imagereward", checkpoint=str(tmp_path / "ImageReward.pt"), tokenizer_path=str(root / "bert"),
                    vision_heads=HEADS)  # fmt: skip
