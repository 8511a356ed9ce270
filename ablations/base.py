"""Ablation families as recipe functions: each returns the arms of one study, every arm a full PolicyConfig.

A family derives all its arms from one *base* method (a preset) by swapping exactly one component (or one option)
and always includes the ``baseline`` arm (the plain model, the reference of every metric). An arm that cannot be
built here — a component not registered (yet), an option that does not exist — is kept with its ``error`` so
``ls`` and the result table say what is missing instead of silently dropping it; ``validate`` fails on it.

Add a family with::

    @family("name", "one-line description", table="Paper Table N")
    def name(ctx: FamilyContext) -> list[Arm]:
        base = ctx.preset("nova")
        return [baseline_arm(), swap(base, "scorer", "entropy"), ...]

A family may also register an ``analysis`` (``@family(..., analysis=fn)``): a measurement beyond the arms' table
(LD-Pruning's criterion IoU, NOVA's per-layer entropy maps, the γ_k curve) that the study runs after the arms on
a few of its samples, writing under ``<out>/analysis`` for the report's plots.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from var_core import plugins
from var_core.accel.knobs import SearchSpace
from var_core.accel.policy import COMPONENT_KINDS, PolicyConfig, component_config
from var_core.accel.presets import PRESETS, get_preset
from var_core.accel.registry import REGISTRIES

__all__ = ["Arm", "FamilyContext", "FAMILIES", "FamilyInfo", "AnalysisContext", "family", "family_info", "get_family",
           "build_arms", "baseline_arm", "swap", "swap_option", "preset_arm", "component_choices", "knob_alternatives",
           "registered", "run_analysis", "compose"]


@dataclass(frozen=True)
class Arm:
    """One arm of an ablation: a name, the full policy config, and what distinguishes it from the base."""

    name: str
    config: PolicyConfig | None
    description: str = ""
    role: str = "arm"  # "baseline" (plain model, reference), "base" (the family's base method), "arm"
    error: str | None = None  # why the arm cannot be built here (None: it can)
    changes: str = ""  # "scorer: entropy -> attention" etc.

    @property
    def ok(self) -> bool:
        return self.error is None and self.config is not None

    @property
    def config_hash(self) -> str | None:
        return self.config.config_hash() if self.config is not None else None


@dataclass(frozen=True)
class FamilyContext:
    """Options a recipe may read: ``method`` (the base of the ``options`` family) and the study's model —
    ``model`` (a :class:`~var_core.accel.presets.ModelKey`: family, depth, scale grids; None when unknown, e.g.
    ``ls``) and ``model_name`` (the zoo name) — so a recipe can pick per-model values as per-model presets do."""

    method: str = "nova"
    model: Any = None  # var_core.accel.presets.ModelKey | None
    model_name: str | None = None

    def preset(self, name: str) -> PolicyConfig:
        """The preset ``name`` (its generic config: a per-model preset is resolved for the model when a generation
        starts; ``var_core.accel.presets.resolve_config(config, ctx.model)`` gives that setting here)."""
        return get_preset(name)


@dataclass
class AnalysisContext:
    """What a family's analysis receives after its arms ran: the loaded model, the study's sample set and sampling,
    the results folder (the analysis writes under ``out_dir / "analysis"``), its arms and the threads setting."""

    adapter: Any
    conditions: Any  # var_core.eval.lightning.ConditionSet
    sampling: Any
    out_dir: Path
    arms: list[Arm] = dataclasses.field(default_factory=list)
    threads: int | None = None
    max_samples: int = 16  # an analysis generates at most this many of the study's samples (cost bound)
    log: Callable[[str], None] = print

    @property
    def analysis_dir(self) -> Path:
        """``<out>/analysis``, created; never a symbolic link (``var_core.eval.records.make_dirs`` refuses one)."""
        from var_core.eval.records import make_dirs

        return make_dirs(Path(self.out_dir) / "analysis", self.out_dir)


@dataclass(frozen=True)
class FamilyInfo:
    """A family's registration: its recipe, one-line description, the paper table it reproduces and an optional
    analysis (a measurement beyond the arms' table, e.g. LD-Pruning's criterion IoU; run by the study after the
    arms, its files go to ``<out>/analysis`` and the report plots them)."""

    name: str
    recipe: Callable[[FamilyContext], list[Arm]]
    doc: str
    table: str = ""
    analysis: Callable[[AnalysisContext], dict] | None = None
    samples: int = 64  # the CLI's default samples per arm (a family with many arms lowers it to fit the time budget)


FAMILIES: dict[str, tuple[Callable[[FamilyContext], list[Arm]], str]] = {}
FAMILY_INFO: dict[str, FamilyInfo] = {}
FAMILY_MODULES = ("scorer", "activation", "linkage", "cache", "guidance", "extractor", "method", "options", "depth",
                  "criterion", "kv")
NOT_FAMILIES = ("base", "runner", "overrides", "swaps", "probes", "validate", "report", "calibrate", "loadwatch")


def family(name: str, doc: str, *, table: str = "", analysis: Callable[[AnalysisContext], dict] | None = None,
           samples: int = 64):
    """Register a recipe as the family ``name``; ``table`` names the paper table it reproduces ("" = none);
    ``samples`` is the default samples per arm of ``studies.ablate`` for it."""
    def decorator(fn: Callable[[FamilyContext], list[Arm]]):
        if plugins.loading() and not _LOADING_BUILTINS:  # built-ins first: a plugin taking a built-in name fails
            _load_builtin_families()
        plugins.note_registration("family", name, fn.__module__)
        if name in FAMILIES and FAMILIES[name][0] is not fn:
            raise ValueError(f"ablation family {name!r} already defined")
        FAMILIES[name] = (fn, doc)
        FAMILY_INFO[name] = FamilyInfo(name, fn, doc, table, analysis, samples)
        return fn

    return decorator


_LOADING_BUILTINS: list[bool] = []


def _load_all() -> None:
    _load_builtin_families()
    plugins.load_plugins()  # families (and components, presets) of plugins: var_core.plugins


def _load_builtin_families() -> None:
    if _LOADING_BUILTINS:
        return
    _LOADING_BUILTINS.append(True)
    try:
        _import_family_modules()
    finally:
        _LOADING_BUILTINS.clear()


def _import_family_modules() -> None:
    for module in FAMILY_MODULES:
        importlib.import_module(f"ablations.{module}")
    for info in pkgutil.iter_modules([str(Path(__file__).resolve().parent)]):  # families added in new files register too
        if info.name not in FAMILY_MODULES and not info.name.startswith("_") and info.name not in NOT_FAMILIES:
            importlib.import_module(f"ablations.{info.name}")


def family_names() -> list[str]:
    _load_all()
    return list(FAMILIES)


def get_family(name: str) -> tuple[Callable[[FamilyContext], list[Arm]], str]:
    _load_all()
    if name not in FAMILIES:
        close = difflib.get_close_matches(name, list(FAMILIES), n=3, cutoff=0.4)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise KeyError(f"unknown ablation family {name!r}.{hint} Families: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_info(name: str) -> FamilyInfo:
    """The registration of family ``name`` (recipe, description, paper table, analysis)."""
    get_family(name)
    return FAMILY_INFO[name]


def run_analysis(name: str, ctx: AnalysisContext) -> dict:
    """Run family ``name``'s analysis (if it has one) and return what it wrote ({} when it has none). An analysis
    that fails is logged and reported as ``{"error": ...}``: it must never lose the arms' records."""
    info = family_info(name)
    if info.analysis is None:
        return {}
    import torch

    previous = torch.get_num_threads()
    if ctx.threads is not None:
        torch.set_num_threads(ctx.threads)
    try:
        ctx.log(f"analysis of {name!r}: {(info.analysis.__doc__ or '').strip().splitlines()[0]}")
        return info.analysis(ctx) or {}
    except Exception as exc:  # noqa: BLE001 - reported, the arms stand without it
        ctx.log(f"analysis of {name!r} failed: {type(exc).__name__}: {exc}")
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        torch.set_num_threads(previous)


