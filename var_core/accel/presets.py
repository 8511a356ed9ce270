"""Method presets: functions returning a complete :class:`PolicyConfig` for each published method.

Each preset composes registered components with the paper's defaults (see specs/methods.md). Where a paper's
setting is tied to Infinity-1024's 13-scale schedule, the preset maps it onto the model at hand by position from
the end of the schedule (documented per preset). What a preset leaves out of the original method is stated in
its docstring — a preset never pretends to be more than it is.

**Per-model presets.** Some authors published a setting per model family (FastVAR: one for Infinity, one for
HART, none for VAR). Such a preset is declared ``@preset(name, per_model=True)`` and takes ``model`` (a
:class:`ModelKey`: family, depth, scale grids; ``None`` = the generic config). ``get_preset(name)`` returns the
generic config, marked ``per_model=name``; when a generation starts (``AccelPolicy.start``, also
``check_model``) :func:`resolve_config` replaces it by the preset's config for the model in hand. Values changed
from the generic config (``--set``, sweeps, ablation swaps) are kept over the per-model setting, knob by knob.
Runners record the resolved config, so a record's ``config_hash`` names what ran; :func:`resolved_settings`
describes each family's setting (``python -m studies.ablate ls``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from .. import plugins
from ..errors import UserError, did_you_mean
from .policy import COMPONENT_KINDS, PolicyConfig, component_config, set_per_model_resolver


class UnknownPresetError(UserError, KeyError):
    """An unknown preset name (a user error, exit 2 on the command line; still a KeyError for old callers)."""


PRESETS: dict[str, Callable[..., PolicyConfig]] = {}
PER_MODEL: set[str] = set()  # presets whose setting depends on the model (they take ``model=``)
# presets that are another reading of a method (ours, or a third party's code), not its authors' setting: listed by
# ``ls presets`` and compared with the method in the ``options`` family, but not arms of the ``method`` family
OTHER_READINGS: dict[str, str] = {
    "stagevar_sampled": "stagevar",  # our earlier reading (sampled tokens, flat 50 %, every scale generated)
    "skipvar_static": "skipvar",  # one branch of the released per-sample decision, for every sample
    "sparsevar_lvar": "sparsevar",  # the third-party code (Weepingchestnut/Lvar) against our reconstruction
}


@dataclass(frozen=True)
class ModelKey:
    """What a per-model preset may read of the model in hand: family, depth and the scales' token grids."""

    family: str
    num_blocks: int
    scale_hw: tuple[tuple[int, int], ...]

    @staticmethod
    def from_info(info) -> "ModelKey":
        """From a :class:`~var_core.engine.context.GenerationInfo` (or anything with the same three fields)."""
        return ModelKey(str(info.family), int(info.num_blocks), tuple(tuple(int(v) for v in hw)
                                                                     for hw in info.scale_hw))


INFINITY_1M = ((1, 1), (2, 2), (4, 4), (6, 6), (8, 8), (12, 12), (16, 16), (20, 20), (24, 24), (32, 32), (40, 40),
               (48, 48), (64, 64))
# the model each family's setting is described on (``resolved_settings``; the setting itself reads the real model)
REFERENCE_MODELS: dict[str, tuple[str, ModelKey]] = {
    "var": ("VAR-d16, 256 px, 10 scales", ModelKey("var", 16, tuple((p, p) for p in (1, 2, 3, 4, 5, 6, 8, 10, 13,
                                                                                     16)))),
    "infinity": ("Infinity-2B, 1024 px, 13 scales", ModelKey("infinity", 32, INFINITY_1M)),
    "hart": ("HART-0.7B, 1024 px, 14 scales", ModelKey("hart", 24, tuple((p, p) for p in (
        1, 2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64)))),
}


def preset(name: str, *, per_model: bool = False):
    """Register a preset function. ``per_model=True``: it takes ``model: ModelKey | None`` (None = the generic
    config) and its configs are marked ``per_model=name``, so they are resolved for the model at start."""

    def decorator(fn: Callable[..., PolicyConfig]) -> Callable[..., PolicyConfig]:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} already defined")
        plugins.note_registration("preset", name, fn.__module__)
        if not per_model:
            PRESETS[name] = fn
            return fn

        @functools.wraps(fn)
        def marked(*args, **kwargs) -> PolicyConfig:
            return dataclasses.replace(fn(*args, **kwargs), per_model=name)

        PRESETS[name] = marked
        PER_MODEL.add(name)
        return marked

    return decorator


def _unknown_preset(name: str) -> UnknownPresetError:
    return UnknownPresetError(f"unknown preset {name!r}.{did_you_mean(name, PRESETS)} "
                              f"Presets: {', '.join(sorted(PRESETS))}")


def get_preset(name: str, **overrides) -> PolicyConfig:
    if name not in PRESETS or plugins.pending():
        plugins.load_plugins()  # a preset of a plugin (var_core.plugins)
    if name not in PRESETS:
        raise _unknown_preset(name)
    return PRESETS[name](**overrides)


def preset_summary(name: str) -> str:
    doc = (PRESETS[name].__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def _changed(config, generic, target):
    """``target`` with every knob where ``config`` differs from ``generic`` set to ``config``'s value (a component
    whose name differs from the generic one is taken from ``config`` whole)."""
    if config == generic:
        return target
    if type(config) is not type(generic) or type(target) is not type(generic):
        return config
    changes = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
               if getattr(config, f.name) != getattr(generic, f.name)}
    return dataclasses.replace(target, **changes)


