"""``--swap KIND=NAME[:k=v,...]`` and ``--extra-arm NAME=PRESET[+EDIT...]``: new components and methods in a family
without editing it (the family's own arms, the paper's, stay as pinned).

* ``--swap scorer=mine`` replaces the ``scorer`` of every non-baseline arm by the registered component ``mine``
  (any kind: scorer, activation, schedule, restorer, guidance, skip), built with the knobs after ``:``
  (``--swap schedule=fixed_table:ratios=(0.3,0.5),widths=()``), typed and range-checked like ``--set``. Use
  ``--arms`` to limit it to some arms.
* ``--extra-arm mine=nova+scorer=entropy:source=lens+schedule.tau=0.7`` adds the arm ``mine``: the preset
  ``nova``, then each ``+`` edit in order — ``KIND=NAME[:k=v,...]`` swaps a component, ``KIND.OPTION=VALUE`` or
  ``POLICY_OPTION=VALUE`` sets a knob. Extra arms also receive ``--swap`` and ``--set``.

Every name is checked before anything runs: an unknown kind, component, preset or knob is one ``error:`` line
with a did-you-mean (exit 2 on the command line).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from var_core.accel.knobs import coerce
from var_core.accel.policy import COMPONENT_KINDS, PolicyConfig
from var_core.accel.registry import REGISTRIES
from var_core.errors import did_you_mean

from .base import Arm
from .overrides import OverrideError

__all__ = ["Swap", "parse_swap", "parse_swaps", "apply_swaps", "parse_extra_arm", "extra_arms"]


@dataclass(frozen=True)
class Swap:
    """One component swap: ``kind`` becomes the registered ``name`` with ``params`` (already typed)."""

    kind: str
    name: str
    params: tuple[tuple[str, object], ...] = ()
    text: str = ""

    def config(self):
        return REGISTRIES[self.kind].get(self.name).Config(**dict(self.params))


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split on ``sep`` outside parentheses (tuple values keep their commas)."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char == "("
        depth -= char == ")"
        if char == sep and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def _hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - fall back to the raw annotations
        return {f.name: f.type for f in dataclasses.fields(cls)}


def parse_swap(text: str, option: str = "--swap") -> Swap:
    """``KIND=NAME[:k=v,...]`` → :class:`Swap`, every name and knob checked (:class:`OverrideError` otherwise)."""
    if "=" not in text:
        raise OverrideError(f"{option} {text!r}: expected KIND=NAME[:knob=value,...] (e.g. {option} scorer=entropy); "
                            f"kinds: {', '.join(COMPONENT_KINDS)}")
    kind, rest = (part.strip() for part in text.split("=", 1))
    if kind not in COMPONENT_KINDS:
        raise OverrideError(f"{option} {text}: unknown component kind {kind!r}.{did_you_mean(kind, COMPONENT_KINDS)} "
                            f"Kinds: {', '.join(COMPONENT_KINDS)}")
    name, _, knobs = rest.partition(":")
    name = name.strip()
    registry = REGISTRIES[kind]
    if name not in registry.names():
        raise OverrideError(f"{option} {text}: unknown {kind} {name!r}.{did_you_mean(name, registry.names())} "
                            f"Registered {kind}s: {', '.join(registry.names())} (varscope ls components)")
    cls = registry.get(name)
    fields = {f.name: f for f in dataclasses.fields(cls.Config)}
    params: list[tuple[str, object]] = []
    for item in (p for p in _split_top(knobs, ",") if p.strip()) if knobs else ():
        if "=" not in item:
            raise OverrideError(f"{option} {text}: {item!r} is not knob=value")
        key, value = (part.strip() for part in item.split("=", 1))
        if key not in fields:
            raise OverrideError(f"{option} {text}: {kind} {name!r} has no knob {key!r}.{did_you_mean(key, fields)} "
                                f"Its knobs: {', '.join(sorted(fields))}")
        try:
            params.append((key, coerce(fields[key], value, _hints(cls.Config))))
        except ValueError as exc:
            raise OverrideError(f"{option} {text}: {exc}") from None
    swap = Swap(kind, name, tuple(params), text)
    try:
        swap.config()
    except (ValueError, TypeError) as exc:
        raise OverrideError(f"{option} {text}: {exc}") from None
    return swap


def parse_swaps(items) -> list[Swap]:
    return [item if isinstance(item, Swap) else parse_swap(item) for item in items or ()]


def _describe(swap: Swap, old: str) -> str:
    knobs = ", ".join(f"{k}={v}" for k, v in swap.params)
    return f"swap {swap.kind}: {old} -> {swap.name}" + (f" ({knobs})" if knobs else "")


def _swapped(config: PolicyConfig, swap: Swap) -> PolicyConfig:
    return dataclasses.replace(config, **{swap.kind: swap.config()})


def apply_swaps(arms: list[Arm], swaps) -> list[Arm]:
    """Every non-baseline arm (that can be built) with each swap applied in order; the baseline never changes."""
    swaps = parse_swaps(swaps)
    if not swaps:
        return arms
    out = []
    for arm in arms:
        if not arm.ok or arm.role == "baseline":
            out.append(arm)
            continue
        config, steps = arm.config, []
        for swap in swaps:
            steps.append(_describe(swap, getattr(config, swap.kind).component_name))
            config = _swapped(config, swap)
        config = dataclasses.replace(config, name=f"{config.name}+" + "+".join(s.text for s in swaps))
        out.append(dataclasses.replace(
            arm, config=config, description=(arm.description + f" [--swap {' '.join(s.text for s in swaps)}]").strip(),
            changes=(arm.changes + "; " if arm.changes else "") + "; ".join(steps)))
    return out


def _set(config: PolicyConfig, key: str, text: str, spec: str) -> tuple[PolicyConfig, str]:
    """``config`` with ``KIND.OPTION`` or a policy option set from ``text`` (typed and checked)."""
    policy_fields = {f.name: f for f in dataclasses.fields(PolicyConfig)
                     if f.name not in COMPONENT_KINDS and f.name != "name"}
    try:
        if "." in key:
            kind, option = key.split(".", 1)
            if kind not in COMPONENT_KINDS:
                raise OverrideError(f"--extra-arm {spec}: unknown component kind {kind!r} in {key!r}."
                                    f"{did_you_mean(kind, COMPONENT_KINDS)}")
            part = getattr(config, kind)
            fields = {f.name: f for f in dataclasses.fields(part)}
            if option not in fields:
                raise OverrideError(f"--extra-arm {spec}: {kind} {part.component_name!r} has no knob {option!r}."
                                    f"{did_you_mean(option, fields)} Its knobs: {', '.join(sorted(fields))}")
            value = coerce(fields[option], text, _hints(type(part)))
            old = getattr(part, option)
            return dataclasses.replace(config, **{kind: dataclasses.replace(part, **{option: value})}), \
                f"{key}: {old} -> {value}"
        if key not in policy_fields:
            keys = list(policy_fields) + list(COMPONENT_KINDS)
            raise OverrideError(f"--extra-arm {spec}: unknown key {key!r}.{did_you_mean(key, keys)} Use KIND=NAME "
                                f"(kinds: {', '.join(COMPONENT_KINDS)}), KIND.KNOB=VALUE or one of "
                                f"{', '.join(policy_fields)}")
        value = coerce(policy_fields[key], text, _hints(PolicyConfig))
        old = getattr(config, key)
        return dataclasses.replace(config, **{key: value}), f"{key}: {old} -> {value}"
    except (ValueError, TypeError) as exc:
        if isinstance(exc, OverrideError):
            raise
        raise OverrideError(f"--extra-arm {spec}: {key}={text}: {exc}") from None


def parse_extra_arm(spec: str) -> Arm:
    """``NAME=PRESET[+EDIT...]`` → one arm (see the module docstring); :class:`OverrideError` on any bad part."""
    from var_core.accel.presets import PRESETS, get_preset

    if "=" not in spec:
        raise OverrideError(f"--extra-arm {spec!r}: expected NAME=PRESET[+KIND=COMPONENT|+KIND.KNOB=VALUE...] "
                            f"(e.g. --extra-arm mine=nova+scorer=entropy)")
    name, rest = (part.strip() for part in spec.split("=", 1))
    if not name or name == "baseline" or any(c in name for c in "/\\"):
        raise OverrideError(f"--extra-arm {spec!r}: the arm needs a name other than 'baseline', without slashes")
    parts = _split_top(rest, "+")
    preset_name = parts[0].strip()
    try:
        config = get_preset(preset_name)
    except KeyError:
        raise OverrideError(f"--extra-arm {spec}: unknown preset {preset_name!r}.{did_you_mean(preset_name, PRESETS)} "
                            f"Presets: {', '.join(sorted(PRESETS))}") from None
    steps = [f"method: {preset_name}"]
    for edit in (p.strip() for p in parts[1:]):
        if not edit:
            continue
        key = edit.split("=", 1)[0].strip()
        if "=" in edit and key in COMPONENT_KINDS:
            swap = parse_swap(edit, option=f"--extra-arm {name}=...+")
            steps.append(_describe(swap, getattr(config, swap.kind).component_name))
            config = _swapped(config, swap)
        elif "=" in edit:
            config, step = _set(config, key, edit.split("=", 1)[1].strip(), spec)
            steps.append("set " + step)
        else:
            raise OverrideError(f"--extra-arm {spec}: {edit!r} is neither KIND=COMPONENT nor KEY=VALUE")
    config = dataclasses.replace(config, name=name)
    return Arm(name, config, f"extra arm (--extra-arm {spec})", role="arm", changes="; ".join(steps))


def extra_arms(arms: list[Arm], specs) -> list[Arm]:
    """``arms`` followed by one arm per ``--extra-arm`` spec; a name already taken is an error."""
    if not specs:
        return arms
    taken = {a.name for a in arms}
    out = list(arms)
    for spec in specs:
        arm = parse_extra_arm(spec)
        if arm.name in taken:
            raise OverrideError(f"--extra-arm {spec}: the family already has an arm named {arm.name!r}; pick another "
                                f"name")
        taken.add(arm.name)
        out.append(arm)
    return out