def build_arms(name: str, ctx: FamilyContext | None = None) -> list[Arm]:
    """The arms of a family, baseline first, duplicates (same config hash) merged into the first."""
    fn, _ = get_family(name)
    arms = fn(ctx or FamilyContext())
    return dedupe(arms)


def dedupe(arms: list[Arm]) -> list[Arm]:
    out: list[Arm] = []
    seen: dict[str, int] = {}
    names: set[str] = set()
    for arm in arms:
        if arm.name in names:
            raise ValueError(f"two arms are named {arm.name!r}")
        names.add(arm.name)
        key = arm.config_hash if arm.ok else None
        if key is not None and key in seen:
            first = out[seen[key]]
            out[seen[key]] = dataclasses.replace(first, description=(first.description + f" (= {arm.name})").strip())
            continue
        if key is not None:
            seen[key] = len(out)
        out.append(arm)
    baseline = [a for a in out if a.role == "baseline"]
    if len(baseline) != 1:
        raise ValueError(f"a family needs exactly one baseline arm, got {len(baseline)}")
    return baseline + [a for a in out if a.role != "baseline"]


# ----- recipe helpers --------------------------------------------------------------------------------------
def registered(kind: str, name: str) -> bool:
    return name in REGISTRIES[kind].names()


def baseline_arm() -> Arm:
    return Arm("baseline", get_preset("baseline"), "the plain model: no pruning, full guidance (reference)",
               role="baseline")


