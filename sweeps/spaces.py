"""Search spaces read from the knob metadata of a policy's components (never a separate list of names).

A *field* is a dotted path into a :class:`~var_core.accel.policy.PolicyConfig`: ``<kind>.<option>`` for a knob of
the component of that kind (``schedule.tau``, ``activation.t_est``, ``guidance.delta``, ``schedule.rho``) or a bare
policy-level option (``min_keep``). Its range comes from the knob's ``search=SearchSpace(...)`` declared next to the
config field (``var_core/accel/knobs.py``), so a knob added to a component is tunable without an edit here.

Aliases for the papers' symbols resolve against the chosen method: ``tau``/``τ``, ``lambda``/``lam``/``λ``,
``t_est``, ``alpha``/``α``, ``rho``/``ρ``, ``delta``/``δ``, ``beta``/``β`` — an alias names the knob of that symbol
(``lambda`` = a knob called ``lam`` or ``*_lam``) and resolves to the **unique** such knob among the method's
components; none or several is an error that lists the candidates. Any other bare name resolves the same way if
exactly one component of the method has a knob of that exact name (``stride``, ``s_rep``).

Tied fields: ``schedule.scale_lam+schedule.layer_lam`` is ONE sampled value written to both knobs (NOVA's dual
linkage has two λ knobs where the paper has a single λ; the tie sweeps the paper's λ). The spaces of tied knobs
must agree.

A field that no component of the chosen policy has (``schedule.tau`` on LD-Pruning, whose schedule is
``energy_fraction``) is an error raised before any trial, listing the tunable fields of that method.

Range overrides: ``tau=0.5:0.95`` (float/int, ``:log`` for log scale), ``restorer.interpolation=area,nearest``
(categorical). Out-of-range endpoints fail when the space is built (each endpoint is validated by constructing the
config), not in the middle of a study.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from var_core.accel.knobs import SearchSpace, coerce
from var_core.errors import UserError
from var_core.accel.policy import COMPONENT_KINDS, PolicyConfig

__all__ = [
    "SpaceError", "ALIASES", "KnobInfo", "Param", "SweepSpace", "knob_infos", "tunable_fields", "resolve_field",
    "resolve_param", "build_space", "apply_values", "apply_overrides", "parse_param_spec", "format_tunable",
]

#: paper symbol -> knob names that carry it (exact names, or ``*_<name>`` suffix for ``lam``)
ALIASES: dict[str, tuple[str, ...]] = {
    "tau": ("tau",), "τ": ("tau",),
    "lambda": ("lam",), "lam": ("lam",), "λ": ("lam",),
    "t_est": ("t_est",),
    "alpha": ("alpha",), "α": ("alpha",),
    "rho": ("rho",), "ρ": ("rho",),
    "delta": ("delta",), "δ": ("delta",),
    "beta": ("beta",), "β": ("beta",),
}
SUFFIX_ALIASES = {"lam"}  # ``lambda`` also matches ``scale_lam`` / ``layer_lam``


class SpaceError(UserError, ValueError):
    """A field or range that cannot be swept for this policy; the message lists what can."""


@dataclass(frozen=True)
class KnobInfo:
    """One knob of a policy: where it lives, its current value, documentation and declared search space."""

    path: str  # "schedule.tau" / "min_keep"
    kind: str  # component kind, or "policy"
    component: str  # component name ("dual_linkage"), or "policy"
    option: str  # "tau"
    value: Any
    doc: str
    search: SearchSpace | None
    field: dataclasses.Field
    owner: type  # the config class holding the knob (for its type hints)

    @property
    def tunable(self) -> bool:
        return self.search is not None


def _hints(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001
        return {f.name: f.type for f in dataclasses.fields(cls)}


def knob_infos(policy: PolicyConfig) -> dict[str, KnobInfo]:
    """Every knob the policy's components (and the policy itself) declare, keyed by dotted path."""
    out: dict[str, KnobInfo] = {}
    for kind in COMPONENT_KINDS:
        part = getattr(policy, kind)
        for f in dataclasses.fields(part):
            if "doc" not in f.metadata:
                continue
            out[f"{kind}.{f.name}"] = KnobInfo(f"{kind}.{f.name}", kind, part.component_name, f.name,
                                               getattr(part, f.name), f.metadata.get("doc", ""),
                                               f.metadata.get("search"), f, type(part))
    for f in dataclasses.fields(policy):
        if f.name in COMPONENT_KINDS or "doc" not in f.metadata:
            continue
        out[f.name] = KnobInfo(f.name, "policy", "policy", f.name, getattr(policy, f.name),
                               f.metadata.get("doc", ""), f.metadata.get("search"), f, PolicyConfig)
    return out


