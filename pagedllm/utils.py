"""Small helpers shared across the package (no imports from it)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Generic, TypeVar

_C = TypeVar("_C")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


def json_dict_option(value: Any, field: str) -> dict[str, Any]:
    """An engine option given as a dict or as JSON text (the CLI's form): a new dict ({} for None);
    ValueError naming `field` for invalid JSON or a non-object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: not valid JSON ({e})") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{field}: expected a JSON object, got {type(value).__name__}")
    return dict(value or {})


class PluginRegistry(Generic[_C]):
    """Classes by name, registered by a decorator in the modules of one package folder and loaded on the first
    lookup (the tool-call and reasoning parsers). The modules are found by path: importing the package itself
    from its base module would be an import cycle."""

    def __init__(self, field: str, package: str, folder: str, skip: tuple[str, ...]) -> None:
        self.field = field
        """The option the names are given in (named by the lookup's ValueError)."""
        self.package, self.folder, self.skip = package, folder, skip
        self.classes: dict[str, type[_C]] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[type[_C]], type[_C]]:
        def deco(cls: type[_C]) -> type[_C]:
            self.classes[name] = cls
            return cls

        return deco

    def _load(self) -> None:
        if self._loaded:
            return
        import importlib
        import pkgutil

        for mod in pkgutil.iter_modules([self.folder]):
            if mod.name not in self.skip:
                importlib.import_module(f"{self.package}.{mod.name}")
        self._loaded = True

    def names(self) -> list[str]:
        self._load()
        return sorted(self.classes)

    def get(self, name: str) -> type[_C]:
        """The class registered as `name`; ValueError naming the option otherwise."""
        self._load()
        if name not in self.classes:
            raise ValueError(f"{self.field}: unknown parser {name!r}; expected one of {', '.join(self.names())}")
        return self.classes[name]


def exit_when_parent_dies(thread_name: str) -> None:
    """A spawned process (engine core, worker) that must not outlive its parent, e.g. one killed with SIGKILL
    that could not shut it down: a daemon thread waits on the parent's sentinel and exits the process."""
    import multiprocessing
    import os
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name=thread_name, daemon=True).start()