def _failed(name: str, exc: BaseException, description: str, changes: str = "") -> Arm:
    return Arm(name, None, description, error=f"{type(exc).__name__}: {exc}", changes=changes)


def preset_arm(name: str, *, arm_name: str | None = None, role: str = "arm") -> Arm:
    """A preset as an arm (its first docstring line as the description)."""
    from var_core.accel.presets import preset_summary

    label = arm_name or name
    try:
        doc = preset_summary(name) if name in PRESETS else ""
        return Arm(label, get_preset(name), doc, role=role, changes=f"method: {name}")
    except Exception as exc:  # noqa: BLE001 - reported per arm
        return _failed(label, exc, f"preset {name}")


def _base_or_error(base: PolicyConfig | Callable[[], PolicyConfig] | str):
    try:
        if isinstance(base, str):
            return get_preset(base), None
        return (base() if callable(base) else base), None
    except Exception as exc:  # noqa: BLE001
        return None, exc


def swap(base: PolicyConfig | str, kind: str, name: str, *, arm_name: str | None = None, role: str = "arm",
         description: str = "", **params) -> Arm:
    """``base`` with its ``kind`` component replaced by the registered component ``name`` (with ``params``)."""
    label = arm_name or (f"{kind}={name}" + "".join(f",{k}={_fmt(v)}" for k, v in params.items()))
    config, exc = _base_or_error(base)
    base_label = base if isinstance(base, str) else getattr(config, "name", "base")
    if config is None:
        return _failed(label, exc, description, f"{kind} -> {name}")
    old = getattr(config, kind).component_name
    changes = f"{kind}: {old} -> {name}" + (f" ({', '.join(f'{k}={_fmt(v)}' for k, v in params.items())})"
                                            if params else "")
    try:
        new = config.replace_component(kind, name, **params)
        if new.config_hash() == config.config_hash():
            changes = f"none: {base_label} itself"
            new = dataclasses.replace(new, name=config.name)
        else:
            new = dataclasses.replace(new, name=f"{config.name}/{label}")
    except Exception as exc:  # noqa: BLE001
        return _failed(label, exc, description, changes)
    if not description:
        description = (f"{base_label} (the base method; {kind} {name})" if changes.startswith("none:")
                       else f"{base_label} with {changes}")
    return Arm(label, new, description, role=role, changes=changes)