def tunable_fields(policy: PolicyConfig) -> dict[str, KnobInfo]:
    """The knobs of this policy that declare a search space (what a sweep samples by default)."""
    return {p: k for p, k in knob_infos(policy).items() if k.tunable}


def format_tunable(policy: PolicyConfig) -> str:
    lines = []
    for path, info in tunable_fields(policy).items():
        lines.append(f"  {path:<28} {_space_text(info.search):<34} now {info.value!r}  ({info.component})")
    return "\n".join(lines) if lines else "  (none)"


def _space_text(space: SearchSpace | None) -> str:
    if space is None:
        return "no search space"
    if space.kind == "categorical":
        return f"categorical {list(space.choices or ())}"
    text = f"{space.kind} [{space.low:g}, {space.high:g}]"
    if space.log:
        text += " log"
    if space.step:
        text += f" step {space.step:g}"
    return text


def _method_label(policy: PolicyConfig) -> str:
    parts = ", ".join(f"{k}={getattr(policy, k).component_name}" for k in COMPONENT_KINDS)
    return f"{policy.name!r} ({parts})"


def _not_read(policy: PolicyConfig, name: str, extra: str = "") -> SpaceError:
    infos = knob_infos(policy)
    close = difflib.get_close_matches(name, list(infos), n=3, cutoff=0.5)
    if not close:  # a bare knob name or alias ('taux' for 'tau'): match it against the last part of each path
        by_option = {p.rsplit(".", 1)[-1]: p for p in infos}
        bare = name.rsplit(".", 1)[-1]
        close = [by_option[o] for o in difflib.get_close_matches(bare, list(by_option), n=3, cutoff=0.6)]
        options = {k.option for k in infos.values()}
        close += [a for a in difflib.get_close_matches(bare.lower(), list(ALIASES), n=2, cutoff=0.75)
                  if options & set(ALIASES[a])]  # aliases of a knob this policy has
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return SpaceError(
        f"no component of the policy {_method_label(policy)} reads {name!r}{extra}.{hint}\n"
        f"Tunable fields of this method (dotted path, search space from the knob metadata, current value):\n"
        f"{format_tunable(policy)}")


def resolve_field(name: str, policy: PolicyConfig) -> list[str]:
    """Dotted path(s) of one field name: a path, an alias or a bare knob name (a ``+``-tie gives several)."""
    name = name.strip()
    if "+" in name:
        paths = [p for part in name.split("+") for p in resolve_field(part, policy)]
        if len(set(paths)) != len(paths):
            raise SpaceError(f"{name!r} names the same knob twice")
        return paths
    infos = knob_infos(policy)
    if name.startswith("policy."):
        name = name.removeprefix("policy.")
    if "." in name:
        kind = name.split(".", 1)[0]
        if kind not in COMPONENT_KINDS:
            raise SpaceError(f"{name!r}: {kind!r} is not a component kind ({', '.join(COMPONENT_KINDS)})\n"
                             f"Tunable fields of {_method_label(policy)}:\n{format_tunable(policy)}")
        if name not in infos:
            part = getattr(policy, kind)
            raise _not_read(policy, name, f" (its {kind} is {part.component_name!r}, whose options are "
                                          f"{[f.name for f in dataclasses.fields(part)] or 'none'})")
        return [name]
    if name in infos:  # policy-level option
        return [name]
    key = name.lower()
    if key in ALIASES:
        names = ALIASES[key]
        matches = [p for p, k in infos.items() if k.kind != "policy" and (
            k.option in names or any(n in SUFFIX_ALIASES and k.option.endswith("_" + n) for n in names))]
        label = f"alias {name!r} (a knob named {' / '.join(names)}" + (
            f" or *_{names[0]}" if names[0] in SUFFIX_ALIASES else "") + ")"
    else:
        matches = [p for p, k in infos.items() if k.kind != "policy" and k.option == name]
        label = f"{name!r}"
    if not matches:
        raise _not_read(policy, name, f" ({label} matches no knob of its components)")
    if len(matches) > 1:
        raise SpaceError(
            f"{label} is ambiguous for the policy {_method_label(policy)}: it matches {', '.join(matches)}. "
            f"Name one dotted path, or tie them to one sampled value with {'+'.join(matches)!r}.")
    return matches


