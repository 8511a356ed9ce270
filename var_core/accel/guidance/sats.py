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
    """LD-Pruning §5.2 SATS: per sample, once ``γ_k < δ`` the sample is conditional-only at every later scale.

    Knob that matters: ``delta`` (δ = 0.15, FOUND(paper §6.3)). Where it may act, ``min_scale`` (default −4) and
    ``scales``: the paper runs "SATS at scales 9 to 12" of Infinity's 13 (FOUND(paper §6.1), errata 1), mapped by
    position from the end (−4 … −1) on other schedules. What those four scales are is RECONSTRUCTED (``scales``):

    * ``dropped`` (default): the scales that may run without the unconditional branch — γ is tested from scale
      ``min_scale − 1`` (8 of 13) on, so the branch can stop from 9 on (the paper accelerates "only the detail
      scales {9, 10, 11, 12}", and LHEP starts at 10, so SATS must be what accelerates 9);
    * ``tested``: the scales whose γ is tested — γ_9 … γ_12, the branch stops from 10 at the earliest.

    ``min_scale=0`` removes the guard (γ tested from the first scale on).

    ``γ_k`` (the paper's equation is not in our copy; RECONSTRUCTED, specs §3.2) is measured on scale k's
    conditional and unconditional head outputs, in the space chosen by ``space``: ``expected_code`` (Infinity only:
    the expected residual code ``s(2p−1)`` per bit — the spec's default), ``probabilities`` (per-bit for Infinity,
    codebook distribution for VAR), ``logits``; ``auto`` (default) = ``expected_code`` on Infinity, ``probabilities``
    on VAR. The spec's codebook-VAR form (expected code embedding ``Σ_v p_v e_v``) needs the codebook, which
    components cannot see; ``probabilities`` is the available stand-in. ``temperature`` (RECONSTRUCTED): ``raw``
    (default: the head outputs before the sampler's temperature and filters) or ``sampling`` (the logits divided
    by the run's sampling temperature first — the spec's "temperature-scaled" probabilities; Infinity's τ, 1 on
    VAR). ``normalization`` (RECONSTRUCTED): ``cond`` (÷ ‖f(c)‖, the spec) or ``symmetric`` (÷ mean of both norms).

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
        min_scale: int = knob(-4, "first scale of SATS's window (0-indexed; -k = k-th from the end). LD-Pruning: "
                              "scales 9-12 of 13, i.e. -4; 0 = no guard. What the window means: see 'scales'",
                          unit="scale")
        scales: str = knob("dropped", "RECONSTRUCTED: what min_scale bounds: 'dropped' = the first scale that may "
                           "run without the unconditional branch (γ tested from min_scale-1 on); 'tested' = the "
                           "first scale whose γ is tested (the branch can stop from min_scale+1 on)",
                           choices=("dropped", "tested"), reconstructed=True)
        temperature: str = knob("raw", "RECONSTRUCTED: γ on the raw head outputs ('raw') or on the logits divided "
                                "by the run's sampling temperature ('sampling')", choices=("raw", "sampling"),
                                reconstructed=True)

    def first_tested_scale(self, num_scales: int) -> int:
        """The first scale whose γ is tested (0-indexed) on a ``num_scales`` schedule."""
        m = self.config.min_scale
        first = m if m >= 0 else num_scales + m
        return max(0, first - 1) if self.config.scales == "dropped" else first

    def _resolved_space(self, family: str) -> str:
        return AUTO_SPACE.get(family, "probabilities") if self.config.space == "auto" else self.config.space

    def check_model(self, info) -> None:
        if self._resolved_space(info.family) not in SPACES_BY_FAMILY.get(info.family, ("probabilities", "logits")):
            raise ValueError(f"guidance 'sats': space={self.config.space!r} is not available for the "
                             f"{info.family!r} family (available: {SPACES_BY_FAMILY.get(info.family)}); the "
                             f"codebook expected embedding needs the codebook, which components cannot see")
        m = self.config.min_scale
        if not 0 <= (m if m >= 0 else info.num_scales + m) < info.num_scales:
            raise ValueError(f"guidance 'sats': min_scale={m} is outside the {info.num_scales} scales of this model; "
                             f"use --set guidance.min_scale=<-{info.num_scales}..{info.num_scales - 1}> (0 = no guard)")

    def start(self, info, signals: Signals) -> None:
        self.check_model(info)
        self._family = info.family
        self._space = self._resolved_space(info.family)
        self._num_scales = info.num_scales
        self._min_scale = self.first_tested_scale(info.num_scales)
        sampling = getattr(info, "sampling", None)
        tau = float(getattr(sampling, "temperature", 1.0) or 1.0)
        self._inv_tau = 1.0 / tau if self.config.temperature == "sampling" else 1.0
        self._stop_B = torch.full((info.batch_size,), info.num_scales, dtype=torch.long)
        signals.extras["sats_stop_scale"] = self._stop_B
        signals.extras["sats_gamma"] = {}

    def observe_logits(self, ctx, raw_logits_RNV, signals: Signals) -> None:
        if ctx.guidance is not GuidanceMode.BOTH:
            return
        B, si = ctx.batch_size, ctx.scale_index
        logits = raw_logits_RNV if self._inv_tau == 1.0 else raw_logits_RNV.float() * self._inv_tau
        gamma_B = guidance_discrepancy(logits[:B], logits[B:], self._family, self._space, self.config.normalization)
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
        stopped = stopped_B.cpu()  # one host read per scale: the decision changes which rows run
        if bool(stopped.all()):
            return GuidanceDecision(mode=GuidanceMode.COND_ONLY)
        if bool(stopped.any()):
            return GuidanceDecision(cond_only_B=stopped_B)
        return KEEP_GUIDANCE
