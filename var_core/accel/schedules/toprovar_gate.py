"""ToProVAR's layer (Global/Detail) and token (entropy gate) levels as a schedule (specs/methods.md §4.3–4.4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention_stats import fill_missing, may_prune_at, may_prune_next, record_attention_entropy
from ..base import NO_NEEDS, Needs, Schedule, Signals
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCHEDULES
from ._linkage_math import counts_for_rows, started_B

EXTRAS_KEY = "toprovar_gate"
NORMALIZATIONS = ("max", "rank", "literal")
REALISATIONS = ("deterministic", "bernoulli")
GATE_SOURCES = ("previous_scale", "previous_layer")


# ------------------------------------------------------------------------------------------------ pure formulas
def layer_score(entropy_map_Bhw: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ToProVAR Eq. 4: ``ϱ = σ1/σ2`` of the (h × w) entropy map and ``R = exp(−β(ϱ − 1))``, per sample ``[B]``.

    A map with ``σ2 = 0`` (rank one, or a single row/column) has ``ϱ = inf`` and ``R = 0`` (Global)."""
    sigma = torch.linalg.svdvals(entropy_map_Bhw.double())
    if sigma.shape[-1] < 2:
        ratio = torch.full(sigma.shape[:-1], float("inf"), dtype=torch.float64, device=sigma.device)
    else:
        s1, s2 = sigma[..., 0], sigma[..., 1]
        ratio = torch.where(s2 > 0, s1 / s2.clamp(min=torch.finfo(torch.float64).tiny),
                            torch.full_like(s1, float("inf")))
    return ratio, torch.exp(-beta * (ratio - 1.0))


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

    Layer level (once per image): at the representative scale ``s_rep`` (1-indexed; paper: 6) every block's
    head-averaged attention-entropy map (h × w, the sample's conditional row) gives ``ϱ = σ1/σ2`` and
    ``R = exp(−β(ϱ − 1))``; ``R > detail_threshold`` → Detail layer, else Global (dense: the schedule returns
    dense counts). Before and at ``s_rep`` every layer is unknown → dense; before the activation scale D
    (``signals.activation_scale_B``, e.g. ``low_entropy_ratio``) every row is dense.
    Token level (Detail layers, s ≥ D): ``1 − P_keep_i = clip(α_min + (α_max − α_min)·φ(s)·R·Ĥ_i, 0, 1)`` with
    ``φ(s) = s/S_max`` (1-indexed s); the row keeps ``N − n`` tokens. WHICH tokens is the scorer's job: ToProVAR
    prunes the highest-entropy tokens, i.e. pair this schedule with an attention-entropy scorer that keeps the
    low-entropy ones.

    RECONSTRUCTED parts (each an option; defaults first):

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

    Diagnostics in ``signals.extras["toprovar_gate"]``: ``sigma_ratio_BL``, ``R_BL`` (per sample and block) and
    ``prune_fraction[(si, block)]``.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        s_rep: int = knob(6, "representative scale (1-indexed NUMBER) whose attention-entropy maps classify layers",
                          low=1, search=SearchSpace("int", 4, 8))
        beta: float = knob(0.05, "R = exp(-beta (sigma1/sigma2 - 1)); Detail when R > detail_threshold", low=0.0,
                           low_open=True, search=SearchSpace("float", 0.01, 2.0, log=True))
        detail_threshold: float = knob(0.5, "layers with R above this are Detail layers (pruned)", low=0.0,
                                       high=1.0, low_open=True, high_open=True,
                                       search=SearchSpace("float", 0.2, 0.8))
        alpha_min: float = knob(0.1, "pruning probability of a zero-entropy token", low=0.0, high=1.0,
                                search=SearchSpace("float", 0.0, 0.5))
        alpha_max: float = knob(0.9, "pruning probability at q = 1 (max entropy, last scale, R = 1)", low=0.0,
                                high=1.0, search=SearchSpace("float", 0.5, 1.0))
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

    def _detail_blocks(self, signals: Signals) -> set[int]:
        R_BL = self._state(signals).get("R_BL")
        if R_BL is None:
            return set()
        return set((R_BL > self.config.detail_threshold).any(0).nonzero().flatten().tolist())

    def _attention_blocks(self, ctx, signals: Signals) -> set[int]:
        si, s_rep0 = ctx.scale_index, self.config.s_rep - 1
        if si == s_rep0:
            return set(range(ctx.num_blocks))
        if si < s_rep0:
            return set()
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

    # ------------------------------------------------------------------------------------------------ slots
    def check_model(self, info) -> None:
        if self.config.s_rep >= info.num_scales:
            raise ValueError(
                f"s_rep={self.config.s_rep} but the model has {info.num_scales} scales: the representative scale "
                f"(1-indexed) must come before the last one so that later scales can be pruned (the paper's 6 "
                f"assumes Infinity's 13-scale schedule); pass e.g. --set schedule.s_rep={max(1, info.num_scales - 2)}")

    def start(self, info, signals: Signals) -> None:
        self.check_model(info)
        signals.extras[EXTRAS_KEY] = dict(R_BL=None, sigma_ratio_BL=None, prune_fraction={})

    def needs(self, ctx, signals: Signals) -> Needs:
        blocks = self._attention_blocks(ctx, signals)
        return Needs(attention_blocks=frozenset(blocks)) if blocks else NO_NEEDS

    def observe_attention(self, ctx, block, probs_RHnL, keep_Rn, signals: Signals) -> None:
        if block in self._attention_blocks(ctx, signals):
            record_attention_entropy(signals, ctx, block, probs_RHnL, keep_Rn)

    def end_scale(self, ctx, record, signals: Signals) -> None:
        if ctx.scale_index != self.config.s_rep - 1:
            return
        B, (h, w), L = ctx.batch_size, ctx.hw, ctx.num_blocks
        ratio = torch.full((B, L), float("inf"), dtype=torch.float64)
        for block in range(L):
            entropy = signals.attention_entropy.get((ctx.scale_index, block))
            if entropy is None or record.skipped:
                continue  # never observed (skipped scale): R = 0, Global
            ratio[:, block] = layer_score(fill_missing(entropy[:B], "row_mean").view(B, h, w),
                                          self.config.beta)[0].cpu()
        state = self._state(signals)
        state["sigma_ratio_BL"] = ratio
        state["R_BL"] = torch.exp(-self.config.beta * (ratio - 1.0))

    def prunes_scale(self, ctx, signals) -> bool:
        if ctx.scale_index < self.config.s_rep or self._state(signals)["R_BL"] is None:
            return False
        detail_B = (self._state(signals)["R_BL"] > self.config.detail_threshold).any(1)
        return bool((detail_B & started_B(ctx, signals)).any())

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        cfg = self.config
        si, N = ctx.scale_index, ctx.num_tokens
        R_BL = self._state(signals)["R_BL"]
        if si < cfg.s_rep or R_BL is None:
            return None  # layer classes unknown until the end of s_rep: every layer counts as Global
        R_B = R_BL[:, block]
        active_B = (R_B > cfg.detail_threshold) & started_B(ctx, signals)
        if not bool(active_B.any()):
            return None  # a Global layer (for every accelerated sample): dense
        entropy_BN = self._gate_entropy(ctx, block, signals)
        if entropy_BN is None:
            return None
        phi = (si + 1) / ctx.num_scales
        p_prune = prune_probability(entropy_BN, phi, R_B, cfg.alpha_min, cfg.alpha_max, cfg.normalization)
        generator = None
        if cfg.realisation == "bernoulli":
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + si * 1009 + block)
        pruned_B = pruned_count(p_prune, cfg.realisation, generator).cpu()
        keep_B = (N - pruned_B).clamp(0, N)
        self._state(signals)["prune_fraction"][(si, block)] = torch.where(active_B, pruned_B / N, 0.0)
        return counts_for_rows(ctx, keep_B, active_B, scores_RN.shape[0], scores_RN.device)
