"""`imagereward`: ImageReward (Xu et al. 2023), a BLIP ViT-L image encoder, a BERT text encoder that cross-attends to
the image, and an MLP on the [CLS] feature; trained on human rankings of generated images.

    reward = (MLP(text_encoder(prompt, image)[:, 0]) − 0.16717362830052426) / 1.0333394966054072

(the authors' normalisation: about mean 0 and std 1 on their data). The weights are the files the authors
publish in the Hugging Face repo THUDM/ImageReward: `ImageReward.pt` (the state dict of their `ImageReward` module:
keys `blip.visual_encoder.*`, `blip.text_encoder.*`, `mlp.layers.*`) and `med_config.json` (the BERT config, a
BertConfig JSON); the tokenizer is bert-base-uncased's (`tokenizer_path`).

They load onto transformers' BLIP classes: `BlipVisionModel` (BLIP's timm-style ViT, LayerNorm eps 1e-6) and
`BlipTextModel` (the port of BLIP's med.py BERT, with cross-attention), key by key:

    blip.visual_encoder.cls_token / pos_embed   -> vision.embeddings.class_embedding / position_embedding
    blip.visual_encoder.patch_embed.proj.*       -> vision.embeddings.patch_embedding.*
    blip.visual_encoder.blocks.i.norm1 / norm2   -> vision.encoder.layers.i.layer_norm1 / layer_norm2
    ...attn.qkv / attn.proj                      -> ...self_attn.qkv / self_attn.projection
    ...mlp.fc1 / mlp.fc2                         -> ...mlp.fc1 / mlp.fc2
    blip.visual_encoder.norm                     -> vision.post_layernorm
    blip.text_encoder.<name>                     -> text.<name>   (the same names; position_ids is rebuilt)
    mlp.layers.{0,2,4,6,7}                       -> head.layers.{0,2,4,6,7}

The checkpoint's other keys (blip.vision_proj, blip.text_proj: ITC projections ImageReward does not use) are left
out, as the authors' own `load_state_dict(strict=False)` leaves them; a key the model needs and the file lacks is
an error naming it. The ViT's head count is not in the tensors: ViT-L has 16 (head width 64, the default).

Preprocessing is BLIP's in ImageReward: shorter side to 224 (PIL bicubic), centre crop, OpenAI CLIP mean/std; the
prompt is tokenized padded to 35 tokens.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS
from diffusion_rl.rewards.clip import (
    _existing_dir,
    aesthetic_head,
    check_settings,
    checkpoint_file,
    load_state,
    load_weights,
)

logger = logging.getLogger(__name__)

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # the authors' score normalisation
MAX_TOKENS = 35
_VISION_BLOCK = re.compile(r"blip\.visual_encoder\.blocks\.(\d+)\.(.+)")
_VISION_BLOCK_PARTS = {
    "norm1": "layer_norm1",
    "norm2": "layer_norm2",
    "attn.qkv": "self_attn.qkv",
    "attn.proj": "self_attn.projection",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}
_VISION_DIRECT = {
    "blip.visual_encoder.cls_token": "vision.embeddings.class_embedding",
    "blip.visual_encoder.pos_embed": "vision.embeddings.position_embedding",
    "blip.visual_encoder.patch_embed.proj.weight": "vision.embeddings.patch_embedding.weight",
    "blip.visual_encoder.patch_embed.proj.bias": "vision.embeddings.patch_embedding.bias",
    "blip.visual_encoder.norm.weight": "vision.post_layernorm.weight",
    "blip.visual_encoder.norm.bias": "vision.post_layernorm.bias",
}


def map_imagereward_state(state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(state dict for ImageRewardModel, checkpoint keys left out) of an ImageReward.pt state dict."""
    mapped, unused = {}, []
    for key, tensor in state.items():
        key = key.removeprefix("module.")
        if key in _VISION_DIRECT:
            mapped[_VISION_DIRECT[key]] = tensor
        elif match := _VISION_BLOCK.fullmatch(key):
            index, rest = match.groups()
            part = next((p for p in _VISION_BLOCK_PARTS if rest.startswith(p + ".")), None)
            if part is None:
                raise UserError(f"imagereward: checkpoint key {key!r} is not part of a BLIP ViT block")
            mapped[f"vision.encoder.layers.{index}.{_VISION_BLOCK_PARTS[part]}{rest[len(part) :]}"] = tensor
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            mapped["text." + key.removeprefix("blip.text_encoder.")] = tensor
        elif key.startswith("mlp.layers."):
            mapped["head." + key.removeprefix("mlp.")] = tensor
        else:
            unused.append(key)
    return mapped, unused


