"""Strict loading of config dataclasses from YAML files and dotted command-line overrides.

Works for any tree of dataclasses. Every key is checked: unknown keys, wrong types and values outside a
``Literal`` are errors (``UserError``) that name the full dotted key, never silently ignored. The only
conversions are int -> float and numeric string -> float for float fields.

YAML is read with YAML 1.2 scalar rules rather than PyYAML's 1.1 defaults, because the 1.1 rules bite
configs: ``1e-4`` would be a string, ``yes``/``no``/``on``/``off`` booleans, ``010`` octal, ``1:30`` an int
and ``2024-01-01`` a date. Here those are a float and strings (``true``/``false`` are the booleans).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import types
import typing
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar, Union

import yaml

from diffusion_rl.errors import UserError, did_you_mean

__all__ = [
    "REDACTED",
    "apply_overrides",
    "describe",
    "field_help",
    "from_dict",
    "is_secret_key",
    "load_config",
    "redact_secrets",
    "refuse_redacted",
    "to_dict",
    "to_yaml",
    "without_redacted",
]

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------------------------
# YAML dialect

_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_INT_RE = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+|0o[0-7_]+)$")
_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_TAG = "tag:yaml.org,2002:"


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 bool/int/float resolution and an error on duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == _TAG + "merge":  # '<<: *base' may legitimately repeat keys of the base
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_REPLACED_TAGS = tuple(_TAG + t for t in ("bool", "int", "float", "timestamp", "value"))
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_TAG + "bool", _BOOL_RE, list("tTfF"))
_Loader.add_implicit_resolver(_TAG + "int", _INT_RE, list("-+0123456789"))
_Loader.add_implicit_resolver(_TAG + "float", _FLOAT_RE, list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """Quotes a string when either YAML 1.1 or 1.2 rules would read it as something else (e.g. 'yes', '1e-4')."""


_Dumper.add_implicit_resolver(_TAG + "float", _FLOAT_RE, list("-+0123456789."))
_Dumper.add_representer(  # numbers on one line ('resolution: [512, 512]'), anything else one entry per line
    list,
    lambda dumper, data: dumper.represent_sequence(
        _TAG + "seq", data, flow_style=all(isinstance(x, (int, float)) or x is None for x in data)
    ),
)


def _yaml_load(text: str | typing.BinaryIO) -> Any:
    return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader: no arbitrary objects


# ---------------------------------------------------------------------------------------------------------------
# Errors


class _ConfigError(UserError):
    """A UserError about one config key; ``key`` lets load_config say which input (file or override) caused it."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if dataclasses.is_dataclass(tp):
        return tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{inner}]" if args else name
    return getattr(tp, "__name__", str(tp))


def _type_error(tp: Any, value: Any, path: str) -> _ConfigError:
    where = f"config key '{path}'" if path else "config"
    expected = f"a mapping (the {tp.__name__} section)" if dataclasses.is_dataclass(tp) else _type_name(tp)
    message = f"{where} expects {expected}, got {_show(value)}"
    if isinstance(value, Mapping) and value and all(isinstance(k, str) and k.isdigit() for k in value):
        message += (
            "; to override one list entry by index (e.g. 'rewards.0.weight=2') the list must be written out in "
            "the config file; otherwise pass the whole list (e.g. 'rewards=[{...}]')"
        )
    return _ConfigError(message, path)


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


