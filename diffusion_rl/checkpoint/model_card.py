"""The model card (README.md) `diffusion-rl export` writes beside the weights: the Hugging Face Hub's front matter,
what was trained and how, and a diffusers snippet that samples as the run validated.

The snippet matters because some settings change the images and the pipelines' defaults differ from a run's: the
text length above all (`model.max_sequence_length`, 256 by default here, where most pipelines default to 512 and
pad unmasked text, so the same prompt reaches the transformer as other embeddings), then the guidance (spelt per
family: `FlowModel.pipeline_call_settings`), the step count, the size and frames. They come from the run's
validation settings (`val.*`, else `sampling.*`: `validation_sampling`), and the snippet passes only the keywords
the pipeline's `__call__` takes.
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import yaml

from diffusion_rl.checkpoint.weights import validation_sampling
from diffusion_rl.data.prompts import condition_images_in, load_prompts
from diffusion_rl.errors import UserError
from diffusion_rl.models.base import SnippetImage
from diffusion_rl.models.export import LORA_FILES
from diffusion_rl.models.registry import family_named
from diffusion_rl.utils.hub_ids import names_hub_repo

CARD_FILE = "README.md"
# the folder huggingface_hub's cache keeps a Hub repository's snapshots in
_HUB_CACHE = re.compile(r"models--([\w.-]+?)--([\w.-]+)(?:/snapshots/([0-9a-f]{40})\b)?")


def hub_id(path: str | Path | None) -> str | None:
    """The Hub id a model path names: an `owner/name` that is no local path, or a huggingface_hub cache snapshot
    (…/models--owner--name/snapshots/…); None for any other path (a local directory names no Hub model)."""
    if not path:
        return None
    cached = _HUB_CACHE.search(str(path))
    if cached:
        return f"{cached[1]}/{cached[2]}"
    if names_hub_repo(path) and not Path(path).exists():
        return str(path)
    return None


def hub_commit(path: str | Path | None) -> str | None:
    """The commit of a huggingface_hub cache snapshot path (…/models--owner--name/snapshots/<commit>); else None."""
    cached = _HUB_CACHE.search(str(path or ""))
    return cached[3] if cached else None


def pipeline_call(model, cfg, sources: int | None = None) -> dict:
    """The keywords of `model`'s pipeline call that sample as the run (`cfg`, its Config) validated, those its
    `__call__` takes only: steps, guidance, size (frames for video; FluxKontextPipeline's `max_area`, to which it
    rescales any size, 1024² by default), text length, an empty negative prompt where guidance runs classifier-free
    (the pipelines that take one need it for CFG), and those that make the pipeline read condition images as given
    where the run read them at the output size and the pipeline would resize them (`model.condition_size`;
    FluxKontextPipeline's `_auto_resize=False`). `sources`: the run's condition images per prompt, when known."""
    s = validation_sampling(cfg)
    sources = _condition_images(model, cfg) if sources is None else sources
    wanted = {"num_inference_steps": s["steps"], "height": s["height"], "width": s["width"],
              "max_area": s["height"] * s["width"]}  # fmt: skip
    if _reads_sources_elsewhere(model, cfg, sources, s["height"], s["width"]):
        wanted |= model.conditions_as_given or {}
    if model.video:
        wanted["num_frames"] = s["frames"]
    wanted |= model.pipeline_call_settings(s["guidance"], s["guidance_low_noise"])
    if model.forwards_per_evaluation(s["guidance"]) == 2:
        wanted["negative_prompt"] = ""
    return {k: v for k, v in wanted.items() if k in _parameters(model)}


def _condition_images(model, cfg) -> int:
    """Condition images per prompt the run read: its data.train records' count (FLUX.2 reads 0 or more), where that
    file is here and readable; else 1 for an editing family (task image-to-…), 0 for the others."""
    if not model.edits:
        return 0
    try:
        known = condition_images_in(cfg.data.train) if cfg.data.train else None
    except UserError:
        known = None
    return known if known is not None else int(family_named(model.family).task.startswith("image-to"))


def _reads_sources_elsewhere(model, cfg, sources: int, height: int, width: int) -> tuple[int, int] | None:
    """The size at which the family's pipeline reads condition images for a height × width output, where the run read
    some (`sources` per prompt) at the output size (model.condition_size: output) and the two differ; else None."""
    if cfg.model.condition_size != "output" or not sources:
        return None
    size = model.pipeline_condition_size(height, width)
    return None if size == (height, width) else size


def _own_negatives(cfg) -> list[str]:
    """The distinct non-empty negative prompts of the run's prompt files (val.prompts, data.train) that are here; a
    file that is gone or unreadable is left out (the card is written without it)."""
    found: dict[str, None] = {}
    for path in (cfg.val.prompts, cfg.data.train):
        if path and Path(path).is_file():
            try:
                found.update(dict.fromkeys(r.negative_prompt for r in load_prompts(path) if r.negative_prompt))
            except UserError:
                continue
    return list(found)


def _parameters(model) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(type(model.pipeline).__call__).parameters)


def model_card(model, cfg, *, out: Path, base: str, step: int, weights: str, merged: bool) -> str:
    """The README.md text for an export of `model` (trained as `cfg` says) at `out`: front matter, then what it is
    and a runnable snippet. `base`: the base model path it was loaded from; `step`: the checkpoint's training step;
    `weights`: "ema" or "trained"."""
    family = family_named(model.family)
    pipeline = type(model.pipeline).__name__
    lora = model.policies.lora is not None and not merged
    loaded_from = getattr(model.pipeline.config, "_name_or_path", None)
    base_id = hub_id(loaded_from) or hub_id(cfg.model.path)
    commit = hub_commit(loaded_from) if base_id else None  # the snippet loads the commit the run trained on
    front = {"base_model": base_id} if base_id else {}
    tags = ["diffusion-rl", "diffusers", family.task, *(["lora"] if lora else []), model.family]
    front |= {"library_name": "diffusers", "pipeline_tag": family.task, "tags": tags}
    header = "---\n" + yaml.safe_dump(front, sort_keys=False) + "---\n"
    return "\n".join([header, *_summary(model, cfg, family, pipeline, step, weights, merged, base_id or base),
                      "", *_snippet(model, cfg, family, pipeline, out, base_id or base, lora, commit)])  # fmt: skip


def _summary(model, cfg, family, pipeline, step, weights, merged, base) -> list[str]:
    rewards = ", ".join(f"`{r.label or r.name}` (weight {r.weight:g})" for r in cfg.rewards)
    lora_cfg = cfg.model.lora
    if model.policies.lora is None:
        trained = "the whole transformer (full fine-tuning)"
    else:
        targets = ", ".join(lora_cfg.target_modules or family.lora_targets)
        trained = f"a LoRA of rank {lora_cfg.rank}, alpha {lora_cfg.alpha} on {targets}"
        trained += ", merged into the transformer" if merged else ""
    what = "A merged diffusers model" if merged else "A LoRA for diffusers"
    lines = [
        f"# {what}: {model.family} fine-tuned with diffusion-rl",
        "",
        f"- base model: `{base}` ({family.task}, `{pipeline}`)",
        f"- algorithm: `{cfg.algorithm.loss}`; the {weights} weights of the checkpoint at training step {step}",
        f"- rewards: {rewards}",
        f"- trained: {trained}",
    ]
    solver = cfg.val.ode_solver or cfg.sampling.ode_solver
    if solver != "euler":
        lines.append(f"- the run validated with the `{solver}` ODE solver; diffusers samples with its scheduler's")
    return lines


def _snippet(model, cfg, family, pipeline, out: Path, base: str, lora: bool, commit: str | None = None) -> list[str]:
    s, sources = validation_sampling(cfg), _condition_images(model, cfg)
    call = pipeline_call(model, cfg, sources)
    elsewhere = _reads_sources_elsewhere(model, cfg, sources, s["height"], s["width"])
    video = model.video
    lines = [
        "Sample it as the run validated (its steps, guidance, size and text length: other values, the pipeline's "
        "defaults among them, give other images):",
        "",
        "```python",
        "import torch",
        f"from diffusers import {pipeline}",
    ]
    if video:
        lines.append("from diffusers.utils import export_to_video")
    image = _image_argument(model, sources, elsewhere, s["height"], s["width"])
    if image or any(isinstance(v, SnippetImage) for v in call.values()):
        lines.append("from diffusers.utils import load_image")
    lines.append("")
    dtype = str(model.dtype)
    if lora:
        pinned = f", revision={_py(commit)}" if commit else ""
        lines.append(f"pipe = {pipeline}.from_pretrained({_py(base)}{pinned}, dtype={dtype})")
        lines.append(f"lora = {_py(str(out.resolve()))}  # this folder, or the Hub repository it was pushed to")
        for component, file in LORA_FILES.items():
            if (out / file).is_file():
                extra = "" if component == "transformer" else ", load_into_transformer_2=True"
                lines.append(f"pipe.load_lora_weights(lora, weight_name={_py(file)}{extra})")
    else:
        lines.append(f"pipe = {pipeline}.from_pretrained({_py(str(out.resolve()))}, dtype={dtype})")
    lines.append('pipe.to("cuda" if torch.cuda.is_available() else "cpu")')
    lines.append("")
    args = [*([image] if image else []), '    prompt="a red fox in the snow",']
    args += [f"    {k}={_py(v)}," for k, v in call.items()]
    args.append("    generator=torch.Generator().manual_seed(0),")
    result = "frames" if video else "images"
    lines += [f"{result} = pipe(", *args, f").{result}"]
    lines.append('export_to_video(frames[0], "sample.mp4")' if video else 'images[0].save("sample.png")')
    lines.append("```")
    defaults = {k: p.default for k, p in _parameters(model).items() if p.default is not inspect.Parameter.empty}
    differ = [f"`{k}` ({defaults[k]!r} there)" for k, v in call.items() if k in defaults and defaults[k] != v]
    if differ:
        lines += ["", f"These differ from `{pipeline}`'s defaults: {', '.join(differ)}."]
    negatives = _own_negatives(cfg) if "negative_prompt" in call else []
    if negatives:
        lines += [
            "",
            f"The run's prompts carry negative prompts of their own ({len(negatives)} distinct, e.g. "
            f"{json.dumps(negatives[0])}): pass a prompt's own as `negative_prompt` to sample as the run did.",
        ]
    if elsewhere and model.conditions_as_given is None:
        size = f"{elsewhere[0]}×{elsewhere[1]}"
        lines += ["", f"The run read its condition images at the output size (`model.condition_size: output`); "
                  f"`{pipeline}` resizes them to {size} for its VAE whatever it is given, so its samples differ "
                  "from the run's. Train with `model.condition_size: pipeline` to sample as trained."]  # fmt: skip
    return lines


def _image_argument(model, count: int, elsewhere, height: int, width: int) -> str | None:
    """The snippet's `image=` line: the run's `count` condition images per prompt (input.png; input_1.png … for
    several), resized to the output size where the run read them so and the pipeline would read them `elsewhere`; a
    video's first frame; None for a run that read none."""
    if model.video:  # image-to-video: the first frame (a last one, where read, is the call's `last_image`)
        return '    image=load_image("input.png"),  # the image to start from' if model.edits else None
    if not count:
        return None
    resize = f".resize(({width}, {height}))" if elsewhere else ""
    files = ["input.png"] if count == 1 else [f"input_{i}.png" for i in range(1, count + 1)]
    loads = [f"load_image({json.dumps(f)}){resize}" for f in files]
    value = loads[0] if count == 1 else f"[{', '.join(loads)}]"
    why = "at the output size, as trained" if resize else "as the pipeline reads it"
    return f"    image={value},  # the image{'s' if count > 1 else ''} to edit, {why}"


def _py(value) -> str:
    """A Python literal of `value` for the snippet, strings in double quotes like the lines around them."""
    if isinstance(value, SnippetImage):
        return f"load_image({json.dumps(str(value))})"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def write_model_card(out: Path, text: str) -> Path:
    """Write `text` as out/README.md (in place of the one peft's save_pretrained writes for a LoRA)."""
    path = Path(out) / CARD_FILE
    path.write_text(text)
    return path
