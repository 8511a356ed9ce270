"""NOVA's adaptive acceleration activation: the inflection of scale-entropy growth (specs/methods.md §2.2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Activation, Signals
from ..entropy import SCALE_ENTROPY_DEFINITIONS
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import ACTIVATIONS
from ._entropy_growth import (FIRST_ACCELERATED, GROWTH_TESTS, REFERENCES, SCOPES, SMOOTHINGS, first_test_scale,
                              fires_at, growth, growth_reference, quorum_size, scale_entropy_curve)

EXTRAS_KEY = "entropy_inflection"


@ACTIVATIONS.register("entropy_inflection")
class EntropyInflection(Activation):
    """NOVA (arXiv 2602.01345) §2.2: accelerate once the growth of the scale entropy flattens. Knob: ``alpha``.

    Per sample, at the end of every scale (paper index ``t = si + 1``): ``H_t`` = scale entropy of the sampled
    distribution (``definition``), ``g_t = H_t − H_{t−1}``, ``δ_t`` = smoothed growth, ``ḡ`` = reference over the
    early growths ``g_2 … g_{t_est}``; the test ``δ_t < α·ḡ`` fires once at ``t*`` and scales ``t > t*`` are
    accelerated (``signals.activation_scale_B = t*`` in 0-indexed terms, i.e. the first accelerated scale). If it
    never fires, nothing is accelerated. ``t_est`` is a 1-indexed scale NUMBER (the paper's t_est = 5 means the
    first five scales, 0-indexed 0..4, form the reference; the earliest test is at the end of scale t = 6).

    RECONSTRUCTED parts (each an option; defaults first):

    * ``definition`` — ``mean`` per-token entropy / ``sum`` per-scale total / ``normalized`` mean over the maximum
      per-token entropy. Default ``mean``: methods.md's H_t. The inflection decision is invariant to the positive
      factor of ``normalized`` (same t* as ``mean``); ``sum`` grows with the token count.
    * ``growth_test`` — ``signed`` (default): the literal ``δ_t < α·ḡ`` of the spec (methods.md §2.2: "δ_t
      falls for the first time below a baseline"), ``magnitude``: ``|δ_t| < α·|ḡ|`` (``|mean|`` or ``max |g|`` for the
      reference). On NOVA's rising Infinity curves (Fig. 4(b)) the two agree as long as the growth stays
      non-negative. On a codebook VAR the per-token mean FALLS with scale (MEASURED on our VAR testbed: 3.5 nats at
      scale 1, ~1.5 by scale 5, then flat with bumps), so ``ḡ < 0`` and the signed test can only fire while the
      entropy still falls fast (δ below α times the early fall); once the curve flattens it never fires. The
      magnitude test detects that flattening on falling and rising curves alike: choose it for codebook VARs.
      (``sum`` keeps growing with the token count on a codebook VAR and never flattens, so it does not fire there
      either way.)
    * ``smoothing`` — ``backward`` ``δ_t = (g_{t−1} + g_t)/2`` (online form of the write-up's forward pair) /
      ``none`` ``δ_t = g_t``.
    * ``reference`` — ``mean`` / ``max`` of ``g_2 … g_{t_est}``.
    * ``first_accelerated`` — ``after``: the first accelerated scale is ``t* + 1`` with
      ``t* = min{t > t_est : δ_t < α·ḡ}``. ``at``: scale ``t*`` itself is accelerated; online this is only possible
      if the test for ``t*`` uses growth up to ``t* − 1``, so ``t* = min{t > t_est : δ_{t−1} < α·ḡ}``. Both
      accelerate the scale after the one whose end fired the test; ``at`` allows the test one scale earlier (at
      the end of scale ``t_est``), so acceleration can start at ``t_est + 1`` instead of ``t_est + 2``.
    * ``scope`` — how a batch decides (NOVA Table 9 runs batch 5, the paper does not say how; RECONSTRUCTED):
      ``sample`` (default): every sample on its own test, so a sample's result does not depend on its batch
      (a never-firing sample keeps its own rows dense, but the batch still pays its padded attention);
      ``batch``: the whole batch is accelerated from the scale after the one at whose end at least
      ``ceil(batch_share·B)`` samples have fired their own test (a quorum; ``batch_share = 1`` waits for every
      sample, a small share follows the first one); ``pooled``: one test on the batch-mean curve
      ``H_t = mean_b H_{b,t}`` (what a batched implementation gets by averaging the scale entropy over the whole
      batch tensor). With ``batch`` or ``pooled`` a sample's pruning depends on its neighbours; at batch 1 all three
      are the same rule.

    Diagnostics: ``signals.extras["entropy_inflection"]`` holds ``H_BK`` (curve so far; one row with ``pooled``),
    ``growth_BK``, ``reference_B`` (as used by ``growth_test``), ``t_star_B`` (0-indexed scale whose end fired the
    test, −1 = not fired; the sample's own test with ``batch``, the batch curve's with ``pooled``) and
    ``batch_t_star`` (batch scopes: the scale whose end switched the batch on, −1 = not yet). With ``after``,
    ``activation_scale_B`` (0-indexed first accelerated scale) is numerically the paper's 1-indexed t*. A
    ``t_est`` at or beyond the number of scales never tests, so never accelerates.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        t_est: int = knob(5, "last scale (1-indexed NUMBER, >= 2) of the early-growth reference window g_2..g_t_est",
                          low=2, search=SearchSpace("int", 2, 7), unit="scale_number")
        alpha: float = knob(0.5, "the test fires when the smoothed growth drops below alpha x the reference",
                            low=0.0, high=1.0, low_open=True, search=SearchSpace("float", 0.1, 1.0))
        definition: str = knob("mean", "scale entropy H_t: per-token mean, per-scale sum, or mean / max entropy",
                               choices=SCALE_ENTROPY_DEFINITIONS, reconstructed=True)
        growth_test: str = knob("signed", "'signed' delta < alpha ref (the spec's literal test) or 'magnitude' "
                                "|delta| < alpha |ref| (also fires on falling codebook-VAR curves)",
                                choices=GROWTH_TESTS, reconstructed=True)
        smoothing: str = knob("backward", "delta_t = (g_{t-1}+g_t)/2 ('backward', online) or g_t ('none')",
                              choices=SMOOTHINGS, reconstructed=True)
        reference: str = knob("mean", "early-growth reference: mean or max over g_2..g_t_est", choices=REFERENCES,
                              reconstructed=True)
        first_accelerated: str = knob("after", "'after': scales t > t* are accelerated; 'at': t* itself (its test "
                                      "uses growth up to t*-1)", choices=FIRST_ACCELERATED, reconstructed=True)
        scope: str = knob("sample", "'sample': each sample on its own test; 'batch': the whole batch once a share "
                          "batch_share of its samples fired; 'pooled': one test on the batch-mean entropy curve",
                          choices=SCOPES, reconstructed=True)
        batch_share: float = knob(0.5, "scope='batch': share of the batch's samples that must have fired (at least "
                                  "one sample; 1 = all of them)", low=0.0, high=1.0, low_open=True)

    def start(self, info, signals: Signals) -> None:
        B, K = info.batch_size, info.num_scales
        signals.activation_scale_B = torch.full((B,), K, dtype=torch.long)
        signals.extras[EXTRAS_KEY] = dict(t_star_B=torch.full((B,), -1, dtype=torch.long), batch_t_star=-1)

    def active_B(self, ctx, signals: Signals) -> torch.Tensor:
        return signals.activation_scale_B <= ctx.scale_index

    def end_scale(self, ctx, record, signals: Signals) -> None:
        cfg = self.config
        si, K = ctx.scale_index, ctx.num_scales
        first_B = signals.activation_scale_B
        undecided = first_B >= K
        if not bool(undecided.any()):
            return  # every sample has fired: nothing left to measure
        H = scale_entropy_curve(signals, si, cfg.definition)
        if H is None:
            return
        if cfg.scope == "pooled":
            H = H.mean(0, keepdim=True)  # one curve for the batch (NaN where a scale was skipped)
        diag = signals.extras[EXTRAS_KEY]
        diag["H_BK"], diag["growth_BK"] = H, growth(H)
        if si >= cfg.t_est - 1:
            diag["reference_B"] = growth_reference(diag["growth_BK"], cfg.t_est, cfg.reference, cfg.growth_test)
        if si < first_test_scale(cfg.t_est, cfg.first_accelerated):
            return
        fired = fires_at(H, si, t_est=cfg.t_est, alpha=cfg.alpha, reference=cfg.reference,
                         smoothing=cfg.smoothing, test=cfg.growth_test).cpu()
        t_star = diag["t_star_B"]
        if cfg.scope == "sample":
            fired = fired & undecided
            signals.activation_scale_B = torch.where(fired, torch.full_like(first_B, si + 1), first_B)
            diag["t_star_B"] = torch.where(fired, torch.full_like(first_B, si), t_star)
            return
        if cfg.scope == "pooled":
            fired = fired.expand(first_B.shape[0])
        diag["t_star_B"] = torch.where(fired & (t_star < 0), torch.full_like(t_star, si), t_star)
        have_fired = int((diag["t_star_B"] >= 0).sum())
        if have_fired >= quorum_size(first_B.shape[0], cfg.batch_share if cfg.scope == "batch" else 1.0):
            signals.activation_scale_B = torch.full_like(first_B, si + 1)
            diag["batch_t_star"] = si
