"""CLIP-family rewards on transformers' `CLIPModel`, loaded from a local directory (save_pretrained layout).

- `clip_score`: 100 · max(cos(image, prompt), 0) with the model's projected embeddings.
- `pickscore`: exp(logit_scale) · cos(image, prompt), PickScore's logit (the PickScore_v1 weights are a CLIPModel;
  its tokenizer and preprocessing are those of laion/CLIP-ViT-H-14: pass that directory as `processor_path`).
- `aesthetic`: the LAION improved aesthetic predictor, an MLP on the L2-normalised CLIP image embedding (trained on
  ViT-L/14 embeddings, 768-d); its weights come from a separate state-dict file (`head_path`: .pth/.pt or
  .safetensors, keys layers.{0,2,4,6,7}.{weight,bias}).

Images are preprocessed by transformers' `CLIPImageProcessorPil` (the PIL backend: no torchvision) loaded from
`preprocessor_config.json` in `processor_path` (default: `path`): the shorter side resized to `size` (bicubic), a
centre crop, scaling to [0, 1] and normalisation with the processor's mean/std. Without that file, the model's
image size and OpenAI CLIP's mean/std are used.

Common kwargs: path, device (None = cuda if available, else cpu), batch_size, dtype ("float32", "bfloat16",
"float16"), processor_path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from diffusion_rl.errors import UserError
from diffusion_rl.rewards.base import REWARDS

logger = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
CLIP_L14 = "openai/clip-vit-large-patch14"  # the CLIP of CLIPScore and of the LAION aesthetic predictor
CLIP_H14 = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"  # PickScore's and HPS v2's processor and tokenizer
PICKSCORE = "yuvalkirstain/PickScore_v1"


class ClipEncoder:
    """A CLIPModel, its tokenizer and image preprocessing; gives L2-normalised float32 embeddings."""

    def __init__(
        self,
        path: str,
        device: str | None = None,
        batch_size: int = 32,
        dtype: str = "float32",
        processor_path: str | None = None,
        *,
        repo: str = CLIP_L14,
        processor_repo: str | None = None,
    ):
        """repo, processor_repo (default: repo): where the model and the processor come from (named in messages)."""
        import torch
        from transformers import AutoTokenizer, CLIPModel

        torch_dtype, torch_device = check_settings(dtype, batch_size, device, "CLIP reward")
        model_dir = _existing_dir(path, "path", repo)
        processor_dir = model_dir
        if processor_path:
            processor_dir = _existing_dir(processor_path, "processor_path", processor_repo or repo)
        try:
            model = CLIPModel.from_pretrained(model_dir, dtype=torch.float32)  # cast in _adopt, after logit_scale
            tokenizer = AutoTokenizer.from_pretrained(processor_dir)
        except (OSError, ValueError) as e:
            raise UserError(f"CLIP reward: cannot load a CLIP model and tokenizer from {model_dir} ({e})") from None
        processor = image_processor(processor_dir, model.config.vision_config.image_size)
        self._adopt(model, tokenizer, processor, torch_device, torch_dtype, batch_size)

    @classmethod
    def from_parts(cls, model, tokenizer, processor, device, dtype, batch_size: int) -> ClipEncoder:
        """An encoder of a CLIPModel built elsewhere (e.g. converted from another checkpoint layout)."""
        encoder = cls.__new__(cls)
        encoder._adopt(model, tokenizer, processor, device, dtype, batch_size)
        return encoder

    def _adopt(self, model, tokenizer, processor, device, dtype, batch_size: int) -> None:
        self.device, self.dtype, self.batch_size = device, dtype, batch_size
        self.logit_scale = float(model.logit_scale.exp())  # before the cast: bf16 would make PickScore's 100 a 99
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.tokenizer, self.processor = tokenizer, processor
        self.max_length = min(self.tokenizer.model_max_length, self.model.config.text_config.max_position_embeddings)

    def pixel_values(self, images_BHW3: np.ndarray):
        """Model inputs [B, 3, crop_h, crop_w] on the device, in the model's dtype."""
        pixels = self.processor(images=list(images_BHW3), return_tensors="pt")["pixel_values"]
        return pixels.to(self.device, self.dtype)

    def image_embeddings(self, images_BHW3: np.ndarray):
        """L2-normalised image embeddings, float32 [B, D]."""
        import torch

        out = []
        with torch.inference_mode():
            for start in range(0, len(images_BHW3), self.batch_size):
                pixels = self.pixel_values(images_BHW3[start : start + self.batch_size])
                out.append(_pooled(self.model.get_image_features(pixel_values=pixels)).float())
        return torch.nn.functional.normalize(torch.cat(out), dim=-1)

    def text_embeddings(self, prompts: list[str]):
        """L2-normalised text embeddings, float32 [B, D]."""
        import torch

        out = []
        with torch.inference_mode():
            for start in range(0, len(prompts), self.batch_size):
                tokens = self.tokenizer(
                    prompts[start : start + self.batch_size],
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                features = self.model.get_text_features(
                    input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]
                )
                out.append(_pooled(features).float())
        return torch.nn.functional.normalize(torch.cat(out), dim=-1)

    def cosines(self, images_BHW3: np.ndarray, prompts: list[str]):
        """cos(image_i, prompt_i), float32 [B]."""
        return (self.image_embeddings(images_BHW3) * self.text_embeddings(prompts)).sum(-1)


