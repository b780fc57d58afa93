"""YAML loading: config files (with their ``base`` files) and dotted command-line overrides → a dataclass tree.

YAML is read with YAML 1.2 scalar rules rather than PyYAML's 1.1 defaults, because the 1.1 rules bite
configs: ``1e-4`` would be a string, ``yes``/``no``/``on``/``off`` booleans, ``010`` octal, ``1:30`` an int
and ``2024-01-01`` a date. Here those are a float and strings (``true``/``false`` are the booleans). Building and
checking the tree is config/convert.py's.

What is read is bounded: a config file is at most ``MAX_CONFIG_BYTES``, and aliases (``*name``) may repeat what their
anchor names by at most ``ALIAS_BUDGET`` entries in all (merge keys and a few reuses; a YAML bomb, nine aliases of
nine aliases…, would otherwise expand to hundreds of millions of entries when the tree is built). An alias that
contains itself is refused too.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import yaml

from diffusion_rl.config.convert import FLOAT_RE, INT_RE, ConfigError, T, from_dict, show, to_dict
from diffusion_rl.errors import UserError

# ---------------------------------------------------------------------------------------------------------------
# YAML dialect

MAX_CONFIG_BYTES = 1 << 20  # a config holds settings (a few kB); data such as prompts lives in the files it names
ALIAS_BUDGET = 10_000  # entries aliases may add to a document beyond its own

_BOOL_RE = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_TAG = "tag:yaml.org,2002:"


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 bool/int/float resolution, an error on duplicate keys and bounded aliases; a value
    PyYAML fails to build (`!!float abc`) is a YAMLError at its line."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _check_aliases(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():  # else: super's error (`!!set`)
            if key_node.tag == _TAG + "merge":  # '<<: *base' may legitimately repeat keys of the base
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):  # super's error: a list as a key
                break
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, LookupError, AttributeError) as e:  # PyYAML's own: `!!float abc`, `!!bool no`
            tag = node.tag.replace(_TAG, "!!")
            problem = f"{node.value!r} is not a valid {tag}" if isinstance(node, yaml.ScalarNode) else f"{tag}: {e}"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from None


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


class _AliasError(yaml.composer.ComposerError):
    """Aliases beyond the budget, or one inside itself: well-formed YAML, refused."""


def _check_aliases(root: yaml.Node) -> None:
    """A YAMLError (at the anchor that repeats most) when aliases would expand the document by more than
    ALIAS_BUDGET nodes, or an alias contains itself. The composed graph shares an aliased node; its expanded size is
    counted once per node (depth first, without recursion), so a bomb is measured without being expanded."""
    size: dict[int, int] = {}
    uses: dict[int, int] = {}
    nodes: dict[int, yaml.Node] = {}
    open_: set[int] = set()  # the nodes on the current path
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in _children(node))
            continue
        if key in open_:
            raise _AliasError(None, None, "an alias inside the node it names (an infinite document)", node.start_mark)
        if key in size:
            continue
        open_.add(key)
        nodes[key] = node
        stack.append((node, True))
        for child in _children(node):
            uses[id(child)] = uses.get(id(child), 0) + 1
            stack.append((child, False))
    extra = size[id(root)] - len(size)
    if extra > ALIAS_BUDGET:
        worst = max((k for k, n in uses.items() if n > 1), key=lambda k: size[k] * (uses[k] - 1))
        raise _AliasError(
            None,
            None,
            f"they would expand the document to {size[id(root)]:,} entries, {extra:,} more than it holds (at most "
            f"{ALIAS_BUDGET:,} are allowed; a YAML bomb?): write the values out instead of repeating this anchor",
            nodes[worst].start_mark,
        )


_REPLACED_TAGS = tuple(_TAG + t for t in ("bool", "int", "float", "timestamp", "value"))
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_TAG + "bool", _BOOL_RE, list("tTfF"))
_Loader.add_implicit_resolver(_TAG + "int", INT_RE, list("-+0123456789"))
_Loader.add_implicit_resolver(_TAG + "float", FLOAT_RE, list("-+0123456789."))


class _Dumper(yaml.SafeDumper):
    """Quotes a string when either YAML 1.1 or 1.2 rules would read it as something else (e.g. 'yes', '1e-4')."""


_Dumper.add_implicit_resolver(_TAG + "float", FLOAT_RE, list("-+0123456789."))
_Dumper.add_representer(  # numbers on one line ('resolution: [512, 512]'), anything else one entry per line
    list,
    lambda dumper, data: dumper.represent_sequence(
        _TAG + "seq", data, flow_style=all(isinstance(x, (int, float)) or x is None for x in data)
    ),
)


class _ReadError(yaml.YAMLError):
    """Malformed input PyYAML failed on with another error (construct_object names most, with their line)."""


def load_yaml_text(text: str | bytes) -> Any:
    """The value of YAML `text` in this dialect, aliases bounded (a YAMLError otherwise, also where PyYAML itself
    raises another error: `!!float abc`, nesting past the recursion limit): a config's or a command-line value's."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader: no arbitrary objects
    except RecursionError:
        raise _ReadError("lists or mappings nested too deeply to read; a config needs a few levels") from None
    except (ValueError, TypeError, LookupError, AttributeError) as e:  # what construct_object does not see
        raise _ReadError(f"{type(e).__name__}: {e}") from None


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
            value = load_yaml_text(raw)
        except yaml.YAMLError as e:
            raise UserError(f"command-line override {override!r}: {_yaml_error_message('the value', e)}") from None
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
                    f"command-line override {override!r}: '{where}' holds {show(node)}, not a section or list"
                )
            if last:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:
                    node[part] = {}
                node = node[part]
    return result