def resolve_config(config: PolicyConfig, model) -> PolicyConfig:
    """The config that runs on ``model`` (a :class:`ModelKey` or a ``GenerationInfo``).

    ``config.per_model`` empty: ``config`` itself. Otherwise the named preset's config for the model, with every
    value in which ``config`` differs from that preset's generic config kept (component knobs one by one; a
    swapped component whole; the ``name`` label always), and ``per_model`` cleared: the result is concrete, so
    resolving it again changes nothing and its hash is what runs. Caveat: a value set *equal* to the generic one
    cannot be told from an untouched one, so the per-model value wins there (e.g. ``restorer.cache_scale=-3`` on
    ``fastvar``, whose Infinity setting caches at the 24×24 scale); to set such a value, resolve first and change
    the resolved config. Raises ``ValueError`` (with the fix) when the preset has no setting for the model.
    """
    name = config.per_model
    if not name:
        return config
    if name not in PER_MODEL:
        raise _unknown_preset(name) if name not in PRESETS else UserError(
            f"per_model={name!r}: preset {name!r} has one setting for every model; set per_model to one of "
            f"{', '.join(sorted(PER_MODEL))} or to '' (run as given)")
    key = model if isinstance(model, ModelKey) else ModelKey.from_info(model)
    generic, target = PRESETS[name](), PRESETS[name](model=key)
    fields = {}
    for f in dataclasses.fields(PolicyConfig):
        mine, base, theirs = getattr(config, f.name), getattr(generic, f.name), getattr(target, f.name)
        if f.name == "name":
            fields[f.name] = mine
        elif f.name in COMPONENT_KINDS:
            fields[f.name] = _changed(mine, base, theirs)
        else:
            fields[f.name] = mine if mine != base else theirs
    fields["per_model"] = ""
    return PolicyConfig(**fields)


def describe_config(config: PolicyConfig) -> str:
    """One line: every acting component with all its knobs, then the policy options that differ from
    :class:`PolicyConfig`'s defaults (``name`` and ``per_model`` left out). Components that do nothing are left
    out: ``none`` / ``full`` / ``dense`` / ``keep_all`` ones, and scorer, schedule and restorer under the ``never`` activation."""
    inert = {"skip": ("none",), "guidance": ("full",), "activation": ("never",), "attention": ("dense",),
             "kv": ("keep_all",)}
    never = config.activation.component_name == "never"
    parts = []
    for kind in COMPONENT_KINDS:
        cfg = getattr(config, kind)
        if cfg.component_name in inert.get(kind, ()) or (never and kind in ("scorer", "schedule", "restorer")):
            continue
        knobs = [f"{f.name}={_text(getattr(cfg, f.name))}" for f in dataclasses.fields(cfg)]
        parts.append(f"{kind}={cfg.component_name}" + (f"({', '.join(knobs)})" if knobs else ""))
    plain = PolicyConfig()
    for f in dataclasses.fields(PolicyConfig):
        if f.name in COMPONENT_KINDS or f.name in ("name", "per_model"):
            continue
        if getattr(config, f.name) != getattr(plain, f.name):
            parts.append(f"{f.name}={_text(getattr(config, f.name))}")
    return "; ".join(parts) if parts else "the plain model"


def _text(value) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_text(v) for v in value) + ")"
    return f"{value:g}" if isinstance(value, float) else str(value)


def resolved_settings(name: str) -> dict[str, str]:
    """Family → what preset ``name`` runs on that family's reference model (``REFERENCE_MODELS``), one line each:
    ``"<reference model>: <describe_config>"``, or ``"not available: <why>"``. A preset with one setting for
    every model gives the same description for each family."""
    config = get_preset(name)
    out = {}
    for family, (label, key) in REFERENCE_MODELS.items():
        try:
            out[family] = f"{label}: {describe_config(resolve_config(config, key))}"
        except ValueError as exc:
            out[family] = f"not available: {exc}"
    return out


def _c(kind: str, name: str, **params):
    return component_config(kind, name, **params)


@preset("baseline")
def baseline() -> PolicyConfig:
    """The plain model: no pruning, full classifier-free guidance (every arm's reference)."""
    return PolicyConfig(name="baseline")


@preset("nova")
def nova() -> PolicyConfig:
    """NOVA: entropy-inflection activation, dual-linkage ratios, predictive-entropy top-k, residual cache reuse.

    Defaults t_est=5, α=0.5, τ=0.8, λ=0.1 (paper §4.1). As the authors ran it where the paper says so: tokens are
    ranked by the entropy of the predictive distribution already produced (errata 5, NOVA's O(N_t·|V|) cost model:
    the previous scale's sampled distribution, upsampled — scorer ``source="predictive"``), the activation uses the
    spec's signed test ``δ_t < α·ḡ`` per sample. Ours (RECONSTRUCTED, component docstrings): the layer linkage reads
    the logit lens entering each block (one head projection per block at pruned scales; a fixed per-block profile
    instead: ``--set schedule.layer_profile=...``, measured with ``_linkage_math.measure_layer_profile``); every
    other wiring choice keeps its component default. Batch activation is per sample (NOVA Table 9 runs batch 5
    without saying how a batch decides: ``activation.scope``). On a codebook VAR the per-token entropy falls with
    scale and the signed test rarely fires: ``--set activation.growth_test=magnitude`` detects the flattening.

    Execution, not method: ``count_sync='bounded'`` — the per-block counts stay on the device and each row of a
    pruned block runs its bound ``ceil((1 − sigmoid(logit(r_t) − λ_l))·N) + 1`` of tokens (rows packed), the slots
    past the count masked (no host read inside a scale: 1.1 / 2.7 syncs per scale at batch 1 / 8 on the testbed
    instead of 3.4 / 4.6; the same tokens; the padding runs, +0.02 of the dense FLOPs). ``--set
    count_sync=per_block`` reads each block's count for exact shapes (``python -m profilers.bounded_counts``).
    """
    return PolicyConfig(
        name="nova",
        scorer=_c("scorer", "entropy", source="predictive"),
        activation=_c("activation", "entropy_inflection", growth_test="signed", scope="sample"),
        schedule=_c("schedule", "dual_linkage"),
        restorer=_c("restorer", "residual_reuse"),
        cfg_rows="shared",
        granularity="block",
        count_sync="bounded",
    )


