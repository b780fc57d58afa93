"""Name → object registries. A name registers once; looking up an unknown name lists the known ones."""

from collections.abc import Callable
from typing import Generic, TypeVar

from diffusion_rl.errors import UserError, did_you_mean

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind  # "loss", "reward", "step type": used in error messages
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._items[name] = item
            return item

        return add

    def get(self, name: str) -> T:
        if name not in self._items:
            raise UserError(
                f"unknown {self.kind} '{name}'{did_you_mean(name, self._items)}; "
                f"known: {', '.join(sorted(self._items))}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())

    def remove(self, name: str) -> None:
        """Unregister `name` (tests that register a temporary entry clean up with this)."""
        self._items.pop(name)

    def __contains__(self, name: str) -> bool:
        return name in self._items
