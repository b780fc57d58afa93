"""model_index.json's components, checked before diffusers loads (and imports) what they name."""

from __future__ import annotations

import json

import pytest

from diffusion_rl.errors import UserError
from diffusion_rl.models.load_errors import raise_if_bad_index


def _index(tmp_path, **entries):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", **entries}))
    return tmp_path


def test_pipeline_settings_and_absent_components_pass(tmp_path):
    # Wan 2.2's model_index.json holds settings beside its components: boundary_ratio, expand_timesteps
    components = {"vae": ["diffusers", "AutoencoderKLWan"], "text_encoder": ["transformers", "UMT5EncoderModel"]}
    raise_if_bad_index(_index(tmp_path, boundary_ratio=0.875, expand_timesteps=False, transformer_2=[None, None],
                              **components))  # fmt: skip


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (["os", "system"], "component 'vae' names the library 'os'; a model directory may name diffusers or"),
        (["diffusers"], "component 'vae' is ['diffusers'], not [library, class]"),
        (["diffusers", "AutoencoderKLWan", "x"], "component 'vae' is ['diffusers', 'AutoencoderKLWan', 'x'], not"),
    ],
)
def test_a_component_naming_another_module_or_of_another_shape_is_refused(tmp_path, entry, message):
    with pytest.raises(UserError, match=f"model_index.json: {message}".replace("[", r"\[").replace("]", r"\]")):
        raise_if_bad_index(_index(tmp_path, vae=entry))