def _fastvar_machinery(**fields) -> PolicyConfig:
    """FastVAR's PTS + CTR: distance-to-mean scores re-selected before every sub-layer, per network row."""
    return PolicyConfig(name="fastvar", scorer=_c("scorer", "mse", mode="mean_distance"), cfg_rows="per_row",
                        granularity="branch", **fields)


# FastVAR's released (width → removal ratio) tables; 1.0 = the scale is not generated
FASTVAR_TABLES = {"infinity": ((32, 40, 48, 64), (0.4, 0.5, 1.0, 1.0)), "hart": ((48, 64), (0.5, 0.75))}
FASTVAR_CACHE_GRID = {"infinity": (24, 24), "hart": (36, 36)}  # cached_size / cache_scale_step of the code


def _cache_scale(scale_hw, grid: tuple[int, int], widths: tuple[int, ...]) -> int:
    """Index of the scale with the token grid ``grid`` (the released code caches there). A schedule without it
    (not one the code was written for): the scale before the first tabulated width, FastVAR's K−N rule (ours)."""
    for si, hw in enumerate(scale_hw):
        if tuple(hw) == tuple(grid):
            return si
    first = next((si for si, hw in enumerate(scale_hw) if hw[1] in widths), len(scale_hw))
    return max(first - 1, 0)


def _fastvar_released(model: ModelKey, widths: tuple[int, ...], ratios: tuple[float, ...]) -> PolicyConfig:
    """FastVAR's released code for ``model.family`` (``infinity`` or ``hart``) with a width-keyed table.

    Infinity (csguoh/FastVAR ``Infinity/``, errata 7): blocks 3..27 only (absolute indices), the 24×24 cache,
    scores ranked raw (the code's argsort). HART (``HART/``, specs/hart.md §9.1): every block, both sub-layers,
    the 36×36 cache, no scale skipped. The cache scale is an index of ``model``'s schedule (a sweep of
    ``restorer.cache_scale`` then changes it, as it should).
    """
    cache = _cache_scale(model.scale_hw, FASTVAR_CACHE_GRID[model.family], widths)
    released = dict(activation=_c("activation", "fixed", start_scale=0),  # the width table decides where
                    schedule=_c("schedule", "fixed_table", widths=widths, ratios=ratios),
                    restorer=_c("restorer", "static_cache", cache_scale=cache), rank_bits=0)
    if model.family == "infinity":
        return _fastvar_machinery(exempt_first_blocks=3, pruned_blocks_end=28, **released)
    return _fastvar_machinery(**released)


@preset("fastvar", per_model=True)
def fastvar(model: ModelKey | None = None) -> PolicyConfig:
    """FastVAR: distance-to-mean token selection before every sub-layer, fixed ratios on the last scales, cached
    sub-layer outputs of an earlier scale (area-upsampled); the released code's setting per family.

    Knob that matters: ``schedule.ratios`` (the removal ratio per tabulated width; 1.0 = not generated).

    * **Infinity** = the released code, bit for bit (tested against its goldens, errata 7): ratios keyed on the
      token map's width, 32 → 0.4 and 40 → 0.5 removed; widths 48 and 64 are not generated (ratio 1.0; the image
      is decoded from the codes summed up to the 40 scale); blocks 3 ≤ l < 28 only (``exempt_first_blocks=3``,
      ``pruned_blocks_end=28``, absolute, whatever the depth); branch outputs cached at the 24×24 scale; raw scores
      ranked (``rank_bits=0``, the code's argsort: the fixture's goldens match with 0 and with the default 16,
      whose grid could move the cut where kept and removed scores are closer than 2^-16 of the row's largest;
      0 gives up the grid's batch-size invariance for near-ties). A schedule with none of these widths (below
      512 px) is not accelerated, as with the released code; one without a 24×24 scale caches at the scale before
      the first tabulated width (ours: the code assumes 24×24).
    * **HART** = the released HART port (specs/hart.md §9.1): 48 → 0.5 and 64 → 0.75 removed, every block, the
      36×36 cache, nothing skipped (``var_core.models.hart.FASTVAR_HART_SETTING``).
    * **VAR** (and any other family): FastVAR publishes no VAR setting. Our mapping (a choice of ours; the
      alternatives are ``--set`` away, e.g. ``skip.count`` with ``skip=skip_last``): the last two scales pruned
      by 0.4 / 0.5, cache at the scale before them (−3), every block, none skipped (skipping the last two VAR
      scales would drop 62 % of a 256-px image's tokens; the ``skip`` ablation covers it). This is also the
      generic config ``get_preset("fastvar")`` returns before a model is known.
    """
    if model is not None and model.family in FASTVAR_TABLES:
        return _fastvar_released(model, *FASTVAR_TABLES[model.family])
    return _fastvar_machinery(
        activation=_c("activation", "fixed", start_scale=-2),
        schedule=_c("schedule", "fixed_table", ratios=(0.4, 0.5)),
        restorer=_c("restorer", "static_cache", cache_scale=-3),
    )


