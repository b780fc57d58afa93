"""The Qwen2-VL processor of Qwen-Image-Edit without its video half, so it loads without torchvision.

QwenImageEditPlusPipeline shows its condition images to the Qwen2.5-VL text encoder through a `Qwen2VLProcessor`
(its `processor/` folder: the tokenizer files and preprocessor_config.json, plus a video processor config).
transformers builds that processor only with torchvision installed, because its video processor needs it, and the
pipeline never processes videos. `ImageTextProcessor` is the same processor with the image and text parts only;
the loader builds it from the `processor/` folder (models/registry.py: `components`) on every machine, so the path
is the same with and without torchvision.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"


class ImageTextProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor with an image processor and a tokenizer only: what the edit pipeline calls it with."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = IMAGE_TOKEN, VIDEO_TOKEN
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.video_token_id = tokenizer.convert_tokens_to_ids(VIDEO_TOKEN)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def save_to(self, folder: str | Path) -> None:
        """Write the folder as a checkpoint's `processor/` holds it: the tokenizer's and the image processor's files."""
        self.tokenizer.save_pretrained(folder)
        self.image_processor.save_pretrained(folder)


def load_image_text_processor(folder: str | Path) -> ImageTextProcessor:
    """The processor of a `processor/` folder (tokenizer files and preprocessor_config.json)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return ImageTextProcessor(Qwen2VLImageProcessorPil.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))
