"""One registry per component kind; a decorator registers a component class under a name.

Registries reject duplicate names and answer unknown names with a did-you-mean. ``python -m studies.ablate ls``
lists every registered component with the first line of its docstring.
"""

from __future__ import annotations

import difflib

from .. import plugins
from ..errors import UserError
import importlib
import pkgutil
from typing import Callable, Iterator


class UnknownComponentError(UserError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class Registry:
    def __init__(self, kind: str, package: str):
        self.kind = kind
        self._package = package  # components live one file each in this package; imported on first use
        self._items: dict[str, type] = {}
        self._loaded = False
        self._builtin_loaded = False

    def register(self, name: str) -> Callable[[type], type]:
        def decorator(cls: type) -> type:
            if plugins.loading():  # built-ins first, so a plugin taking a built-in name is refused here
                self._load_builtin()
            if name in self._items and self._items[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is already registered by {self._items[name].__qualname__}")
            cls.name = name
            cls.kind = self.kind
            cls.Config.component_name = name
            cls.Config.component_kind = self.kind
            self._items[name] = cls
            plugins.note_registration(self.kind, name, cls.__module__)
            return cls

        return decorator

    def _load_builtin(self) -> None:
        if not self._builtin_loaded:
            self._builtin_loaded = True
            package = importlib.import_module(self._package)
            for module in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{self._package}.{module.name}")

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            self._load_builtin()
            plugins.load_plugins()  # outside components (var_core.plugins): entry points, --plugins paths
        elif plugins.pending():
            plugins.load_plugins()

    def get(self, name: str) -> type:
        self._load()
        if name not in self._items:
            close = difflib.get_close_matches(name, list(self._items), n=3, cutoff=0.4)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise UnknownComponentError(
                f"unknown {self.kind} {name!r}.{hint} Registered {self.kind}s: {', '.join(sorted(self._items))}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        self._load()
        return sorted(self._items)

    def __iter__(self) -> Iterator[tuple[str, type]]:
        self._load()
        return iter(sorted(self._items.items()))

    def summary(self, name: str) -> str:
        doc = (self.get(name).__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


SCORERS = Registry("scorer", "var_core.accel.scorers")
ACTIVATIONS = Registry("activation", "var_core.accel.activation")
SCHEDULES = Registry("schedule", "var_core.accel.schedules")
RESTORERS = Registry("restorer", "var_core.accel.restorers")
GUIDANCES = Registry("guidance", "var_core.accel.guidance")
SKIPS = Registry("skip", "var_core.accel.skip")
KV_POLICIES = Registry("kv", "var_core.accel.kv")  # the KV-cache policy (issue 29): which cached keys stay
ATTENTION_PATTERNS = Registry("attention", "var_core.accel.attention")  # sparse attention patterns (issue 29)

REGISTRIES: dict[str, Registry] = {r.kind: r for r in (SCORERS, ACTIVATIONS, SCHEDULES, RESTORERS, GUIDANCES, SKIPS,
                                                       KV_POLICIES, ATTENTION_PATTERNS)}
