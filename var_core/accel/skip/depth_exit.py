"""ToProVAR's adaptive scale-depth truncation: stop generating at the depth D of the low-entropy-ratio rule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..activation.low_entropy_ratio import COMPARISONS, ENTROPY_SOURCES, below_mean_ratio, depth_fires
from ..attention_stats import entropy_source_blocks, record_attention_entropy
from ..base import NO_NEEDS, Needs, ScaleSkip, Signals, SkipDecision
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SKIPS

EXTRAS_KEY = "depth_exit"
BATCH_RULES = ("all", "any")


@SKIPS.register("depth_exit")
class DepthExit(ScaleSkip):
    """ToProVAR (arXiv 2602.22948) §4.2 "scale depth localisation" as an exit: the scales from D on are not
    generated and the image is decoded from the codes accumulated so far. Knob: ``tau`` (0.4).

    ``ρ_s`` = share of the tokens of scale s whose entropy is below the scale's mean (Eq. 3, per sample: its
    conditional row), tested at every scale with at least ``min_test_tokens`` tokens, except the last (stopping
    after it changes nothing); the first scale s whose test fires is still generated in full and generation stops
    before s + 1, i.e. ``D = s + 1`` (the first scale that is not generated; the spec's consolidated loop; the paper
    prunes "from D" and its own indexing, D = s, cannot be an exit because ρ_s needs scale s computed). If ρ never
    crosses τ the sample is generated in full (the appendix's "no scale pruning" fallback). This is the
    "Scale Depth Loc." arm of ToProVAR Table 10 (0.47 s, GenEval 0.477 on Infinity-2B, against 0.41 s / 0.403 for a
    fixed scale exit, ``skip_last``); the other Table 10 arms prune tokens from D on instead of stopping
    (``low_entropy_ratio`` activation + ``toprovar_gate``).

    Shared with the ``low_entropy_ratio`` activation (same helpers, same RECONSTRUCTED options): ``comparison``
    (``le`` ρ ≤ τ, the appendix / ``ge`` the main text) and ``entropy_source`` (``attention_block0``: head-averaged
    attention entropy of block 0, eager attention on block 0 only while undecided / ``attention_mean_previous``:
    mean over every block of scale s / ``predictive``: the scale's final guided-logit entropy, free).

    ``batch_rule`` (RECONSTRUCTED; the engine stops a whole batch at once, there is no per-sample stop slot):
    ``all`` — the batch stops once every sample's test has fired (no sample is cut before its own D; samples that
    fired earlier keep generating until then) / ``any`` — at the first sample's D. ToProVAR measures at batch 1
    (Tables 1–3), where both are exactly the paper's rule; in a batch a sample's image then depends on its
    neighbours (the only component for which batch = single does not hold: run batch 1 for paper numbers).
    ``mode``: ``stop`` ends generation there (``GenerationResult.stopped_at``); ``skip`` records every later scale
    as skipped (same image).

    Diagnostics: ``signals.extras["depth_exit"]``: ``rho_BK`` (ρ per sample and tested scale, NaN elsewhere),
    ``depth_B`` (each sample's own D, 0-indexed first scale not generated; K = never) and ``stopped_at`` (the
    batch's first scale not generated, None when it ran in full).
    """

    # read by the contract suite: the stop is a batch-level decision (see batch_rule), so a sample's image depends on
    # its batch; the suite checks batch = single on a batch whose samples all decide alike
    batch_coupled: ClassVar[bool] = True

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        tau: float = knob(0.4, "threshold on the fraction of below-mean-entropy tokens", low=0.0, high=1.0,
                          low_open=True, high_open=True, search=SearchSpace("float", 0.2, 0.6))
        comparison: str = knob("le", "'le' stop after the first scale with rho_s <= tau (appendix) or 'ge' "
                               "rho_s >= tau (main text)", choices=COMPARISONS, reconstructed=True)
        entropy_source: str = knob("attention_block0", "entropy map behind rho_s: block-0 attention entropy, mean "
                                   "attention entropy over blocks, or final-logit (predictive) entropy",
                                   choices=ENTROPY_SOURCES, reconstructed=True)
        min_test_tokens: int = knob(16, "scales with fewer tokens are never tested (rho is degenerate there)", low=1)
        batch_rule: str = knob("all", "a batch stops when 'all' its samples reached their depth, or at the first "
                               "one ('any')", choices=BATCH_RULES, reconstructed=True)
        mode: str = knob("stop", "'stop' ends generation there; 'skip' records each left-out scale as skipped",
                         choices=("stop", "skip"))

    # ------------------------------------------------------------------------------------------------ helpers
    def _testable(self, ctx) -> bool:
        return ctx.num_tokens >= self.config.min_test_tokens and not ctx.is_last

    def _undecided(self, ctx, signals: Signals) -> torch.Tensor:
        return signals.extras[EXTRAS_KEY]["depth_B"] >= ctx.num_scales

    def _decide(self, ctx, signals: Signals, entropy_RN: torch.Tensor) -> None:
        state = signals.extras[EXTRAS_KEY]
        B, si = ctx.batch_size, ctx.scale_index
        rho = below_mean_ratio(entropy_RN[:B]).cpu()
        state["rho_BK"][:, si] = rho.float()
        depth_B = state["depth_B"]
        fired = depth_fires(rho, self.config.tau, self.config.comparison) & (depth_B >= ctx.num_scales)
        state["depth_B"] = torch.where(fired, torch.full_like(depth_B, si + 1), depth_B)

    # ------------------------------------------------------------------------------------------------ slots
    def start(self, info, signals: Signals) -> None:
        B, K = info.batch_size, info.num_scales
        signals.extras[EXTRAS_KEY] = dict(rho_BK=torch.full((B, K), float("nan")),
                                          depth_B=torch.full((B,), K, dtype=torch.long), stopped_at=None)

    def decide(self, ctx, signals: Signals) -> SkipDecision:
        state = signals.extras[EXTRAS_KEY]
        reached = state["depth_B"] <= ctx.scale_index
        stop = bool(reached.all()) if self.config.batch_rule == "all" else bool(reached.any())
        if not stop:
            return SkipDecision()
        if state["stopped_at"] is None:
            state["stopped_at"] = ctx.scale_index
        return SkipDecision(stop=True) if self.config.mode == "stop" else SkipDecision(skip=True)

    def needs(self, ctx, signals: Signals) -> Needs:
        blocks = entropy_source_blocks(self.config.entropy_source, ctx.num_blocks)
        if not blocks or not self._testable(ctx) or not bool(self._undecided(ctx, signals).any()):
            return NO_NEEDS
        return Needs(attention_blocks=blocks)

    def observe_attention(self, ctx, block, probs_RHnL, keep_Rn, signals: Signals) -> None:
        source = self.config.entropy_source
        if source == "predictive" or (source == "attention_block0" and block != 0):
            return
        if self._testable(ctx) and bool(self._undecided(ctx, signals).any()):
            record_attention_entropy(signals, ctx, block, probs_RHnL, keep_Rn)

    def end_scale(self, ctx, record, signals: Signals) -> None:
        si = ctx.scale_index
        if record.skipped or not self._testable(ctx) or not bool(self._undecided(ctx, signals).any()):
            return
        source = self.config.entropy_source
        if source == "predictive":
            entropy = signals.token_entropy(si)
        elif source == "attention_block0":
            entropy = signals.attention_entropy.get((si, 0))
        else:
            maps = [signals.attention_entropy.get((si, block)) for block in range(ctx.num_blocks)]
            maps = [m for m in maps if m is not None]
            entropy = torch.stack(maps).nanmean(0) if maps else None
        if entropy is not None:
            self._decide(ctx, signals, entropy)
