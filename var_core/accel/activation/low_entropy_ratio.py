"""ToProVAR's pruning depth D: the first scale whose low-entropy-token ratio crosses τ (specs/methods.md §4.2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention_stats import entropy_source_blocks, record_attention_entropy
from ..base import NO_NEEDS, Activation, Needs, Signals
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import ACTIVATIONS

EXTRAS_KEY = "low_entropy_ratio"
COMPARISONS = ("le", "ge")
ENTROPY_SOURCES = ("attention_block0", "attention_mean_previous", "predictive")
FIRST_ACCELERATED = ("after", "at")


def below_mean_ratio(entropy_BN: torch.Tensor) -> torch.Tensor:
    """``ρ = |{i : H_i < mean_j H_j}| / N`` per row (ToProVAR Eq. 3), ``[B]``; NaN entries (uncomputed queries) are
    left out of both the mean and the count."""
    ent = entropy_BN.double()
    valid = ~torch.isnan(ent)
    count = valid.sum(-1)
    mean = torch.where(valid, ent, 0.0).sum(-1) / count.clamp(min=1)
    below = (valid & (ent < mean.unsqueeze(-1))).sum(-1)
    return torch.where(count > 0, below / count.clamp(min=1), torch.full_like(mean, float("nan")))


def depth_fires(rho_B: torch.Tensor, tau: float, comparison: str) -> torch.Tensor:
    """bool ``[B]``: ``ρ ≤ τ`` (``le``, appendix) or ``ρ ≥ τ`` (``ge``, main text); NaN never fires."""
    if comparison == "le":
        return rho_B <= tau
    if comparison == "ge":
        return rho_B >= tau
    raise ValueError(f"unknown comparison {comparison!r}; choose one of {COMPARISONS}")


@ACTIVATIONS.register("low_entropy_ratio")
class LowEntropyRatio(Activation):
    """ToProVAR (arXiv 2602.22948) §4.2: accelerate from the depth D where ρ_s crosses τ. Knob: ``tau`` (0.4).

    ``ρ_s`` = fraction of the tokens of scale s whose entropy is below the scale's mean (per sample; the sample's
    conditional row, or the only computed half). The test runs at every scale with at least ``min_test_tokens``
    tokens until it fires (on 1, 4 or 9 tokens ρ is degenerate: a single token is never below its own mean, so
    ``le`` would fire at the first scale); if it never fires, nothing is accelerated.

    RECONSTRUCTED parts (each an option; defaults first):

    * ``comparison`` — ``le``: ``D = min{s : ρ_s ≤ τ}`` (appendix: calibration and error bound; ρ decreases with
      scale) / ``ge``: ``ρ_s ≥ τ`` (main text, Eq. 3 as printed).
    * ``entropy_source`` — which entropy map of scale s gives ρ_s: ``attention_block0`` (head-averaged attention
      entropy of block 0, observed with eager attention on block 0 only) / ``attention_mean_previous`` (the mean
      over all blocks of scale s, i.e. "the previous scale" seen from the first accelerated one; eager attention on
      every block while undecided) / ``predictive`` (entropy of the final, guided logits; free).
    * ``first_accelerated`` — ``after`` (default; D = s + 1, the spec's consolidated loop) / ``at`` (D = s, the
      paper's own indexing: scale s is pruned from block 1 on, right after block 0's attention gave ρ_s). ``at``
      exists only with ``attention_block0`` (the other maps are complete only after scale s has run).
      FRAMEWORK LIMITATION: ``AccelPolicy`` asks the activation once per scale, before block 0. ``at`` therefore
      reports undecided samples as provisionally active at each testable scale and publishes the decision in
      ``signals.activation_scale_B`` after block 0; a schedule must keep rows whose sample's activation scale is
      after the current scale dense (every NOVA/ToProVAR/LD schedule in this package does). At the end of such a
      scale this component checks ``record.kept_tokens`` and raises if block 0, or a sample that did not fire, was
      pruned (a schedule that ignores ``activation_scale_B``, e.g. ``fixed_table``).

    Diagnostics: ``signals.extras["low_entropy_ratio"]["rho_BK"]`` (ρ per sample and tested scale, NaN elsewhere).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        tau: float = knob(0.4, "threshold on the fraction of below-mean-entropy tokens", low=0.0, high=1.0,
                          low_open=True, high_open=True, search=SearchSpace("float", 0.2, 0.6))
        comparison: str = knob("le", "'le' D = min{s: rho_s <= tau} (appendix) or 'ge' rho_s >= tau (main text)",
                               choices=COMPARISONS, reconstructed=True)
        entropy_source: str = knob("attention_block0", "entropy map behind rho_s: block-0 attention entropy, mean "
                                   "attention entropy over blocks, or final-logit (predictive) entropy",
                                   choices=ENTROPY_SOURCES, reconstructed=True)
        first_accelerated: str = knob("after", "'after': D = s+1 (s = scale whose rho fired); 'at': D = s, from "
                                      "block 1 on (attention_block0 only)", choices=FIRST_ACCELERATED,
                                      reconstructed=True)
        min_test_tokens: int = knob(16, "scales with fewer tokens are never tested (rho is degenerate there)", low=1)

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.first_accelerated == "at" and self.entropy_source != "attention_block0":
                raise ValueError(
                    f"activation 'low_entropy_ratio': first_accelerated='at' needs rho_s before scale s's pruned "
                    f"blocks run, which only entropy_source='attention_block0' provides (the "
                    f"{self.entropy_source!r} map of scale s is complete only after the scale); use 'after'")

    # ------------------------------------------------------------------------------------------------ helpers
    def _testable(self, ctx) -> bool:
        if ctx.num_tokens < self.config.min_test_tokens:
            return False
        return self.config.first_accelerated == "at" or not ctx.is_last  # 'after' at the last scale decides nothing

    def _undecided(self, ctx, signals: Signals) -> torch.Tensor:
        return signals.activation_scale_B >= ctx.num_scales

    def _decide(self, ctx, signals: Signals, entropy_RN: torch.Tensor) -> None:
        cfg = self.config
        B, si = ctx.batch_size, ctx.scale_index
        rho = below_mean_ratio(entropy_RN[:B]).cpu()
        signals.extras[EXTRAS_KEY]["rho_BK"][:, si] = rho.float()
        first_B = signals.activation_scale_B
        fired = depth_fires(rho, cfg.tau, cfg.comparison) & (first_B >= ctx.num_scales)
        target = si if cfg.first_accelerated == "at" else si + 1
        signals.activation_scale_B = torch.where(fired, torch.full_like(first_B, target), first_B)

    # ------------------------------------------------------------------------------------------------ slots
    def start(self, info, signals: Signals) -> None:
        B, K = info.batch_size, info.num_scales
        signals.activation_scale_B = torch.full((B,), K, dtype=torch.long)
        signals.extras[EXTRAS_KEY] = dict(rho_BK=torch.full((B, K), float("nan")), provisional_B=None)

    def active_B(self, ctx, signals: Signals) -> torch.Tensor:
        started = signals.activation_scale_B <= ctx.scale_index
        provisional = None
        if self.config.first_accelerated == "at" and self._testable(ctx):
            provisional = self._undecided(ctx, signals)
            if not bool(provisional.any()):
                provisional = None
        signals.extras[EXTRAS_KEY]["provisional_B"] = provisional
        return started if provisional is None else started | provisional

    def needs(self, ctx, signals: Signals) -> Needs:
        blocks = entropy_source_blocks(self.config.entropy_source, ctx.num_blocks)
        if not blocks or not self._testable(ctx) or not bool(self._undecided(ctx, signals).any()):
            return NO_NEEDS
        return Needs(attention_blocks=blocks)

    def observe_attention(self, ctx, block, probs_RHnL, keep_Rn, signals: Signals) -> None:
        source = self.config.entropy_source
        if source == "predictive" or (source == "attention_block0" and block != 0):
            return
        if not self._testable(ctx) or not bool(self._undecided(ctx, signals).any()):
            return
        entropy_RN = record_attention_entropy(signals, ctx, block, probs_RHnL, keep_Rn)
        if source == "attention_block0":
            self._decide(ctx, signals, entropy_RN)

    def end_scale(self, ctx, record, signals: Signals) -> None:
        cfg = self.config
        si = ctx.scale_index
        provisional = signals.extras[EXTRAS_KEY].get("provisional_B")
        if provisional is not None:
            self._check_provisional(ctx, record, signals, provisional)
            signals.extras[EXTRAS_KEY]["provisional_B"] = None
        if cfg.entropy_source == "attention_block0" or record.skipped or not self._testable(ctx):
            return
        if not bool(self._undecided(ctx, signals).any()):
            return
        if cfg.entropy_source == "predictive":
            self._decide(ctx, signals, signals.token_entropy(si))
            return
        maps = [signals.attention_entropy.get((si, block)) for block in range(ctx.num_blocks)]
        maps = [m for m in maps if m is not None]
        if maps:
            self._decide(ctx, signals, torch.stack(maps).nanmean(0))

    @staticmethod
    def _check_provisional(ctx, record, signals: Signals, provisional_B: torch.Tensor) -> None:
        if record.skipped or not record.kept_tokens:
            return
        N = ctx.num_tokens
        not_fired = provisional_B & (signals.activation_scale_B > ctx.scale_index)
        blocks = range(len(record.kept_tokens)) if bool(not_fired.any()) else range(1)
        for block in blocks:
            if any(n < N for n in record.kept_tokens[block]):
                raise RuntimeError(
                    f"activation 'low_entropy_ratio' with first_accelerated='at': scale {ctx.scale_index} block "
                    f"{block} computed {min(record.kept_tokens[block])} of {N} tokens for a sample whose depth test "
                    f"had not fired (yet). 'at' needs a schedule that keeps rows dense before "
                    f"signals.activation_scale_B (e.g. toprovar_gate, scale_linkage, energy_fraction); this one "
                    f"ignores it. Use first_accelerated='after' with this schedule.")
