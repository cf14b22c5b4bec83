"""Names -> things of one kind (attention backends, transfer backends, routing policies,
orderings), with lazy imports for heavy entries and one error that names the choices.

    BACKENDS: Registry[type[Backend]] = Registry("transfer backend")
    BACKENDS.add("shm", Lazy("store.transfer.shm_backend", "ShmBackend"))  # imported on get
    BACKENDS.add("fake", FakeBackend)                                        # already here
    BACKENDS.get("shm")   # the class; ValueError "unknown transfer backend 'x'; choose one of ..."

Stdlib only, so every layer may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

T = TypeVar("T")


@dataclass(frozen=True)
class Lazy:
    """An entry imported when first asked for: ``getattr(import_module(module), attr)``.
    ``hint`` (what to install, what to use instead) joins the ImportError when the import
    fails."""

    module: str
    attr: str
    hint: str = ""


class Registry(Generic[T]):
    """Entries by name, in the order they were added. ``error`` is the exception an unknown
    name raises (a ValueError by default); its message names every choice."""

    def __init__(self, kind: str, error: type[Exception] = ValueError) -> None:
        self.kind = kind
        self.error = error
        self._entries: dict[str, T | Lazy] = {}

    def add(self, name: str, entry: T | Lazy, *, replace: bool = False) -> None:
        """Register ``entry`` under ``name``; a second entry for a name needs ``replace``."""
        if name in self._entries and not replace:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def unknown(self, name: str) -> Exception:
        """The error for a name that is not registered: it names the choices."""
        choices = ", ".join(sorted(self))
        return self.error(f"unknown {self.kind} {name!r}; choose one of {choices}")

    def get(self, name: str) -> T:
        """The entry called ``name``, importing it first if it is ``Lazy``.

        Raises ``self.error`` for an unknown name, ImportError (with the entry's hint) when
        a lazy entry's module cannot be imported."""
        try:
            entry = self._entries[name]
        except KeyError:
            raise self.unknown(name) from None
        if not isinstance(entry, Lazy):
            return entry
        try:
            module = importlib.import_module(entry.module)
        except ImportError as exc:
            hint = f"; {entry.hint}" if entry.hint else ""
            raise ImportError(
                f"{self.kind} {name!r} needs a package that is not installed ({exc}){hint}"
            ) from exc
        return cast(T, getattr(module, entry.attr))