BASE_KEY = "base"  # a config file may start from another: `base: quickstart_flow_grpo.yaml` (relative to the file)


def read_yaml_config(path: str | os.PathLike, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The mapping in YAML file ``path``, merged over its ``base`` file (recursively; its keys win)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:  # bytes: PyYAML detects the encoding and reports bad bytes as YAMLError
            text = fh.read(MAX_CONFIG_BYTES + 1)  # a pipe or device too: never more than the bound
        if len(text) > MAX_CONFIG_BYTES:
            size = os.stat(path).st_size if os.path.isfile(path) else len(text)
            raise UserError(
                f"{path}: {size / 2**20:.1f} MiB is larger than a config file may be ({MAX_CONFIG_BYTES >> 20} MiB: "
                "settings only); put data such as prompts in a file the config names (data.train)"
            )
        data = load_yaml_text(text)
    except FileNotFoundError:
        raise UserError(f"config file not found: {path}") from None
    except OSError as e:
        raise UserError(f"cannot read config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise UserError(_yaml_error_message(path, e)) from None
    if data is None:  # empty file
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: the top level of a config file must be a mapping of keys, got {show(data)}")
    base = data.pop(BASE_KEY, None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise UserError(f"{path}: '{BASE_KEY}' names another config file, got {show(base)}")
    base_path = os.path.join(os.path.dirname(path), base)
    if os.path.abspath(base_path) in _seen:
        raise UserError(f"{path}: '{BASE_KEY}: {base}' makes a cycle of config files")
    if not os.path.exists(base_path):
        raise UserError(f"{path}: '{BASE_KEY}: {base}' names a config file that does not exist: {base_path} (a base "
                        "path is relative to the folder of the file that names it)")  # fmt: skip
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
    return config_from_data(cls, read_yaml_config(path) if path is not None else {}, path, overrides)


def config_from_data(cls: type[T], data: dict[str, Any], path: str | os.PathLike | None, overrides: Sequence[str]) -> T:
    """``cls`` from the mapping a config file ``path`` held (None: no file) with ``overrides``; an error names the
    override, else the file, it came from."""
    data = apply_overrides(data, overrides)
    try:
        return from_dict(cls, data)
    except ConfigError as e:
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
    what = "YAML aliases" if isinstance(error, _AliasError) else "YAML syntax error"
    return " ".join(f"{what} in {path}{where}: {detail}".split())  # one line: the CLI prints it as is


def to_yaml(obj: Any) -> str:
    """YAML text for a dataclass tree (or plain data), in field order, readable by ``load_config``."""
    return yaml.dump(to_dict(obj), Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=100)
