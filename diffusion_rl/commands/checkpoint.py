"""`diffusion-rl checkpoint upgrade DIR`: rewrite a checkpoint of the earlier formats in the current one.

Before the one format (checkpoint/state.py), the local engine wrote `policy_<name>.safetensors` and
`trainer_state.pt` (optimizer, LR schedule, EMA, counters), the Ray engine `dcp/` (policies, optimizer, EMA,
sharded) and a `trainer_state.pt` without the optimizer; both a `run_state.pt` (step, data order, RNG). Every file
is read without running code from it (weights_only). The checkpoint's config.yaml is brought to today's keys first
(the loss settings that sat in `algorithm` move into its section `algorithm.<loss>`; `algorithm.family` goes); the
model is rebuilt from it on the CPU (`--model` points at the base model when it has moved), the old state loaded
into it and written anew with the converted config and a manifest (checkpoint/manifest.py); the directory is replaced
only once the new one is complete.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from diffusion_rl.checkpoint.manifest import verify_checkpoint, write_manifest
from diffusion_rl.checkpoint.paths import step_of
from diffusion_rl.checkpoint.state import CONFIG_FILE, DCP_DIR, STATE_FILE, write_state
from diffusion_rl.checkpoint.store import rename_into_place
from diffusion_rl.errors import UserError

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("checkpoint", help="checkpoint tools: upgrade a checkpoint of an earlier format")
    actions = p.add_subparsers(dest="action", required=True)
    up = actions.add_parser(
        "upgrade",
        help="rewrite a checkpoint of an earlier diffusion-rl format in the current one (in place)",
        description=__doc__.split("\n\n")[1],
    )
    up.add_argument("checkpoint", nargs="+", help="step_NNNNNN checkpoint directories")
    up.add_argument(
        "--model",
        default=None,
        help="the base model: a directory or a Hub id owner/name (default: the run's model.path)",
    )
    up.set_defaults(fn=cmd_upgrade)


def cmd_upgrade(args) -> None:
    for directory in args.checkpoint:
        upgrade(directory, args.model)


OLD_TRAINER_STATE = "trainer_state.pt"
OLD_RUN_STATE = "run_state.pt"


def _load_plain(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # any failure to read is the same answer for the user
        raise UserError(f"{path}: cannot be read as plain data ({type(e).__name__}: {e})") from None


def migrate_config(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A config of the earlier formats (as its config.yaml holds it) with today's keys, and what changed: each loss
    setting that sat in `algorithm` moves into the selected loss's section when that loss has it (a setting of
    another loss, never read by the run, and `algorithm.family`, which the loss now implies, are dropped)."""
    from diffusion_rl.config.algorithm import OLD_LOSS_KEYS, losses_with_key

    data = copy.deepcopy(data)
    algorithm = data.get("algorithm")
    if not isinstance(algorithm, dict):
        return data, []
    loss, changes = algorithm.get("loss", "flow_grpo"), []
    if algorithm.pop("family", None) is not None:
        changes.append("algorithm.family dropped (algorithm.loss implies it)")
    for key in [k for k in OLD_LOSS_KEYS if k in algorithm]:
        value = algorithm.pop(key)
        if value is not None and loss in losses_with_key(key):  # null: the loss's default, which its section has
            section = algorithm.setdefault(loss, {})
            section.setdefault(key, value)
            changes.append(f"algorithm.{key} → algorithm.{loss}.{key}")
        else:
            changes.append(f"algorithm.{key} dropped ({'null' if value is None else f'not a key of {loss}'})")
    return data, changes


def _upgraded_config(directory: Path):
    """The checkpoint's config.yaml, migrated and built (a UserError naming the file when it does not load)."""
    from diffusion_rl.config import Config
    from diffusion_rl.config.convert import from_dict
    from diffusion_rl.config.loading import read_yaml_config
    from diffusion_rl.user_code import refusing_user_code

    data, changes = migrate_config(read_yaml_config(directory / CONFIG_FILE))
    try:
        with refusing_user_code(f"the {CONFIG_FILE} of checkpoint {directory}"):  # it chooses no code to run
            cfg = from_dict(Config, data)
    except UserError as e:
        raise UserError(f"{directory / CONFIG_FILE}: {e}") from None
    for change in changes:
        logger.info("%s: %s", directory / CONFIG_FILE, change)
    return cfg


