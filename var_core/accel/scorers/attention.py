"""ToProVAR's attention-entropy token score (specs/methods.md §4.1, §4.4): keep the focused (salient) queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention_stats import (MISSING_FILLS, RECEIVED_MASS_KEY, align_rows, fill_missing, may_prune_at,
                               may_prune_next, record_attention_entropy, record_received_mass, region_priority)
from ..base import Needs, NO_NEEDS, Scorer, Signals
from ..frequency import RESIZE_MODES, resize_map
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCORERS


@SCORERS.register("attention")
class AttentionScorer(Scorer):
    """ToProVAR (arXiv 2602.22948): head-averaged attention entropy per query, LOW entropy = keep. Knob: ``source``.

    ``signal``: ``query_entropy`` (default; Eq. 2, ``score = −H(q_i)`` so the focused, low-entropy tokens are kept)
    or ``received_mass`` (the attention mass a token receives as a key from the scale's queries; high = keep).

    ``source`` resolves the chicken-and-egg problem of §4.4 (RECONSTRUCTED, both implemented):

    * ``previous_scale`` (default): the same block's map at the last computed scale, resized to the current grid
      with ``upsample`` (RECONSTRUCTED, default ``bilinear``). Observed on every scale that precedes a scale that
      may be pruned. At the first scale (nothing before) it falls back to ``previous_block``.
    * ``previous_block``: block ``l−1``'s map at the current scale (tokens pruned in block ``l−1`` have no value and
      are filled per ``missing``). Block 0 falls back to ``previous_scale``.

    ``blocks`` restricts which blocks' attention is observed (the entropy pass runs only there: a fused or chunked
    ``log Z − E[s]``, never the probabilities, var_core/engine/attention.py); empty = all. No map is computed before
    a schedule's first prunable scale (``attention_stats.first_prunable_scale``, published by ``toprovar_gate``).
    A block without its own observation uses the nearest observed block below it (or above it if none is below).
    Maps of a pruned scale have no value at pruned queries: ``missing`` fills them (``lowest``: rank last — a token
    pruned before stays a candidate for pruning — or ``row_mean``) before resizing. Returns ``[R, N]``; 0 when no
    map exists yet.

    ``min_region_keep`` (default 0 = off) is the token side of ToProVAR's appendix safety fallback "a minimum
    per-region keep ratio" (RECONSTRUCTED: regions = the cells of a ``regions × regions`` grid on the scale's token
    map): the scores are re-ranked so that the best ``ceil(min_region_keep · n)`` tokens of every cell are kept
    before any other token (``attention_stats.region_priority``). It guarantees the quota whenever the schedule
    keeps at least ``Σ_cells ceil(min_region_keep · n_cell)`` tokens: set the same two values on
    ``toprovar_gate``, whose count floor is exactly that (the ``toprovar`` preset does).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        signal: str = knob("query_entropy", "per-query attention entropy (low = keep) or attention mass received as a "
                           "key (high = keep)", choices=("query_entropy", "received_mass"),
                           search=SearchSpace("categorical", choices=("query_entropy", "received_mass")))
        source: str = knob("previous_scale", "where block l's map comes from: same block at the previous scale "
                           "(upsampled) or block l-1 at the current scale",
                           choices=("previous_scale", "previous_block"),
                           reconstructed=True, search=SearchSpace("categorical", choices=("previous_scale",
                                                                                           "previous_block")))
        upsample: str = knob("bilinear", "resize of a previous scale's map to the current grid", choices=RESIZE_MODES,
                             reconstructed=True)
        blocks: tuple[int, ...] = knob((), "blocks whose attention entropy is computed; () = all",
                                       low=0, unit="block")
        missing: str = knob("lowest", "value given to tokens without a map value (not computed in that block)",
                            choices=MISSING_FILLS, reconstructed=True)
        min_region_keep: float = knob(0.0, "share of every grid cell's tokens ranked before all others (ToProVAR's "
                                      "per-region keep floor; 0 = plain ranking)", low=0.0, high=1.0)
        regions: int = knob(4, "cells per side of the region grid of min_region_keep", low=1)

    def start(self, info, signals) -> None:
        self._resized: dict[tuple[int, int], torch.Tensor] = {}

    # observations ------------------------------------------------------------------------------------------
    def _observed_blocks(self, num_blocks: int) -> list[int]:
        blocks = sorted({b for b in self.config.blocks if b < num_blocks}) if self.config.blocks else []
        return blocks or list(range(num_blocks))

    def _source_block(self, target: int, num_blocks: int) -> int:
        observed = self._observed_blocks(num_blocks)
        below = [b for b in observed if b <= target]
        return below[-1] if below else observed[0]

    def needs(self, ctx, signals: Signals) -> Needs:
        si, L = ctx.scale_index, ctx.num_blocks
        wanted: set[int] = set()
        # maps read at the next scale: previous_scale for every block; previous_block's block-0 fallback
        if may_prune_next(si, ctx.num_scales, signals):
            wanted |= set(self._observed_blocks(L)) if self.config.source == "previous_scale" else {
                self._source_block(0, L)}
        # maps read at this scale: previous_block for blocks >= 1 (and previous_scale's first-scale fallback)
        if may_prune_at(si, signals) and (self.config.source == "previous_block" or ctx.last_computed() is None):
            wanted |= {self._source_block(block - 1, L) for block in range(1, L)}
        return Needs(attention_blocks=frozenset(wanted)) if wanted else NO_NEEDS

    def observe_attention(self, ctx, block, probs_RHnL, keep_Rn, signals: Signals) -> None:
        if self.config.signal == "query_entropy":
            record_attention_entropy(signals, ctx, block, probs_RHnL, keep_Rn)
        else:
            record_received_mass(signals, ctx, block, probs_RHnL, keep_Rn)

    # scores --------------------------------------------------------------------------------------------------
    def _map(self, signals: Signals, si: int, block: int) -> torch.Tensor | None:
        if self.config.signal == "query_entropy":
            entropy = signals.attention_entropy.get((si, block))
            return None if entropy is None else -entropy
        return signals.extras.get(RECEIVED_MASS_KEY, {}).get((si, block))

    def _from_previous_scale(self, ctx, signals: Signals, block: int) -> torch.Tensor | None:
        record = ctx.last_computed()
        if record is None:
            return None
        source = self._source_block(block, ctx.num_blocks)
        key = (ctx.scale_index, source)
        if key not in self._resized:
            prev = self._map(signals, record.scale_index, source)
            if prev is None:
                return None
            prev = fill_missing(align_rows(prev, record.guidance, ctx), self.config.missing)
            self._resized = {k: v for k, v in self._resized.items() if k[0] == ctx.scale_index}
            self._resized[key] = resize_map(prev.view(-1, *record.hw), ctx.hw, self.config.upsample).flatten(1)
        return self._resized[key]

    def _from_previous_block(self, ctx, signals: Signals, block: int) -> torch.Tensor | None:
        if block < 1:
            return None
        current = self._map(signals, ctx.scale_index, self._source_block(block - 1, ctx.num_blocks))
        return None if current is None else fill_missing(current, self.config.missing)

    def score(self, ctx, block, branch, x_RNC, signals: Signals) -> torch.Tensor:
        if self.config.source == "previous_scale":
            order = (self._from_previous_scale, self._from_previous_block)
        else:
            order = (self._from_previous_block, self._from_previous_scale)
        scores = None
        for get in order:
            scores = get(ctx, signals, block)
            if scores is not None:
                break
        if scores is None:
            scores = torch.zeros(ctx.batch_size, ctx.num_tokens, device=x_RNC.device)
        cfg = self.config
        return region_priority(scores, ctx.hw, cfg.regions, cfg.min_region_keep)