def build_model(state: dict[str, Any], med_config: dict[str, Any], vision_heads: int | None = None):
    """ImageRewardModel sized from the checkpoint's tensors and the BERT config, its weights loaded."""
    import torch
    from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

    state = {k.removeprefix("module."): v for k, v in state.items()}
    needed = [f"blip.visual_encoder.{k}" for k in ("cls_token", "pos_embed", "patch_embed.proj.weight")]
    needed.append("mlp.layers.0.weight")
    missing = [k for k in needed if k not in state]
    if missing:
        raise UserError(f"imagereward: not an ImageReward state dict: no {missing} (keys: {sorted(state)[:6]} ...)")
    width = state["blip.visual_encoder.cls_token"].shape[-1]
    patch = state["blip.visual_encoder.patch_embed.proj.weight"].shape[-1]
    grid = round((state["blip.visual_encoder.pos_embed"].shape[1] - 1) ** 0.5)
    depth = 1 + max(int(m.group(1)) for k in state if (m := _VISION_BLOCK.fullmatch(k)))
    heads = vision_heads or width // 64
    if heads < 1 or width % heads:
        raise UserError(f"imagereward: vision width {width} does not split into vision_heads={heads}")
    vision = BlipVisionConfig(
        hidden_size=width,
        intermediate_size=state["blip.visual_encoder.blocks.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=depth,
        num_attention_heads=heads,
        image_size=grid * patch,
        patch_size=patch,
        layer_norm_eps=1e-6,  # BLIP's ViT: partial(nn.LayerNorm, eps=1e-6)
        hidden_act="gelu",
    )
    try:
        text = BlipTextConfig(
            vocab_size=med_config["vocab_size"],
            hidden_size=med_config["hidden_size"],
            encoder_hidden_size=width,  # BLIP sets encoder_width to the ViT's width
            intermediate_size=med_config["intermediate_size"],
            num_attention_heads=med_config["num_attention_heads"],
            num_hidden_layers=med_config["num_hidden_layers"],
            max_position_embeddings=med_config["max_position_embeddings"],
            layer_norm_eps=med_config.get("layer_norm_eps", 1e-12),
            hidden_act=med_config.get("hidden_act", "gelu"),
            pad_token_id=med_config.get("pad_token_id", 0),
            is_decoder=True,  # builds the cross-attention layers; the forward runs bidirectional (is_decoder=False)
        )
    except KeyError as e:
        raise UserError(f"imagereward: med_config lacks {e}; expected a BertConfig JSON (med_config.json)") from None

    class ImageRewardModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vision = BlipVisionModel(vision)
            self.text = BlipTextModel(text, add_pooling_layer=False)
            self.head = aesthetic_head(text.hidden_size)  # ImageReward's MLP: the same five linear layers

        def forward(self, pixel_values, input_ids, attention_mask):
            image = self.vision(pixel_values=pixel_values).last_hidden_state
            image_mask = torch.ones(image.shape[:2], dtype=torch.long, device=image.device)
            out = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                            encoder_attention_mask=image_mask, is_decoder=False)  # fmt: skip
            return (self.head(out.last_hidden_state[:, 0].float()).squeeze(-1) - MEAN) / STD

    model = ImageRewardModel()
    mapped, unused = map_imagereward_state(state)
    load_weights(model, mapped, "imagereward", "the checkpoint")
    if unused:
        logger.info("imagereward: %d checkpoint keys unused (as in the authors' loader): %s", len(unused), unused[:6])
    return model.eval().requires_grad_(False)


@REWARDS.register("imagereward")
class ImageReward:
    """Reward = ImageReward's normalised score (about −2 … 2 on typical images; higher = preferred)."""

    def __init__(
        self,
        checkpoint: str,
        tokenizer_path: str,
        med_config: str | None = None,
        device: str | None = None,
        batch_size: int = 16,
        dtype: str = "float32",
        vision_heads: int | None = None,
    ):
        """
        checkpoint: ImageReward.pt as the authors publish it (THUDM/ImageReward on Hugging Face).
        tokenizer_path: a directory with the bert-base-uncased tokenizer (vocab.txt).
        med_config: the BERT config JSON (null = med_config.json next to the checkpoint).
        vision_heads: the ViT's attention heads (null = width / 64: 16 for ViT-L).
        """
        from transformers import BertTokenizer, CLIPImageProcessorPil

        self.dtype, self.device = check_settings(dtype, batch_size, device, "imagereward")
        self.batch_size = batch_size
        download = ("ImageReward.pt and med_config.json with `huggingface-cli download THUDM/ImageReward "
                    "ImageReward.pt med_config.json --local-dir DIR`")  # fmt: skip
        file = checkpoint_file(checkpoint, "imagereward", "checkpoint", download)
        config_file = checkpoint_file(med_config or file.parent / "med_config.json", "imagereward", "med_config",
                                      download)  # fmt: skip
        state = load_state(file, "imagereward")
        self.model = build_model(state, json.loads(config_file.read_text()), vision_heads)
        self.model.to(device=self.device, dtype=self.dtype)
        self.model.head.float()  # the MLP on the [CLS] feature runs in fp32 at any dtype, as the authors' does
        try:
            self.tokenizer = BertTokenizer.from_pretrained(
                _existing_dir(tokenizer_path, "tokenizer_path", "google-bert/bert-base-uncased", "imagereward")
            )
        except (OSError, ValueError) as e:
            raise UserError(f"imagereward: cannot load a BERT tokenizer from {tokenizer_path} ({e})") from None
        size = self.model.vision.config.image_size
        self.processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> np.ndarray:
        import torch

        out = []
        with torch.inference_mode():
            for start in range(0, len(images), self.batch_size):
                chunk = slice(start, start + self.batch_size)
                pixels = self.processor(images=list(images[chunk]), return_tensors="pt")["pixel_values"]
                tokens = self.tokenizer(prompts[chunk], padding="max_length", truncation=True, max_length=MAX_TOKENS,
                                        return_tensors="pt")  # fmt: skip
                scores = self.model(pixels.to(self.device, self.dtype), tokens["input_ids"].to(self.device),
                                    tokens["attention_mask"].to(self.device))  # fmt: skip
                out.append(scores.float().cpu())
        return torch.cat(out).numpy().astype(np.float32)
