"""NOVA's predictive-entropy token score (specs/methods.md §2.1): keep the most uncertain tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention_stats import may_prune_at
from ..base import Needs, NO_NEEDS, Scorer, Signals
from ..frequency import RESIZE_MODES, resize_map
from ..knobs import ComponentConfig, SearchSpace, knob
from ..lens import LENS_COMBINES, lens_entropy_map, record_lens_entropy
from ..registry import SCORERS


SOURCES = ("predictive", "lens")
SOURCE_ALIASES = {"previous": "predictive"}  # the name before issue 12


@SCORERS.register("entropy")
class EntropyScorer(Scorer):
    """NOVA (arXiv 2602.01345): predictive entropy per token, higher entropy = keep. Knob: ``source``.

    ``source`` selects which entropy ranks the tokens of block ``l`` at scale ``t``:

    * ``predictive`` (default; errata 5 of specs/methods.md): the entropy of the predictive distribution the model
      already produced — the last computed scale's final, guided logits (the distribution actually sampled) —
      resized to the current grid with ``upsample`` (RECONSTRUCTED, default ``bilinear``) and shared by all blocks
      of the scale. This is NOVA's own cost model (§3.4 / §4.3 "Entropy Computation Overhead": entropy "directly
      from the predictive token distributions already produced during standard decoding", O(N_t·|V|) per scale,
      0.9 % of a scale on Infinity-2B): no extra projection. The current scale's own distribution exists only
      after its blocks ran, so the previous scale's is the one available while pruning. ``previous`` (the name
      before issue 12) is accepted as an alias and stored as ``predictive``.
    * ``lens`` (RECONSTRUCTED, our reading of the per-layer analysis of NOVA Fig. 4(c) and the consolidated loop
      of methods.md §2.5): the logit lens on the hidden state ENTERING block ``l``, i.e. the head applied to block
      ``l−1``'s output (the loop's ``observe_lens`` for block ``l−1``). Declares ``Needs(lens_blocks={0, …, L−2})``
      on scales that may be pruned: one head projection per block. Block 0 has no lens input and falls back to
      ``predictive``. How the lens combines CFG rows is ``lens_rows`` (RECONSTRUCTED, see
      :mod:`var_core.accel.lens`; default ``guided``).

    Returns ``[B, N]`` (``[R, N]`` with ``lens_rows="per_row"``). Before any scale was computed the scores are 0.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        source: str = knob("predictive", "which entropy ranks the tokens: the predictive distribution already "
                           "produced (the previous scale's sampled logits, upsampled: 'predictive'; alias "
                           "'previous') or the logit lens on the block input ('lens'; block 0 falls back to "
                           "'predictive')", choices=SOURCES, reconstructed=True,
                           search=SearchSpace("categorical", choices=SOURCES))
        upsample: str = knob("bilinear", "resize of the previous scale's entropy map to the current grid",
                             choices=RESIZE_MODES, reconstructed=True)
        lens_rows: str = knob("guided", "CFG rows in the lens entropy: entropy of the guided logits ('guided'), of "
                              "the cond rows ('cond'), mean of both rows' entropies ('mean'), or per row ('per_row')",
                              choices=LENS_COMBINES, reconstructed=True)
        guidance_scale: float | None = knob(None, "cfg used by lens_rows='guided' in the family's convention; None = "
                                            "infer the guidance weights from the previous scale's logits", low=0.0)
        temperature: float = knob(1.0, "sampling temperature (Infinity's tau) used with an explicit guidance_scale",
                                  low=0.0, low_open=True)

        def __post_init__(self) -> None:
            if self.source in SOURCE_ALIASES:
                object.__setattr__(self, "source", SOURCE_ALIASES[self.source])
            super().__post_init__()

    def start(self, info, signals) -> None:
        self._previous: dict[int, torch.Tensor] = {}

    def needs(self, ctx, signals: Signals) -> Needs:
        if self.config.source != "lens" or ctx.num_blocks < 2 or not may_prune_at(ctx.scale_index, signals):
            return NO_NEEDS
        return Needs(lens_blocks=frozenset(range(ctx.num_blocks - 1)))

    def observe_lens(self, ctx, block, lens, signals: Signals) -> None:
        if self.config.source == "lens":
            cfg = self.config
            record_lens_entropy(signals, ctx, block, lens, cfg.lens_rows, cfg.guidance_scale, cfg.temperature)

    def predictive_scores(self, ctx, signals: Signals, device: torch.device) -> torch.Tensor:
        """``[B, N]`` the last computed scale's predictive-entropy map on the current grid (0 when there is none)."""
        si = ctx.scale_index
        if si not in self._previous:
            record = ctx.last_computed()
            ent = None if record is None else signals.token_entropy_map(record.scale_index)
            if ent is None:
                scores = torch.zeros(ctx.batch_size, ctx.num_tokens, device=device)
            else:
                scores = resize_map(ent, ctx.hw, self.config.upsample).flatten(1)
            self._previous = {si: scores}
        return self._previous[si]

    def score(self, ctx, block, branch, x_RNC, signals: Signals) -> torch.Tensor:
        if self.config.source == "lens" and block >= 1:
            cfg = self.config
            lens = lens_entropy_map(signals, ctx.scale_index, block - 1, cfg.lens_rows, cfg.guidance_scale,
                                    cfg.temperature)
            if lens is not None:
                return lens
        return self.predictive_scores(ctx, signals, x_RNC.device)