def upgrade(directory: str | os.PathLike[str], model_path: str | None = None) -> Path:
    """Rewrite the checkpoint `directory` (a step_NNNNNN folder) in the current format, in place."""
    from diffusion_rl.config.loading import to_yaml
    from diffusion_rl.config.secrets import redact_secrets
    from diffusion_rl.engine.worker import PolicyWorker
    from diffusion_rl.trainer.setup import worker_spec

    given = Path(directory)
    step_of(given.resolve())  # a step_NNNNNN folder, or a UserError
    verify_checkpoint(given)  # no link to or in it (the earlier formats had no manifest: read unverified)
    directory = given.resolve()
    if (directory / STATE_FILE).is_file():
        raise UserError(f"{directory} is already in the current checkpoint format")
    missing = [n for n in (OLD_TRAINER_STATE, OLD_RUN_STATE, CONFIG_FILE) if not (directory / n).is_file()]
    if missing:
        raise UserError(f"{directory} is not a checkpoint of an earlier diffusion-rl format: no {', '.join(missing)}")
    saved = _upgraded_config(directory)
    given = {"path": model_path, "revision": None} if model_path else {}  # another base model: at main
    model = {"device": "cpu", "create_tiny_if_missing": None, **given}
    cfg = dataclasses.replace(saved, model=dataclasses.replace(saved.model, **model), engine=copy.copy(saved.engine))
    cfg.engine.kind = "local"  # the saved config keeps its own engine
    worker = PolicyWorker(worker_spec(cfg))
    trainer_state = _load_plain(directory / OLD_TRAINER_STATE)
    run_state = _load_plain(directory / OLD_RUN_STATE)
    if (directory / DCP_DIR).is_dir():
        _load_old_sharded(worker, directory)
    else:
        _load_old_local(worker, directory, trainer_state)
    worker.optimizer.load_counters_state(trainer_state)

    tmp = directory.parent / f".tmp-upgrade-{directory.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        engine_state = worker.save(tmp)
        state = {"step": run_state["step"], "sampler": run_state["sampler"], "rng": run_state["rng"]}
        write_state(tmp, {**state, "engine": engine_state})
        (tmp / CONFIG_FILE).write_text(to_yaml(redact_secrets(saved)), encoding="utf-8")  # today's keys
        write_manifest(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    rename_into_place(tmp, directory, aside=directory.parent / f".tmp-old-{directory.name}-{os.getpid()}")
    logger.info("upgraded %s to the current checkpoint format", directory)
    return directory


def _load_old_local(worker, directory: Path, trainer_state: dict) -> None:
    policies = worker.model.policies
    for name in policies.saved_names():
        path = directory / f"policy_{name}.safetensors"
        if not path.is_file():
            raise UserError(f"{directory}: no {path.name} for the model's '{name}' policy")
        policies.load_state_dict_of(name, load_file(path))
    worker.optimizer.optimizer.load_state_dict(trainer_state["optimizer"])
    ema, saved = worker.optimizer.ema, trainer_state.get("ema")
    if ema is not None and saved is not None:
        ema.load_shadow(saved["shadow"])


def _load_old_sharded(worker, directory: Path) -> None:
    """The Ray engine's dcp/ already had today's layout (policies, optimizer, EMA)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from diffusion_rl.checkpoint.state import SafeLoadPlanner, SafeReader

    reader = SafeReader(directory / DCP_DIR)
    has_ema = any(k.startswith("ema.") for k in reader.read_metadata().state_dict_metadata)
    tensors = worker.tensors(with_ema=has_ema and worker.optimizer.ema is not None)
    dcp.load(tensors, storage_reader=reader, planner=SafeLoadPlanner())
    for name, weights in tensors["policies"].items():
        worker.model.policies.load_state_dict_of(name, weights)
    set_optimizer_state_dict(worker.model.policies.trained, worker.optimizer.optimizer, tensors["optimizer"])
    if "ema" in tensors:
        worker.optimizer.ema.load_shadow(list(tensors["ema"].values()))