@dataclass(frozen=True)
class Param:
    """One sampled dimension: an Optuna parameter named ``name`` written to every path of ``paths``."""

    name: str  # the Optuna parameter name: the canonical path(s), e.g. "schedule.tau" or "a.x+b.y"
    paths: tuple[str, ...]
    space: SearchSpace
    default: Any  # the value the base policy has (first path)
    doc: str
    label: str = ""  # what the user wrote ("tau"), for plots

    @property
    def display(self) -> str:
        return self.name if not self.label or self.label == self.name else f"{self.label} ({self.name})"

    def suggest(self, trial) -> Any:
        s = self.space
        if s.kind == "float":
            return trial.suggest_float(self.name, float(s.low), float(s.high), log=bool(s.log),
                                       step=None if s.log else s.step)
        if s.kind == "int":
            return trial.suggest_int(self.name, int(s.low), int(s.high), log=bool(s.log), step=int(s.step or 1))
        if s.kind == "categorical":
            return trial.suggest_categorical(self.name, list(s.choices))
        raise SpaceError(f"{self.name}: unknown search-space kind {s.kind!r}")

    def canonical(self, value: Any) -> Any:
        """``value`` as the space can tell it apart: ints rounded to their step, floats to their ``step`` grid
        (from ``low``) or, without a step, to 12 significant digits (absorbs storage round-trip noise);
        categorical values unchanged. Two trials whose canonical values agree evaluate the same policy."""
        s = self.space
        if value is None or s.kind == "categorical" or isinstance(value, (bool, str)):
            return value
        if s.kind == "int":
            step = int(s.step or 1)
            low = int(s.low)
            return low + step * int(round((float(value) - low) / step))
        v = float(value)
        if s.step and not s.log:
            v = float(s.low) + float(s.step) * round((v - float(s.low)) / float(s.step))
        return float(f"{v:.12g}")

    def to_dict(self) -> dict:
        return {"name": self.name, "label": self.label, "paths": list(self.paths),
                "space": dataclasses.asdict(self.space), "default": self.default, "doc": self.doc}


def parse_param_spec(text: str) -> tuple[str, str | None]:
    """``"tau=0.5:0.9"`` -> ``("tau", "0.5:0.9")``; ``"tau"`` -> ``("tau", None)``."""
    if "=" in text:
        name, rng = text.split("=", 1)
        return name.strip(), rng.strip()
    return text.strip(), None


def _override_space(base: SearchSpace | None, info: KnobInfo, text: str) -> SearchSpace:
    hints = _hints(info.owner)
    if ":" in text:
        parts = text.split(":")
        log = len(parts) > 2 and parts[2].strip().lower() == "log"
        lo = coerce(info.field, parts[0], hints)
        hi = coerce(info.field, parts[1], hints)
        kind = "int" if isinstance(lo, int) and isinstance(hi, int) and not isinstance(lo, bool) else "float"
        if base is not None and base.kind == "float":
            kind = "float"
        return SearchSpace(kind, float(lo) if kind == "float" else int(lo), float(hi) if kind == "float" else int(hi),
                           log=log)
    choices = tuple(coerce(info.field, c, hints) for c in text.split(",") if c.strip())
    if not choices:
        raise SpaceError(f"{info.path}={text!r}: expected low:high[:log] or a comma-separated list of choices")
    return SearchSpace("categorical", choices=choices)


def resolve_param(spec: str, policy: PolicyConfig) -> Param:
    """A :class:`Param` from ``name`` or ``name=range`` (see the module docstring)."""
    name, rng = parse_param_spec(spec)
    paths = resolve_field(name, policy)
    infos = knob_infos(policy)
    first = infos[paths[0]]
    if rng is not None:
        try:
            space = _override_space(first.search, first, rng)
        except (ValueError, TypeError) as exc:  # coerce: 'abc' for a float knob
            if isinstance(exc, SpaceError):
                raise
            kind = first.search.kind if first.search is not None else "value"
            raise SpaceError(f"--param {spec}: {exc}; {name} takes a {kind} range low:high[:log] (e.g. {name}="
                             f"{_example_range(first)}) or a comma-separated list of choices") from None
    else:
        space = first.search
        if space is None:
            raise SpaceError(f"{first.path} ({first.doc}) declares no search space; give a range "
                             f"({name}=low:high or {name}=a,b,c), or sweep one of the tunable fields:\n"
                             f"{format_tunable(policy)}")
        for path in paths[1:]:
            if infos[path].search != space:
                raise SpaceError(f"tied fields {paths} have different search spaces "
                                 f"({_space_text(space)} vs {_space_text(infos[path].search)}); give a range")
    if space.kind in ("float", "int") and (space.low is None or space.high is None or space.low > space.high):
        raise SpaceError(f"{name}: invalid range {_space_text(space)}")
    param = Param("+".join(paths), tuple(paths), space, first.value, first.doc, label=name)
    for value in _endpoints(space):  # every endpoint must be a valid config: fail now, not at trial 17
        try:
            apply_values(policy, {param.name: value}, params=[param])
        except (ValueError, TypeError) as exc:
            raise SpaceError(f"{param.display}: the search-space value {value!r} is not valid for this knob ({exc})"
                             ) from None
    return param


