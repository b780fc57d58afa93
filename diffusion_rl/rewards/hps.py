"""`hpsv2`: Human Preference Score v2 / v2.1 (Wu et al. 2023), an open_clip ViT-H/14 fine-tuned on human choices.

Score = cos(image embedding, prompt embedding), as HPSv2's own scorer computes it (the diagonal of
image_features @ text_features.T of normalised features; no logit scale): about 0.2–0.35 on real images.

The weights are the authors' checkpoint as published (`HPS_v2.1_compressed.pt` or `HPS_v2_compressed.pt` from the
Hugging Face repo xswu/HPSv2: {"state_dict": open_clip ViT-H-14 state dict}). open_clip does not run here (it
needs torchvision), so `openclip_to_clip` maps that state dict onto transformers' `CLIPModel`, key by key:

    visual.conv1.weight                          -> vision_model.embeddings.patch_embedding.weight
    visual.class_embedding                       -> vision_model.embeddings.class_embedding
    visual.positional_embedding                  -> vision_model.embeddings.position_embedding.weight
    visual.ln_pre.*                              -> vision_model.pre_layrnorm.*   (sic: transformers' name)
    visual.transformer.resblocks.i.ln_1.*        -> vision_model.encoder.layers.i.layer_norm1.*
    ...attn.in_proj_{weight,bias} (rows q | k | v) -> ...self_attn.{q,k,v}_proj.{weight,bias}
    ...attn.out_proj.*                           -> ...self_attn.out_proj.*
    ...ln_2.*, mlp.c_fc.*, mlp.c_proj.*          -> ...layer_norm2.*, mlp.fc1.*, mlp.fc2.*
    visual.ln_post.*                             -> vision_model.post_layernorm.*
    visual.proj [width, embed]                   -> visual_projection.weight (transposed)
    token_embedding.weight, positional_embedding -> text_model.embeddings.{token,position}_embedding.weight
    transformer.resblocks.i.*                    -> text_model.encoder.layers.i.* (as for the vision tower)
    ln_final.*                                   -> text_model.final_layer_norm.*
    text_projection [width, embed]               -> text_projection.weight (transposed)
    logit_scale                                  -> logit_scale

Sizes come from the tensors; the head counts do not (ViT-H-14: 16 and 16, the defaults). ViT-H-14 uses exact GELU
and LayerNorm eps 1e-5, so the config says so. A checkpoint key left unmapped, or a key the model needs and the
checkpoint lacks, is an error naming it. How the mapping was checked: tests/rewards/test_reward_hps.py writes a tiny
state dict with these key names, compares every converted tensor with its source, and compares the reward with
a forward pass computed by hand from the open_clip tensors (no transformers code on that side).

Preprocessing is HPSv2's: the longer side resized to the model's image size, centred on a black square, scaled to
[0, 1] and normalised with OpenAI CLIP's mean and std; HPSv2 resizes the float tensor (torch bicubic), this the uint8
image (PIL bicubic): ~0.001 apart per pixel. The tokenizer is open_clip's ViT-H-14 BPE, which is the CLIP tokenizer
of laion/CLIP-ViT-H-14-laion2B-s32B-b79K (`tokenizer_path`), padded to the batch's longest prompt (the same as
HPSv2's 77 under the causal mask).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS
from diffusion_rl.rewards.clip import (
    CLIP_H14,
    ClipEncoder,
    _existing_dir,
    check_settings,
    checkpoint_file,
    load_state,
    load_weights,
)

_BLOCK = re.compile(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)")
_BLOCK_PARTS = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "attn.out_proj": "self_attn.out_proj",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_DIRECT = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"visual.proj": "visual_projection.weight", "text_projection": "text_projection.weight"}
_IGNORED = ("attn_mask",)  # a buffer open_clip keeps for the causal mask; transformers builds its own


def _convert_block(key: str, tensor) -> dict[str, Any]:
    match = _BLOCK.fullmatch(key)
    tower = "vision_model" if match.group(1) else "text_model"
    prefix, rest = f"{tower}.encoder.layers.{match.group(2)}.", match.group(3)
    if rest.startswith("attn.in_proj_"):
        kind = rest.removeprefix("attn.in_proj_")  # weight [3W, W] or bias [3W]: rows q | k | v
        q, k, v = tensor.chunk(3, dim=0)
        return {f"{prefix}self_attn.{name}_proj.{kind}": part for name, part in zip("qkv", (q, k, v))}
    for source, target in _BLOCK_PARTS.items():
        if rest.startswith(source + "."):
            return {prefix + target + rest[len(source) :]: tensor}
    raise UserError(f"hpsv2: checkpoint key {key!r} is not part of an open_clip transformer block")


def openclip_to_clip(state: dict[str, Any], vision_heads: int = 16, text_heads: int = 16, eos_token_id: int = 49407):
    """(CLIPConfig, state dict for CLIPModel) of an open_clip CLIP state dict (see the module docstring)."""
    from transformers import CLIPConfig

    state = {k.removeprefix("module."): v for k, v in state.items()}
    required = ("visual.conv1.weight", "visual.positional_embedding", "visual.proj", "token_embedding.weight",
                "positional_embedding", "text_projection")  # fmt: skip
    missing = [k for k in required if k not in state]
    if missing:
        raise UserError(f"hpsv2: not an open_clip CLIP state dict: no {missing} (keys: {sorted(state)[:8]} ...)")
    converted: dict[str, Any] = {}
    unknown = []
    for key, tensor in state.items():
        if key in _DIRECT:
            converted[_DIRECT[key]] = tensor
        elif key in _TRANSPOSED:
            converted[_TRANSPOSED[key]] = tensor.t().contiguous()
        elif _BLOCK.fullmatch(key):
            converted.update(_convert_block(key, tensor))
        elif not key.endswith(_IGNORED):
            unknown.append(key)
    if unknown:
        raise UserError(f"hpsv2: checkpoint keys with no place in CLIPModel: {unknown[:10]}")

    def layers(prefix: str) -> int:
        return 1 + max(int(m.group(2)) for k in state if (m := _BLOCK.fullmatch(k)) and k.startswith(prefix))

    conv = state["visual.conv1.weight"]  # [W, 3, P, P]
    width, patch = conv.shape[0], conv.shape[-1]
    grid = round((state["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    text_width = state["token_embedding.weight"].shape[1]
    vision = dict(
        hidden_size=width,
        intermediate_size=state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        num_hidden_layers=layers("visual."),
        num_attention_heads=vision_heads,
        image_size=grid * patch,
        patch_size=patch,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
    )
    text = dict(
        vocab_size=state["token_embedding.weight"].shape[0],
        hidden_size=text_width,
        intermediate_size=state["transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
        num_hidden_layers=layers("transformer."),
        num_attention_heads=text_heads,
        max_position_embeddings=state["positional_embedding"].shape[0],
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        eos_token_id=eos_token_id,
    )
    for name, dim, heads in (("vision", width, vision_heads), ("text", text_width, text_heads)):
        if dim % heads:
            raise UserError(f"hpsv2: {name} width {dim} is not divisible by {name}_heads={heads}")
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=state["visual.proj"].shape[1])
    return config, converted


class LetterboxProcessor:
    """HPSv2's preprocessing: longer side to `size` (PIL bicubic), centred on black, then CLIP normalisation."""

    def __init__(self, size: int):
        from transformers import CLIPImageProcessorPil

        self.size = size
        self.normalize = CLIPImageProcessorPil(do_resize=False, do_center_crop=False)  # OpenAI mean/std

    def letterbox(self, image_HW3: np.ndarray) -> np.ndarray:
        from PIL import Image

        height, width = image_HW3.shape[:2]
        scale = self.size / max(height, width)
        if scale == 1.0:
            return image_HW3
        new_h, new_w = round(height * scale), round(width * scale)
        resized = Image.fromarray(image_HW3).resize((new_w, new_h), Image.Resampling.BICUBIC)
        canvas = Image.new("RGB", (self.size, self.size), (0, 0, 0))
        canvas.paste(resized, ((self.size - new_w) // 2, (self.size - new_h) // 2))
        return np.asarray(canvas)

    def __call__(self, images: list[np.ndarray], return_tensors: str = "pt"):
        return self.normalize(images=[self.letterbox(im) for im in images], return_tensors=return_tensors)


@REWARDS.register("hpsv2")
def hpsv2(
    checkpoint: str,
    tokenizer_path: str,
    device: str | None = None,
    batch_size: int = 32,
    dtype: str = "float32",
    vision_heads: int = 16,
    text_heads: int = 16,
):
    """Reward = HPS v2 / v2.1: cos(image, prompt) of the HPS-tuned ViT-H/14 (see the module docstring).

    checkpoint: HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt) as the authors publish it.
    tokenizer_path: a directory with the CLIP tokenizer of laion/CLIP-ViT-H-14-laion2B-s32B-b79K.
    vision_heads, text_heads: attention heads of each tower (not readable from the tensors; ViT-H-14: 16, 16).
    """
    from transformers import AutoTokenizer, CLIPModel

    torch_dtype, torch_device = check_settings(dtype, batch_size, device, "hpsv2")
    tokenizer_dir = _existing_dir(tokenizer_path, "tokenizer_path", CLIP_H14, "hpsv2")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise UserError(f"hpsv2: cannot load a CLIP tokenizer from {tokenizer_dir} ({e})") from None
    file = checkpoint_file(
        checkpoint,
        "hpsv2",
        "checkpoint",
        "HPS_v2.1_compressed.pt from the Hugging Face repo "
        "xswu/HPSv2 (`huggingface-cli download xswu/HPSv2 HPS_v2.1_compressed.pt --local-dir DIR`)",
    )
    config, state = openclip_to_clip(load_state(file, "hpsv2"), vision_heads, text_heads, tokenizer.eos_token_id)
    model = CLIPModel(config)
    load_weights(model, state, "hpsv2", str(file))
    processor = LetterboxProcessor(config.vision_config.image_size)
    encoder = ClipEncoder.from_parts(model, tokenizer, processor, torch_device, torch_dtype, batch_size)

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        return encoder.cosines(images, prompts).cpu().numpy().astype(np.float32)

    return reward
