"""LD-Pruning's SATS: stop a sample's guidance once its conditional and unconditional predictions agree."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...engine.context import GuidanceMode
from ..base import KEEP_GUIDANCE, Guidance, GuidanceDecision, Signals
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import GUIDANCES

SPACES = ("auto", "expected_code", "probabilities", "logits")
SPACES_BY_FAMILY = {"infinity": ("expected_code", "probabilities", "logits"), "var": ("probabilities", "logits")}
AUTO_SPACE = {"infinity": "expected_code", "var": "probabilities"}


def prediction_features(logits_BNV: torch.Tensor, family: str, space: str) -> torch.Tensor:
    """The per-token quantity whose cond/uncond difference SATS measures (float32, any trailing shape).

    ``expected_code`` (Infinity): ``s·(2p−1)`` per bit, ``p`` = probability of bit value 1 (class ``2b+1``),
    ``s = 1/√d`` — the expected residual code. ``probabilities``: the predictive distribution (per bit for
    Infinity, over the codebook for VAR). ``logits``: the raw logits.
    """
    x = logits_BNV.float()
    if space == "logits":
        return x
    if family == "infinity":
        B, N, two_d = x.shape
        p = torch.softmax(x.view(B, N, two_d // 2, 2), dim=-1)  # [B, N, d, 2]
        if space == "probabilities":
            return p
        if space == "expected_code":
            return (2 * p[..., 1] - 1) / math.sqrt(two_d // 2)  # [B, N, d]
    elif space == "probabilities":
        return torch.softmax(x, dim=-1)
    raise ValueError(f"SATS space {space!r} is not available for the {family!r} family; "
                     f"available: {SPACES_BY_FAMILY.get(family, ('probabilities', 'logits'))}")


def guidance_discrepancy(cond_BNV: torch.Tensor, uncond_BNV: torch.Tensor, family: str, space: str,
                         normalization: str = "cond", eps: float = 1e-8) -> torch.Tensor:
    """γ per sample ``[B]`` (specs §3.2): ``‖f(c) − f(u)‖_F / ‖f(c)‖_F`` over all tokens of the scale.

    ``normalization='symmetric'`` divides by the mean of both norms instead.
    """
    fc = prediction_features(cond_BNV, family, space).flatten(1)
    fu = prediction_features(uncond_BNV, family, space).flatten(1)
    diff = (fc - fu).norm(dim=1)
    if normalization == "cond":
        denom = fc.norm(dim=1)
    elif normalization == "symmetric":
        denom = 0.5 * (fc.norm(dim=1) + fu.norm(dim=1))
    else:
        raise ValueError(f"unknown SATS normalization {normalization!r}; choose 'cond' or 'symmetric'")
    return diff / (denom + eps)


@GUIDANCES.register("sats")
class SATS(Guidance):
    """LD-Pruning §3.2 SATS: per sample, once ``γ_k < δ`` the sample is conditional-only at every later scale.

    Knob that matters: ``delta`` (δ = 0.15). ``γ_k`` (RECONSTRUCTED, specs §3.2) is measured on the raw head
    outputs of scale k's conditional and unconditional rows (before the sampler's temperature and filters), in
    the space chosen by ``space`` (RECONSTRUCTED): ``expected_code`` (Infinity only: the expected residual code
    ``s(2p−1)`` per bit — the spec's default), ``probabilities`` (per-bit for Infinity, codebook distribution for
    VAR), ``logits``; ``auto`` (default) = ``expected_code`` on Infinity, ``probabilities`` on VAR. The spec's
    codebook-VAR form (expected code embedding ``Σ_v p_v e_v``) needs the codebook, which components cannot see;
    ``probabilities`` is the available stand-in. ``normalization`` (RECONSTRUCTED): ``cond`` (÷ ‖f(c)‖, the spec)
    or ``symmetric`` (÷ mean of both norms). ``min_scale``: no test before that scale (a guard not in the source;
    default 0 = none; the spec suggests K/2).

    A sample whose γ falls below δ at scale k uses its conditional logits from scale k+1 on (``cond_only_B``,
    outputs equal a physical row drop); once every sample has stopped the uncond rows are dropped physically
    (``COND_ONLY``), which halves the remaining compute. ``signals.extras["sats_stop_scale"]``: int64 ``[B]``,
    the first conditional-only scale of each sample (``num_scales`` = never); ``["sats_gamma"]``: γ per scale.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        delta: float = knob(0.15, "threshold δ on the cond/uncond discrepancy γ_k (stop when γ_k < δ)", low=0.0,
                            search=SearchSpace("float", low=0.02, high=0.5, log=True))
        space: str = knob("auto", "RECONSTRUCTED: where γ_k is measured ('auto' = expected_code on Infinity, "
                          "probabilities on VAR)", choices=SPACES, reconstructed=True)
        normalization: str = knob("cond", "RECONSTRUCTED: γ's denominator, ‖f(c)‖ ('cond') or the mean of both "
                                  "norms ('symmetric')", choices=("cond", "symmetric"), reconstructed=True)
        min_scale: int = knob(0, "first scale at which the test may fire (0-indexed; -k = k-th from the end)")

    def _resolved_space(self, family: str) -> str:
        return AUTO_SPACE.get(family, "probabilities") if self.config.space == "auto" else self.config.space

    def check_model(self, info) -> None:
        if self._resolved_space(info.family) not in SPACES_BY_FAMILY.get(info.family, ("probabilities", "logits")):
            raise ValueError(f"guidance 'sats': space={self.config.space!r} is not available for the "
                             f"{info.family!r} family (available: {SPACES_BY_FAMILY.get(info.family)}); the "
                             f"codebook expected embedding needs the codebook, which components cannot see")

    def start(self, info, signals: Signals) -> None:
        self.check_model(info)
        self._family = info.family
        self._space = self._resolved_space(info.family)
        self._num_scales = info.num_scales
        m = self.config.min_scale
        self._min_scale = m if m >= 0 else info.num_scales + m
        self._stop_B = torch.full((info.batch_size,), info.num_scales, dtype=torch.long)
        signals.extras["sats_stop_scale"] = self._stop_B
        signals.extras["sats_gamma"] = {}

    def observe_logits(self, ctx, raw_logits_RNV, signals: Signals) -> None:
        if ctx.guidance is not GuidanceMode.BOTH:
            return
        B, si = ctx.batch_size, ctx.scale_index
        gamma_B = guidance_discrepancy(raw_logits_RNV[:B], raw_logits_RNV[B:], self._family, self._space,
                                       self.config.normalization)
        signals.extras["sats_gamma"][si] = gamma_B
        stop_B = self._stop_B.to(gamma_B.device)
        if si >= self._min_scale:
            fires_B = (gamma_B < self.config.delta) & (stop_B >= self._num_scales)
            stop_B = torch.where(fires_B, torch.full_like(stop_B, si + 1), stop_B)
        self._stop_B = stop_B
        signals.extras["sats_stop_scale"] = stop_B

    def decide(self, ctx, signals) -> GuidanceDecision:
        if ctx.guidance is not GuidanceMode.BOTH:
            return KEEP_GUIDANCE
        stopped_B = self._stop_B <= ctx.scale_index
        if bool(stopped_B.all()):
            return GuidanceDecision(mode=GuidanceMode.COND_ONLY)
        if bool(stopped_B.any()):
            return GuidanceDecision(cond_only_B=stopped_B)
        return KEEP_GUIDANCE
