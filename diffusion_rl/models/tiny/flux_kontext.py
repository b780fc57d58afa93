"""A tiny FLUX.1 Kontext model: a real FluxKontextPipeline with random weights, for CPUs and tests.

FLUX.1-Kontext-dev has FLUX.1-dev's components (a guidance-distilled FluxTransformer2DModel, the FLUX VAE, CLIP and
T5) and scheduler; what differs is how the pipeline feeds the condition image, which the adapter
(models/families/flux_kontext.py) does. So the tiny Kontext is the tiny FLUX.1-dev's pieces in a FluxKontextPipeline.
"""

from __future__ import annotations

from diffusion_rl.models.tiny.flux import PRESETS as FLUX_PRESETS
from diffusion_rl.models.tiny.flux import TinyFluxSpec, components

PRESETS = {"base": FLUX_PRESETS["base"], "small": FLUX_PRESETS["small"]}  # ~2.3M / ~0.08M-parameter transformers


def build(spec: TinyFluxSpec):
    """A FluxKontextPipeline of `spec`, its random weights drawn from the global RNG (see build_seeded)."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**components(spec))
