"""Typed ``--set key=value`` overrides applied to every arm's PolicyConfig (except the baseline's).

Keys:

* a policy-level option: ``granularity``, ``cfg_rows``, ``exempt_first_blocks``, ``exempt_last_blocks``,
  ``min_keep`` — applied to every non-baseline arm;
* ``<kind>.<option>`` (``schedule.tau``, ``scorer.extractor``, ``restorer.interpolation`` …) — applied to every
  non-baseline arm whose ``<kind>`` component has that option.

The value is parsed into the option's declared type (bool, int, float, str, tuple of numbers), and the new config
is validated (declared range and choices), so an unknown key, a wrong type or an out-of-range value is an error
before any model is loaded. A key that no arm of the family has is an error naming the keys that exist. The
baseline arm is never changed: it stays the plain model every metric is measured against.

Once the model is loaded, :func:`check_overrides_on_model` checks the values that name scales or blocks
(``knob(unit=...)``: ``activation.start_scale``, ``restorer.cache_scale``, ``exempt_first_blocks``,
``schedule.layer_profile``, ...) against the model's number of scales and blocks: a value beyond the model is an
error before anything is generated, never an arm that silently runs as the baseline or is skipped.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass

from var_core.accel.knobs import coerce, model_problem
from var_core.errors import UserError
from var_core.accel.policy import COMPONENT_KINDS, PolicyConfig

from .base import Arm

__all__ = ["Override", "OverrideError", "parse_overrides", "apply_overrides", "valid_keys",
           "check_overrides_on_model"]


class OverrideError(UserError, ValueError):
    """A ``--set`` that cannot be applied; the message names the valid keys or the valid range."""


@dataclass(frozen=True)
class Override:
    key: str
    text: str

    @property
    def kind(self) -> str | None:
        return self.key.split(".", 1)[0] if "." in self.key else None

    @property
    def option(self) -> str:
        return self.key.split(".", 1)[1] if "." in self.key else self.key


def parse_overrides(items: list[str] | tuple[str, ...] | None) -> list[Override]:
    out = []
    for item in items or ():
        if "=" not in item:
            raise OverrideError(f"--set {item!r}: expected key=value (e.g. --set schedule.tau=0.7)")
        key, text = item.split("=", 1)
        key = key.strip()
        if not key:
            raise OverrideError(f"--set {item!r}: empty key")
        out.append(Override(key, text.strip()))
    return out


def _policy_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(PolicyConfig) if f.name not in COMPONENT_KINDS and f.name != "name"}


def valid_keys(arms: list[Arm]) -> list[str]:
    """Every key ``--set`` accepts for these arms."""
    keys = set(_policy_fields())
    for arm in arms:
        if not arm.ok or arm.role == "baseline":
            continue
        for kind in COMPONENT_KINDS:
            for f in dataclasses.fields(getattr(arm.config, kind)):
                keys.add(f"{kind}.{f.name}")
    return sorted(keys)


def _hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - fall back to the raw annotations
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _unknown(key: str, keys: list[str]) -> OverrideError:
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return OverrideError(f"--set {key}: unknown key.{hint} Valid keys for these arms: {', '.join(keys)}")


def _apply_one(config: PolicyConfig, override: Override) -> PolicyConfig | None:
    """The overridden config, or None when the key does not apply to this config (other component)."""
    if override.kind is None:
        field_ = _policy_fields()[override.option]
        value = coerce(field_, override.text, _hints(PolicyConfig))
        try:
            return dataclasses.replace(config, **{override.option: value})
        except (ValueError, TypeError) as exc:
            raise OverrideError(f"--set {override.key}={override.text}: {exc}") from None
    part = getattr(config, override.kind)
    fields = {f.name: f for f in dataclasses.fields(part)}
    if override.option not in fields:
        return None
    try:
        value = coerce(fields[override.option], override.text, _hints(type(part)))
    except ValueError as exc:
        raise OverrideError(f"--set {override.key}={override.text}: {exc}") from None
    try:
        new_part = dataclasses.replace(part, **{override.option: value})
    except (ValueError, TypeError) as exc:
        raise OverrideError(f"--set {override.key}={override.text}: {exc}") from None
    return dataclasses.replace(config, **{override.kind: new_part})


def apply_overrides(arms: list[Arm], overrides: list[Override] | list[str]) -> list[Arm]:
    """Arms with every override applied (baseline untouched); raises :class:`OverrideError` before any run."""
    overrides = [o if isinstance(o, Override) else parse_overrides([o])[0] for o in overrides]
    if not overrides:
        return arms
    keys = valid_keys(arms)
    for o in overrides:
        if o.kind is None and o.option not in _policy_fields():
            raise _unknown(o.key, keys)
        if o.kind is not None and o.kind not in COMPONENT_KINDS:
            raise _unknown(o.key, keys)
        if o.key not in keys:
            raise _unknown(o.key, keys)
    out = []
    for arm in arms:
        if not arm.ok or arm.role == "baseline":
            out.append(arm)
            continue
        config, applied = arm.config, []
        for o in overrides:
            new = _apply_one(config, o)
            if new is not None:
                config = new
                applied.append(f"{o.key}={o.text}")
        if applied:
            desc = (arm.description + f" [--set {' '.join(applied)}]").strip()
            changes = (arm.changes + ("; " if arm.changes else "") + "set " + ", ".join(applied))
            arm = dataclasses.replace(arm, config=config, description=desc, changes=changes)
        out.append(arm)
    return out


def check_overrides_on_model(arms: list[Arm], overrides: list[Override] | list[str] | tuple[str, ...],
                             num_scales: int, num_blocks: int, model: str = "the model") -> None:
    """Raise :class:`OverrideError` when a ``--set`` value names a scale or block that a model of ``num_scales``
    scales and ``num_blocks`` blocks does not have (knobs declared with a ``unit``), or when the exempt blocks
    leave no block to prune. ``arms`` are the arms with the overrides applied (baseline and failed arms are
    ignored): the value checked is the one each arm will run with."""
    overrides = [o if isinstance(o, Override) else parse_overrides([o])[0] for o in overrides]
    runs = [arm for arm in arms if arm.ok and arm.role != "baseline"]
    for o in overrides:
        for arm in runs:
            part = arm.config if o.kind is None else getattr(arm.config, o.kind)
            field_ = {f.name: f for f in dataclasses.fields(part)}.get(o.option)
            if field_ is None:
                continue
            problem = model_problem(field_, getattr(part, o.option), num_scales, num_blocks, model)
            if problem:
                raise OverrideError(f"--set {o.key}={o.text}: {problem}")
    if any(o.kind is None and o.option in ("exempt_first_blocks", "exempt_last_blocks") for o in overrides):
        for arm in runs:
            first, last = arm.config.exempt_first_blocks, arm.config.exempt_last_blocks
            if first + last >= num_blocks:
                raise OverrideError(f"--set exempt_first_blocks={first} / exempt_last_blocks={last}: {model} has "
                                    f"{num_blocks} blocks, so no block is left to prune (arm {arm.name!r}); exempt "
                                    f"fewer than {num_blocks} blocks in all")
