"""The study's model as a :class:`~var_core.accel.presets.ModelKey` (family, depth, scale grids) read from the zoo
spec, the testbed card or the fixture's ``config.json`` without loading weights: what a family recipe receives as
``FamilyContext.model`` (issue 31), and the schedule ``ls models`` prints."""

from __future__ import annotations

import json
from pathlib import Path


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def model_schedule(name: str) -> tuple[tuple[int, int], ...] | None:
    """``(h, w)`` of every scale of zoo entry ``name`` (``random:`` stripped), from its spec, the testbed card or the
    fixture's ``config.json``; None when that file is not there."""
    from var_core import zoo

    base = name.removeprefix("random:")
    spec = zoo.ZOO[base]
    sides = None
    if spec.var_config is not None:
        sides = spec.var_config.patch_nums
    elif zoo.is_testbed(base):
        sides = ((_read_json(zoo.testbed_folder(base) / "testbed.json") or {}).get("var_config") or {}).get("patch_nums")
    elif base == "official-tiny":
        config = _read_json(zoo.default_fixture_dir() / "config.json") or {}
        sides = (config.get("build_vae_var_kwargs") or {}).get("patch_nums")
    elif spec.family == "infinity":
        inf = zoo.INFINITY_SPECS[base]
        if inf.config is not None:
            from var_core.models.infinity import scale_schedule

            return tuple(tuple(int(v) for v in hw) for hw in scale_schedule(inf.pn, 1.0, inf.num_scales))
        config = _read_json(zoo.default_infinity_fixture_dir() / "config.json") or {}
        hws = config.get("scale_schedule")
        return tuple((int(s[-2]), int(s[-1])) for s in hws) if hws else None
    elif spec.family == "hart":
        cfg = zoo.HART_SPECS[base].config
        if cfg is not None:
            sides = cfg.patch_nums
        else:
            config = _read_json(zoo.default_hart_fixture_dir() / "config.json") or {}
            sides = (config.get("llm_config") or {}).get("patch_nums")
    return tuple((int(p), int(p)) for p in sides) if sides else None


def study_model_key(model: str | None):
    """The :class:`~var_core.accel.presets.ModelKey` of zoo entry ``model`` from its spec / card, without loading
    it; None when the schedule or depth cannot be read that way (the recipe then gets ``model=None``)."""
    if not model:
        return None
    try:
        from var_core import zoo
        from var_core.accel.presets import ModelKey

        base = model.removeprefix("random:")
        spec = zoo.ZOO[base]
        schedule = model_schedule(model)
        depth = None
        for holder in (spec.var_config, getattr(zoo, "INFINITY_SPECS", {}).get(base),
                       getattr(zoo, "HART_SPECS", {}).get(base)):
            cfg = getattr(holder, "config", holder)
            depth = depth or getattr(cfg, "depth", None)
        if not depth and zoo.is_testbed(base):  # the testbed card / the fixture's config.json
            depth = ((_read_json(zoo.testbed_folder(base) / "testbed.json") or {}).get("var_config") or {}).get("depth")
        elif not depth and base == "official-tiny":
            depth = ((_read_json(zoo.default_fixture_dir() / "config.json") or {}).get("build_vae_var_kwargs")
                     or {}).get("depth")
        if schedule is None or not depth:
            return None
        return ModelKey(str(spec.family), int(depth), tuple(tuple(int(v) for v in hw) for hw in schedule))
    except Exception:  # noqa: BLE001 - a recipe without the key still runs; the runner checks the loaded model
        return None
