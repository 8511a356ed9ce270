"""Hyper-parameter fields with their documentation, valid range and search space in one place.

Every tunable number of a component is declared with :func:`knob` inside the component's nested ``Config``
dataclass. The metadata drives three things: validation when a config is built (out-of-range values fail
before any generation starts), typed ``--set`` overrides, and the Optuna search spaces of ``sweeps/`` (which
read ``search`` from here instead of keeping their own list of names).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Range:
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return False
        return True

    def __str__(self) -> str:
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        return f"{'(' if self.low_open or self.low is None else '['}{lo}, {hi}{')' if self.high_open or self.high is None else ']'}"


@dataclass(frozen=True)
class SearchSpace:
    """How a sweep samples a knob: ``float``/``int`` in [low, high] (optionally log-scaled) or ``categorical``."""

    kind: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple | None = None
    step: float | None = None


def knob(default: Any, doc: str, *, low=None, high=None, low_open=False, high_open=False, choices=None,
         search: SearchSpace | None = None, reconstructed: bool = False):
    """A config field with documentation, validation range/choices and an optional search space.

    ``reconstructed=True`` marks an option that selects between RECONSTRUCTED alternatives of specs/methods.md.
    """
    meta = dict(doc=doc, range=Range(low, high, low_open, high_open) if (low is not None or high is not None) else None,
                choices=tuple(choices) if choices is not None else None, search=search, reconstructed=reconstructed)
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for sequence defaults (configs are frozen and hashable)")
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ComponentConfig:
    """Base of every component's nested ``Config``; validates its knobs on construction."""

    component_name: ClassVar[str] = "?"
    component_kind: ClassVar[str] = "?"

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        out = {"name": self.component_name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


def validate(config) -> None:
    validate_plain(config, f"{config.component_kind} {config.component_name!r}")


def validate_plain(config, label: str) -> None:
    """Check every knob field of a dataclass instance against its declared range / choices."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        rng: Range | None = f.metadata.get("range")
        choices = f.metadata.get("choices")
        doc = f.metadata.get("doc", "")
        if choices is not None and value not in choices:
            raise ValueError(f"{label}: {f.name}={value!r} is not one of {list(choices)} ({doc})")
        if rng is not None:
            values = value if isinstance(value, tuple) else (value,)
            for v in values:
                if v is None:
                    continue
                if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or not rng.contains(v):
                    raise ValueError(f"{label}: {f.name}={value!r} is out of range {rng} ({doc})")


def knob_fields(config_cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(config_cls) if "doc" in f.metadata]


def coerce(field_: dataclasses.Field, text: str, type_hints: dict) -> Any:
    """Parse a ``--set`` string into the field's declared type (bool, int, float, str, tuple of numbers)."""
    hint = type_hints.get(field_.name, field_.type)
    hint_s = hint if isinstance(hint, str) else str(hint)
    if text.strip().lower() == "none" and ("None" in hint_s or "Optional" in hint_s):
        return None
    try:
        if "tuple" in hint_s:
            parts = [p for p in text.replace("(", "").replace(")", "").split(",") if p.strip()]
            inner = float if "float" in hint_s else int
            return tuple(inner(p) for p in parts)
        if hint_s.startswith("bool"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if hint_s.startswith("int") and "float" not in hint_s:
            return int(text)
        if hint_s.startswith("float") or "float" in hint_s:
            if text.lower() == "none" and "None" in hint_s:
                return None
            return float(text)
        if "int" in hint_s and text.lower() == "none":
            return None
        if "int" in hint_s:
            return int(text)
        return text
    except ValueError:
        raise ValueError(f"cannot read {text!r} as {hint_s} for {field_.name}") from None
