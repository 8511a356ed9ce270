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


#: What a knob's number refers to in the model it runs on (``knob(unit=...)``), checked by :func:`model_problem`
#: once the model is known (its number of scales and blocks):
UNITS = {
    "scale": "a scale index, 0-indexed, -k = the k-th from the end",
    "scale_number": "a scale number, 1-indexed",
    "scales": "a number of scales, fewer than the model has",
    "block": "a block index, 0-indexed, -k = the k-th from the end",
    "blocks": "a number of blocks, fewer than the model has",
    "per_block": "one value per block of the model, or () for none",
}


def knob(default: Any, doc: str, *, low=None, high=None, low_open=False, high_open=False, choices=None,
         search: SearchSpace | None = None, reconstructed: bool = False, unit: str | None = None):
    """A config field with documentation, validation range/choices and an optional search space.

    ``reconstructed=True`` marks an option that selects between RECONSTRUCTED alternatives of specs/methods.md.
    ``unit`` (one of :data:`UNITS`) says that the value names scales or blocks of the model, so that a value
    beyond the model in hand can be refused once it is known (:func:`model_problem`).
    """
    if unit is not None and unit not in UNITS:
        raise ValueError(f"unknown knob unit {unit!r}; one of {sorted(UNITS)}")
    meta = dict(doc=doc, range=Range(low, high, low_open, high_open) if (low is not None or high is not None) else None,
                choices=tuple(choices) if choices is not None else None, search=search, reconstructed=reconstructed,
                unit=unit)
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
    """Check every knob field of a dataclass instance against its declared range / choices; a float knob (or a
    number of a tuple knob) must be finite whether or not it declares a range (``nan`` compares false with every
    bound and ``inf`` overflows the arithmetic it enters)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        rng: Range | None = f.metadata.get("range")
        choices = f.metadata.get("choices")
        doc = f.metadata.get("doc", "")
        if choices is not None and value not in choices:
            raise ValueError(f"{label}: {f.name}={value!r} is not one of {list(choices)} ({doc})")
        if "doc" in f.metadata:
            numbers = value if isinstance(value, tuple) else (value,)
            if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
                raise ValueError(f"{label}: {f.name}={value!r} must be finite ({doc})")
        if rng is not None:
            values = value if isinstance(value, tuple) else (value,)
            for v in values:
                if v is None:
                    continue
                if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or not rng.contains(v):
                    raise ValueError(f"{label}: {f.name}={value!r} is out of range {rng} ({doc})")


def model_problem(field_: dataclasses.Field, value: Any, num_scales: int, num_blocks: int,
                  model: str = "the model") -> str | None:
    """Why ``value`` of a knob with a ``unit`` does not fit ``model`` with ``num_scales`` scales and ``num_blocks``
    blocks (a sentence naming the valid values), or None when it fits or the knob has no unit. ``None`` values
    (a knob's "off") always fit."""
    unit = field_.metadata.get("unit")
    if unit is None or value is None:
        return None
    if unit == "per_block":
        if len(value) in (0, num_blocks):
            return None
        return f"has {len(value)} values but {model} has {num_blocks} blocks: give one per block, or ()"
    count, what = (num_scales, "scales") if unit.startswith("scale") else (num_blocks, "blocks")
    for v in value if isinstance(value, tuple) else (value,):
        if unit in ("scale", "block") and not -count <= v < count:
            return (f"{model} has {count} {what}: give 0 … {count - 1}, or -1 … -{count} counting from the end "
                    f"(got {v})")
        if unit == "scale_number" and not 1 <= v <= count:
            return f"{model} has {count} {what}, numbered 1 … {count} (got {v})"
        if unit in ("scales", "blocks") and not v < count:
            return f"{model} has {count} {what}: give fewer than {count} (got {v}, which leaves none)"
    return None


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