def _example_range(info: KnobInfo) -> str:
    s = info.search
    if s is not None and s.kind == "categorical":
        return ",".join(str(c) for c in (s.choices or ())[:2])
    if s is not None and s.low is not None and s.high is not None:
        return f"{s.low:g}:{s.high:g}"
    return "0.5:0.9"


def _endpoints(space: SearchSpace) -> list:
    if space.kind == "categorical":
        return list(space.choices or ())
    return [space.low, space.high]


def apply_values(policy: PolicyConfig, values: Mapping[str, Any], params: Sequence[Param] | None = None,
                 name: str | None = None) -> PolicyConfig:
    """``policy`` with every value written to its field(s); validated by the configs' own checks.

    ``values`` keys are Param names (``schedule.tau``, ``a.x+b.y``) or anything :func:`resolve_field` accepts.
    """
    by_name = {p.name: p for p in params or ()}
    per_kind: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in values.items():
        paths = by_name[key].paths if key in by_name else resolve_field(key, policy)
        for path in paths:
            if "." in path:
                kind, option = path.split(".", 1)
                per_kind.setdefault(kind, {})[option] = value
            else:
                top[path] = value
    changes: dict[str, Any] = dict(top)
    for kind, options in per_kind.items():
        changes[kind] = dataclasses.replace(getattr(policy, kind), **options)
    if name is not None:
        changes["name"] = name
    return dataclasses.replace(policy, **changes)


@dataclass(frozen=True)
class SweepSpace:
    """The dimensions of one study over a base policy."""

    base: PolicyConfig
    params: tuple[Param, ...]

    def suggest(self, trial) -> dict[str, Any]:
        return {p.name: p.suggest(trial) for p in self.params}

    def apply(self, values: Mapping[str, Any], name: str | None = None) -> PolicyConfig:
        return apply_values(self.base, values, self.params, name=name)

    def defaults(self) -> dict[str, Any]:
        """The base policy's values (a good first trial to enqueue)."""
        return {p.name: p.default for p in self.params}

    def in_space(self, values: Mapping[str, Any]) -> bool:
        for p in self.params:
            v = values.get(p.name)
            s = p.space
            if s.kind == "categorical":
                if v not in (s.choices or ()):
                    return False
            elif v is None or not (s.low <= v <= s.high):
                return False
        return True

    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def key(self, values: Mapping[str, Any]) -> tuple:
        """A hashable identity of one parameter set (canonical values, see :meth:`Param.canonical`, in the
        space's order); parameters the space does not have are ignored, missing ones are ``None``."""
        return tuple((p.name, p.canonical(values.get(p.name))) for p in self.params)

    def to_dict(self) -> dict:
        return {"base": self.base.to_dict(), "base_hash": self.base.config_hash(),
                "params": [p.to_dict() for p in self.params]}


def build_space(policy: PolicyConfig, params: Iterable[str] | None = None) -> SweepSpace:
    """The space of ``params`` (specs, see :func:`resolve_param`) or, if none, of every tunable knob."""
    specs = list(params or [])
    if not specs:
        specs = list(tunable_fields(policy))
        if not specs:
            raise SpaceError(f"the policy {_method_label(policy)} has no knob with a search space")
    resolved = [resolve_param(s, policy) for s in specs]
    seen: dict[str, str] = {}
    for p in resolved:
        for path in p.paths:
            if path in seen:
                raise SpaceError(f"{path} is swept twice (by {seen[path]!r} and {p.label!r})")
            seen[path] = p.label
    return SweepSpace(policy, tuple(resolved))


def apply_overrides(policy: PolicyConfig, items: Iterable[str]) -> PolicyConfig:
    """``policy`` with typed ``key=value`` settings (``schedule.tau=0.7``, ``lambda=0.2``, ``min_keep=2``).

    Keys resolve like sweep fields (dotted path, alias, ``+``-tie); the text is parsed into the knob's declared
    type and the result is validated by the configs. Used for the fixed part of a sweep (``--set``).
    """
    infos = knob_infos(policy)
    values: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SpaceError(f"--set {item!r}: expected key=value (e.g. --set schedule.tau=0.7)")
        key, text = (s.strip() for s in item.split("=", 1))
        for path in resolve_field(key, policy):
            info = infos[path]
            try:
                values[path] = coerce(info.field, text, _hints(info.owner))
            except ValueError as exc:
                raise SpaceError(f"--set {item}: {exc}") from None
    try:
        return apply_values(policy, values)
    except (ValueError, TypeError) as exc:
        raise SpaceError(f"--set {' '.join(items)}: {exc}") from None
