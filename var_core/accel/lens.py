"""Logit-lens token entropy per block (NOVA §2.1, layer entropy; RECONSTRUCTED), shared by components.

The loop calls ``observe_lens(ctx, block, lens)`` with a :class:`~var_core.engine.lens_probe.LensProbe` of the
model head on the OUTPUT of ``block`` (the full ``[R, N, C]`` hidden state, pruned slots already restored), i.e.
the hidden state ENTERING block ``block + 1``. :func:`record_lens_entropy` turns it into a token-entropy map and
stores it once in ``signals.lens_entropy[(si, block)]`` (float32 ``[B, N]``, or ``[R, N]`` for
``combine="per_row"``). Only what ``combine`` needs is projected: ``guided`` mixes the two CFG halves' head
features and projects ``B`` rows (half the head FLOPs of projecting both halves), ``cond`` projects the ``B``
conditional rows, ``mean`` and ``per_row`` project every row.

How the CFG halves are combined is a RECONSTRUCTED choice (specs/methods.md §2.1: "CFG-combined if both branches
are present"); ``combine`` selects it:

* ``guided`` (default) — entropy of the guided logits ``ℓ = α·ℓ_u + β·(ℓ_c − ℓ_u)`` in the family's convention
  (VAR and HART: ``α = 1, β = 1 + cfg·si/(K−1)``, HART's last scale at ``si = K−2``; Infinity: ``α = 1/τ,
  β = cfg/τ``). Components do not see the sampling
  settings, so with ``guidance_scale=None`` the weights are INFERRED per sample from the latest computed scale,
  by least squares of its guided logits on its raw ``(ℓ_u, ℓ_c − ℓ_u)`` rows (exact for Infinity's constant
  cfg and temperature, and for samples whose guidance was stopped, β = α = 1); for VAR the guidance part is then
  moved along the linear ramp (``t_si = t_prev · si / si_prev``). Before any scale with both halves (or without
  raw logits in the records) the weights are ``α = β = 1`` (conditional logits: exact at VAR's first scale where
  t = 0; for Infinity the first scale's lens ignores cfg and τ). With an explicit ``guidance_scale`` (and
  ``temperature`` for Infinity) the family formula is used as is.
* ``cond`` — entropy of the conditional rows' logits.
* ``mean`` — mean of the conditional and unconditional rows' entropies.
* ``per_row`` — one map per network row, ``[R, N]``.

When the scale computes one CFG half only, every mode gives that half's entropy ``[B, N]``.

Rows: only the samples that are accelerated at the scale are projected (``samples="accelerated"``, the default:
``signals.activation_scale_B <= si`` when an activation publishes it; every sample otherwise). The others run
dense, so nothing reads their lens entropy; their rows of the map are NaN ("not computed", as attention maps mark
uncomputed queries) and the scale record's ``lens_rows`` counts the rows actually projected. ``samples="all"``
projects every sample (offline analysis of a whole batch).

The guidance weights inferred from the previous scale are computed once per scale (least squares over the
previous scale's ``[2B, N, V]`` raw logits) and reused by every block's lens of that scale, read on the host once per
scale where several samples are projected (one sample: never; issue 27).

Idempotent, and never ambiguous: ``signals.lens_entropy`` holds only the CANONICAL definition (the defaults
``combine="guided", guidance_scale=None, temperature=1.0``), stored by the first component that records it; a
component asking for other settings gets its own map, stored in
``signals.extras["lens.variants"][(combine, guidance_scale, temperature)][(si, block)]`` (read it back with
:func:`lens_entropy_map`). So a reader of ``signals.lens_entropy`` never silently receives another component's
variant, and an ablation arm that changes one component's setting does not change what the others read.
"""

from __future__ import annotations

import torch

from ..engine.context import GuidanceMode, ScaleContext
from ..engine.lens_probe import LensProbe
from ..engine.tracing import NULL_TRACER
from .base import Signals
from .entropy import predictive_entropy

LENS_COMBINES = ("guided", "cond", "mean", "per_row")
LENS_SAMPLES = ("accelerated", "all")
LENS_VARIANTS_KEY = "lens.variants"
WEIGHTS_KEY = "lens.guidance_weights"
ROWS_KEY = "lens.rows"
CANONICAL_SETTINGS = ("guided", None, 1.0)


