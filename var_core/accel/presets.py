"""Method presets: functions returning a complete :class:`PolicyConfig` for each published method.

Each preset composes registered components with the paper's defaults (see specs/methods.md). Where a paper's
setting is tied to Infinity-1024's 13-scale schedule, the preset maps it onto the model at hand by position from
the end of the schedule (documented per preset). What a preset leaves out of the original method is stated in
its docstring — a preset never pretends to be more than it is.
"""

from __future__ import annotations

import difflib
from typing import Callable

from ..errors import UserError
from .policy import PolicyConfig, component_config


class UnknownPresetError(UserError, KeyError):
    """An unknown preset name (a user error, exit 2 on the command line; still a KeyError for old callers)."""


PRESETS: dict[str, Callable[..., PolicyConfig]] = {}


def preset(name: str):
    def decorator(fn: Callable[..., PolicyConfig]) -> Callable[..., PolicyConfig]:
        if name in PRESETS:
            raise ValueError(f"preset {name!r} already defined")
        PRESETS[name] = fn
        return fn

    return decorator


def get_preset(name: str, **overrides) -> PolicyConfig:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=3, cutoff=0.4)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownPresetError(f"unknown preset {name!r}.{hint} Presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name](**overrides)


def preset_summary(name: str) -> str:
    doc = (PRESETS[name].__doc__ or "").strip()
    return doc.splitlines()[0] if doc else ""


def _c(kind: str, name: str, **params):
    return component_config(kind, name, **params)


@preset("baseline")
def baseline() -> PolicyConfig:
    """The plain model: no pruning, full classifier-free guidance (every arm's reference)."""
    return PolicyConfig(name="baseline")


@preset("nova")
def nova() -> PolicyConfig:
    """NOVA: entropy-inflection activation, dual-linkage ratios, logit-lens entropy top-k, residual cache reuse.

    Defaults t_est=5, α=0.5, τ=0.8, λ=0.1 (paper §4.1); every RECONSTRUCTED wiring choice keeps its component
    default (see the components' docstrings).
    """
    return PolicyConfig(
        name="nova",
        scorer=_c("scorer", "entropy", source="lens"),
        activation=_c("activation", "entropy_inflection"),
        schedule=_c("schedule", "dual_linkage"),
        restorer=_c("restorer", "residual_reuse"),
        cfg_rows="shared",
        granularity="block",
    )


@preset("fastvar")
def fastvar() -> PolicyConfig:
    """FastVAR: distance-to-mean token selection before every sub-layer, fixed ratios on the last scales, cached
    sub-layer outputs of the scale before the pruned ones (area-upsampled).

    Mapping: the Infinity code prunes the 32 and 40 scales by 0.4 / 0.5 and skips 48 and 64 entirely; on a
    10-scale VAR schedule we prune the last two scales by 0.4 / 0.5 and skip none (skipping the last two VAR
    scales would drop 62 % of the tokens of a 256-px image; the ``skip`` ablation covers it).
    """
    return PolicyConfig(
        name="fastvar",
        scorer=_c("scorer", "mse", mode="mean_distance"),
        activation=_c("activation", "fixed", start_scale=-2),
        schedule=_c("schedule", "fixed_table", ratios=(0.4, 0.5)),
        restorer=_c("restorer", "static_cache", cache_scale=-3),
        cfg_rows="per_row",
        granularity="branch",
    )


@preset("ldpruning")
def ldpruning() -> PolicyConfig:
    """LD-Pruning: Haar high-frequency energy of the previous residual map (LHEP), keep ρ=0.5 of the energy,
    restore from the latest scale's outputs, stop the unconditional branch adaptively (SATS, δ=0.15)."""
    return PolicyConfig(
        name="ldpruning",
        scorer=_c("scorer", "lhep", extractor="haar"),
        activation=_c("activation", "fixed", start_scale=-3),
        schedule=_c("schedule", "energy_fraction"),
        restorer=_c("restorer", "static_cache", cache_scale=-4, refresh="latest"),
        guidance=_c("guidance", "sats"),
        cfg_rows="shared",
        granularity="block",
    )


@preset("toprovar")
def toprovar() -> PolicyConfig:
    """ToProVAR: attention-entropy pruning depth D (τ=0.4), Global/Detail layers by SVD, entropy token gate in
    Detail layers; pruned tokens pass through (identity)."""
    return PolicyConfig(
        name="toprovar",
        scorer=_c("scorer", "attention"),
        activation=_c("activation", "low_entropy_ratio"),
        schedule=_c("schedule", "toprovar_gate"),
        restorer=_c("restorer", "identity"),
        cfg_rows="shared",
        granularity="block",
    )


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


@preset("skipvar")
def skipvar() -> PolicyConfig:
    """SkipVAR, static rule: skip the last scale and drop the unconditional branch two scales before the end.

    The original chooses both per sample with a logistic-regression classifier trained on 3k Infinity-2B prompts
    (Sobel and FFT features of two tiny VAE decodes); that learned decision model is NOT reproduced here.
    """
    return PolicyConfig(
        name="skipvar",
        guidance=_c("guidance", "stop_at", start_scale=-3),
        skip=_c("skip", "skip_last", count=1),
    )


@preset("stagevar")
def stagevar() -> PolicyConfig:
    """StageVAR, the null-condition + token-restoration part: the last scales run on the unconditional rows only,
    with tokens sampled ∝‖x‖² and the rest restored from the previous scale's outputs.

    Left out: the random-projection low-rank features (offline rank tables per chunk), and the released code's
    extra skip of the last two Infinity scales.
    """
    return PolicyConfig(
        name="stagevar",
        scorer=_c("scorer", "norm"),
        activation=_c("activation", "fixed", start_scale=-2),
        schedule=_c("schedule", "fixed_table", ratios=(0.5, 0.5)),
        restorer=_c("restorer", "static_cache", cache_scale=-3, refresh="latest"),
        guidance=_c("guidance", "null_late", count=2),
        cfg_rows="shared",
        granularity="block",
    )
