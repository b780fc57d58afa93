"""Which image sizes a loaded model can make: its native size, its largest, and a check that suggests one that fits.

Read from the pipeline's configs, so every family (and a real checkpoint as well as a tiny one) answers alike:
- native: the transformer's `sample_size` (in latent pixels) × the VAE's down-sampling, else the VAE's own
  `sample_size` (in pixels), else the pipeline's default (`default_sample_size` × VAE scale, what diffusers
  samples when given no size; Wan's pipeline has none in its configs: the adapter's `native_size`);
- largest: a transformer with a learned position table (SD3's `pos_embed_max_size`, in patches) takes at most
  pos_embed_max_size × patch_size × VAE scale pixels a side; rotary-position transformers (FLUX.1, Qwen-Image)
  have no such bound;
- multiple: the adapter's `size_step` (VAE scale × the latent cells a token covers).

`size_problem` is the one check of a size against them: `sample`'s and `eval`'s flags, the worker's sampling.* and
val.* sizes (engine/worker.py), and `estimate`'s architecture before a model is loaded (estimate/architectures.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ImageSizes:
    native: int | None  # pixels a side the model was made for (None: its configs do not say, as estimate reads them)
    largest: int | None  # pixels a side at most (None: no bound in the config)
    multiple: int  # height and width must be multiples of this
    why_largest: str = ""  # how `largest` follows from the config, for messages


def image_sizes(model) -> ImageSizes:
    """The sizes `model` (a FlowModel) can sample, from its pipeline's configs."""
    pipeline = model.pipeline
    scale, transformer = int(model.vae_scale), pipeline.transformer.config
    return sizes_from_configs(transformer, pipeline.vae.config, scale, model.size_step(scale, transformer),
                              getattr(pipeline, "default_sample_size", None), model.native_size)  # fmt: skip


def sizes_from_configs(transformer, vae, scale: int, multiple: int, default_sample_size: int | None,
                       fallback: int | None) -> ImageSizes:  # fmt: skip
    """The sizes of a model with these transformer and VAE configs (mappings: a loaded pipeline's, or `estimate`'s
    architecture's), VAE scale, size step (`FlowModel.size_step`), pipeline default and adapter's `native_size`."""
    largest, why = None, ""
    table = transformer.get("pos_embed_max_size")
    if table:
        patch = int(transformer.get("patch_size") or 1)
        largest = table * patch * scale
        why = f"pos_embed_max_size {table} × patch {patch} × VAE scale {scale}"
    native = _native(transformer, vae, scale, default_sample_size, fallback)
    if native is not None:
        native = min(native, largest or native)
        native = max(multiple, native - native % multiple)
    return ImageSizes(native=native, largest=largest, multiple=multiple, why_largest=why)


def _native(transformer, vae, scale: int, default_sample_size: int | None, fallback: int | None) -> int | None:
    latent_size = transformer.get("sample_size")
    if isinstance(latent_size, int) and latent_size > 0:
        return latent_size * scale
    vae_size = vae.get("sample_size")
    if isinstance(vae_size, int) and vae_size > 0:
        return vae_size
    if default_sample_size:
        return int(default_sample_size) * scale
    return None if fallback is None else int(fallback)


def size_problem(model, height: int, width: int, keys: tuple[str, str] = ("--height", "--width")) -> str | None:
    """Why `model` (a FlowModel, or its ImageSizes) cannot sample height × width pixels, with a size that works
    (named by `keys`: the flags or config keys the user sets); None when it can."""
    sizes = model if isinstance(model, ImageSizes) else image_sizes(model)

    def fit(size: int) -> int:
        if sizes.largest is not None:
            size = min(size, sizes.largest)
        return max(sizes.multiple, size - size % sizes.multiple)

    native = "" if sizes.native is None else f" (the model's native size is {sizes.native})"
    suggestion = f"try {keys[0]} {fit(height)} {keys[1]} {fit(width)}{native}"
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