@preset("fastvar_toprovar", per_model=True)
def fastvar_toprovar(model: ModelKey | None = None) -> PolicyConfig:
    """FastVAR as ToProVAR re-ran it (ToProVAR Table 8): 32 → 0.4, 40 → 0.6, widths 48 and 64 not generated.

    Table 8 gives Infinity-2B {10: 0.4; 11: 0.6} and Infinity-8B {10: 0.4; 11: 0.6; 12: 1.0; 13: 1.0}, 1-indexed
    scales of the 13-scale 1024-px schedule (10 = 32×32 … 13 = 64×64). **ToProVAR's "11 scales"** (Table 7:
    Infinity-2B 11 scales / 32 layers, Infinity-8B 13 / 40), the reading shared with the ``toprovar`` preset,
    RECONSTRUCTED: the accelerated Infinity-2B runs generate the 1024-px schedule up to 40×40 (11 scales; widths 48
    and 64 not generated, as FastVAR's released 2B code skips them in its scale loop) while the dense Infinity-2B
    reference (the model's own rows of Tables 1–3 and 10) runs all 13: FastVAR's reported 2.6× (Table 1) is out of
    reach if 48 and 64 are generated (FLOPs-ideal 1.14× on Infinity-2B, docs/benchmarks.md). The 8B runs 13 scales
    and its FastVAR row leaves 12 and 13 out explicitly. So both rows give the same config here; the literal 2B
    row is ``--set schedule.ratios=0.4,0.6,0,0`` (48 and 64 dense). Everything else is ``fastvar``'s Infinity
    setting: the 24×24 cache, raw ranking, blocks 3..27 — on the 40-block 8B too, as the released window is
    absolute (RECONSTRUCTED: ToProVAR does not say; ``--set pruned_blocks_end=none --set exempt_last_blocks=4``
    exempts the 8B's last 4 instead, the depth-relative reading). On HART, FastVAR's released HART setting
    (ToProVAR Table 9 re-ran it; Table 8 has no HART row); not available on other families.
    """
    model = model or REFERENCE_MODELS["infinity"][1]
    if model.family == "infinity":
        return dataclasses.replace(_fastvar_released(model, (32, 40, 48, 64), (0.4, 0.6, 1.0, 1.0)),
                                   name="fastvar_toprovar")
    if model.family == "hart":
        return dataclasses.replace(_fastvar_released(model, *FASTVAR_TABLES["hart"]), name="fastvar_toprovar")
    raise ValueError(f"ToProVAR's FastVAR settings (Table 8) are for Infinity (and FastVAR's own for HART), not "
                     f"for family {model.family!r}: use the preset 'fastvar' there")


@preset("ldpruning")
def ldpruning() -> PolicyConfig:
    """LD-Pruning: Haar high-frequency energy of the previous residual map (LHEP), keep ρ=0.5 of the energy,
    pruned positions get no new residual (sparse residual tokens), stop the unconditional branch adaptively (SATS,
    δ=0.15).

    As the paper ran it on Infinity-1024 (§6.1, errata 1–4), mapped by position from the end on other schedules:
    LHEP prunes the last 3 scales (10–12 of 13: 40, 48, 64), measured on the previous residual's own grid; sparse
    inference on the kept inputs yields *sparse residual tokens* (§5.3: pruned positions receive no new residual
    at that scale, the ``sparse_residual`` restorer; FastVAR-style cache restoration is the alternative:
    ``get_preset("ldpruning").replace_component("restorer", "static_cache", cache_scale=-4, refresh="latest")``); SATS may drop the unconditional branch on the last 4 (9–12; guidance
    ``scales`` option for the other reading). Not the paper's: a 5 % minimum keep
    (``schedule.min_keep_fraction``, a guard of ours); γ_k's formula, the aggregation window and the energy-map
    resize are RECONSTRUCTED (component docstrings).
    """
    return PolicyConfig(
        name="ldpruning",
        scorer=_c("scorer", "lhep", extractor="haar", grid="native"),
        activation=_c("activation", "fixed", start_scale=-3),
        schedule=_c("schedule", "energy_fraction"),
        restorer=_c("restorer", "sparse_residual"),
        guidance=_c("guidance", "sats", min_scale=-4),
        cfg_rows="shared",
        granularity="block",
    )


@preset("ldpruning_skip")
def ldpruning_skip() -> PolicyConfig:
    """LD-Pruning in its FastVAR-fair setting: ``ldpruning`` with the last two scales skipped (11–12 of 13).

    FOUND(paper §6.1, errata 4): "when comparing with FastVAR, we use the same setting by skipping scales 11 to
    12". So LHEP prunes only scale 10 (−3) and SATS can act at 9 and 10; the image is decoded from the latent
    summed up to scale 10. Leaves out what ``ldpruning`` leaves out.
    """
    import dataclasses

    base = ldpruning()
    return dataclasses.replace(base, name="ldpruning_skip", skip=_c("skip", "skip_last", count=2))


