"""Load a user's reward function from "package.module:function" or "path/to/file.py:function"."""

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from diffusion_rl.errors import UserError, did_you_mean


def is_user_function_spec(name: str) -> bool:
    """True for "module:function" or "file.py:function"; registered reward names never contain ':'."""
    return ":" in name


# a whole string naming code: "package.module:function" or "path/to/file.py:function" (not a URL, not host:port)
_CODE_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*|\S*\.py:[A-Za-z_]\w*")


def user_functions_named(value: Any, is_name: bool = False) -> list[str]:
    """Every user-function spec in a config value: reward entries' names (with ':', as make_reward reads them) and,
    at any depth of their kwargs, nested entries (a group reward's `reward: {name: file.py:fn}`) and strings of the
    spec's form (`reward: file.py:fn`): the code that building the rewards would import."""
    if isinstance(value, str):
        return [value] if (is_user_function_spec(value) if is_name else _CODE_SPEC.fullmatch(value)) else []
    if isinstance(value, dict):
        return [spec for k, v in value.items() for spec in user_functions_named(v, k == "name")]
    if isinstance(value, (list, tuple)):
        return [spec for v in value for spec in user_functions_named(v)]
    return []


def load_user_function(spec: str) -> Callable[..., Any]:
    """The callable named by `spec`; a missing file, module or attribute is a UserError that names it."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UserError(f"user reward '{spec}' must look like 'package.module:function' or 'path/to/file.py:function'")
    module = _load_file(target) if _looks_like_path(target) else _import_module(target)
    if not hasattr(module, attr):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise UserError(
            f"user reward '{spec}': '{target}' has no attribute '{attr}'{did_you_mean(attr, public)}; "
            f"callables there: {', '.join(sorted(public)) or 'none'}"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise UserError(f"user reward '{spec}': '{attr}' is a {type(fn).__name__}, not a function")
    if inspect.isclass(fn):
        raise UserError(
            f"user reward '{spec}': '{attr}' is a class; point at a function (images, prompts, metadata) -> "
            f"scores, or at an instance of the class defined in the module"
        )
    return fn


def _looks_like_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _load_file(target: str) -> ModuleType:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise UserError(f"user reward file '{target}' does not exist (looked at {path})")
    # A name unique per path: two user files both called rewards.py must not replace each other in sys.modules.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"diffusion_rl_user_reward_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"user reward file '{target}' cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before exec so that dataclasses and pickling inside the file can find their own module.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _import_module(target: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        # Only the module the user named (or a parent package of it) being absent is the user's typo; a missing
        # dependency inside their module keeps its traceback.
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise UserError(
                f"user reward module '{target}' not found (is it installed, or on PYTHONPATH?); to load a file, "
                f"write 'path/to/file.py:function'"
            ) from None
        raise
