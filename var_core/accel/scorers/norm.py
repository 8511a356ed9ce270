"""StageVAR's representative-token weights: squared row norms of the hidden state (RTR, specs/methods.md §8)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Scorer, Signals
from ..knobs import ComponentConfig, knob
from ..registry import SCORERS


@SCORERS.register("norm")
class NormScorer(Scorer):
    """StageVAR (arXiv 2512.16483) RTR: weight ``w_i = ‖x_i‖²`` of the block input; high = keep. Knob: ``mode``.

    * ``sample`` (default; FOUND(code): indices drawn without replacement with probability ∝ ``‖F_i‖²``): the
      scores are ``ln w_i + G_i`` with Gumbel noise ``G`` (Gumbel-top-k), so keeping the top ``n`` is exactly a
      draw of ``n`` indices without replacement ∝ ``w``. The noise comes from a generator seeded by
      ``(seed, scale, block)`` and is shared by every row, so a sample's draw does not depend on its batch.
    * ``top``: deterministic, the ``n`` largest norms.

    Returns ``[R, N]``.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        mode: str = knob("sample", "sample indices with probability proportional to ||x_i||^2 (StageVAR's code) or "
                         "keep the largest norms", choices=("sample", "top"))
        seed: int = knob(0, "seed of the Gumbel noise (mode='sample'); draws depend on (seed, scale, block)", low=0)

    def score(self, ctx, block, branch, x_RNC, signals: Signals) -> torch.Tensor:
        weight = x_RNC.float().square().sum(-1)
        if self.config.mode == "top":
            return weight
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + ctx.scale_index * 1009 + block)
        uniform = torch.rand(ctx.num_tokens, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
        gumbel = -torch.log(-torch.log(uniform)).float().to(x_RNC.device)
        return torch.log(weight.clamp(min=torch.finfo(torch.float32).tiny)) + gumbel
