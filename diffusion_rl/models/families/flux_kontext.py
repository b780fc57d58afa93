"""FLUX.1 Kontext: FLUX.1-dev that also reads one condition image, for instruction editing.

As FluxKontextPipeline does it: the condition image is VAE-encoded (the posterior's mode, FLUX's shift and scale)
and packed like the generated latents; its tokens follow the generated ones in the sequence, their positional ids
(0, row, column) with the first coordinate set to 1, and only the generated tokens' velocity is kept (the velocity
is FluxModel's, which does this whenever the conditioning carries `image_latents`). Guidance is the distilled
embedding, as FLUX.1-dev's; the σ shift follows the generated tokens only, as in the pipeline.

The condition image's size: the pipeline resizes it to the Kontext training resolution nearest its aspect ratio
(PREFERRED_KONTEXT_RESOLUTIONS, ~1 MP, whatever the output size); so does `model.condition_size: pipeline` for an
image fitted to the output's aspect ratio (`pipeline_condition_size`), while `output` (the default) fits it to the
output size (data/condition_images.py): fewer tokens, but not what the pipeline shows a trained LoRA. A prompt
without an image is plain text-to-image, as with the pipeline; a batch's rows all have one image or none.
"""

from __future__ import annotations

from tensordict import TensorDict

from diffusion_rl.models.condition import condition_count, condition_latents
from diffusion_rl.models.families.flux import FLUX_LORA_TARGETS, FluxModel
from diffusion_rl.models.registry import ModelFamily, register_family


class FluxKontextModel(FluxModel):
    edits = True
    conditions_as_given = {"_auto_resize": False}  # FluxKontextPipeline resizes a condition image unless told

    @classmethod
    def pipeline_condition_size(cls, height: int, width: int) -> tuple[int, int]:
        """FluxKontextPipeline's `_auto_resize`: the preferred resolution whose aspect ratio is nearest the image's."""
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        _, w, h = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        return h, w

    def encode_prompts(self, prompts: list[str], negative: list[str] | None = None, images=None) -> TensorDict:
        k = condition_count(self.family, images, len(prompts), most=1)
        cond = super().encode_prompts(prompts, negative)
        if k:
            cond["image_latents"] = condition_latents(self.encode, images).to(self.dtype)  # [B, 1, h, w, 4·C]
        return cond


register_family(
    ModelFamily(
        name="flux_kontext",
        pipeline="FluxKontextPipeline",
        adapter=FluxKontextModel,
        tiny="diffusion_rl.models.tiny.flux_kontext",
        lora_targets=FLUX_LORA_TARGETS,
        task="image-to-image",
    )
)