# ToProVAR Table 7: the Infinity depth whose runs generate 11 scales (the 2B's 32 blocks), and the widths they leave out
TOPROVAR_11_SCALE_BLOCKS = 32
TOPROVAR_SKIPPED_WIDTHS = (48, 64)


@preset("toprovar", per_model=True)
def toprovar(model: ModelKey | None = None) -> PolicyConfig:
    """ToProVAR: attention-entropy pruning depth D (τ=0.4), Global/Detail layers by SVD per scale, entropy token
    gate in Detail layers with the appendix safety fallbacks; pruned tokens pass through (identity).

    As the paper describes it: D = the first scale whose share of below-mean attention-entropy tokens is ≤ τ
    (appendix reading of Eq. 3; never crossing → no pruning); layers re-classified at every scale from s_rep on
    (errata 9, Fig. 4(b)); φ(s) = s/S_max with S_max = the model's scale count (``schedule.s_max``); the
    fallbacks: an ambiguous layer (R within 0.05 of the threshold) runs dense, and every cell of a 4×4 grid keeps
    ≥ 10 % of its tokens (the gate floors the count, the scorer ranks each cell's quota first; both values ours,
    the paper gives none). Not the paper's: β, α_min, α_max and the threshold are uncalibrated (not published),
    Ĥ is max-normalised (the printed H/ΣH collapses the gate), the gate's entropies come from the previous scale,
    and the depth test is taken on block 0's attention at the end of the scale (pruning from the next one). The
    adaptive scale-depth exit of ToProVAR Table 10 is the ``depth_exit`` skip, not part of this preset.

    **ToProVAR's "11 scales"** (Table 7: Infinity-2B 11 scales / 32 layers, Infinity-8B 13 / 40), the reading
    shared with ``fastvar_toprovar``, RECONSTRUCTED: on Infinity-2B the accelerated runs generate the 1024-px
    schedule up to 40×40 — widths 48 and 64 are not generated (``skip_widths``, FastVAR's released 2B scale loop)
    and φ(s) = s/11 (``schedule.s_max=11``, the generated scales) — while the dense reference runs all 13. Per
    model: an Infinity with 32 blocks (the 2B) gets that setting (on a schedule without 48 / 64 nothing is left out
    and S_max = its scale count); the 40-block 8B runs its 13 scales with S_max = 13; VAR, HART and the generic
    config keep every scale with S_max = the model's scale count (``s_max=0``).
    """
    config = PolicyConfig(
        name="toprovar",
        scorer=_c("scorer", "attention", min_region_keep=0.1, regions=4),
        activation=_c("activation", "low_entropy_ratio"),
        schedule=_c("schedule", "toprovar_gate", layer_classes="per_scale", ambiguity_margin=0.05,
                    min_region_keep=0.1, regions=4, s_max=0),
        restorer=_c("restorer", "identity"),
        cfg_rows="shared",
        granularity="block",
    )
    if model is None or model.family != "infinity" or model.num_blocks != TOPROVAR_11_SCALE_BLOCKS:
        return config
    skipped = tuple(w for w in TOPROVAR_SKIPPED_WIDTHS if any(hw[1] == w for hw in model.scale_hw))
    if not skipped:
        return config
    generated = sum(hw[1] not in skipped for hw in model.scale_hw)
    return dataclasses.replace(config, skip=_c("skip", "skip_widths", widths=skipped),
                               schedule=dataclasses.replace(config.schedule, s_max=generated))


@preset("sparsevar")
def sparsevar() -> PolicyConfig:
    """SparseVAR: tokens whose block input/output changed least at the previous scale are excluded from the last
    scales, except a regular grid of anchors from which they are recovered (code unreleased: reconstructed)."""
    return PolicyConfig(
        name="sparsevar",
        scorer=_c("scorer", "mse", mode="block_change"),
        activation=_c("activation", "fixed", start_scale=-2),
        schedule=_c("schedule", "fixed_table", ratios=(0.5, 0.5)),
        restorer=_c("restorer", "anchors"),
        cfg_rows="shared",
        granularity="block",
    )


LVAR_CHUNK_DEPTH = (3, 8)  # the third-party code's specific_mse_layer=3: block chunk 3 of Infinity's 8