def _fit_weights(raw_RNV: torch.Tensor, guided_BNV: torch.Tensor, B: int, chunk: int = 1 << 16
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample least-squares ``guided ≈ α·u + β·(c − u)``; returns ``(α [B], β [B])``. The five inner products
    are accumulated in float64 over chunks of ``chunk`` logits per sample (cache-sized temporaries)."""
    c_all, u_all, g_all = raw_RNV[:B].flatten(1), raw_RNV[B:].flatten(1), guided_BNV.flatten(1)
    sums = torch.zeros(5, B, dtype=torch.float64, device=raw_RNV.device)
    for start in range(0, c_all.shape[1], chunk):
        c, u, g = (t[:, start:start + chunk].double() for t in (c_all, u_all, g_all))
        d = c - u
        sums += torch.stack(((u * u).sum(1), (u * d).sum(1), (d * d).sum(1), (u * g).sum(1), (d * g).sum(1)))
    uu, ud, dd, ug, dg = sums.unbind(0)
    det = uu * dd - ud * ud
    ok = det > 1e-10 * uu * dd.clamp(min=1e-30)
    safe_det = torch.where(ok, det, torch.ones_like(det))
    alpha = torch.where(ok, (ug * dd - dg * ud) / safe_det, ug / uu.clamp(min=1e-30))
    beta = torch.where(ok, (uu * dg - ud * ug) / safe_det, alpha)  # c ≈ u: any β fits; use the cond weight
    return alpha.float(), beta.float()


def _ramp_position(family: str, si: int, K: int) -> int:
    """Where scale ``si`` sits on the linear CFG ramp ``t = cfg·pos/(K−1)`` (VAR: ``si``; HART reuses the ratio of
    scale ``K−2`` at its last scale)."""
    return min(si, max(K - 2, 0)) if family == "hart" else si


def guidance_weights(ctx: ScaleContext, signals: Signals, guidance_scale: float | None = None,
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(α [B], β [B])`` with guided logits ``α·ℓ_u + β·(ℓ_c − ℓ_u)`` at scale ``ctx`` (see module docstring);
    memoised per scale in ``signals.extras`` (every block's lens of a scale uses the same weights)."""
    extras = getattr(signals, "extras", None)
    key = (ctx.scale_index, guidance_scale, temperature)
    if extras is not None:
        memo = extras.setdefault(WEIGHTS_KEY, {})
        if key not in memo:
            memo.clear()  # one scale at a time
            memo[key] = _guidance_weights(ctx, guidance_scale, temperature)
        return memo[key]
    return _guidance_weights(ctx, guidance_scale, temperature)


def host_guidance_weights(ctx: ScaleContext, signals: Signals, guidance_scale: float | None = None,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`guidance_weights` on the host, copied once per scale (one host synchronisation per scale where they
    were fitted on the device; every block's lens reads them for its cache key and shared-bias test)."""
    alpha, beta = guidance_weights(ctx, signals, guidance_scale, temperature)
    extras = getattr(signals, "extras", None)
    memo = {} if extras is None else extras.setdefault(WEIGHTS_KEY + ".host", {})
    key = (ctx.scale_index, guidance_scale, temperature)
    if key not in memo:
        memo.clear()
        memo[key] = tuple(torch.stack((alpha, beta)).cpu().unbind(0))
    return memo[key]


def _guidance_weights(ctx: ScaleContext, guidance_scale: float | None, temperature: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    B, si, K = ctx.batch_size, ctx.scale_index, ctx.num_scales
    if guidance_scale is not None:
        if ctx.family in ("var", "hart"):
            alpha, beta = 1.0, 1.0 + guidance_scale * _ramp_position(ctx.family, si, K) / max(1, K - 1)
        else:
            alpha, beta = 1.0 / temperature, guidance_scale / temperature
        return torch.full((B,), alpha), torch.full((B,), beta)
    record = ctx.last_computed()
    if (record is None or record.guidance is not GuidanceMode.BOTH or record.raw_logits_RNV is None
            or record.guided_logits_BNV is None):
        return torch.ones(B), torch.ones(B)
    alpha, beta = _fit_weights(record.raw_logits_RNV, record.guided_logits_BNV, B)
    if ctx.family in ("var", "hart"):  # linear CFG ramp: t_si = cfg * si / (K - 1) (HART: see _ramp_position)
        prev = _ramp_position(ctx.family, record.scale_index, K)
        ramp = _ramp_position(ctx.family, si, K) / prev if prev > 0 else 0.0
        beta = alpha + (beta - alpha) * ramp
    return alpha, beta


def lens_samples(ctx: ScaleContext, signals: Signals, samples: str = "accelerated") -> torch.Tensor | None:
    """bool ``[B]``: the samples whose lens entropy is computed at ``ctx`` (None: every sample). ``accelerated``:
    those whose activation scale (``signals.activation_scale_B``, when published) is reached at this scale."""
    if samples not in LENS_SAMPLES:
        raise ValueError(f"unknown lens samples {samples!r}; choose one of {LENS_SAMPLES}")
    first = getattr(signals, "activation_scale_B", None)
    if samples == "all" or first is None:
        return None
    active = first.cpu() <= ctx.scale_index
    return None if bool(active.all()) else active


def lens_entropy(ctx: ScaleContext, signals: Signals, lens: LensProbe | torch.Tensor, combine: str = "guided",
                 guidance_scale: float | None = None, temperature: float = 1.0, samples: str = "accelerated"
                 ) -> torch.Tensor:
    """Token entropy of the lens, CFG rows combined per ``combine`` (``[B, N]``, or ``[R, N]`` for per_row); rows
    of samples left out by ``samples`` (see :func:`lens_samples`) are NaN and never projected.

    ``lens`` is the loop's :class:`LensProbe` (or logits ``[R, N, V]`` already computed)."""
    if combine not in LENS_COMBINES:
        raise ValueError(f"unknown lens combine {combine!r}; choose one of {LENS_COMBINES}")
    family, B = ctx.family, ctx.batch_size
    if isinstance(lens, torch.Tensor):
        lens = LensProbe.of_logits(lens, B)
    active = lens_samples(ctx, signals, samples)
    index = None if active is None else active.nonzero().flatten()
    # the head projection runs in the loop's "lens" span; the entropy itself in "accel/entropy"
    tracer = getattr(getattr(signals, "info", None), "tracer", None) or NULL_TRACER
    if index is not None and index.numel() == 0:  # nobody accelerated (asked for anyway): every sample
        index = None
    if not lens.both_halves or combine == "per_row" or combine == "mean":
        logits = lens.logits(index)
    elif combine == "cond":
        logits = lens.cond_logits(index)
    else:
        alpha, beta = guidance_weights(ctx, signals, guidance_scale, temperature)
        weights_key = (ctx.scale_index, guidance_scale, temperature)  # the weights' per-scale memo key
        if (B if index is None else int(index.numel())) == 1:  # one sample: the probe needs no weight on the host
            host = None
        else:
            alpha_h, beta_h = host_guidance_weights(ctx, signals, guidance_scale, temperature)
            host = (beta_h, alpha_h - beta_h)
        # α·ℓ_u + β·(ℓ_c − ℓ_u) = β·ℓ_c + (α − β)·ℓ_u
        logits = lens.mixed_logits(beta, alpha - beta, index, host_weights=host, weights_key=weights_key)
    with tracer.span("accel/entropy", ctx.scale_index):
        if combine == "mean" and lens.both_halves:
            b = logits.shape[0] // 2
            entropy = 0.5 * (predictive_entropy(logits[:b], family) + predictive_entropy(logits[b:], family))
        else:
            entropy = predictive_entropy(logits, family)
    if index is None:
        return entropy
    both_rows = combine == "per_row" and lens.both_halves  # [R, N]: cond rows, then uncond rows
    out = entropy.new_full((2 * B if both_rows else B, entropy.shape[-1]), float("nan"))
    out[_device_rows(signals, ctx, index, B, both_rows, out.device)] = entropy
    return out


def _device_rows(signals: Signals, ctx: ScaleContext, index: torch.Tensor, B: int, both_rows: bool, device
                 ) -> torch.Tensor:
    """The map's rows of the projected samples (host ``index``) on ``device``, copied there once per scale (every
    block's lens of a scale projects the same samples), not once per block."""
    target = torch.cat((index, index + B)) if both_rows else index
    extras = getattr(signals, "extras", None)
    if extras is None:
        return target.to(device)
    memo = extras.setdefault(ROWS_KEY, {})
    key = (ctx.scale_index, tuple(target.tolist()), str(device))  # host data: free
    if key not in memo:
        memo.clear()  # one scale at a time
        memo[key] = target.to(device)
    return memo[key]


def _store(signals: Signals, settings: tuple) -> dict:
    if settings == CANONICAL_SETTINGS:
        return signals.lens_entropy
    return signals.extras.setdefault(LENS_VARIANTS_KEY, {}).setdefault(settings, {})


def record_lens_entropy(signals: Signals, ctx: ScaleContext, block: int, lens: LensProbe | torch.Tensor,
                        combine: str = "guided", guidance_scale: float | None = None, temperature: float = 1.0
                        ) -> torch.Tensor:
    """Store (once) and return the lens entropy of the hidden state AFTER ``block`` (= entering ``block + 1``):
    ``signals.lens_entropy[(si, block)]`` for the canonical settings, a variant store otherwise. Rows of samples
    not accelerated at this scale are NaN (module docstring, "Rows")."""
    store = _store(signals, (combine, guidance_scale, temperature))
    key = (ctx.scale_index, block)
    if key not in store:
        store[key] = lens_entropy(ctx, signals, lens, combine, guidance_scale, temperature)
    return store[key]


def lens_entropy_map(signals: Signals, si: int, block: int, combine: str = "guided",
                     guidance_scale: float | None = None, temperature: float = 1.0) -> torch.Tensor | None:
    """The map :func:`record_lens_entropy` stored for these settings, or None if it was not recorded."""
    return _store(signals, (combine, guidance_scale, temperature)).get((si, block))


__all__ = ["CANONICAL_SETTINGS", "LENS_COMBINES", "LENS_SAMPLES", "guidance_weights", "lens_entropy",
           "lens_entropy_map", "lens_samples", "record_lens_entropy"]
