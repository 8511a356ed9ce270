"""ToProVAR's layer (Global/Detail) and token (entropy gate) levels as a schedule (specs/methods.md §4.3–4.4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention_stats import (fill_missing, may_prune_at, may_prune_next, publish_first_prunable,
                               record_attention_entropy, region_floor)
from ..base import NO_NEEDS, Needs, Schedule, Signals
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCHEDULES
from ._linkage_math import counts_for_rows, started_B

EXTRAS_KEY = "toprovar_gate"
NORMALIZATIONS = ("max", "rank", "literal")
REALISATIONS = ("deterministic", "bernoulli")
GATE_SOURCES = ("previous_scale", "previous_layer")
LAYER_CLASSES = ("per_scale", "once")
AMBIGUITY_SCOPES = ("layer", "sample")


# ------------------------------------------------------------------------------------------------ pure formulas
def layer_score(entropy_map_Bhw: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ToProVAR Eq. 4: ``ϱ = σ1/σ2`` of the (h × w) entropy map and ``R = exp(−β(ϱ − 1))``, per sample ``[B]``.

    A map of numerical rank one (``σ2 ≤ σ1·max(h, w)·ε``, the usual matrix-rank tolerance, ε of float64), or a single
    row/column, has ``ϱ = inf`` and ``R = 0`` (Global). The tolerance makes that verdict independent of the LAPACK
    build: an exactly rank-one map's σ2 comes out as 0 on one CPU and as ~1e-17 on another."""
    sigma = torch.linalg.svdvals(entropy_map_Bhw.double())
    if sigma.shape[-1] < 2:
        ratio = torch.full(sigma.shape[:-1], float("inf"), dtype=torch.float64, device=sigma.device)
    else:
        s1, s2 = sigma[..., 0], sigma[..., 1]
        rank_tol = s1 * max(entropy_map_Bhw.shape[-2:]) * torch.finfo(torch.float64).eps
        ratio = torch.where(s2 > rank_tol, s1 / s2.clamp(min=torch.finfo(torch.float64).tiny),
                            torch.full_like(s1, float("inf")))
    return ratio, torch.exp(-beta * (ratio - 1.0))


def detail_layers(R_BL: torch.Tensor, threshold: float, margin: float = 0.0, scope: str = "layer") -> torch.Tensor:
    """bool ``[B, L]``: the layers pruned as Detail layers, with ToProVAR's appendix fallback "no layer pruning
    when the split is ambiguous" (RECONSTRUCTED): a layer whose ``R`` lies within ``margin`` of ``threshold``
    (``|R − threshold| ≤ margin``) is ambiguous; ``layer``: the ambiguous layers run dense (as Global), the others
    keep their class; ``sample``: a sample with any ambiguous layer prunes no layer at all. ``margin = 0`` keeps
    only exact ties dense."""
    detail = R_BL > threshold
    ambiguous = (R_BL - threshold).abs() <= margin
    if scope == "layer":
        return detail & ~ambiguous
    if scope == "sample":
        return detail & ~ambiguous.any(-1, keepdim=True)
    raise ValueError(f"unknown ambiguity scope {scope!r}; choose one of {AMBIGUITY_SCOPES}")


def phi(s: int, s_max: int) -> float:
    """ToProVAR Eq. 5's scale factor ``φ(s) = s / S_max`` (1-indexed ``s``; not clipped: Eq. 6 clips the gate)."""
    return s / s_max


def normalized_entropy(entropy_BN: torch.Tensor, normalization: str) -> torch.Tensor:
    """``Ĥ`` of ToProVAR Eq. 5: ``literal`` ``H_i / Σ_j H_j`` (O(1/N)), ``max`` ``H_i / max_j H_j``, ``rank`` the
    token's entropy rank scaled to [0, 1] (ties by position)."""
    H = entropy_BN.double()
    if normalization == "literal":
        return H / H.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
    if normalization == "max":
        return H / H.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
    if normalization == "rank":
        N = H.shape[-1]
        ranks = H.argsort(dim=-1, stable=True).argsort(dim=-1, stable=True).double()
        return ranks / max(1, N - 1)
    raise ValueError(f"unknown normalization {normalization!r}; choose one of {NORMALIZATIONS}")


