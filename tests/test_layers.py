"""The package's dependency arrows point one way (docs/architecture.md), and no module reaches itself through imports.

Every import statement counts: lazy ones inside functions and those under `if TYPE_CHECKING:` too (a lazy import
hides a circle, it does not remove it; a type hint that points up is a dependency a reader follows).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffusion_rl"
BENCHMARKS = ROOT / "benchmarks"  # its scripts put benchmarks/ on sys.path and import each other by plain names

# layer → the layers it must never import
FORBIDDEN = {
    "data": ("rewards", "models", "sampling", "algorithms", "engine", "trainer", "evaluation", "checkpoint"),
    "models": ("algorithms", "engine", "trainer", "evaluation", "rewards", "checkpoint"),
    "sampling": ("algorithms", "engine", "trainer", "evaluation", "rewards", "checkpoint"),
    "algorithms": ("models", "engine", "trainer", "evaluation", "checkpoint"),
    "engine": ("trainer", "evaluation"),
    "rewards": ("engine", "trainer", "algorithms", "models", "evaluation"),
    "checkpoint": ("engine", "trainer", "evaluation", "algorithms"),
}
# config/ is the ground: what it may import besides itself, the leaves below every layer
GROUND = ("diffusion_rl.errors", "diffusion_rl.registry", "diffusion_rl.user_code", "diffusion_rl.utils")


def _module_name(path: Path, search_root: Path) -> str:
    parts = path.relative_to(search_root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, search_root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, dotted name) of every import statement in `path` (a module found from `search_root`, a sys.path
    entry), relative imports resolved; `from a import b` gives a.b, which is the module a.b or a name in a."""
    module = _module_name(path, search_root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names = [f"{base}.{a.name}" if base else a.name for a in node.names]  # a.name may be a module of base
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n]
    return found


def _package_imports(path: Path) -> list[tuple[int, str]]:
    return [(line, n) for line, n in _imports(path) if n.startswith("diffusion_rl.")]


def _layer(module: str) -> str:
    return module.split(".")[1]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_never_imports_the_layers_above_it(layer):
    problems = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, module in _package_imports(path):
            if _layer(module) in FORBIDDEN[layer]:
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not problems, "\n".join(problems)


def test_config_imports_no_layer_above_it():
    """config/ is the ground: it imports itself and the leaves only. A name a plugin registers is checked against
    config/plugins.py's registries, into which the plugins register from their own layers."""
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((PACKAGE / "config").rglob("*.py")) for line, module in _package_imports(path)
             if not module.startswith(("diffusion_rl.config.", *GROUND))]  # fmt: skip
    assert not found, "\n".join(found)


def test_importing_the_config_loads_no_layer_above_it():
    """Not at import either (a registry imports its plugins on its first look-up, when a config is checked)."""
    allowed = ("diffusion_rl.config", *GROUND)
    code = "import sys, diffusion_rl.config; print(' '.join(m for m in sys.modules if m.startswith('diffusion_rl.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert [m for m in loaded.split() if not m.startswith(allowed)] == []


def test_the_engine_reads_no_dataset():
    """Workers get the run's texts in their spec (engine/spec.py): the trainer reads the prompts, once."""
    readers = {"diffusion_rl.data.prompts", "diffusion_rl.data.pairs"}
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
             for path in sorted((PACKAGE / "engine").rglob("*.py"))
             for line, module in _package_imports(path) if _module_of(module) in readers]  # fmt: skip
    assert not found, "\n".join(found)


def test_checkpoint_paths_is_a_leaf():
    imported = {m for _, m in _package_imports(PACKAGE / "checkpoint" / "paths.py")}
    assert imported <= {"diffusion_rl.errors", "diffusion_rl.errors.UserError"}, imported


def test_no_file_in_the_package_is_over_600_lines():
    """Small files with one job: a module past 600 lines is split by what it does (docs/architecture.md)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > 600:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert not long, "over 600 lines:\n" + "\n".join(long)


def test_the_config_loader_imports_nothing_of_the_tree():
    """The loader works for any dataclass tree (the run config, pretraining's, a loss's settings): its modules import
    only each other and diffusion_rl.errors, so loading a tree never reaches the run's sections or the plugins."""
    loader = ("fields", "loading", "convert", "reference", "secrets")
    allowed = ("diffusion_rl.errors", *(f"diffusion_rl.config.{name}." for name in loader))
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in (PACKAGE / "config" / f"{name}.py" for name in loader)
             for line, module in _package_imports(path) if not module.startswith(allowed)]  # fmt: skip
    assert not found, "\n".join(found)


def _module_of(name: str) -> str | None:
    """The diffusion_rl module (file or package) an imported name lives in: the longest prefix that is one."""
    parts = name.split(".")
    for end in range(len(parts), 1, -1):
        base = PACKAGE.parent.joinpath(*parts[:end])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return ".".join(parts[:end])
    return None


def import_circles(sources: list[tuple[Path, Path]]) -> list[list[str]]:
    """The import circles among the modules of `sources` ((folder, the sys.path entry it is imported from) pairs):
    each strongly connected component of more than one module, by file. An imported name is the longest prefix of it
    that is a module (a package's __init__.py before a same-named file), looked up from the importing file's own
    sys.path entry, then the others'."""
    files = {path: root for folder, root in sources for path in sorted(folder.rglob("*.py"))}

    def find(name: str, roots: list[Path]) -> Path | None:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            for root in roots:
                base = root.joinpath(*parts[:end])
                for candidate in (base / "__init__.py", base.with_suffix(".py")):
                    if candidate in files:
                        return candidate
        return None

    graph: dict[Path, set[Path]] = {}
    for path, root in files.items():
        roots = [root, *(r for r in dict.fromkeys(files.values()) if r != root)]
        graph[path] = {t for _, n in _imports(path, root) if (t := find(n, roots)) not in (None, path)}
    # Tarjan's strongly connected components
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    circles: list[list[str]] = []

    def visit(node: Path) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(str(m.relative_to(files[m])) for m in component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def test_no_import_circle_in_the_package_or_the_benchmarks():
    circles = import_circles([(PACKAGE, ROOT), (BENCHMARKS, BENCHMARKS)])
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_sees_circles_through_type_hints_lazy_and_relative_imports(tmp_path):
    """A synthetic package with one circle of each hidden kind, and an import chain that is no circle."""
    files = {
        "pkg/__init__.py": "",
        "pkg/hinted.py": "from pkg.hinting import X\n",
        "pkg/hinting.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.hinted import Y\n",
        "pkg/lazy.py": "def f():\n    import pkg.eager\n",
        "pkg/eager.py": "from pkg import lazy\n",
        "pkg/sub/__init__.py": "from .one import A\n",
        "pkg/sub/one.py": "from . import two\n",
        "pkg/sub/two.py": "from ..sub.one import A\n",
        "pkg/chain.py": "import pkg.leaf\nfrom pkg.hinted import X\n",
        "pkg/leaf.py": "import os\n",
        "scripts/run.py": "import helper\nimport pkg.chain\n",  # a script beside its helper, on its own sys.path
        "scripts/helper.py": "def main():\n    import run\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    circles = import_circles([(tmp_path / "pkg", tmp_path), (tmp_path / "scripts", tmp_path / "scripts")])
    assert circles == [
        ["helper.py", "run.py"],
        ["pkg/eager.py", "pkg/lazy.py"],
        ["pkg/hinted.py", "pkg/hinting.py"],
        ["pkg/sub/one.py", "pkg/sub/two.py"],
    ]
