"""Each family's `text_shapes` (what its `_encode_texts` gives per text, declared from the architecture alone) is what
the tiny model's real encoders give: every name, every shape, masks bool; for a short, an empty and a long text."""

from __future__ import annotations

import pytest
import torch

from diffusion_rl.config.model import ModelConfig
from diffusion_rl.config.plugins import FAMILIES
from diffusion_rl.estimate.architectures import from_tiny
from diffusion_rl.models.loader import model_of_pipeline
from diffusion_rl.models.registry import family_named
from diffusion_rl.models.tiny import build_tiny

TEXTS = ["a red cube", "", "a very long prompt " * 12]  # the last one is longer than max_sequence_length tokens
LENGTH = 24  # not a tiny preset's own max_sequence_length (32)

# every family whose text embeddings depend on the text alone (an editing family's encoder reads its images too),
# and the Wan 2.2 TI2V-shaped preset beside Wan 2.1's
CASES = [(name, "small") for name, family in FAMILIES.items() if family.adapter.caches_text] + [("wan", "ti2v")]


@pytest.mark.parametrize(("family", "preset"), CASES)
def test_the_declared_text_shapes_are_what_the_encoders_give(family, preset):
    cfg = ModelConfig(path="unused", device="cpu", max_sequence_length=LENGTH)
    model = model_of_pipeline(build_tiny(family, preset), family_named(family), cfg, torch.device("cpu"),
                              torch.float32, "tiny")  # fmt: skip
    real = model.encode_texts(TEXTS)
    declared = family_named(family).adapter.text_shapes(from_tiny(family, preset), LENGTH, prompt_tokens=5)
    shapes = {name: tuple(value.shape) for name, value in real.items()}
    assert {name: (len(TEXTS), *shape) for name, shape in declared.items()} == shapes
    assert {name: real[name].dtype == torch.bool for name in real} == {name: name.endswith("_mask") for name in real}
