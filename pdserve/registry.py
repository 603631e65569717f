"""Named, lazily imported classes: transports, proxy flows, routing policies, placement rules,
model families. Each registry lists pdserve's own as "module:Class" strings (importing one costs
nothing until it is used); `register` adds another from anywhere, a plugin module included
(`PDSERVE_PLUGINS`, see `load_plugins`), without touching a pdserve file."""

from __future__ import annotations

import importlib
import os
from typing import Generic, TypeVar

T = TypeVar("T")

PLUGINS_ENV = "PDSERVE_PLUGINS"  # comma-separated modules imported at start: they register their classes


class Registry(Generic[T]):
    """What a name stands for, in one place: the CLI's choices, config checks and lookups read it."""

    def __init__(self, kind: str, entries: dict[str, str | type[T]]) -> None:
        self.kind = kind  # "mode", "policy", ...: how an error names a bad choice
        self._entries: dict[str, str | type[T]] = dict(entries)

    def register(self, name: str, target: str | type[T]) -> None:
        """Add (or replace) `name`: a class, or "module:Class" imported on first use."""
        self._entries[name] = target

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(list(self._entries))

    def get(self, name: str) -> type[T]:
        """The class of `name`; ValueError naming the choices."""
        target = self._entries.get(name)
        if target is None:
            raise ValueError(f"{self.kind} must be one of {', '.join(self._entries)}, got {name!r}")
        if isinstance(target, str):
            module, _, cls = target.partition(":")
            target = self._entries[name] = getattr(importlib.import_module(module), cls)
        return target

    def classes(self) -> dict[str, type[T]]:
        """Every entry, imported."""
        return {name: self.get(name) for name in self._entries}


def load_plugins() -> None:
    """Import the plugin modules named in $PDSERVE_PLUGINS, so that what they register is there
    before any choice is read; the CLI calls this first, and so does a spawned TP rank."""
    for name in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"{PLUGINS_ENV}: cannot import plugin module {name!r}: {exc}") from exc
