"""Make this interpreter import only what the GPU machine would have: the image's packages (packages.txt beside this
file), the standard library, and what PYTHONPATH names (the source tree, the folder the carried wheels are
installed into). Every other installed package is as absent as it is there: `import` raises ModuleNotFoundError and
`importlib.util.find_spec` / `importlib.metadata` do not find it.

How: Python runs this file at start-up when its folder is on PYTHONPATH (site.py imports `sitecustomize`); it takes
the site-packages folders off sys.path and puts a finder first on sys.meta_path that finds, in them, only the
image's distributions and what they require (modules and metadata). Forked children inherit it. With
$DEVICE_IMPORT_LOG set, each top-level import that does not come from the image is written there: "carried NAME
PATH" (found in the folder $DEVICE_CARRIED_SITE), "absent NAME" (installed here, absent there: a failed import, or
a library's probe for an optional package) or "required NAME" (not listed, but required by a listed package as
installed here). Used by scripts/prove_device_wheels.sh.
"""

import importlib.machinery
import importlib.metadata
import os
import re
import sys
from pathlib import Path


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _with_requirements(names: set[str]) -> set[str]:
    """`names` and, transitively, what they require as installed here (not their extras): the image resolved its
    packages' requirements when it was built, so a package here that needs another (at this version) has it there."""
    todo, seen = list(names), set(names)
    while todo:
        try:
            requires = importlib.metadata.requires(todo.pop()) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" in requirement.replace('"', "").replace("'", ""):
                continue
            name = _normal(re.match(r"[A-Za-z0-9._-]+", requirement).group(0))
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


_LISTED = {_normal(line.strip()) for line in Path(__file__).with_name("packages.txt").read_text().splitlines()
           if line.strip() and not line.startswith("#")}  # fmt: skip
_IMAGE = _with_requirements(_LISTED)
_CARRIED = os.environ.get("DEVICE_CARRIED_SITE", "")
_LOG = os.environ.get("DEVICE_IMPORT_LOG")
_OWNERS = importlib.metadata.packages_distributions()  # top-level module → the distributions that install it
_SITES = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
sys.path[:] = [p for p in sys.path if p not in _SITES]


def _note(line: str) -> None:
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(line + "\n")


class DeviceImage:
    """Finds the image's packages (and their metadata) in the site-packages folders taken off sys.path."""

    def find_spec(self, name, path=None, target=None):
        if path is not None or "." in name or name in sys.stdlib_module_names:
            return None  # submodules follow their package; the rest of sys.path is searched as usual after this
        owners = _OWNERS.get(name, [])
        if any(_normal(d) in _IMAGE for d in owners):
            if not any(_normal(d) in _LISTED for d in owners):
                _note(f"required {name} (by a package of the image, as installed here)")
            return importlib.machinery.PathFinder.find_spec(name, _SITES)
        carried = importlib.machinery.PathFinder.find_spec(name, [_CARRIED]) if _CARRIED else None
        if carried is not None:
            _note(f"carried {name} {carried.origin}")
        elif owners and importlib.machinery.PathFinder.find_spec(name, sys.path) is None:  # not the source tree
            _note(f"absent {name}")
        return None  # the rest of sys.path (the carried folder, the source tree) is searched as usual

    def find_distributions(self, context=None):
        context = context or importlib.metadata.DistributionFinder.Context()
        found = importlib.metadata.MetadataPathFinder.find_distributions(
            importlib.metadata.DistributionFinder.Context(name=context.name, path=_SITES)
        )
        return (d for d in found if _normal(d.metadata["Name"] or "") in _IMAGE)


sys.meta_path.insert(0, DeviceImage())
