"""Secrets in what a run writes: config values under secret-named keys replaced before any file or tracker sees them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from diffusion_rl.config_io.convert import join_key, to_dict
from diffusion_rl.errors import UserError

REDACTED = "***redacted***"
# a key naming a secret, as a whole word of the key (api_key, x-api-key, hf_token, client_secret, Authorization);
# max_tokens or tokenizer are not secrets, nor is a key ending in _env, which names the variable holding one
_SECRET_KEY = re.compile(
    r"(?:^|[_\-])(?:api[_\-]?key|access[_\-]?key|token|password|passwd|secret|authorization|credentials?)(?:$|[_\-])",
    re.IGNORECASE,
)


def is_secret_key(key: Any) -> bool:
    return isinstance(key, str) and bool(_SECRET_KEY.search(key)) and not key.lower().endswith("_env")


def redact_secrets(obj: Any) -> Any:
    """``to_dict(obj)`` with the value of every secret-named key (``is_secret_key``) replaced by ``REDACTED``, at any
    depth (reward kwargs, their nested headers). What a run writes (config.yaml files, tracker configs) goes
    through this; ``load_config`` reads the result back (a redacted value is a string like any other)."""

    def redact(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: REDACTED if is_secret_key(k) and v is not None else redact(v) for k, v in value.items()}
        if isinstance(value, list):
            return [redact(v) for v in value]
        return value

    return redact(to_dict(obj))


def without_redacted(mapping: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """``mapping`` without the entries ``redact_secrets`` replaced (at any depth), and their dotted keys: what a
    written config can still pass on (e.g. a checkpoint's reward kwargs) and what the user must give again."""
    kept, dropped = {}, []
    for key, value in mapping.items():
        if value == REDACTED:
            dropped.append(join_key(prefix, key))
        elif isinstance(value, Mapping):
            kept[key], inner = without_redacted(value, join_key(prefix, key))
            dropped += inner
        else:
            kept[key] = value
    return kept, dropped


def refuse_redacted(mapping: Mapping[str, Any], where: str) -> None:
    """A UserError when ``mapping`` holds a value ``redact_secrets`` replaced: a config a run wrote, used to run."""
    _, dropped = without_redacted(mapping)
    if dropped:
        raise UserError(
            f"{where}: {', '.join(dropped)} {'is' if len(dropped) == 1 else 'are'} '{REDACTED}' (configs a run "
            "writes hide secrets): give the real value again, or take it from the environment (vlm: api_key_env)"
        )
