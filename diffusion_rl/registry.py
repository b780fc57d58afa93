"""Name → object registries, and the one way plugins reach them.

A plugin (a loss, a preference algorithm, a reward, a model family) is one module that registers itself when
imported. A registry names the packages its plugins live in and imports every module of them (`load_plugins`) the
first time it is looked up, so adding a plugin is adding its file: no list of modules is kept by hand. A registry
may sit in a layer below its plugins (config/plugins.py: losses, model families, step types, ODE solvers), so that
the config checks a name with no import of their layers. A name registers once; looking up an unknown name lists
the known ones.
"""

import importlib
import pkgutil
from collections.abc import Callable
from typing import Generic, TypeVar

from diffusion_rl.errors import UserError, did_you_mean

T = TypeVar("T")


def load_plugins(package: str) -> None:
    """Import every module of `package` (a dotted name; a subpackage is imported as one module, its __init__); a
    plain module is imported itself."""
    root = importlib.import_module(package)
    for module in pkgutil.iter_modules(getattr(root, "__path__", ())):
        importlib.import_module(f"{package}.{module.name}")


class Registry(Generic[T]):
    def __init__(self, kind: str, plugins: tuple[str, ...] = ()):
        self.kind = kind  # "loss", "reward", "step type": used in error messages
        self.plugins = plugins  # packages whose modules register this registry's entries (imported on first use)
        self._items: dict[str, T] = {}
        self._loaded = not plugins

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._items[name] = item
            return item

        return add

    def _entries(self) -> dict[str, T]:
        if not self._loaded:
            self._loaded = True  # before importing: a plugin module that looks something up does not recurse
            try:
                for package in self.plugins:
                    load_plugins(package)
            except BaseException:
                self._loaded = False
                raise
        return self._items

    def get(self, name: str) -> T:
        items = self._entries()
        if name not in items:
            raise UserError(
                f"unknown {self.kind} '{name}'{did_you_mean(name, items)}; known: {', '.join(sorted(items))}"
            )
        return items[name]

    def names(self) -> list[str]:
        return sorted(self._entries())

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._entries().items())

    def remove(self, name: str) -> None:
        """Unregister `name` (tests that register a temporary entry clean up with this)."""
        self._items.pop(name)

    def __contains__(self, name: str) -> bool:
        return name in self._entries()
