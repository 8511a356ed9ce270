"""Random token scores: the control arm of every scorer ablation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Scorer, Signals
from ..knobs import ComponentConfig, knob
from ..registry import SCORERS


@SCORERS.register("random")
class RandomScorer(Scorer):
    """Uniformly random importance per token (control). Knob: ``seed``; draws depend on (seed, scale, block)."""

    input_independent = True  # a control: the same scores for every sample by design (var_core.accel.contract)

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        seed: int = knob(0, "seed of the score draws (each sample also mixes in its batch position: see docstring)",
                         low=0)

    def score(self, ctx, block, branch, x_RNC, signals: Signals) -> torch.Tensor:
        # One generator per (scale, block): identical scores for every sample, so a sample's choice does not
        # depend on the batch it is in; seeded from the config for reproducibility.
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + ctx.scale_index * 1009 + block)
        scores = torch.rand(ctx.num_tokens, generator=gen)
        return scores.to(x_RNC.device).expand(ctx.batch_size, -1)
