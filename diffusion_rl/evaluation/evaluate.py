"""Evaluate the base model and training checkpoints on a prompt file: K samples per prompt, every reward.

Every model sees the same prompts with the same seeds (sample k of prompt p starts from the noise of
(seed, p, k) whatever the batch), so the sheets and numbers of the columns are directly comparable and a
second run with the same seed reproduces the first. Output directory:

    metrics.json            settings, prompt file, rewards, and per column: checkpoint identity and statistics
    samples.jsonl           one row per image: column, prompt, ground truth, seed, image path, every score
    compare.md              the comparison table (also printed by the CLI)
    compare.png             the first prompts side by side across columns (when there are several columns); an
                            edit's row starts with its source image(s)
    <column>/sheet.png      contact sheet of a column (the first `sheet_prompts` prompts, K samples each); edits:
                            each tile source → result
    <column>/images/pPPPP_sKK.png

Videos (a video family, `frames` > 1) are written as animated WebP: the images, sheet.webp and compare.webp. An
edit's condition images (the prompt file's rows) are fitted to the output size, given to the model and to the
rewards (metadata["condition_images"]), as in training.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from diffusion_rl.checkpoint.weights import checkpoint_config, load_trained_weights
from diffusion_rl.config.fields import check_flag
from diffusion_rl.config.sampling import SamplingConfig
from diffusion_rl.config.secrets import redact_secrets
from diffusion_rl.config.train import TrainConfig, ValConfig
from diffusion_rl.data.condition_images import METADATA_KEY, fit_rows
from diffusion_rl.data.prompts import PromptRecord
from diffusion_rl.errors import UserError
from diffusion_rl.evaluation.summary import comparison_table, reward_stats
from diffusion_rl.evaluation.targets import Target
from diffusion_rl.models.image_size import require_size
from diffusion_rl.models.loader import load_model, resolve_device
from diffusion_rl.rewards import RewardCombiner, RewardFailure, WeightedReward, make_reward
from diffusion_rl.sampling.ode import ODE_SOLVER_NAMES
from diffusion_rl.sampling.rollout import SamplerSettings, sample_images
from diffusion_rl.sampling.sde import STEP_TYPE_NAMES
from diffusion_rl.sampling.window import default_window
from diffusion_rl.tracking.media import sample_sheet, save_sample
from diffusion_rl.utils.digest import file_sha256
from diffusion_rl.utils.files import naming, refuse_file_in_the_way
from diffusion_rl.utils.seeding import seed_for

logger = logging.getLogger(__name__)

OUTPUT_FILES = ("metrics.json", "samples.jsonl", "compare.md", "compare.png", "compare.webp")


# EvalSettings' fields, their flags and the config keys whose ranges (fields.Range) they are checked against
FLAG_KEYS = (
    ("n", "--n", "val.n", ValConfig),
    ("num_steps", "--steps", "val.num_steps", ValConfig),
    ("guidance", "--guidance", "val.guidance", ValConfig),
    ("guidance_low_noise", "--guidance-low-noise", "val.guidance_low_noise", ValConfig),
    ("height", "--height", "val.height", ValConfig),
    ("width", "--width", "val.width", ValConfig),
    ("noise_level", "--noise-level", "sampling.noise_level", SamplingConfig),
    ("batch_size", "--batch-size", "train.micro_batch_size", TrainConfig),
    ("frames", "--frames", "sampling.num_frames", SamplingConfig),
)


@dataclass(frozen=True)
class EvalSettings:
    """The sampling flags of `eval` (and `sample`, which checks its flags with it): one UserError naming the flag
    for a value that cannot work."""

    n: int = 4  # samples per prompt (K)
    num_steps: int = 20
    guidance: float = 4.5
    guidance_low_noise: float | None = None  # two timestep experts (Wan 2.2 A14B): the low-noise one's (None: guidance)
    height: int = 64
    width: int = 64
    sde_type: str = "ode"  # ode, or a stochastic step type for every step but the last
    noise_level: float = 0.7
    ode_solver: str = "euler"  # solver of the ODE steps (sampling/ode.py)
    seed: int = 0
    batch_size: int = 8  # images per forward pass and per reward call
    sheet_prompts: int = 16  # prompts shown on the contact sheets (all images are written regardless)
    use_ema: bool = True  # sample a checkpoint with its EMA weights when the run kept an EMA (as validation does)
    frames: int = 1  # video frames per sample (a video family)

    def __post_init__(self):
        for name, flag, key, section in FLAG_KEYS:  # each flag in the range of the config key it stands for
            check_flag(flag, getattr(self, name), key, section)
        if self.num_steps < 2 and self.sde_type != "ode":
            raise UserError(f"--steps must be ≥ 2 for SDE sampling, got {self.num_steps}")
        if self.sde_type not in STEP_TYPE_NAMES:
            raise UserError(f"--sde-type {self.sde_type!r} is unknown; known: {', '.join(STEP_TYPE_NAMES)}")
        if self.ode_solver not in ODE_SOLVER_NAMES:
            raise UserError(f"--ode-solver {self.ode_solver!r} is unknown; known: {', '.join(ODE_SOLVER_NAMES)}")
        if self.sheet_prompts < 1:
            raise UserError(f"--sheet-prompts must be ≥ 1, got {self.sheet_prompts}")

    def sampler(self) -> SamplerSettings:
        sde = self.sde_type if self.sde_type != "ode" else "sde"
        return SamplerSettings(
            self.num_steps, self.guidance, self.height, self.width, sde, self.noise_level, self.frames,
            self.ode_solver, guidance_low_noise=self.guidance_low_noise,
        )  # fmt: skip

    def seeds(self, prompt_index: int, sample: int) -> tuple[int, int]:
        """(initial-noise seed, SDE-noise seed) of sample k of prompt p: the same for every column."""
        return (
            seed_for(self.seed, "eval_init", prompt_index, sample),
            seed_for(self.seed, "eval_noise", prompt_index, sample),
        )


@dataclass(frozen=True)
class RewardChoice:
    name: str  # the reward to build (make_reward's name)
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    label: str | None = None  # its name in the scores, tables and captions (a training config's label); None = name
    frames: str = "mean"  # how an image reward scores a video (rewards/video.py)

    @property
    def metric_name(self) -> str:
        return self.label if self.label is not None else self.name


def build_scorer(rewards: Sequence[RewardChoice]) -> RewardCombiner:
    """Each reward scored on its own: not required, so one reward failing on a sample leaves the others' scores."""
    names = [r.metric_name for r in rewards]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UserError(f"--reward lists {', '.join(repeated)} more than once")
    return RewardCombiner(
        [WeightedReward(r.metric_name, 1.0, make_reward(r.name, **r.kwargs), False, frames=r.frames) for r in rewards]
    )


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with naming(path):
        tmp.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _none_if_nan(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def prepare_output(out: Path, force: bool) -> None:
    """Create `out`; an earlier evaluation there is an error, or removed (only its own files) with force."""
    refuse_file_in_the_way(out, "--out")
    earlier = [name for name in OUTPUT_FILES if (out / name).exists()]
    if earlier and not force:
        raise UserError(f"{out} holds an earlier evaluation ({', '.join(earlier)}); pass --force to replace it")
    if earlier:
        try:
            old_columns = [c["name"] for c in json.loads((out / "metrics.json").read_text())["columns"]]
        except (OSError, ValueError, KeyError, TypeError):
            old_columns = []
        for name in old_columns:
            folder = _column_folder(out, name)
            if folder is not None:
                shutil.rmtree(folder)
        for name in earlier:
            (out / name).unlink()
    out.mkdir(parents=True, exist_ok=True)


def _column_folder(out: Path, name) -> Path | None:
    """The folder an earlier evaluation wrote for its column `name`, when `name` is a plain folder name inside `out`
    (metrics.json may have been edited: never `out` itself, a parent, a link or a path)."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
        return None
    folder = out / name
    inside = folder.is_dir() and not folder.is_symlink() and folder.resolve().parent == out.resolve()
    return folder if inside else None


class _ModelSlot:
    """One loaded model at a time; reloaded only when a column needs other LoRA settings or pristine weights."""

    def __init__(self, model_cfg):
        self.model_cfg = model_cfg  # ModelConfig of the base model (LoRA off)
        self.model = None
        self.key: Any = None
        self.modified = False  # full fine-tuning weights were loaded over the base weights

    def get(self, target: Target):
        lora = None
        if not target.is_base:
            ckpt_lora = checkpoint_config(target.checkpoint).model.lora
            lora = ckpt_lora if ckpt_lora.enabled else None
        key = None if lora is None else (lora.rank, lora.alpha, tuple(lora.target_modules))
        if self.model is None or key != self.key or (target.is_base and self.modified):
            self.release()
            cfg = self.model_cfg if lora is None else dataclasses.replace(self.model_cfg, lora=lora)
            self.model, self.key, self.modified = load_model(cfg), key, False
        return self.model

    def release(self) -> None:
        self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _scores_of(
    scorer: RewardCombiner, images: np.ndarray, rows: Sequence[PromptRecord], sources: list[list[np.ndarray]] | None
) -> dict[str, np.ndarray]:
    prompts = [r.prompt for r in rows]
    metadata = [r.reward_metadata() for r in rows]
    for entry, row_sources in zip(metadata, sources or []):
        entry[METADATA_KEY] = row_sources
    try:
        return scorer(images, prompts, metadata).per_reward
    except RewardFailure as e:  # recorded as failed samples (NaN), counted in the table, not a crash mid-evaluation
        logger.error("%s", e)
        return {r.name: np.full(len(rows), np.nan, dtype=np.float32) for r in scorer.rewards}


def _caption(prompt: str, scores: dict[str, float], names: list[str]) -> str:
    if len(names) == 1:
        return f"{prompt} | {scores[names[0]]:.4g}"
    return prompt + " | " + ", ".join(f"{n} {scores[n]:.4g}" for n in names)


@torch.no_grad()
def evaluate_target(
    model, target: Target, records: list[PromptRecord], scorer: RewardCombiner, settings: EvalSettings, out: Path
) -> tuple[dict[str, np.ndarray], list[dict], np.ndarray]:
    """Sample and score one column. Returns (scores per reward [P, K], samples.jsonl rows, sheet images)."""
    names = [r.name for r in scorer.rewards]
    items = [(p, k) for p in range(len(records)) for k in range(settings.n)]
    window = None if settings.sde_type == "ode" else default_window(settings.num_steps)
    sampler = settings.sampler()
    scores = {n: np.full((len(records), settings.n), np.nan, dtype=np.float32) for n in names}
    rows, sheet, captions, sheet_sources = [], [], [], []
    image_dir = out / target.name / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(items), settings.batch_size)
    for start in tqdm(starts, desc=target.name, disable=None, dynamic_ncols=True, leave=False):
        chunk = items[start : start + settings.batch_size]
        chunk_records = [records[p] for p, _ in chunk]
        seeds = [settings.seeds(p, k) for p, k in chunk]
        sources = _sources(chunk_records, settings)
        images = sample_images(
            model,
            [r.prompt for r in chunk_records],
            [r.negative_prompt for r in chunk_records],
            sampler,
            init_seeds=[s for s, _ in seeds],
            noise_seeds=[s for _, s in seeds],
            window=window,
            images=model.fit_conditions([r.images for r in chunk_records], settings.height, settings.width),
        ).numpy()
        chunk_scores = _scores_of(scorer, images, chunk_records, sources)
        for i, ((p, k), record) in enumerate(zip(chunk, chunk_records)):
            image_path = save_sample(images[i], image_dir / f"p{p:04d}_s{k:02d}")
            sample_scores = {n: _none_if_nan(chunk_scores[n][i]) for n in names}
            for n in names:
                scores[n][p, k] = chunk_scores[n][i]
            rows.append(
                {
                    "model": target.name,
                    "prompt_index": p,
                    "sample": k,
                    "seed": seeds[i][0],
                    "prompt": record.prompt,
                    "negative_prompt": record.negative_prompt,
                    "ground_truth": record.ground_truth,
                    "data_source": record.data_source,
                    "image": image_path.relative_to(out).as_posix(),
                    "scores": sample_scores,
                }
            )
            if p < settings.sheet_prompts:
                sheet.append(images[i])
                sheet_sources.append(sources[i] if sources else [])
                captions.append(_caption(record.prompt, {n: float(chunk_scores[n][i]) for n in names}, names))
    save_sample(sample_sheet(np.stack(sheet), captions, settings.n, sheet_sources), out / target.name / "sheet")
    return scores, rows, np.stack(sheet)


def _sources(records: Sequence[PromptRecord], settings: EvalSettings) -> list[list[np.ndarray]] | None:
    """Each record's condition images at the output size; None for text prompts."""
    rows = [r.images for r in records]
    return fit_rows(rows, settings.height, settings.width)


def _identity(target: Target, model_path: str, weights: tuple[str, str] | None) -> dict[str, Any]:
    """Which weights a column sampled: `weights` is load_trained_weights' (which, digest of the trained weights)."""
    if target.is_base:
        return {"path": None, "step": None, "weights_sha256": None, "weights": "base", "model": model_path}
    which, digest = weights
    return {"path": str(target.checkpoint), "step": target.step, "weights_sha256": digest, "weights": which,
            "model": model_path}  # fmt: skip


def compare_sheet(
    targets: list[Target],
    sheets: dict[str, np.ndarray],
    scores: dict[str, dict[str, np.ndarray]],
    records: list[PromptRecord],
    settings: EvalSettings,
) -> np.ndarray:
    """One row per prompt: K samples of each column next to each other (the same seeds in every column); an edit's
    row starts with its source image(s) (one tile each). Videos give an animated sheet [F, H', W', 3].

    Each tile is captioned with its column, sample and the first reward's score; a row's first tile also
    names the prompt (below, so a long prompt is what gets cut).
    """
    k = settings.n
    n_prompts = len(sheets[targets[0].name]) // k
    sources = _sources(records[:n_prompts], settings)
    tiles, captions = [], []
    for p in range(n_prompts):
        for s, source in enumerate(sources[p] if sources else []):
            tiles.append(source)
            captions.append(f"source {s + 1}" if s else f"source\n{records[p].prompt}")
        for t in targets:
            first_reward = next(iter(scores[t.name].values()))
            for j in range(k):
                tiles.append(sheets[t.name][p * k + j])
                caption = f"{t.name} #{j} | {first_reward[p, j]:.4g}"
                first = t is targets[0] and j == 0 and not sources
                captions.append(f"{caption}\n{records[p].prompt}" if first else caption)
    width = k * len(targets) + (len(sources[0]) if sources else 0)
    return sample_sheet(np.stack(tiles), captions, width)


def evaluate(
    model_cfg,
    targets: list[Target],
    records: list[PromptRecord],
    rewards: Sequence[RewardChoice],
    settings: EvalSettings,
    out: str | os.PathLike[str],
    prompts_file: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Evaluate every target (column) and write the output directory; returns what metrics.json holds.

    model_cfg: the `ModelConfig` of the base model (LoRA off); a checkpoint column adds its run's LoRA settings.
    """
    out = Path(out)
    scorer = build_scorer(rewards)
    prepare_output(out, force)
    slot = _ModelSlot(model_cfg)
    names = [r.metric_name for r in rewards]
    # base first, then checkpoints grouped by LoRA settings: the fewest model loads; the table keeps the given order
    order = sorted(targets, key=lambda t: (not t.is_base, str(slot_key_hint(t))))
    first = slot.get(order[0])
    require_size(first, settings.height, settings.width, settings.frames)  # the user's to fix
    first.check_low_noise_guidance(settings.guidance_low_noise, "--guidance-low-noise")
    columns: dict[str, dict[str, Any]] = {}
    sheets: dict[str, np.ndarray] = {}
    all_scores: dict[str, dict[str, np.ndarray]] = {}
    sources = [r.data_source for r in records]
    with naming(out / "samples.jsonl"), open(out / "samples.jsonl", "w", encoding="utf-8") as samples_file:
        for target in order:
            start = time.perf_counter()
            model = slot.get(target)
            weights = None
            if not target.is_base:
                weights = load_trained_weights(model, target.checkpoint, use_ema=settings.use_ema)
                slot.modified = slot.modified or model.policies.lora is None
            logger.info("evaluating %s (%d prompts × %d samples)", target.name, len(records), settings.n)
            scores, rows, sheets[target.name] = evaluate_target(model, target, records, scorer, settings, out)
            all_scores[target.name] = scores
            for row in rows:
                samples_file.write(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
            samples_file.flush()
            columns[target.name] = {
                "name": target.name,
                "checkpoint": _identity(target, str(model.directory.resolve()), weights),
                "rewards": {n: reward_stats(scores[n], sources) for n in names},
                "sheet": f"{target.name}/sheet.{'webp' if settings.frames > 1 else 'png'}",
                "seconds": time.perf_counter() - start,
            }
    slot.release()
    ordered = [columns[t.name] for t in targets]
    result = {
        "prompts": {
            "file": str(prompts_file) if prompts_file is not None else None,
            "sha256": file_sha256(Path(prompts_file)) if prompts_file is not None else None,
            "count": len(records),
        },
        "settings": dataclasses.asdict(settings),
        "model": {
            **{k: v for k, v in dataclasses.asdict(model_cfg).items() if k != "lora"},
            "device": str(resolve_device(model_cfg.device)),
        },
        "rewards": [redact_secrets(r) for r in rewards],  # kwargs may hold an api_key
        "columns": ordered,
    }
    table = comparison_table(ordered, settings.n)
    with naming(out / "compare.md"):
        (out / "compare.md").write_text(_compare_markdown(result, table), encoding="utf-8")
    if len(targets) > 1:
        save_sample(compare_sheet(targets, sheets, all_scores, records, settings), out / "compare")
    _write_json(out / "metrics.json", result)
    result["table"] = table
    return result


def slot_key_hint(target: Target) -> Any:
    """Groups checkpoints by their LoRA settings so consecutive columns reuse one loaded model."""
    if target.is_base:
        return ""
    lora = checkpoint_config(target.checkpoint).model.lora
    return (lora.rank, lora.alpha, tuple(lora.target_modules)) if lora.enabled else ()


def _compare_markdown(result: dict[str, Any], table: str) -> str:
    s = result["settings"]
    lines = [
        "# Evaluation",
        "",
        f"Prompts: `{result['prompts']['file']}` ({result['prompts']['count']}), {s['n']} samples each, "
        f"{s['num_steps']} {s['sde_type']} steps, guidance {s['guidance']}"
        + ("" if s["guidance_low_noise"] is None else f" (low-noise expert {s['guidance_low_noise']})")
        + f", {s['height']}×{s['width']}, "
        f"seed {s['seed']}. Rewards: {', '.join(r['label'] or r['name'] for r in result['rewards'])}.",
        "",
        table,
        "| column | checkpoint | step | weights | sha256 |",
        "|---|---|---|---|---|",
    ]
    for c in result["columns"]:
        ident = c["checkpoint"]
        sha = (ident["weights_sha256"] or "")[:16]
        step = "-" if ident["step"] is None else ident["step"]
        lines.append(f"| {c['name']} | {ident['path'] or ident['model']} | {step} | {ident['weights']} | {sha} |")
    lines.append("")
    if len(result["columns"]) > 1:
        lines += [f"![side by side](compare.{'webp' if s['frames'] > 1 else 'png'})", ""]
    return "\n".join(lines)
