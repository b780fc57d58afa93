"""Load a user's own code — a reward function, a loss — from "package.module:function" or
"path/to/file.py:function". A leaf: rewards/ and the config (a loss named by algorithm.loss) both use it.

A checkpoint never chooses code to run (docs/evaluation.md): `refusing_user_code` marks a load of a checkpoint's
config, during which `load_user_code` refuses, and the config keeps a user loss's name without importing it.
"""

import contextlib
import contextvars
import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from diffusion_rl.errors import UserError, did_you_mean


def is_user_function_spec(name: str) -> bool:
    """True for "module:function" or "file.py:function"; registered names (rewards, losses) never contain ':'."""
    return ":" in name


_REFUSED: contextvars.ContextVar[str | None] = contextvars.ContextVar("refused_user_code", default=None)


@contextlib.contextmanager
def refusing_user_code(whose: str):
    """While a checkpoint's config loads (`whose`: "the config.yaml of checkpoint DIR"), no user code is imported."""
    token = _REFUSED.set(whose)
    try:
        yield
    finally:
        _REFUSED.reset(token)


def user_code_refused() -> bool:
    return _REFUSED.get() is not None


def load_user_code(spec: str, kind: str) -> Callable[..., Any]:
    """The callable named by `spec`, a user `kind` ("reward", "loss"); a missing file, module or attribute is a
    UserError that names it, and so is an exception raised importing it (with its file and line)."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UserError(f"user {kind} '{spec}' must look like 'package.module:function' or 'path/to/file.py:function'")
    whose = _REFUSED.get()
    if whose is not None:
        raise UserError(f"{whose} names the user {kind} '{spec}', which would run as code; a checkpoint cannot choose "
                        f"code to run")  # fmt: skip
    module = _load_file(target, kind) if _looks_like_path(target) else _import_module(target, kind)
    if not hasattr(module, attr):
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise UserError(
            f"user {kind} '{spec}': '{target}' has no attribute '{attr}'{did_you_mean(attr, public)}; "
            f"callables there: {', '.join(sorted(public)) or 'none'}"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise UserError(f"user {kind} '{spec}': '{attr}' is a {type(fn).__name__}, not a function")
    return fn


def _looks_like_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _load_file(target: str, kind: str) -> ModuleType:
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise UserError(f"user {kind} file '{target}' does not exist (looked at {path})")
    # A name unique per path: two user files both called rewards.py must not replace each other in sys.modules.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"diffusion_rl_user_code_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"user {kind} file '{target}' cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before exec so that dataclasses and pickling inside the file can find their own module.
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[module_name]
        if isinstance(e, Exception) and not isinstance(e, UserError):  # Ctrl-C and sys.exit stay what they are
            raise _import_failed(f"user {kind} file '{target}'", e) from None
        raise
    return module


def _import_module(target: str, kind: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        # Only the module the user named (or a parent package of it) being absent is the user's typo; a missing
        # dependency inside their module is a failed import, like any other exception raised there.
        if e.name is not None and (target == e.name or target.startswith(e.name + ".")):
            raise UserError(
                f"user {kind} module '{target}' not found (is it installed, or on PYTHONPATH?); to load a file, "
                f"write 'path/to/file.py:function'"
            ) from None
        raise _import_failed(f"user {kind} module '{target}'", e) from None
    except UserError:
        raise
    except Exception as e:
        raise _import_failed(f"user {kind} module '{target}'", e) from None


def _import_failed(what: str, e: Exception) -> UserError:
    """An exception raised while importing the user's code, as one line: where (file, line) and the cause."""
    if isinstance(e, SyntaxError):  # where the parser stopped: the user's file or one it imports
        where, cause = f"{e.filename}, line {e.lineno}", f"SyntaxError: {e.msg}"
    else:  # the outermost module's top level: the user's line that led to the error
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.name == "<module>"]
        where = f"{frames[0].filename}, line {frames[0].lineno}" if frames else "where unknown"
        cause = " ".join(f"{type(e).__name__}: {e}".split())
    todo = f"install {e.name!r} or fix the import" if isinstance(e, ModuleNotFoundError) and e.name else "fix the code"
    return UserError(f"{what} failed to import ({where}: {cause}); {todo}")