def check_settings(dtype: str, batch_size: int, device: str | None, who: str):
    """(torch dtype, torch device) for a reward's dtype/batch_size/device kwargs, or UserError."""
    import torch

    if dtype not in DTYPES:
        raise UserError(f"{who}: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    if batch_size < 1:
        raise UserError(f"{who}: batch_size must be >= 1, got {batch_size}")
    return getattr(torch, dtype), torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def checkpoint_file(path: Any, who: str, what: str, download: str) -> Path:
    """The file `path` names, or a UserError saying how to get it (`download`: the command that fetches it)."""
    file = Path(str(path)).expanduser()
    if not file.is_file():
        raise UserError(f"{who}: {what} {file} is not a file; download {download}")
    return file


def load_state(file: Path, who: str) -> dict[str, Any]:
    """The state dict in a torch checkpoint file ({"state_dict": ...}, or the state dict itself), read as weights only
    (no code runs)."""
    import torch

    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle errors have no common base
        raise UserError(f"{who}: cannot read {file} as a torch checkpoint ({type(e).__name__}: {e})") from None
    return loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded


def load_weights(model, state: dict[str, Any], who: str, what: str) -> None:
    """`state` into `model`; position_ids buffers are rebuilt by transformers, anything else missing or left over
    means a wrong checkpoint (a UserError listing the first keys)."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("position_ids")]
    if missing or result.unexpected_keys:
        raise UserError(f"{who}: {what} does not fit the model: missing {missing[:8]}, "
                        f"unexpected {result.unexpected_keys[:8]}")  # fmt: skip


def _pooled(features: Any):
    """The projected embedding: transformers 5 returns an output object, older versions the tensor itself."""
    return features if hasattr(features, "dim") else features.pooler_output


def _existing_dir(path: Any, name: str, repo: str, who: str = "CLIP reward") -> Path:
    """`path` as a directory, or a UserError with the command that downloads `repo` (a Hugging Face id) there."""
    if not isinstance(path, str) or not path:
        raise UserError(f"{who}: {name} must be a local model directory (a download of {repo}), got {path!r}")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise UserError(
            f"{who}: {name} {directory} is not a directory; download the model first: "
            f"`huggingface-cli download {repo} --local-dir {directory}`"
        )
    return directory


def image_processor(directory: Path, image_size: int):
    """CLIPImageProcessorPil from directory/preprocessor_config.json; without it, resize and crop to image_size with
    the processor's defaults (OpenAI CLIP's mean and std)."""
    from transformers import CLIPImageProcessorPil

    if (directory / "preprocessor_config.json").is_file():
        return CLIPImageProcessorPil.from_pretrained(directory)
    logger.info("CLIP reward: no %s; using size %d and OpenAI CLIP's mean/std", directory / "preprocessor_config.json",
                image_size)  # fmt: skip
    return CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )


@REWARDS.register("clip_score")
def clip_score(
    path: str,
    device: str | None = None,
    batch_size: int = 32,
    dtype: str = "float32",
    processor_path: str | None = None,
):
    """Reward = 100 · max(cos(image, prompt), 0)."""
    encoder = ClipEncoder(path, device, batch_size, dtype, processor_path)

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        return (100 * encoder.cosines(images, prompts).clamp(min=0)).cpu().numpy().astype(np.float32)

    return reward


@REWARDS.register("pickscore")
def pickscore(
    path: str,
    device: str | None = None,
    batch_size: int = 32,
    dtype: str = "float32",
    processor_path: str | None = None,
):
    """Reward = exp(logit_scale) · cos(image, prompt) (about 20–23 for PickScore_v1 on typical images)."""
    encoder = ClipEncoder(path, device, batch_size, dtype, processor_path, repo=PICKSCORE, processor_repo=CLIP_H14)

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        return (encoder.logit_scale * encoder.cosines(images, prompts)).cpu().numpy().astype(np.float32)

    return reward


def aesthetic_head(embed_dim: int = 768):
    """The LAION improved-aesthetic-predictor MLP (dropouts are inactive in eval mode)."""
    from torch import nn

    class AestheticHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(
                nn.Linear(embed_dim, 1024),
                nn.Dropout(0.2),
                nn.Linear(1024, 128),
                nn.Dropout(0.2),
                nn.Linear(128, 64),
                nn.Dropout(0.1),
                nn.Linear(64, 16),
                nn.Linear(16, 1),
            )

        def forward(self, embeddings_BD):
            return self.layers(embeddings_BD)

    return AestheticHead()


def load_aesthetic_head(head_path: str, embed_dim: int):
    """The aesthetic MLP with the weights in `head_path`, strictly loaded, or UserError saying what does not match."""
    import torch

    file = Path(head_path).expanduser()
    if not file.is_file():
        raise UserError(f"aesthetic: head_path {file} is not a file; expected the predictor's state dict")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/safetensors errors have no common base
        raise UserError(f"aesthetic: cannot read {file} as a state dict ({type(e).__name__}: {e})") from None
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    head = aesthetic_head(embed_dim)
    try:
        head.load_state_dict(state, strict=True)
    except (RuntimeError, TypeError, AttributeError) as e:
        expected = {k: tuple(v.shape) for k, v in head.state_dict().items()}
        raise UserError(
            f"aesthetic: {file} does not fit the LAION aesthetic MLP on {embed_dim}-d CLIP embeddings "
            f"({' '.join(str(e).split())}); "
            f"expected keys and shapes {expected}"
        ) from None
    return head.eval().requires_grad_(False)


@REWARDS.register("aesthetic")
def aesthetic(
    path: str,
    head_path: str,
    device: str | None = None,
    batch_size: int = 32,
    dtype: str = "float32",
    processor_path: str | None = None,
):
    """Reward = the LAION aesthetic score (roughly 1–10) of the image; `path` is the CLIP (ViT-L/14) directory."""
    import torch

    encoder = ClipEncoder(path, device, batch_size, dtype, processor_path)
    head = load_aesthetic_head(head_path, encoder.model.config.projection_dim).to(encoder.device)

    def reward(images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
        with torch.inference_mode():
            return head(encoder.image_embeddings(images)).squeeze(-1).cpu().numpy().astype(np.float32)

    return reward
