"""Why a model directory failed to load, in one line that names the file.

diffusers and transformers report a damaged directory as a long traceback whose last line may not name the file
(a truncated text encoder: "Error while deserializing header: incomplete metadata, file not fully covered") or
the component ("Error no file named config.json found in directory …/vae"). After a failed `from_pretrained`,
`raise_if_damaged` looks through the directory for the first missing or unreadable file and raises a UserError
that names it and says what to do. `raise_if_bad_index` checks model_index.json's components before any loading: each is
[library, class] of diffusers or transformers (a model directory must not choose the code that loads it: diffusers
takes any module already imported, and refuses others with a traceback); a class its library lacks is named after a
failed load. A config.json that describes another network than its weights is named too: a weight of another shape
fails the load (`raise_if_damaged`), and weights the network has no place for, which diffusers drops with a log line,
stop it (`refuse_unused_weights`, for the trained transformers).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from diffusion_rl.errors import UserError

_WEIGHTS = ("*.safetensors", "*.bin", "*.pt")
_FIX = "download the model again or re-save it with save_pretrained"
_LIBRARIES = ("diffusers", "transformers")  # what a component may name: no other module is imported for it


def raise_if_bad_index(path: Path) -> None:
    """Before loading: a UserError naming model_index.json's first component that is not [library, class] of
    diffusers or transformers (reading the classes waits for a failed load: `damaged_file`)."""
    problem = _index_problem(path, classes=False)
    if problem is not None:
        raise UserError(f"cannot load the model in {path}: {problem}")


def raise_if_damaged(path: Path, error: Exception) -> None:
    """Raise a one-line UserError for a failed load of the model directory `path` when a file of it is missing or
    damaged, or when the load failed reading a file (OSError); return otherwise (the caller re-raises `error`)."""
    problem = _index_problem(path, classes=True) or damaged_file(path)
    if problem is not None:
        raise UserError(f"cannot load the model in {path}: {problem}; {_FIX}") from error
    shape = re.search(r"(\S+) expected shape (torch\.Size\(\[[\d, ]*\]\)), but got (torch\.Size\(\[[\d, ]*\]\))",
                      str(error))  # fmt: skip
    if isinstance(error, ValueError) and shape is not None:
        key, wanted, stored = shape.groups()
        folder = next((f for f in sorted(path.iterdir()) if key in _stored_keys(f)), path)
        raise UserError(
            f"cannot load the model in {path}: {folder / 'config.json'} describes another network than "
            f"its weights ({key}: {wanted} by the config, {stored} stored); {_CONFIG_FIX}"
        ) from error
    if isinstance(error, OSError):
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"cannot load the model in {path}: {first}") from error


_CONFIG_FIX = "restore the config.json the weights were saved with"


def refuse_unused_weights(path: Path, pipeline) -> None:
    """A UserError when a transformer's weight files hold weights its network, as its config.json describes it, has
    no place for (diffusers drops them with a log line: a smaller network than was saved would train)."""
    for name in ("transformer", "transformer_2"):  # Wan 2.2 A14B: two
        module, folder = getattr(pipeline, name, None), path / name
        if module is None or not folder.is_dir():
            continue
        ignored = getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ()
        unused = sorted(k for k in _stored_keys(folder) - module.state_dict().keys()
                        if not any(re.search(pattern, k) for pattern in ignored))  # fmt: skip
        if unused:
            raise UserError(f"cannot load the model in {path}: {len(unused)} weights in {folder} have no place in the "
                            f"network its config.json describes (e.g. {unused[0]}); {_CONFIG_FIX}")  # fmt: skip


def _stored_keys(folder: Path) -> set[str]:
    """The tensor names in a component folder's safetensors files (their headers only); none for another format."""
    from safetensors import safe_open

    keys: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
        with safe_open(str(file), "pt") as opened:
            keys.update(opened.keys())
    return keys


def damaged_file(path: Path) -> str | None:
    """'FILE: what is wrong' for the first missing or unreadable file of the diffusers model directory `path`
    (components in model_index.json order), or None when every file looks whole."""
    try:
        index = json.loads((path / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{path / 'model_index.json'}: unreadable ({e})"
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or not spec or spec[0] is None:
            continue  # metadata, or an optional component the pipeline does not have
        folder = path / name
        if not folder.is_dir():
            return f"{folder}: missing (model_index.json lists the component '{name}')"
        problem = _component_problem(folder)
        if problem is not None:
            return problem
    return None


def _index_problem(path: Path, classes: bool) -> str | None:
    """'model_index.json: what is wrong' for its first component entry (a list) that is not [library, class] of
    diffusers or transformers (or [null, null]); with `classes` (after a failed load), also one whose library has no
    such class, or a component folder's entry that is no list."""
    index_file = path / "model_index.json"
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # damaged_file names it
    if not isinstance(index, dict):
        return f"{index_file}: not a JSON object of components"
    for name, spec in index.items():
        if name.startswith("_") or not (isinstance(spec, list) or (classes and (path / name).is_dir())):
            continue  # metadata (_class_name, …) or a pipeline setting (Wan 2.2's boundary_ratio: 0.875)
        if not (isinstance(spec, list) and len(spec) == 2):  # a setting is no list; a folder's entry is one
            return f"{index_file}: component '{name}' is {spec!r}, not [library, class]"
        library, class_name = spec
        if library is None and class_name is None:
            continue  # an optional component the pipeline does not have
        if library not in _LIBRARIES:
            return (
                f"{index_file}: component '{name}' names the library {library!r}; a model directory may name "
                "diffusers or transformers only (no other module is imported for it)"
            )
        if classes and not _has_class(library, class_name):
            return f"{index_file}: component '{name}': {library} has no class {class_name!r}"
    return None


def _has_class(library: str, class_name: object) -> bool:
    import importlib

    if not isinstance(class_name, str):
        return False
    try:
        return getattr(importlib.import_module(library), class_name, None) is not None
    except Exception:  # a class whose own import fails (a missing extra): not this check's to name
        return True


def _component_problem(folder: Path) -> str | None:
    weights = sorted(file for pattern in _WEIGHTS for file in folder.glob(pattern))
    configs = sorted(folder.glob("*.json"))
    if weights and not (folder / "config.json").is_file():
        return f"{folder / 'config.json'}: missing (the config of the weights in {folder.name}/)"
    for config in configs:
        try:
            text = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return f"{config}: not valid JSON ({e})"
        if config.name.endswith(".index.json") and isinstance(text, dict):  # sharded weights: every shard there
            for shard in sorted(set(text.get("weight_map", {}).values())):
                if not (folder / shard).is_file():
                    return f"{folder / shard}: missing (listed in {config.name})"
    for file in weights:
        if file.suffix == ".safetensors":
            problem = _safetensors_problem(file)
            if problem is not None:
                return f"{file}: {problem}"
    return None


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's header and length (a truncated file fails here), or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt"):
            pass
    except Exception as e:  # safetensors raises its own SafetensorError, not an OSError
        return f"not a complete safetensors file, truncated or corrupt ({e})"
    return None