def _sections_field(cls: type) -> tuple[str, dict[str, type]] | None:
    """A dataclass may hold one field `name: dict[str, Any]` with metadata {"sections": fn, "help": text}: fn()
    gives the sections registered now ({key: dataclass}, e.g. each loss's settings). In YAML they sit directly in
    the parent section (`algorithm.nft.nft_beta`), not under `name`; the field holds the given ones, built. The
    help text describes each section, with `{key}` standing for its key."""
    for name, (f, _) in _all_fields(cls).items():
        if SECTIONS in f.metadata:
            return name, f.metadata[SECTIONS]()
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
    extra = _sections_field(cls)
    registered = extra[1] if extra else {}
    for key in data:
        if key not in fields and key not in registered:
            raise _unknown_key(cls, str(key), path)
    kwargs = {}
    if extra:
        kwargs[extra[0]] = {
            key: from_dict(registered[key], value, _join(path, key)) for key, value in data.items() if key in registered
        }
    for name, (f, tp) in fields.items():
        if name in data:
            kwargs[name] = _convert(tp, data[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            help_text = f.metadata.get("help")
            hint = f" ({help_text})" if help_text else ""
            raise _ConfigError(f"missing required key '{_join(path, name)}'{hint}", _join(path, name))
    try:
        return cls(**kwargs)
    except ValueError as e:
        where = f"in '{path}'" if path else "at top level"
        raise _ConfigError(f"invalid config {where}: {e}", path) from e


def _unknown_key(cls: type, key: str, path: str) -> _ConfigError:
    moved = getattr(cls, "moved_keys", {}).get(key)
    if moved:
        return _ConfigError(f"config key '{_join(path, key)}' {moved}", _join(path, key))
    names = _key_names(cls)
    # A key written one section too high ('lr' for 'train.lr') is the likeliest intent, then a misspelling,
    # then a longer or shorter form of a valid name ('lr_rate' for 'lr', which difflib finds too far).
    candidates = [k for k in field_help(cls) if k.endswith("." + key)][:3]
    if not candidates:
        close = did_you_mean(key, names)
        candidates = [n for n in names if close == f" (did you mean '{n}'?)"]
    if not candidates:
        candidates = [n for n in names if len(min(n, key, key=len)) >= 2 and (key.startswith(n) or n.startswith(key))]
    hint = ""
    if candidates:
        hint = " (did you mean " + " or ".join(f"'{_join(path, c)}'" for c in candidates[:3]) + "?)"
    where = f"in '{path}'" if path else "at top level"
    return _ConfigError(
        f"unknown config key '{_join(path, key)}'{hint}; valid keys {where}: {', '.join(names)}", _join(path, key)
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
        raise _ConfigError(f"config key '{path}' must be one of {choices}; got {_show(value)}{hint}", path)
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
        return {_convert(key_tp, k, _join(path, k)): _convert(value_tp, v, _join(path, k)) for k, v in value.items()}
    raise TypeError(f"config field '{path}' has a type config_io does not support: {tp!r}")


def _number_from_str(text: str) -> float | None:
    """The float a numeric-looking string spells ('3e-4', '10', '-.inf'), or None for any other string."""
    text = text.strip()
    if not (_FLOAT_RE.match(text) or re.fullmatch(r"[-+]?[0-9][0-9_]*", text)):
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
            raise _ConfigError(
                f"config key '{path}' expects {_type_name(tp)} ({len(args)} entries), got {len(value)} entries", path
            )
        return tuple(_convert(a, v, _join(path, i)) for i, (a, v) in enumerate(zip(args, value)))
    item_tp = args[0] if args else Any
    items = [_convert(item_tp, v, _join(path, i)) for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


# ---------------------------------------------------------------------------------------------------------------
# Overrides and files

_OVERRIDE_FORM = "expected dotted.key=value, e.g. train.lr=1e-4 or rewards.0.weight=2"


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``dotted.key=value`` set; values are parsed as YAML.

    A key creates the sections it passes through when they are missing; a number addresses a list entry
    (which must exist). A value replaces what was there, also for sections (``train={lr: 1}`` drops the rest).
    Keys are not checked here: ``from_dict`` checks them against the schema afterwards.
    """
    result = copy.deepcopy(dict(data))
    for override in overrides:
        key, sep, raw = override.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise UserError(f"bad command-line override {override!r}: {_OVERRIDE_FORM}")
        try:
            value = _yaml_load(raw)
        except yaml.YAMLError as e:
            raise UserError(f"command-line override {override!r}: cannot parse the value as YAML ({e})") from None
        node: Any = result
        for depth, part in enumerate(parts):
            last = depth == len(parts) - 1
            where = ".".join(parts[:depth]) or "top level"
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise UserError(
                        f"command-line override {override!r}: '{where}' is a list of {len(node)} entries; "
                        f"'{part}' is not a valid index (0..{len(node) - 1})"
                    )
                part = int(part)
            elif not isinstance(node, dict):
                raise UserError(
                    f"command-line override {override!r}: '{where}' holds {_show(node)}, not a section or list"
                )
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return result


BASE_KEY = "base"  # a config file may start from another: `base: quickstart.yaml` (relative to the file)


def read_yaml_config(path: str | os.PathLike, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The mapping in YAML file ``path``, merged over its ``base`` file (recursively; its keys win)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:  # bytes: PyYAML detects the encoding and reports bad bytes as YAMLError
            data = _yaml_load(fh)
    except FileNotFoundError:
        raise UserError(f"config file not found: {path}") from None
    except OSError as e:
        raise UserError(f"cannot read config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UserError(_yaml_error_message(path, e)) from None
    if data is None:  # empty file
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level of a config file must be a mapping of keys, got {_show(data)}")
    base = data.pop(BASE_KEY, None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise UserError(f"{path}: '{BASE_KEY}' names another config file, got {_show(base)}")
    base_path = os.path.join(os.path.dirname(path), base)
    if os.path.abspath(base_path) in _seen:
        raise UserError(f"{path}: '{BASE_KEY}: {base}' makes a cycle of config files")
    return _deep_merge(read_yaml_config(base_path, (*_seen, os.path.abspath(path))), data)


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``: mappings merge key by key; anything else (lists too) replaces."""
    merged = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def load_config(cls: type[T], path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> T:
    """Read YAML ``path`` (with its ``base`` files; nothing when None), apply ``overrides``, build ``cls``."""
    data: Any = read_yaml_config(path) if path is not None else {}
    data = apply_overrides(data, overrides)
    try:
        return from_dict(cls, data)
    except _ConfigError as e:
        culprit = [o for o in overrides if _is_under(e.key, o.partition("=")[0].strip())]
        if culprit:
            raise UserError(f"command-line override {culprit[-1]!r}: {e}") from e
        if path is not None:
            raise UserError(f"{os.fspath(path)}: {e}") from e
        raise


def _is_under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _yaml_error_message(path: str, error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or str(error)
    context = getattr(error, "context", None)
    detail = f"{problem} ({context})" if context else problem
    return " ".join(f"YAML syntax error in {path}{where}: {detail}".split())  # one line: the CLI prints it as is


# ---------------------------------------------------------------------------------------------------------------
# Writing and documenting


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


def to_yaml(obj: Any) -> str:
    """YAML text for a dataclass tree (or plain data), in field order, readable by ``load_config``."""
    return yaml.dump(to_dict(obj), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)


# ---------------------------------------------------------------------------------------------------------------
# Secrets in what a run writes

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
            dropped.append(_join(prefix, key))
        elif isinstance(value, Mapping):
            kept[key], inner = without_redacted(value, _join(prefix, key))
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


def _walk(cls: type, prefix: str = "", seen: tuple = ()) -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, type) for every key under ``cls``; list/dict entries appear as ``*``."""
    entries = [(name, f, tp) for name, (f, tp) in _fields(cls).items()]
    extra = _sections_field(cls)
    if extra:
        template = _all_fields(cls)[extra[0]][0].metadata.get("help", "")
        for name, section in extra[1].items():
            entries.append((name, dataclasses.field(metadata={"help": template.format(key=name)}), section))
    for name, f, tp in entries:
        key = _join(prefix, name)
        yield key, f, tp
        inner, sub = _section_of(tp)
        if inner is not None and inner not in seen:
            yield from _walk(inner, key + sub, (*seen, cls))


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


def field_help(cls: type) -> dict[str, str]:
    """Dotted key -> help text (from ``field(metadata={"help": ...})``; '' when a field has none)."""
    return {key: f.metadata.get("help", "") for key, f, _ in _walk(cls)}


def describe(cls: type) -> str:
    """A readable reference of every key under ``cls``: type, default and help, one entry per key."""
    lines = []
    for key, f, tp in _walk(cls):
        if dataclasses.is_dataclass(tp):
            head = f"{key}: section {tp.__name__}"
        else:
            head = f"{key}: {_type_name(tp)} = {_default_text(f)}"
        lines.append(head)
        if f.metadata.get("help"):
            lines.append(f"    {f.metadata['help']}")
    return "\n".join(lines) + "\n"


def describe_markdown(cls: type, title: str) -> str:
    """The same reference as Markdown: one table per section, a row per key (type, default, meaning)."""
    out = [
        f"# {title}",
        "",
        "Generated by `diffusion-rl config reference --markdown`; a test keeps it equal to the code.",
        "",
    ]
    rows: list[str] = []

    def flush() -> None:
        if rows:
            out.extend(["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""])
            rows.clear()

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    for key, f, tp in _walk(cls):
        if dataclasses.is_dataclass(tp):
            flush()
            out.extend([f"{'#' * (key.count('.') + 2)} `{key}`", "", f.metadata.get("help", ""), ""])
        else:
            meaning = cell(f.metadata.get("help", ""))
            rows.append(f"| `{key}` | {cell(_type_name(tp))} | `{cell(_default_text(f))}` | {meaning} |")
    flush()
    return "\n".join(out)


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    text = yaml.safe_dump(to_dict(value), default_flow_style=True, sort_keys=False, width=10_000).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    return text if len(text) <= 80 else text[:77] + "..."