@preset("sparsevar_lvar", per_model=True)
def sparsevar_lvar(model: ModelKey | None = None) -> PolicyConfig:
    """SparseVAR as a third-party implementation runs it (Weepingchestnut/Lvar; the authors' code is unreleased).

    Third-party, not the authors': the public repository ``Weepingchestnut/Lvar``, folder ``models/sparsevar/``.
    On the last 3 scales it computes an adaptive share of tokens (those above 0.6 of the largest block-chunk MSE);
    anchors recover the others' final hidden states where the previous scale's logits are cosine-similar.

    Read by hand from ``sparsevar_model.py`` (``autoregressive_infer_cfg``, ``lf_anchor``, ``map_to_best_corner``,
    ``generate_anchors_from_flat``) of that repository; each piece is a generic component option:

    * from scale 10 of Infinity-1024's 13 on (``start_prune_stage=10``: 40, 48, 64) = the last 3 scales
      (``fixed``, ``start_scale=-3``); every block of those scales runs on the kept tokens at their own positions;
    * score: the MSE across **block chunk 3** (``specific_mse_layer=3``: blocks 12–15 of Infinity-2B's 8 chunks)
      at the previous computed scale, mean over the channels, averaged over the two CFG halves, resized with
      ``'nearest'`` (``mse`` ``block_change``, ``span='chunk'``, ``cfg_halves='mean'``, ``upsample='nearest'``);
      at a pruned scale the excluded tokens' MSE is 0 (they never move);
    * count: ``int(N · share)`` with ``share`` the fraction of the previous scale's cells whose MSE / max exceeds
      0.6 (``compress_ratio``), the tokens kept by rank (``score_threshold``, ``share_grid='previous'``);
    * anchors: stride 4 plus the last row and column, appended whenever ``4 % width != 0`` (``anchors``,
      ``grid='with_last'``); at batch 1 they are **not** forced into the kept set (the code merges them only for
      B > 1: ``forced=False``);
    * recovery (``recovery='most_similar'``, ``target='final'``): after the last block, an excluded token whose
      4 nearest anchors include one with cosine similarity > 0.8 (the ``beta`` of ``lf_anchor``; the
      ``beta=0.99`` argument of ``autoregressive_infer_cfg`` is never passed on) takes that anchor's final hidden
      state. The similarity is **not** between hidden states: it is between the previous scale's guided logits,
      resized to this grid with ``'nearest'``. An anchor the scorer dropped lends its input. An excluded token
      with no such anchor keeps its input as its final state and its codes are zeroed (no residual this scale).

    Ours, not the code's: its batch rules (one MSE maximum and the largest share over the batch; anchors merged
    into the kept set and cut to the batch's smallest union; the code zeroes codes through a ``view(1, 32, -1)``
    that assumes B = 1) — here every sample follows the batch-1 rule on its own; ties (equal MSE ranks, equally
    distant anchors) go to the lower position / earlier grid anchor where the code leaves them to ``torch.sort``;
    scores are ranked on the policy's 2^-16 grid (``rank_bits``). Per model: the chunk is the one holding block
    ⌊3L/8⌋ of the model's own chunks (Infinity's ``block_chunks``; L/8 groups elsewhere): chunk 3 of 8 on
    Infinity-2B/8B, chunk 0 of 2 on the tiny Infinity (blocks 0–1), block 3 on the 8-block testbed, blocks 6–7 on
    VAR-d16, 9–11 on HART-0.7B. On VAR and HART (not the code's models) the same rule runs on their last 3 scales
    (VAR-d16: 10, 13, 16; HART: 36, 48, 64) with their guided logits (4096-way) as the similarity features; on a
    schedule of 5 scales (the tiny Infinity: 4, 6, 8 wide) it prunes scales 2–4, where the 4-wide grid has the
    single anchor (0, 0) (``4 % 4 == 0`` appends no last line). Today's reconstruction is the preset ``sparsevar``.
    """
    num_blocks = 32 if model is None else model.num_blocks  # the generic config is Infinity-2B's setting
    block = LVAR_CHUNK_DEPTH[0] * num_blocks // LVAR_CHUNK_DEPTH[1]
    return PolicyConfig(
        name="sparsevar_lvar",
        scorer=_c("scorer", "mse", mode="block_change", span="chunk", block=block, cfg_halves="mean",
                  upsample="nearest"),
        activation=_c("activation", "fixed", start_scale=-3),
        schedule=_c("schedule", "score_threshold", threshold=0.6, share_grid="previous"),
        restorer=_c("restorer", "anchors", stride=4, grid="with_last", forced=False, recovery="most_similar",
                    target="final", neighbours=4, similarity=0.8),
        cfg_rows="shared",
        granularity="block",
    )


@preset("skipvar", per_model=True)
def skipvar(model: ModelKey | None = None) -> PolicyConfig:
    """SkipVAR (arXiv 2506.08908; code and models fakerone-li/SkipVAR). Per family:

    * **Infinity — the released code**: after scale 9 of 13, two features of the 8×8-grid previews decoded after
      scales 8 and 9 (HF_Diff of their Sobel magnitudes, HF_Ratio of the new one's FFT) go through the released
      ``decision_model_ssim_84`` logistic models (numbers shipped as JSON, never unpickled): ``c`` ∈ {0..3} last
      scales left out, and only for ``c = 0`` the unconditional rows dropped on the last ``u`` scales
      (``skipvar_decision`` skip + ``skipvar_uncond`` guidance; ``--set skip.model=decision_model_ssim_86`` etc.).
      Not the released code: the batch rule (a stopped sample's latent is frozen while its batch runs on; at
      batch 1 exactly the released rule).
    * **VAR, HART — ours, static**: the decision models were trained on Infinity-2B previews and do not apply, so
      the preset is the released models' most common branch as a fixed rule: nothing skipped (c = 0) and the
      unconditional branch replaced on the last 3 scales (``stop_at``, ``start_scale=-3``); errata 8. This is
      also the generic config shown before a model is known. Until git ``0de61a6`` the static rule was the preset
      on Infinity too (FLOPs-ideal 1.69× on Infinity-2B); it stays as the preset ``skipvar_static`` on every family.
    """
    if model is not None and model.family == "infinity":
        return PolicyConfig(name="skipvar", skip=_c("skip", "skipvar_decision"),
                            guidance=_c("guidance", "skipvar_uncond"))
    return PolicyConfig(
        name="skipvar",
        guidance=_c("guidance", "stop_at", start_scale=-3),
    )