def prune_probability(entropy_BN: torch.Tensor, phi: float, layer_R_B: torch.Tensor, alpha_min: float,
                      alpha_max: float, normalization: str) -> torch.Tensor:
    """``1 − P_keep = clip(α_min + (α_max − α_min)·φ(s)·R·Ĥ_i, 0, 1)`` (ToProVAR Eq. 6, s ≥ D), ``[B, N]``."""
    q = phi * layer_R_B.double().to(entropy_BN.device).unsqueeze(-1) * normalized_entropy(entropy_BN, normalization)
    return (alpha_min + (alpha_max - alpha_min) * q).clamp(0.0, 1.0)


def pruned_count(p_prune_BN: torch.Tensor, realisation: str, generator: torch.Generator | None = None
                 ) -> torch.Tensor:
    """int64 ``[B]`` tokens to prune: ``round(Σ_i p_i)`` (deterministic, half to even) or ``Σ_i [u_i < p_i]`` with
    one uniform draw per token position shared by all samples (batch-independent)."""
    if realisation == "deterministic":
        return torch.round(p_prune_BN.sum(-1)).long()
    if realisation == "bernoulli":
        u = torch.rand(p_prune_BN.shape[-1], generator=generator, dtype=torch.float64)
        return (u.to(p_prune_BN.device) < p_prune_BN).sum(-1).long()
    raise ValueError(f"unknown realisation {realisation!r}; choose one of {REALISATIONS}")


