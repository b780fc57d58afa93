"""A user's reward function, "package.module:function" or "path/to/file.py:function" (loaded by user_code.py), and
the user functions a config's rewards name (what `eval` refuses to run from a checkpoint's config)."""

import inspect
import re
from collections.abc import Callable
from typing import Any

from diffusion_rl.errors import UserError
from diffusion_rl.user_code import is_user_function_spec, load_user_code

__all__ = ["check_user_call", "is_user_function_spec", "load_user_function", "user_functions_named"]

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


def check_user_call(spec: str, fn: Callable[..., Any], arguments: tuple[str, ...], kwargs: dict[str, Any],
                    called: str = "") -> None:  # fmt: skip
    """A UserError, when the reward is built, if the user function `fn` (named `spec`) cannot be called as
    `called`(*arguments, **kwargs) — the way every scoring call will call it — rather than a TypeError on every
    sample of the first step, after the model has loaded and sampled."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call itself will tell
        return
    try:
        signature.bind(*arguments, **kwargs)
    except TypeError as e:
        called = called or spec.rpartition(":")[2]
        shown = ", ".join([*arguments, *(f"{k}=…" for k in kwargs)])
        raise UserError(
            f"user reward '{spec}' cannot be called as {called}({shown}) ({e}); it takes {signature}"
        ) from None


def load_user_function(spec: str) -> Callable[..., Any]:
    """The reward function named by `spec` (load_user_code), not a class."""
    fn = load_user_code(spec, "reward")
    if inspect.isclass(fn):
        raise UserError(
            f"user reward '{spec}': '{spec.rpartition(':')[2]}' is a class; point at a function (images, prompts, "
            f"metadata) -> scores, or at an instance of the class defined in the module"
        )
    return fn
