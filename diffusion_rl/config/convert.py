"""Type conversion: plain data (parsed YAML, overrides) → a tree of dataclasses, every key and value checked.

Works for any tree of dataclasses. Unknown keys, wrong types, values outside a ``Literal`` and numbers outside a
field's range (``fields.opt(..., within=Range(...))``) are errors (``ConfigError``, a ``UserError``) that name the
full dotted key, never silently ignored. The only conversions are int -> float and numeric string -> float for
float fields. ``to_dict`` turns a tree back into plain data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

from diffusion_rl.errors import UserError, did_you_mean

T = TypeVar("T")

# what YAML 1.2 reads as a number (config/loading.py resolves scalars with these; floats also parse here)
FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
INT_RE = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+|0o[0-7_]+)$")

# ---------------------------------------------------------------------------------------------------------------
# Errors


class ConfigError(UserError):
    """A UserError about one config key; ``key`` lets load_config say which input (file or override) caused it."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def join_key(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{inner}]" if args else name
    return getattr(tp, "__name__", str(tp))


def _type_error(tp: Any, value: Any, path: str) -> ConfigError:
    where = f"config key '{path}'" if path else "config"
    expected = f"a mapping (the {tp.__name__} section)" if dataclasses.is_dataclass(tp) else type_name(tp)
    message = f"{where} expects {expected}, got {show(value)}"
    if isinstance(value, Mapping) and value and all(isinstance(k, str) and k.isdigit() for k in value):
        message += (
            "; to override one list entry by index (e.g. 'rewards.0.weight=2') the list must be written out in "
            "the config file; otherwise pass the whole list (e.g. 'rewards=[{...}]')"
        )
    return ConfigError(message, path)


# ---------------------------------------------------------------------------------------------------------------
# Building dataclasses


SECTIONS = "sections"  # field metadata: a callable giving {key: dataclass} of registered sections (see below)


