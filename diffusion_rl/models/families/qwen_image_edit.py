"""Qwen-Image-Edit (the Plus pipeline: Qwen-Image-Edit-2509 and -2511): an instruction and one or more condition images.

Everything of Qwen-Image (models/families/qwen_image.py) plus the condition images, which enter twice, as in
QwenImageEditPlusPipeline:
- the text encoder sees them: each prompt is encoded with its images by the Qwen2.5-VL ("Picture 1: <image> …"
  before the instruction), each image resized to about 384 × 384 pixels (the pipeline's CONDITION_IMAGE_SIZE, aspect
  ratio kept). The negative prompt is encoded with the same images. Each distinct (text, images) is encoded once,
  one at a time (the pipeline's prompt template numbers the pictures of one prompt);
- the transformer sees their latents: each image VAE-encoded (the posterior's mode, normalised by the VAE's
  per-channel statistics) and packed like the generated latents; their tokens follow the generated ones in the
  sequence (`image_latents` [B, k, h, w, 4·C] in the conditioning), with their own positions (img_shapes), and only
  the generated tokens' velocity is kept. Qwen-Image-Edit-2511 gives the condition tokens timestep 0
  (`zero_cond_t` in its transformer config), which the transformer does by itself.

The condition images' size for the VAE: the pipeline resizes each to about 1024 × 1024 pixels (VAE_IMAGE_SIZE, aspect
ratio kept, sides multiples of 32) whatever the output size; so does `model.condition_size: pipeline` for images
fitted to the output's aspect ratio (`pipeline_condition_size`), while `output` (the default) fits them to the output
size (data/condition_images.py): fewer tokens, but not what the pipeline shows a trained LoRA. The σ shift follows
the generated tokens only, as in the pipeline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image
from tensordict import TensorDict

from diffusion_rl.errors import UserError
from diffusion_rl.models.condition import condition_count, condition_latents, image_key
from diffusion_rl.models.families.qwen_image import QWEN_IMAGE_LORA_TARGETS, QwenImageModel
from diffusion_rl.models.registry import ModelFamily, register_family


class QwenImageEditModel(QwenImageModel):
    edits = True
    caches_text = False  # the text encoder reads the condition images with each prompt

    @classmethod
    def pipeline_condition_size(cls, height: int, width: int) -> tuple[int, int]:
        """QwenImageEditPlusPipeline's VAE image: VAE_IMAGE_SIZE pixels at the aspect ratio (calculate_dimensions)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE, calculate_dimensions

        w, h = calculate_dimensions(VAE_IMAGE_SIZE, width / height)
        return h, w

    def encode_prompts(self, prompts: list[str], negative: list[str] | None = None, images=None) -> TensorDict:
        k = condition_count(self.family, images, len(prompts), most=None)
        if k == 0:
            raise UserError(
                f"the {self.family} family edits images: every prompt needs a condition image (a dataset row's "
                "`images`; see data/condition_images.py)"
            )
        negative = negative if negative is not None else [""] * len(prompts)
        rows = [*zip(prompts, images), *zip(negative, images)]  # (text, images): each positive, then each negative
        distinct: dict[tuple, tuple] = {}
        keys = []
        for text, row in rows:
            keys.append((text, tuple(image_key(image) for image in row)))
            distinct.setdefault(keys[-1], (text, row))
        position = {key: i for i, key in enumerate(distinct)}
        embeds, mask = zip(*(self._encode_one(text, row) for text, row in distinct.values()))
        index = torch.tensor([position[key] for key in keys])
        cond = self.text_cond(torch.cat(embeds), torch.cat(mask), index[: len(prompts)], index[len(prompts) :])
        cond["image_latents"] = condition_latents(self.encode, images).to(self.dtype)  # [B, k, h, w, 4·C]
        return cond

    @torch.no_grad()
    def _encode_one(self, text: str, images) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt with its condition images through the text encoder, padded: ([1, L, D], [1, L])."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
            CONDITION_IMAGE_SIZE,
            calculate_dimensions,
        )

        shown = []
        for image in images:
            height, width = image.shape[:2]
            w, h = calculate_dimensions(CONDITION_IMAGE_SIZE, width / height)
            shown.append(self.pipeline.image_processor.resize(Image.fromarray(image), h, w))
        embeds, mask = self.pipeline.encode_prompt(prompt=[text], image=shown, device=self.device)
        return self.pad_text(embeds, mask)


def save_edit_pipeline(pipeline, directory: Path) -> None:
    """save_pretrained, with the processor written as a real checkpoint has it: its files in processor/ and
    model_index.json naming transformers' Qwen2VLProcessor (whatever class holds it here, models/vl_processor.py)."""
    import diffusers

    processor, verbosity = pipeline.processor, diffusers.utils.logging.get_verbosity()
    pipeline.register_modules(processor=None)
    diffusers.utils.logging.set_verbosity_error()  # not "processor=None cannot be saved": it is written below
    try:
        pipeline.save_pretrained(directory)
    finally:
        pipeline.register_modules(processor=processor)
        diffusers.utils.logging.set_verbosity(verbosity)
    processor.save_to(directory / "processor")
    index_file = directory / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def edit_components(path) -> dict:
    """The processor, built without torchvision (models/vl_processor.py)."""
    from diffusion_rl.models.vl_processor import load_image_text_processor  # transformers' processors: when loading

    return {"processor": load_image_text_processor(path / "processor")}


register_family(
    ModelFamily(
        name="qwen_image_edit",
        pipeline="QwenImageEditPlusPipeline",
        adapter=QwenImageEditModel,
        tiny="diffusion_rl.models.tiny.qwen_image_edit",
        lora_targets=QWEN_IMAGE_LORA_TARGETS,
        components=edit_components,
        save=save_edit_pipeline,
        task="image-to-image",
    )
)
