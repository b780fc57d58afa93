"""Which image sizes a loaded model can make: its native size, its largest, and a check that suggests one that fits.

Read from the pipeline's configs, so every family (and a real checkpoint as well as a tiny one) answers alike:
- native: the transformer's `sample_size` (in latent pixels) × the VAE's down-sampling, else the VAE's own
  `sample_size` (in pixels), else the pipeline's default (`default_sample_size` × VAE scale, what diffusers
  samples when given no size; Wan's pipeline has none in its configs: the adapter's `native_size`);
- largest: a transformer with a learned position table (SD3's `pos_embed_max_size`, in patches) takes at most
  pos_embed_max_size × patch_size × VAE scale pixels a side; rotary-position transformers (FLUX.1, Qwen-Image)
  have no such bound.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSizes:
    native: int  # pixels a side the model was made for
    largest: int | None  # pixels a side at most (None: no bound in the config)
    multiple: int  # height and width must be multiples of this
    why_largest: str = ""  # how `largest` follows from the config, for messages


def image_sizes(model) -> ImageSizes:
    """The sizes `model` (a FlowModel) can sample, from its pipeline's configs."""
    pipeline = model.pipeline
    scale = int(model.vae_scale)
    transformer = pipeline.transformer.config
    largest, why = None, ""
    table = getattr(transformer, "pos_embed_max_size", None)
    if table:
        patch = int(getattr(transformer, "patch_size", 1) or 1)
        largest = table * patch * scale
        why = f"pos_embed_max_size {table} × patch {patch} × VAE scale {scale}"
    multiple = _smallest_multiple(model)
    native = _native(pipeline, scale, model.native_size)
    if largest is not None:
        native = min(native, largest)
    native = max(multiple, native - native % multiple)
    return ImageSizes(native=native, largest=largest, multiple=multiple, why_largest=why)


def _native(pipeline, scale: int, fallback: int | None) -> int:
    latent_size = getattr(pipeline.transformer.config, "sample_size", None)
    if isinstance(latent_size, int) and latent_size > 0:
        return latent_size * scale
    vae_size = getattr(pipeline.vae.config, "sample_size", None)
    if isinstance(vae_size, int) and vae_size > 0:
        return vae_size
    default = getattr(pipeline, "default_sample_size", None)
    return int(default) * scale if default else int(fallback)


def _smallest_multiple(model, limit: int = 512) -> int:
    """The smallest size the adapter's own `latent_shape` accepts: every valid size is a multiple of it."""
    for size in range(1, limit + 1):
        try:
            model.latent_shape(size, size)
        except ValueError:
            continue
        return size
    raise ValueError(f"no image size up to {limit} px fits this {model.family} model")  # pragma: no cover


def size_problem(model, height: int, width: int, keys: tuple[str, str] = ("--height", "--width")) -> str | None:
    """Why `model` cannot sample height × width pixels, with a size that works (named by `keys`: the flags or
    config keys the user sets); None when it can."""
    sizes = image_sizes(model)

    def fit(size: int) -> int:
        if sizes.largest is not None:
            size = min(size, sizes.largest)
        return max(sizes.multiple, size - size % sizes.multiple)

    suggestion = f"try {keys[0]} {fit(height)} {keys[1]} {fit(width)} (the model's native size is {sizes.native})"
    if height < 1 or width < 1 or height % sizes.multiple or width % sizes.multiple:
        return (
            f"{height}×{width} is not a size this model makes: height and width must be positive multiples of "
            f"{sizes.multiple}; {suggestion}"
        )
    if sizes.largest is not None and max(height, width) > sizes.largest:
        return (
            f"{height}×{width} is larger than this model takes: at most {sizes.largest} px a side "
            f"({sizes.why_largest}); {suggestion}"
        )
    return None


def require_size(model, height: int, width: int, frames: int = 1) -> None:
    """A UserError naming the command-line flags when `model` cannot sample height × width pixels (`size_problem`,
    with a size that works) or `frames` frames (its family's own rule, e.g. Wan's 4k + 1)."""
    from diffusion_rl.errors import UserError

    problem = size_problem(model, height, width)
    if problem:
        raise UserError(f"--height/--width: {problem}")
    try:
        model.latent_shape(height, width, frames)
    except ValueError as e:
        raise UserError(f"--frames: {e}") from None