@preset("skipvar_static")
def skipvar_static() -> PolicyConfig:
    """SkipVAR, our static reading (not the released code), on every family: nothing skipped (c = 0) and the
    unconditional branch replaced on the last 3 scales (``stop_at``, ``start_scale=-3``): one branch of the released
    per-sample decision applied to every sample (FLOPs-ideal 1.69× on Infinity-2B, where the released ``skipvar``
    decides per sample; the released 0.84 models' mix averages ≈ 2.56× if the features were Gaussian at the
    scaler's moments: ``python -m profilers.skipvar_flops``)."""
    return PolicyConfig(name="skipvar_static", guidance=_c("guidance", "stop_at", start_scale=-3))


def _stagevar_sampled_tokens(name: str) -> PolicyConfig:
    """StageVAR as this preset read it until the released code was followed (see ``stagevar_sampled``)."""
    return PolicyConfig(
        name=name,
        scorer=_c("scorer", "norm"),
        activation=_c("activation", "fixed", start_scale=-3),
        schedule=_c("schedule", "fixed_table", ratios=(0.5, 0.5, 0.5)),
        restorer=_c("restorer", "previous_output"),
        guidance=_c("guidance", "null_late", count=3),
        cfg_rows="shared",
        granularity="chunk",
    )


# the released StageVAR Infinity code: low rank at these widths, these widths not generated, the demo's alpha
STAGEVAR_LOW_RANK_WIDTHS = (40, 48, 64)
STAGEVAR_SKIPPED_WIDTHS = (48, 64)
STAGEVAR_ALPHA = "0.96"


@preset("stagevar", per_model=True)
def stagevar(model: ModelKey | None = None) -> PolicyConfig:
    """StageVAR (arXiv 2512.16483; code sen-mao/FasterVAR ``Infinity/``): the last 3 scales run on the
    unconditional rows only; per block chunk, the chunk's tokens are replaced by fewer stand-ins and the others
    take the chunk's output at the previous scale (RTR). Per family:

    * **Infinity — the released code** (tested bit for bit against its goldens, ``official_stagevar_tiny``):
      scales of width 48 and 64 are not generated (``skip_widths``; the image decodes from the codes summed up to
      the 40×40 scale); ``cfg_list[-3:] = 0`` (``null_late``, count 3: the 40×40 scale runs on the unconditional
      rows only, null text, KV cache cut to those rows, unguided logits); at widths 40/48/64 (so 40×40 only) each
      of the checkpoint's own block chunks (``block_chunks``: 8 on the 2B) runs on ``r_b = int(ratio · N) + 1``
      random projections ``Qᵀx`` (``rank_table``: the shipped tables, knob ``schedule.alpha``, the demo's
      ``'0.96'``: r = 27, 219, 337, 401, 410, 317, 252, 306 of 1,600) with the RoPE of positions 0..r−1, their K/V
      cached; representatives drawn ∝ ‖x_i‖² (``norm``, ``mode='probability'``, ``torch.multinomial``) and the
      outputs scattered there over the area-resampled previous-scale chunk output (``previous_output``,
      ``inputs='projection'``). Draws: ``restorer.draws='auto'`` = torch's global generator in the released order
      (per chunk the multinomial, then the randn) when the run is in shared-generator mode — seed it with
      ``torch.manual_seed`` right before the call to get the released result — and a per-(scale, chunk) seeded
      generator with per-sample seeds (ours: batch-invariant). The demo's sampling (cfg 3, τ 0.5, top-k 900,
      top-p 0.97) is the Infinity adapter's default. Not the released code: batches (the code runs B = 1; here
      each row draws its own representatives from its own weights, one multinomial over the rows), and the
      seeded draws.
    * **VAR, HART — ours** (no released code; the rank tables are Infinity-2B statistics keyed on Infinity's
      widths, HART has no 40-wide scale and its 48/64 scales are its last two): the earlier reading,
      ``stagevar_sampled``: the last 3 scales on the unconditional rows, per chunk of ``L/8`` blocks a flat 50 %
      of the tokens drawn ∝ ‖x‖² run at their own positions, RTR for the rest, no scale skipped. It is also the
      generic config shown before a model is known.
    """
    if model is not None and model.family == "infinity":
        return PolicyConfig(
            name="stagevar",
            scorer=_c("scorer", "norm", mode="probability"),
            activation=_c("activation", "fixed", start_scale=0),  # the width table decides where
            schedule=_c("schedule", "rank_table", alpha=STAGEVAR_ALPHA, widths=STAGEVAR_LOW_RANK_WIDTHS),
            restorer=_c("restorer", "previous_output", inputs="projection"),
            guidance=_c("guidance", "null_late", count=3),
            skip=_c("skip", "skip_widths", widths=STAGEVAR_SKIPPED_WIDTHS),
            cfg_rows="shared",
            granularity="chunk",
            rank_bits=0,
        )
    return _stagevar_sampled_tokens("stagevar")


@preset("stagevar_sampled")
def stagevar_sampled() -> PolicyConfig:
    """StageVAR, our earlier reading (not the released code), on every family: the last 3 scales run on the
    unconditional rows only; per block chunk (``L/8`` blocks) a flat 50 % of the tokens, drawn ∝ ‖x‖², run at
    their own positions and the others take the chunk's previous-scale output (RTR); all scales generated.

    What differs from the released code (``stagevar`` on Infinity): the kept share (the code runs ``r_b`` random
    projections from its offline rank tables, not 50 % of the tokens), the chunk input (projections ``Qᵀx`` at
    positions 0..r−1 vs sampled tokens at their own positions), the 48/64 skip, the model's own chunks. Until git
    ``2f29048`` this reading selected per block and added FastVAR-style cached branch outputs; that variant is
    ``dataclasses.replace(get_preset("stagevar_sampled"), granularity="block").replace_component("restorer",
    "static_cache", cache_scale=-4, refresh="latest")``.
    """
    return _stagevar_sampled_tokens("stagevar_sampled")


