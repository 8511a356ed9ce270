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
    * ``probability``: the released code's sampling probabilities, ``p_i = c·‖x_i‖² / Σ_j ‖x_j‖²``
      renormalised to sum 1 (``c = 0.1`` cancels up to rounding; computed with the code's own operations, so a
      ``torch.multinomial`` over them draws what the code draws). For a projected chunk (restorer
      ``previous_output`` with ``inputs='projection'``), which draws its representatives from these weights.

    Returns ``[R, N]``.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        mode: str = knob("sample", "sample indices with probability proportional to ||x_i||^2 (StageVAR's code), "
                         "keep the largest norms, or return the code's probabilities (for a projected chunk's draw)",
                         choices=("sample", "top", "probability"))
        seed: int = knob(0, "seed of the Gumbel noise (mode='sample'); draws depend on (seed, scale, block)", low=0)

    def score(self, ctx, block, branch, x_RNC, signals: Signals) -> torch.Tensor:
        if self.config.mode == "probability":
            norm2_RN = torch.norm(x_RNC.float(), dim=2) ** 2
            prob_RN = 0.1 * norm2_RN / norm2_RN.sum(dim=1, keepdim=True)
            return prob_RN / prob_RN.sum(dim=1, keepdim=True)
        weight = x_RNC.float().square().sum(-1)
        if self.config.mode == "top":
            return weight
        gumbel = self._gumbel(ctx, signals, x_RNC.device)[block]
        return torch.log(weight.clamp(min=torch.finfo(torch.float32).tiny)) + gumbel

    def _gumbel(self, ctx, signals, device) -> torch.Tensor:
        """``[L, N]`` Gumbel noise of every block of the scale, drawn on the host (each block from its own
        generator seeded by (seed, scale, block), so a block's draws do not depend on which blocks are scored)
        and copied to ``device`` once per scale instead of once per block (host synchronisations, issue 27)."""
        memo = signals.extras.setdefault("norm.gumbel", {}) if signals is not None else {}
        key = (self.config.seed, ctx.scale_index, ctx.num_tokens, ctx.num_blocks, str(device))
        if key not in memo:
            memo.clear()
            rows = []
            for b in range(ctx.num_blocks):
                gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + ctx.scale_index * 1009 + b)
                uniform = torch.rand(ctx.num_tokens, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
                rows.append(-torch.log(-torch.log(uniform)).float())
            memo[key] = torch.stack(rows).to(device)
        return memo[key]
