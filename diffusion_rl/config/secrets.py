"""Secrets in what a run writes: config values under secret-named keys replaced before any file or tracker sees them."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from diffusion_rl.config.convert import join_key, to_dict
from diffusion_rl.errors import UserError

REDACTED = "***redacted***"

# A key names a secret by its last word (words: split at _, -, . and camelCase; digits dropped): api_key, x-api-key,
# hf_token, openai_key, client_secret, Authorization, private_key, db_password, credentials. `key` and `token` are
# secrets but after a word that makes them something else: image_key, sort_key (a name), pad_token, eos_token (a
# tokenizer's). max_tokens, text_tokens, tokenizer, token_id are not secrets, nor is a key whose last word is env,
# which names the variable holding one (api_key_env). Leaking is the worse mistake: an unknown `…_key` is a secret.
_SECRET_WORDS = frozenset({
    "secret", "secrets", "password", "passwords", "passwd", "passphrase", "pwd", "credential", "credentials",
    "authorization", "auth", "apikey", "accesskey", "privatekey", "private", "cookie",
})  # fmt: skip
_NAMING_KEYS = frozenset({  # `<word>_key` that names a field, column or entry, not a secret
    "image", "images", "video", "sort", "cache", "metric", "metrics", "reward", "rewards", "prompt", "prompts",
    "score", "scores", "column", "field", "label", "text", "caption", "data", "json", "dict", "group", "lookup",
    "primary", "foreign", "partition", "shard", "seed", "name", "id", "index", "input", "output", "result", "answer",
    "target", "row", "config", "model", "sample",
})  # fmt: skip
_TOKENIZER_TOKENS = frozenset({"pad", "bos", "eos", "unk", "cls", "sep", "mask", "image", "video", "vision", "special",
                               "start", "end"})  # fmt: skip
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
# credentials in a URL: scheme://user:password@host (or a token as the user) — the part before the @
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<userinfo>[^\s/?#@]+)@")


def is_secret_key(key: Any) -> bool:
    if not isinstance(key, str):
        return False
    words = [w.lower() for w in _WORD.findall(key)]
    if not words:
        return False
    last, before = words[-1], words[-2] if len(words) > 1 else None
    if last in _SECRET_WORDS:
        return True
    if last == "key":
        return before not in _NAMING_KEYS
    if last == "token":
        return before not in _TOKENIZER_TOKENS
    return False


def redact_text(text: str) -> str:
    """`text` with the credentials of every URL in it (`http://user:password@host`) replaced by REDACTED."""
    return _URL_USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", text) if "@" in text else text


class RedactingFilter(logging.Filter):
    """Log records with every URL's credentials replaced (a reward's URL, said when the server is up or fails)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "@" in message:
            record.msg, record.args = redact_text(message), None
        return True


def _holds_redacted(value: Any) -> bool:
    """A value redact_secrets replaced, in whole or in part (a URL's credentials), or a list holding one."""
    if isinstance(value, str):
        return REDACTED in value
    if isinstance(value, Mapping):
        return any(_holds_redacted(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_redacted(v) for v in value)


def redact_secrets(obj: Any) -> Any:
    """``to_dict(obj)`` with the value of every secret-named key (``is_secret_key``) replaced by ``REDACTED``, at any
    depth (reward kwargs, their nested headers), and the credentials of every URL (``redact_text``). What a run
    writes (config.yaml files, tracker configs) goes through this; ``load_config`` reads the result back (a redacted
    value is a string like any other). A flag under a secret-looking name (``private: true``) is no secret: kept."""

    def redact(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: REDACTED if is_secret_key(k) and _holds_secret(v) else redact(v) for k, v in value.items()}
        if isinstance(value, list):
            return [redact(v) for v in value]
        return redact_text(value) if isinstance(value, str) else value

    return redact(to_dict(obj))


def _holds_secret(value: Any) -> bool:
    return value is not None and not isinstance(value, bool)


def without_redacted(mapping: Mapping[str, Any], prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """``mapping`` without the entries ``redact_secrets`` replaced (at any depth), and their dotted keys: what a
    written config can still pass on (e.g. a checkpoint's reward kwargs) and what the user must give again."""
    kept, dropped = {}, []
    for key, value in mapping.items():
        if isinstance(value, Mapping):
            kept[key], inner = without_redacted(value, join_key(prefix, key))
            dropped += inner
        elif _holds_redacted(value):
            dropped.append(join_key(prefix, key))
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