def swap_option(base: PolicyConfig | str, kind: str, option: str, value: Any, *, arm_name: str | None = None,
                role: str = "arm", description: str = "") -> Arm:
    """``base`` with one option of its ``kind`` component (or a policy-level option, ``kind="policy"``) set."""
    label = arm_name or (f"{kind}.{option}={_fmt(value)}" if kind != "policy" else f"{option}={_fmt(value)}")
    config, exc = _base_or_error(base)
    if config is None:
        return _failed(label, exc, description)
    try:
        if kind == "policy":
            old = getattr(config, option)
            new = dataclasses.replace(config, **{option: value})
            changes = f"{option}: {_fmt(old)} -> {_fmt(value)}"
        else:
            part = getattr(config, kind)
            if option not in {f.name for f in dataclasses.fields(part)}:
                raise ValueError(f"{kind} {part.component_name!r} has no option {option!r}")
            old = getattr(part, option)
            new = dataclasses.replace(config, **{kind: dataclasses.replace(part, **{option: value})})
            changes = f"{kind}.{option}: {_fmt(old)} -> {_fmt(value)}"
        new = dataclasses.replace(new, name=f"{config.name}/{label}")
    except Exception as exc:  # noqa: BLE001
        return _failed(label, exc, description)
    base_label = base if isinstance(base, str) else config.name
    return Arm(label, new, description or f"{base_label} with {changes}", role=role, changes=changes)


Edit = tuple  # (kind, component name or None, {option: value})


def compose(base: PolicyConfig | str, arm_name: str, *edits: Edit, role: str = "arm", description: str = "") -> Arm:
    """``base`` with several edits applied in order, as one arm (for arms that change more than one thing, e.g. a
    scorer at another pruning level). Each edit is ``(kind, component, params)``: a registered ``component`` name
    replaces the ``kind`` component (built with ``params``); ``None`` sets ``params`` as options of the current
    ``kind`` component; ``kind="policy"`` sets policy-level fields (``component`` None). An edit that cannot be
    applied (unregistered component, unknown option, value out of range) makes the arm unavailable, with why."""
    config, exc = _base_or_error(base)
    if config is None:
        return _failed(arm_name, exc, description)
    base_label = base if isinstance(base, str) else config.name
    steps: list[str] = []
    try:
        for kind, component, params in edits:
            params = dict(params or {})
            if kind == "policy":
                olds = {k: getattr(config, k) for k in params}
                config = dataclasses.replace(config, **params)
                steps += [f"{k}: {_fmt(olds[k])} -> {_fmt(v)}" for k, v in params.items()]
            elif component is not None:
                old = getattr(config, kind).component_name
                config = config.replace_component(kind, component, **params)
                steps.append(f"{kind}: {old} -> {component}" + (
                    f" ({', '.join(f'{k}={_fmt(v)}' for k, v in params.items())})" if params else ""))
            else:
                part = getattr(config, kind)
                known = {f.name for f in dataclasses.fields(part)}
                unknown = sorted(set(params) - known)
                if unknown:
                    raise ValueError(f"{kind} {part.component_name!r} has no option(s) {unknown}; its options are "
                                     f"{sorted(known - {'component_name'})}")
                olds = {k: getattr(part, k) for k in params}
                config = dataclasses.replace(config, **{kind: dataclasses.replace(part, **params)})
                steps += [f"{kind}.{k}: {_fmt(olds[k])} -> {_fmt(v)}" for k, v in params.items()]
    except Exception as exc:  # noqa: BLE001 - reported per arm
        return _failed(arm_name, exc, description, "; ".join(steps))
    changes = "; ".join(steps) if steps else f"none: {base_label} itself"
    config = dataclasses.replace(config, name=f"{base_label}/{arm_name}" if steps else config.name)
    return Arm(arm_name, config, description or f"{base_label} with {changes}", role=role, changes=changes)


def _fmt(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_fmt(v) for v in value) + ")"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def knob_alternatives(config_field: dataclasses.Field) -> tuple | None:
    """The values a knob can take when enumerable: its ``choices``, else a categorical search space's."""
    choices = config_field.metadata.get("choices")
    if choices:
        return tuple(choices)
    search: SearchSpace | None = config_field.metadata.get("search")
    if search is not None and search.kind == "categorical" and search.choices:
        return tuple(search.choices)
    return None


def component_choices(kind: str, name: str, option: str) -> tuple | None:
    cls = REGISTRIES[kind].get(name)
    for f in dataclasses.fields(cls.Config):
        if f.name == option:
            return knob_alternatives(f)
    return None


def component_kinds() -> tuple[str, ...]:
    return COMPONENT_KINDS


def safe_component_config(kind: str, name: str, **params):
    try:
        return component_config(kind, name, **params)
    except Exception:  # noqa: BLE001
        return None