@functools.cache
def _all_fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def _fields(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """Init fields of a dataclass with their resolved types (works with ``from __future__ import annotations``),
    except a registered-sections field, whose keys are the sections themselves (see `_sections_field`)."""
    return {name: ft for name, ft in _all_fields(cls).items() if SECTIONS not in ft[0].metadata}


def _sections_field(cls: type, data: Mapping[str, Any] | None = None) -> tuple[str, dict[str, type]] | None:
    """A dataclass may hold one field `name: dict[str, Any]` with metadata {"sections": fn, "help": text}: fn(data)
    gives the sections registered now ({key: type}, e.g. each loss's settings dataclass), `data` being the section's
    plain data when one is built (None otherwise), which may register more (a user loss its config names). In YAML
    they sit directly in the parent section (`algorithm.nft.nft_beta`), not under `name`; the field holds the given
    ones, built. The help text describes each section, with `{key}` standing for its key."""
    for name, (f, _) in _all_fields(cls).items():
        if SECTIONS in f.metadata:
            return name, f.metadata[SECTIONS](data)
    return None


def _key_names(cls: type) -> list[str]:
    """Every key valid directly under a section of type ``cls``: its fields, then its registered sections."""
    extra = _sections_field(cls)
    return [*_fields(cls), *(extra[1] if extra else ())]


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from plain data, checking every key and value; ``path`` prefixes key names in errors."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    if not isinstance(data, Mapping):
        raise _type_error(cls, data, path)
    fields = _fields(cls)
    extra = _sections_field(cls, data)
    registered = extra[1] if extra else {}
    for key in data:
        if key not in fields and key not in registered:
            raise _unknown_key(cls, str(key), path)
    kwargs = {}
    if extra:
        kwargs[extra[0]] = {
            key: _convert(registered[key], value, join_key(path, key))
            for key, value in data.items()
            if key in registered
        }
    for name, (f, tp) in fields.items():
        if name in data:
            kwargs[name] = _in_range(f, _convert(tp, data[name], join_key(path, name)), join_key(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            help_text = f.metadata.get("help")
            hint = f" ({help_text})" if help_text else ""
            raise ConfigError(f"missing required key '{join_key(path, name)}'{hint}", join_key(path, name))
    try:
        return cls(**kwargs)
    except ValueError as e:
        where = f"in '{path}'" if path else "at top level"
        raise ConfigError(f"invalid config {where}: {e}", path) from e


def _in_range(f: dataclasses.Field, value: Any, path: str) -> Any:
    """``value`` when it lies in the field's range (metadata ``within``: any object with ``in`` and ``str``, e.g.
    fields.Range, or one with ``names`` too, fields.OneOf); a ConfigError naming the key (a mapping's entry by
    its own key) and the range otherwise."""
    within = f.metadata.get("within")
    if within is None or value is None:
        return value
    for key, v in value.items() if isinstance(value, Mapping) else [("", value)]:
        if v is not None and v not in within:
            where = join_key(path, key) if key else path
            names = getattr(within, "names", None)  # a set of names (fields.OneOf): said as a Literal's are
            if names is not None:
                hint = did_you_mean(v, names) if isinstance(v, str) else ""
                raise ConfigError(f"config key '{where}' must be {within}; got {show(v)}{hint}", where)
            raise ConfigError(f"config key '{where}' must be in {within}, got {v!r}", where)
    return value


def _unknown_key(cls: type, key: str, path: str) -> ConfigError:
    moved_key = getattr(cls, "moved_key", None)  # a section may say where a key of its earlier versions went
    moved = moved_key(key) if moved_key is not None else None
    if moved:
        return ConfigError(f"config key '{join_key(path, key)}' {moved}", join_key(path, key))
    names = _key_names(cls)
    # A key written one section too high ('lr' for 'train.lr') is the likeliest intent, then a misspelling,
    # then a longer or shorter form of a valid name ('lr_rate' for 'lr', which difflib finds too far).
    candidates = [k for k, _, _ in walk(cls) if k.endswith("." + key)][:3]
    if not candidates:
        close = did_you_mean(key, names)
        candidates = [n for n in names if close == f" (did you mean '{n}'?)"]
    if not candidates:
        candidates = [n for n in names if len(min(n, key, key=len)) >= 2 and (key.startswith(n) or n.startswith(key))]
    hint = ""
    if candidates:
        hint = " (did you mean " + " or ".join(f"'{join_key(path, c)}'" for c in candidates[:3]) + "?)"
    where = f"in '{path}'" if path else "at top level"
    return ConfigError(
        f"unknown config key '{join_key(path, key)}'{hint}; valid keys {where}: {', '.join(names)}", join_key(path, key)
    )


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type ``tp`` and convert it (nested dataclasses, tuples, int -> float)."""
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, args, value, path)
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        choices = ", ".join(repr(a) for a in args)
        hint = did_you_mean(value, [a for a in args if isinstance(a, str)]) if isinstance(value, str) else ""
        raise ConfigError(f"config key '{path}' must be one of {choices}; got {show(value)}{hint}", path)
    if tp is type(None):
        if value is None:
            return None
        raise _type_error(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(tp, value, path)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(tp, value, path)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and (number := _number_from_str(value)) is not None:
            return number  # e.g. a quoted "3e-4", or data that did not come through our YAML loader
        raise _type_error(tp, value, path)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(tp, value, path)
    if tp in (list, tuple, dict):
        origin = tp
    if origin in (list, tuple, Sequence):
        return _convert_sequence(tp, origin, args, value, path)
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise _type_error(tp, value, path)
        key_tp, value_tp = args if args else (Any, Any)
        return {
            _convert(key_tp, k, join_key(path, k)): _convert(value_tp, v, join_key(path, k)) for k, v in value.items()
        }
    raise TypeError(f"config field '{path}' has a type the config loader does not support: {tp!r}")


def _number_from_str(text: str) -> float | None:
    """The float a numeric-looking string spells ('3e-4', '10', '-.inf'), or None for any other string."""
    text = text.strip()
    if not (FLOAT_RE.match(text) or re.fullmatch(r"[-+]?[0-9][0-9_]*", text)):
        return None
    text = text.replace("_", "").lower()
    if text.endswith((".inf", ".nan")):  # YAML spellings; Python's float() wants 'inf' / 'nan'
        text = text.replace(".", "")
    return float(text)


def _convert_union(tp: Any, args: tuple, value: Any, path: str) -> Any:
    if value is None and type(None) in args:
        return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1 and options[0] not in (int, float, bool, str):
        return _convert(options[0], value, path)  # Optional[section/list/...]: its own error is more precise
    for option in options:  # first alternative in declared order that accepts the value
        try:
            return _convert(option, value, path)
        except UserError:
            continue
    raise _type_error(tp, value, path)


def _convert_sequence(tp: Any, origin: Any, args: tuple, value: Any, path: str) -> Any:
    if not isinstance(value, (list, tuple)):
        raise _type_error(tp, value, path)
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise ConfigError(
                f"config key '{path}' expects {type_name(tp)} ({len(args)} entries), got {len(value)} entries", path
            )
        return tuple(_convert(a, v, join_key(path, i)) for i, (a, v) in enumerate(zip(args, value)))
    item_tp = args[0] if args else Any
    items = [_convert(item_tp, v, join_key(path, i)) for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) for a dataclass tree; ``from_dict`` turns it back into an equal tree."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        extra = _sections_field(type(obj))
        if extra:
            out.update(out.pop(extra[0]))  # registered sections sit in the parent section
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def changed_settings(before: Any, after: Any, path: str = "") -> list[str]:
    """'key (old → new)' for each setting that differs between two `to_dict` trees, in the order of `after`'s keys
    (values as YAML writes them, cut at 40 characters; a list that differs is one setting)."""
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        keys = [*after, *(k for k in before if k not in after)]
        return [c for k in keys for c in changed_settings(before.get(k), after.get(k), join_key(path, k))]
    if before == after:
        return []

    def text(value: Any) -> str:
        shown = json.dumps(value, default=str)
        return shown if len(shown) <= 40 else shown[:37] + "..."

    return [f"{path} ({text(before)} → {text(after)})"]


def walk(cls: type, prefix: str = "", seen: tuple = ()) -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) for every key under ``cls``; list/dict entries appear as ``*``."""
    entries = [(name, f, tp) for name, (f, tp) in _fields(cls).items()]
    extra = _sections_field(cls)
    if extra:
        template = _all_fields(cls)[extra[0]][0].metadata.get("help", "")
        for name, section in extra[1].items():
            entries.append((name, dataclasses.field(metadata={"help": template.format(key=name)}), section))
    for name, f, tp in entries:
        key = join_key(prefix, name)
        yield key, f, tp
        inner, sub = _section_of(tp)
        if inner is not None and inner not in seen:
            yield from walk(inner, key + sub, (*seen, cls))


def _section_of(tp: Any) -> tuple[type | None, str]:
    """The dataclass a field holds (directly, optionally, or as list/tuple/dict entries) and the key suffix."""
    if dataclasses.is_dataclass(tp):
        return tp, ""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        return (sections[0], "") if len(sections) == 1 else (None, "")
    if origin in (list, tuple, Sequence, dict, Mapping) and args:
        item = args[-1] if origin in (dict, Mapping) else args[0]
        if dataclasses.is_dataclass(item):
            return item, ".*"
    return None, ""