@preset("code")
def code() -> PolicyConfig:
    """CoDe, training-free (arXiv 2411.17787, CVPR 2025; code ``czg1225/CoDe``, ``infer_CoDe.py --training_free``):
    a large drafter generates the first N scales, a small refiner sharing its VQVAE the rest (engine.switch).

    Knobs that matter: ``refiner`` (a zoo entry) and ``switch_scale`` (N, the drafter's "draft steps").
    FOUND(code): the pair VAR-d30 -> VAR-d16 (the official checkpoints, no fine-tuning in the training-free mode),
    N = 8 of VAR-256's 10 scales (the README's default and its 1.7x / FID 1.98 row; N = 6 is its 2.9x point), the
    refiner prefilling its cache over the drafted scales (one block-causal pass in the code; scale by scale here,
    the same attention). Ours: the generic config names ``testbed-small`` (the testbed's depth-4 refiner: the
    testbeds share one VQVAE and VAR-256's 10 scales, so N = 8 carries over unchanged); for VAR-d30 run
    ``--set refiner=var-d16``. The code's sampling (cfg 4, top-k 600, top-p 0.95, temperature 1.1 on the first 7
    scales) is the study's ``--cfg/--top-k/--top-p``, not part of this config. The refiner continues the drafter's
    random streams (the code reseeds and draws the skipped scales again to reach the same stream position)."""
    return PolicyConfig(name="code", refiner="testbed-small", switch_scale=8)


@preset("stepvar")
def stepvar() -> PolicyConfig:
    """StepVAR (arXiv 2603.01757; FOUND(secondary write-up), code unreleased): tokens ranked by structure (|projection
    on the first principal component|) plus texture (3x3 high-pass energy), selected once per block at the last
    scales; a pruned position takes the output of its nearest kept token of the same scale (restorer ``nearest``).

    Knobs that matter: ``scorer.structure_weight`` (w_str) and ``schedule.ratios``. RECONSTRUCTED: the pruned scales
    and ratios (the write-up reports 1.4x on HART without a table; ours: the last two scales, 0.4 / 0.5 removed, as
    our VAR mapping of FastVAR, so the two scorers compare at equal token counts), w_str = 1 and the scorer's
    other options (see ``structure_texture``), the conditional row's selection shared by both CFG halves."""
    return PolicyConfig(
        name="stepvar",
        scorer=_c("scorer", "structure_texture"),
        activation=_c("activation", "fixed", start_scale=-2),
        schedule=_c("schedule", "fixed_table", ratios=(0.4, 0.5)),
        restorer=_c("restorer", "nearest"),
        cfg_rows="shared",
        granularity="block",
    )


@preset("sparvar")
def sparvar() -> PolicyConfig:
    """SparVAR (arXiv 2602.04361): every token computed, attention sparse from the decision scale on — CS4A's top
    20 % keys per query group of scale −3 carried to the last two scales, plus CSLA windows 7 and 9 on their own
    scale (``attention=sparvar``; FOUND / RECONSTRUCTED parts in its docstring). Without the paper's scale skipping
    (its 2.28× setting) and without the port's output cache."""
    return PolicyConfig(name="sparvar", attention=_c("attention", "sparvar"))


@preset("scalekv")
def scalekv() -> PolicyConfig:
    """ScaleKV (arXiv 2505.19602): drafter/refiner blocks per scale, per-block KV budgets at the paper's 10 %.

    KV cache only (no token pruning, full CFG): after every scale but the last each block keeps its observation
    window and the highest-scoring keys per head (FOUND, Lvar port); the drafter/refiner split by an online
    attention-selectivity index is RECONSTRUCTED (the budget files are not public), see ``kv/scalekv.py``.
    Composes with a token-pruning preset: ``--set`` or the ``kv`` family's ``fastvar+scalekv`` arm.
    """
    return PolicyConfig(name="scalekv", kv=_c("kv", "scalekv", budget=0.1))


@preset("hack")
def hack() -> PolicyConfig:
    """HACK (arXiv 2504.09261, RECONSTRUCTED): structural/contextual heads, asymmetric per-head KV budgets (10 %).

    Heads classified online unless ``--set kv.calibration=<file of varscope calibrate hack>``; structural heads keep
    the most recent keys, contextual heads the most attended ones (``kv/hack.py``). KV cache only.
    """
    return PolicyConfig(name="hack", kv=_c("kv", "hack", budget=0.1))


set_per_model_resolver(resolve_config)


def _load_preset_files() -> None:
    """Presets in their own files: every module of ``var_core/accel/preset_files/`` is imported (after the presets
    above, so a duplicate name is refused), as components are discovered one file each."""
    import importlib
    import pkgutil

    preset_files = importlib.import_module(f"{__package__}.preset_files")
    for module in pkgutil.iter_modules(preset_files.__path__):
        importlib.import_module(f"{preset_files.__name__}.{module.name}")


_load_preset_files()
