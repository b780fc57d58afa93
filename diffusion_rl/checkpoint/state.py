"""What a checkpoint holds, in one format for every engine and worker count.

    step_000010/
      dcp/         torch.distributed.checkpoint: every named policy's weights, the optimizer state and the EMA.
                   Written sharded by the Ray engine's workers or whole by the local engine, and read back into
                   whatever sharding the loading run has: a run moves between engines and worker counts.
      state.pt     plain data (loaded with weights_only=True): format version, step, data order, RNG states,
                   the LR schedule and update counters.
      config.yaml  the run's config (secrets redacted): what `eval`, `sample` and `export` rebuild the model from.
      adapter/     LoRA only, an export not read on resume: the trained adapter in peft's format and in
                   diffusers' (`pipeline.load_lora_weights(adapter/)`).
      manifest.sha256  the sha256 of every file above, written when the checkpoint is saved and checked before it is
                   read (checkpoint/manifest.py: `read_state`, `read_saved_tensors` and checkpoint/weights.py call it).

A checkpoint directory is read without running code from it: state.pt with torch's weights_only loader, DCP's
metadata with an unpickler that admits only DCP's own metadata classes, and DCP's non-tensor entries with the
weights_only loader. Checkpoints of the earlier formats (before `state.pt`) are refused with the command that
converts them (checkpoint/legacy.py).
"""

from __future__ import annotations

import io
import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from diffusion_rl.checkpoint.manifest import verify_checkpoint
from diffusion_rl.errors import UserError

FORMAT_VERSION = 2
DCP_DIR = "dcp"
DCP_METADATA = ".metadata"  # dcp/'s index of every entry and the file holding it
STATE_FILE = "state.pt"
CONFIG_FILE = "config.yaml"
ADAPTER_DIR = "adapter"
LEGACY_FILES = ("trainer_state.pt", "run_state.pt")

# what DCP's .metadata pickle may name: its own metadata classes and the torch types they hold
_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """DCP's file reader, with its metadata read by an unpickler that admits only DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise UserError(f"{path}: not a readable checkpoint metadata file ({e})") from None
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, reading non-tensor entries (optimizer hyper-parameters) with torch's weights_only loader."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, EOFError, RuntimeError) as e:
            raise ValueError(f"{fqn}: an entry that is not plain data ({_refusal(e)})") from None
        if isinstance(self.state_dict.get(fqn), torch.Tensor) and not isinstance(obj, torch.Tensor):
            raise ValueError(f"{fqn}: a {type(obj).__name__} where a tensor belongs")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def saved_keys(directory: Path) -> set[str]:
    """The flattened keys the checkpoint's dcp/ holds (e.g. 'policies.default.<name>', 'ema.<name>')."""
    return set(SafeReader(directory / DCP_DIR).read_metadata().state_dict_metadata)


def read_saved_tensors(directory: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Whole CPU copies of the tensors dcp/ holds under a key prefix (e.g. 'policies.default.', 'ema.'), named
    without it: read from the metadata's shapes, so no model is needed (and any saved sharding works)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify_checkpoint(directory)
    check_format(directory)
    metadata = SafeReader(directory / DCP_DIR).read_metadata()
    targets = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    load_tensors(targets, directory)
    return {key.removeprefix(prefix): tensor for key, tensor in targets.items()}


def save_tensors(tensors: dict, directory: Path) -> None:
    """Write `tensors` (nested dicts of tensors or DTensors) to directory/dcp. Collective under a process group."""
    with warnings.catch_warnings():  # one process without a process group is the local engine's normal case
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(tensors, checkpoint_id=directory / DCP_DIR)


def load_tensors(tensors: dict, directory: Path) -> None:
    """Fill `tensors` (nested dicts shaped like the saved ones, in this run's sharding) from directory/dcp."""
    from torch.distributed.checkpoint.api import CheckpointException

    check_format(directory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.load(tensors, storage_reader=SafeReader(directory / DCP_DIR), planner=SafeLoadPlanner())
        except CheckpointException as e:  # each rank's exception with its traceback: the first one's reason is enough
            short = _cut_short(directory / DCP_DIR)
            reason = next((_first_line(exc) for exc, _ in e.failures.values()), "unknown failure")
            said = f"{', '.join(short)} shorter than dcp/.metadata says (cut short)" if short else reason
            raise UserError(f"checkpoint {directory} is damaged or not ours: {said}") from None


def _cut_short(dcp_dir: Path) -> list[str]:
    """The dcp/ files that end before the entries the metadata places in them (a copy or a disk cut them short)."""
    ends: dict[str, int] = {}
    for info in (SafeReader(dcp_dir).read_metadata().storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return [f"dcp/{name}" for name, end in sorted(ends.items())
            if (dcp_dir / name).is_file() and (dcp_dir / name).stat().st_size < end]  # fmt: skip


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__


def _refusal(error: BaseException) -> str:
    """torch's own line saying what its weights_only loader refused (not its advice to allow-list the global), or
    the error's first line."""
    said = next((line.strip() for line in str(error).splitlines() if "WeightsUnpickler error" in line), None)
    return said.split(". ")[0] if said else _first_line(error)


def write_state(directory: Path, state: dict) -> None:
    """state.pt: plain data only (numbers, strings, lists, dicts, tensors), so weights_only loading reads it."""
    torch.save({"format": FORMAT_VERSION, **state}, directory / STATE_FILE)


def read_state(directory: Path) -> dict:
    """state.pt of a verified checkpoint (the trainer's resume reads it first: checkpoint/manifest.py)."""
    verify_checkpoint(directory)
    check_format(directory)
    return load_state_file(directory / STATE_FILE)


def load_state_file(path: Path) -> dict:
    """A checkpoint's state file (plain data, torch's weights_only loader), with a step; one line when it is not."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"{path}: refused to load (it holds more than plain data: {_refusal(e)})") from None
    except (RuntimeError, EOFError, ValueError) as e:  # not a torch.save file, or a truncated one
        raise UserError(f"{path}: not a readable checkpoint state file ({_first_line(e)})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise UserError(f"{path}: not a checkpoint state (no step in it)")
    return state


@contextmanager
def state_fits(path: Path):
    """Reading a loaded state file's entries back into the run: an entry missing or of another type (a file edited,
    or written by other code, after it was saved) is one line naming the file, not a traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise UserError(f"{path}: its entries do not read back ({type(e).__name__}: {_first_line(e)}); the file was "
                        "changed after it was saved: resume from another checkpoint") from None  # fmt: skip


def check_format(directory: Path) -> None:
    """A UserError unless `directory` is a checkpoint of this format (an earlier one names the command to convert)."""
    if (directory / STATE_FILE).is_file() and (directory / DCP_DIR / DCP_METADATA).is_file():
        return
    if any((directory / name).is_file() for name in LEGACY_FILES):
        raise UserError(
            f"{directory} is a checkpoint of an earlier diffusion-rl format; convert it once with "
            f"`diffusion-rl checkpoint upgrade {directory}`"
        )
    missing = [n for n in (STATE_FILE, f"{DCP_DIR}/{DCP_METADATA}") if not (directory / n).is_file()]
    raise UserError(f"{directory} is not a complete checkpoint: it has no {' and no '.join(missing)}")