# ------------------------------------------------------------------------------------------------ component
@SCHEDULES.register("toprovar_gate")
class ToProVARGate(Schedule):
    """ToProVAR (arXiv 2602.22948) §4.3–4.4: prune Detail layers only, by an entropy gate. Knob: ``alpha_max``.

    Layer level: from the representative scale ``s_rep`` on (1-indexed; paper: 6) every block's head-averaged
    attention-entropy map (h × w, the sample's conditional row; uncomputed queries filled with the row mean) gives
    ``ϱ = σ1/σ2`` and ``R = exp(−β(ϱ − 1))``; ``R > detail_threshold`` → Detail layer, else Global (dense: the
    schedule returns dense counts). Up to and including ``s_rep`` every layer is unknown → dense; before the
    activation scale D (``signals.activation_scale_B``, e.g. ``low_entropy_ratio``) every row is dense.
    Token level (Detail layers, s ≥ D): ``1 − P_keep_i = clip(α_min + (α_max − α_min)·φ(s)·R·Ĥ_i, 0, 1)`` with
    ``φ(s) = s/S_max`` (1-indexed s; ``s_max``, default 0 = the model's number of scales: Infinity-2B's 11 in
    ToProVAR Table 7 is the FastVAR code base that never generates 48/64); the row keeps ``N − n`` tokens. WHICH
    tokens is the scorer's job: ToProVAR prunes the highest-entropy tokens, i.e. pair this schedule with an
    attention-entropy scorer that keeps the low-entropy ones.

    RECONSTRUCTED parts (each an option; defaults first):

    * ``layer_classes`` — ``per_scale``: the classes are recomputed at the end of every scale from s_rep on and used
      at the next scale (errata 9: Fig. 4(b) "for each scale, perform SVD on the entropy map"; a Detail layer's map
      at a pruned scale has values at its kept queries only, filled with the row mean) / ``once``: classified at
      ``s_rep`` only and reused (methods.md §4.3, the paper's cost table computes them once at s = 6).
    * appendix safety fallbacks: ``ambiguity_margin`` / ``ambiguity_scope`` ("no layer pruning when the split is
      ambiguous": a layer with ``|R − detail_threshold| ≤ margin`` is ambiguous; ``layer``: it runs dense,
      ``sample``: that sample prunes no layer while this classification holds; ``margin = 0`` disables it) and
      ``min_region_keep`` / ``regions`` ("a minimum per-region keep ratio": every cell of a ``regions × regions``
      grid keeps at least ``ceil(min_region_keep · n_cell)`` tokens; this schedule floors the COUNT at their sum,
      the ``attention`` scorer's knobs of the same names choose the quota tokens first; 0 disables it). Values are
      not in the paper: margin 0.05 and keep 0.1 per cell (ToProVAR: Detail layers tolerate up to 90 % pruning).
    * ``normalization`` of Ĥ — ``max`` ``H/max H`` / ``rank`` / ``literal`` ``H/ΣH`` (as printed: O(1/N), so the
      gate collapses to α_min for every token).
    * ``realisation`` — ``deterministic``: ``n = round(Σ_i (1 − P_keep_i))`` / ``bernoulli``: ``n = Σ_i [u_i < 1 −
      P_keep_i]`` with uniforms from a generator seeded by (``seed``, scale, block), shared by all samples (the
      literal stochastic gate; only its COUNT is used, since a schedule returns counts and the scorer picks tokens).
    * ``entropy_source`` of the gate's ``H_i`` (the layer's own entropies exist only after it ran densely):
      ``previous_scale`` — the same block's map at the latest earlier scale where it was observed, bilinearly
      upsampled (observed at every scale from s_rep on while a later scale may be pruned) / ``previous_layer`` —
      block l−1's map at the current scale (observed on accelerated scales; block 0, and a missing map, fall back
      to the same block's latest earlier map, which s_rep always provides).
      Uncomputed (pruned) queries in a map are filled with the row mean.
    * ``beta``, ``alpha_min``, ``alpha_max``, ``detail_threshold`` — values not given by the paper (uncalibrated
      defaults; ToProVAR: Global layers break above 50 % pruning, Detail layers tolerate up to 90 %). The SVD is of
      the raw (uncentred) map, whose mean makes σ1 large: ϱ is well above 1 even for structured maps (a map of
      mean m and spatial spread s on n×n tokens has σ1 ≈ m·n), so β must be small. β = 0.05 puts R = 0.5 at
      ϱ ≈ 14.9 (Detail below); on the random official-tiny model every map is almost flat (ϱ ≈ 300–570: all
      Global unless β ≲ 2e-3). Calibrate β on the model at hand (``sigma_ratio_BL`` below).

    Diagnostics in ``signals.extras["toprovar_gate"]``: ``sigma_ratio_BL``, ``R_BL``, ``detail_BL`` (per sample and
    block, of the latest classification), ``classified_at`` (its 0-indexed scale), ``R_by_scale[si]`` and
    ``prune_fraction[(si, block)]``.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        s_rep: int = knob(6, "representative scale (1-indexed NUMBER) whose attention-entropy maps classify layers "
                          "(the first classification with layer_classes='per_scale')",
                          low=1, search=SearchSpace("int", 4, 8), unit="scale_number")
        beta: float = knob(0.05, "R = exp(-beta (sigma1/sigma2 - 1)); Detail when R > detail_threshold", low=0.0,
                           low_open=True, search=SearchSpace("float", 0.01, 2.0, log=True))
        detail_threshold: float = knob(0.5, "layers with R above this are Detail layers (pruned)", low=0.0,
                                       high=1.0, low_open=True, high_open=True,
                                       search=SearchSpace("float", 0.2, 0.8))
        alpha_min: float = knob(0.1, "pruning probability of a zero-entropy token", low=0.0, high=1.0,
                                search=SearchSpace("float", 0.0, 0.5))
        alpha_max: float = knob(0.9, "pruning probability at q = 1 (max entropy, last scale, R = 1)", low=0.0,
                                high=1.0, search=SearchSpace("float", 0.5, 1.0))
        s_max: int = knob(0, "S_max of phi(s) = s / S_max (1-indexed s); 0 = the model's number of scales", low=0)
        layer_classes: str = knob("per_scale", "Global/Detail classes recomputed at every scale from s_rep on "
                                  "('per_scale', Fig. 4(b)) or once at s_rep ('once')", choices=LAYER_CLASSES,
                                  reconstructed=True)
        ambiguity_margin: float = knob(0.05, "a layer with |R - detail_threshold| <= margin is ambiguous and not "
                                       "pruned (appendix fallback; 0 = off)", low=0.0, high=1.0)
        ambiguity_scope: str = knob("layer", "an ambiguous layer runs dense ('layer') or makes its sample prune no "
                                    "layer ('sample')", choices=AMBIGUITY_SCOPES, reconstructed=True)
        min_region_keep: float = knob(0.1, "every cell of the regions x regions grid keeps at least this share of "
                                      "its tokens: floors the kept count (appendix fallback; 0 = off)", low=0.0,
                                      high=1.0)
        regions: int = knob(4, "cells per side of the region grid of min_region_keep", low=1)
        normalization: str = knob("max", "H-hat: H/max H, entropy rank in [0,1], or the literal H/sum H",
                                  choices=NORMALIZATIONS, reconstructed=True)
        realisation: str = knob("deterministic", "prune round(sum of probabilities) tokens, or a seeded Bernoulli "
                                "count", choices=REALISATIONS, reconstructed=True)
        seed: int = knob(0, "seed of the Bernoulli gate (realisation='bernoulli')", low=0)
        entropy_source: str = knob("previous_scale", "gate entropies: same block at the previous observed scale, "
                                   "or block l-1 at this scale", choices=GATE_SOURCES, reconstructed=True)

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.alpha_min > self.alpha_max:
                raise ValueError(f"schedule 'toprovar_gate': alpha_min={self.alpha_min} exceeds "
                                 f"alpha_max={self.alpha_max}")

    # ------------------------------------------------------------------------------------------------ helpers
    @staticmethod
    def _state(signals: Signals) -> dict:
        return signals.extras[EXTRAS_KEY]

    def _classifies_at(self, si: int, num_scales: int, signals: Signals) -> bool:
        """Whether the end of scale ``si`` (re)classifies the layers (every block's map is observed there)."""
        s_rep0 = self.config.s_rep - 1
        if si == s_rep0:
            return True
        return (self.config.layer_classes == "per_scale" and si > s_rep0
                and may_prune_next(si, num_scales, signals))

    def _detail_blocks(self, signals: Signals) -> set[int]:
        detail_BL = self._state(signals).get("detail_BL")
        if detail_BL is None:
            return set()
        return set(detail_BL.any(0).nonzero().flatten().tolist())

    def _attention_blocks(self, ctx, signals: Signals) -> set[int]:
        si, s_rep0 = ctx.scale_index, self.config.s_rep - 1
        if si < s_rep0:
            return set()
        if self._classifies_at(si, ctx.num_scales, signals):
            return set(range(ctx.num_blocks))
        detail = self._detail_blocks(signals)
        if self.config.entropy_source == "previous_layer":
            # block l-1 of this scale (block 0 falls back to its latest earlier map: s_rep's at least)
            pruning = signals.pruning_now and may_prune_at(si, signals)
            return {b - 1 for b in detail if b >= 1} if pruning else set()
        return detail if may_prune_next(si, ctx.num_scales, signals) else set()

    def _gate_entropy(self, ctx, block: int, signals: Signals) -> torch.Tensor | None:
        """``[B, N]`` entropies behind the gate of ``block`` at ``ctx`` (see ``entropy_source``)."""
        B, (h, w), si = ctx.batch_size, ctx.hw, ctx.scale_index
        if self.config.entropy_source == "previous_layer" and block >= 1:
            current = signals.attention_entropy.get((si, block - 1))
            if current is not None:
                return fill_missing(current[:B], "row_mean")
        for sj in range(si - 1, -1, -1):
            earlier = signals.attention_entropy.get((sj, block))
            if earlier is None:
                continue
            hj, wj = signals.info.scale_hw[sj]
            filled = fill_missing(earlier[:B], "row_mean").view(B, 1, hj, wj)
            return F.interpolate(filled, size=(h, w), mode="bilinear", align_corners=False).view(B, h * w)
        return None

    def _s_max(self, num_scales: int) -> int:
        return self.config.s_max or num_scales

    # ------------------------------------------------------------------------------------------------ slots
    def check_model(self, info) -> None:
        if self.config.s_rep >= info.num_scales:
            raise ValueError(
                f"s_rep={self.config.s_rep} but the model has {info.num_scales} scales: the representative scale "
                f"(1-indexed) must come before the last one so that later scales can be pruned (the paper's 6 "
                f"assumes Infinity's 13-scale schedule); pass e.g. --set schedule.s_rep={max(1, info.num_scales - 2)}")

    def start(self, info, signals: Signals) -> None:
        self.check_model(info)
        # nothing is pruned before s_rep (0-indexed: scale s_rep is the first after it), so attention statistics
        # read only at pruned scales (the attention scorer's maps) are not computed earlier
        publish_first_prunable(signals, self.config.s_rep)
        signals.extras[EXTRAS_KEY] = dict(R_BL=None, sigma_ratio_BL=None, detail_BL=None, classified_at=None,
                                          R_by_scale={}, prune_fraction={})

    def needs(self, ctx, signals: Signals) -> Needs:
        blocks = self._attention_blocks(ctx, signals)
        return Needs(attention_blocks=frozenset(blocks)) if blocks else NO_NEEDS

    def observe_attention(self, ctx, block, probs_RHnL, keep_Rn, signals: Signals) -> None:
        if block in self._attention_blocks(ctx, signals):
            record_attention_entropy(signals, ctx, block, probs_RHnL, keep_Rn)

    def end_scale(self, ctx, record, signals: Signals) -> None:
        cfg = self.config
        si = ctx.scale_index
        if record.skipped or not self._classifies_at(si, ctx.num_scales, signals):
            return
        B, (h, w), L = ctx.batch_size, ctx.hw, ctx.num_blocks
        ratio = torch.full((B, L), float("inf"), dtype=torch.float64)
        observed = {}
        for block in range(L):
            entropy = signals.attention_entropy.get((si, block))
            if entropy is None:
                continue  # never observed: R = 0, Global
            observed[block] = layer_score(fill_missing(entropy[:B], "row_mean").view(B, h, w), cfg.beta)[0]
        if observed:  # one copy to the host for every block (issue 27)
            ratio[:, list(observed)] = torch.stack(list(observed.values()), 1).cpu()
        state = self._state(signals)
        R_BL = torch.exp(-cfg.beta * (ratio - 1.0))
        state["sigma_ratio_BL"], state["R_BL"], state["classified_at"] = ratio, R_BL, si
        state["detail_BL"] = detail_layers(R_BL, cfg.detail_threshold, cfg.ambiguity_margin, cfg.ambiguity_scope)
        state["R_by_scale"][si] = R_BL

    def prunes_scale(self, ctx, signals) -> bool:
        detail_BL = self._state(signals)["detail_BL"]
        if ctx.scale_index < self.config.s_rep or detail_BL is None:
            return False
        return bool((detail_BL.any(1) & started_B(ctx, signals)).any())

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        cfg = self.config
        si, N = ctx.scale_index, ctx.num_tokens
        state = self._state(signals)
        R_BL, detail_BL = state["R_BL"], state["detail_BL"]
        if si < cfg.s_rep or R_BL is None:
            return None  # layer classes unknown until the end of s_rep: every layer counts as Global
        R_B = R_BL[:, block]
        active_B = detail_BL[:, block] & started_B(ctx, signals)
        if not bool(active_B.any()):
            return None  # a Global (or ambiguous) layer for every accelerated sample: dense
        entropy_BN = self._gate_entropy(ctx, block, signals)
        if entropy_BN is None:
            return None
        p_prune = prune_probability(entropy_BN, phi(si + 1, self._s_max(ctx.num_scales)), R_B, cfg.alpha_min,
                                    cfg.alpha_max, cfg.normalization)
        generator = None
        if cfg.realisation == "bernoulli":
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + si * 1009 + block)
        pruned_B = pruned_count(p_prune, cfg.realisation, generator).cpu()
        floor = min(N, region_floor(ctx.hw, cfg.regions, cfg.min_region_keep))
        keep_B = (N - pruned_B).clamp(floor, N)
        state["prune_fraction"][(si, block)] = torch.where(active_B, (N - keep_B) / N, 0.0)
        return counts_for_rows(ctx, keep_B, active_B, scores_RN.shape[0], scores_RN.device)
