"""LD-Pruning's distribution-adaptive selection: keep the tokens holding ρ of the score energy (methods.md §3.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..base import Schedule
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCHEDULES
from ._linkage_math import started_B, started_on, to_rows

COUNT_MODES = ("energy", "tokens")


def energy_keep_counts(scores_RN: torch.Tensor, rho: float, counts: str = "energy", min_keep_fraction: float = 0.0
                       ) -> torch.Tensor:
    """int64 ``[R]``: the size of the shortest prefix of the descending scores holding ``ρ`` of the row's total.

    ``energy``: smallest ``K`` with ``Σ_{top K} s ≥ ρ·Σ s`` (negative scores hold no energy and count as 0; tokens
    with score ``+inf`` — forced keeps from the restorer — are kept on top and left out of the energy; a row
    without energy keeps only those). ``tokens``: ``ceil(ρ·N)``. Then at least ``ceil(min_keep_fraction·N)``.
    """
    R, N = scores_RN.shape
    if counts == "tokens":
        keep = torch.full((R,), math.ceil(rho * N - 1e-9 * N), dtype=torch.long, device=scores_RN.device)
    elif counts == "energy":
        scores = scores_RN.double()
        forced = torch.isposinf(scores)
        energy = torch.where(forced | torch.isnan(scores), 0.0, scores.clamp(min=0.0))
        cumulative = energy.sort(dim=1, descending=True, stable=True).values.cumsum(1)
        total = cumulative[:, -1:]
        needed = (cumulative < rho * total).sum(1) + 1  # index of the first prefix reaching rho·total, plus one
        keep = torch.where(total.squeeze(1) > 0, needed, torch.zeros_like(needed)) + forced.sum(1)
    else:
        raise ValueError(f"unknown count mode {counts!r}; choose one of {COUNT_MODES}")
    floor = math.ceil(min_keep_fraction * N - 1e-9 * N)
    return keep.clamp(min=floor, max=N)


@SCHEDULES.register("energy_fraction")
class EnergyFraction(Schedule):
    """LD-Pruning (arXiv 2606.00310) §3.1 step 3: keep the fewest top-scored tokens holding ρ of the energy. Knob: rho.

    Per row, the scorer's scores (LHEP's high-frequency energy of the latent residual map) are sorted descending and
    the shortest prefix with ``Σ s ≥ ρ·Σ s`` is kept, so the kept count adapts to how concentrated the energy is
    (peaky map → few tokens). Scores must be non-negative energies; negative scores count as 0.

    RECONSTRUCTED parts (each an option; defaults first):

    * ``counts`` — ``energy`` (ρ of the total score) / ``tokens`` (ρ of the tokens: ``ceil(ρ·N)``).
    * ``min_keep_fraction`` — guard not in the source (methods.md recommends 5–10 %): at least
      ``ceil(min_keep_fraction·N)`` tokens; 0 gives the bare rule.

    Rows of samples that are not accelerated yet stay dense (which scales are pruned is the activation's job).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        rho: float = knob(0.5, "energy-preservation ratio: fraction of the total score the kept tokens must hold",
                          low=0.0, high=1.0, low_open=True, search=SearchSpace("float", 0.2, 0.9))
        counts: str = knob("energy", "'energy': rho of the total score; 'tokens': rho of the tokens",
                           choices=COUNT_MODES, reconstructed=True)
        min_keep_fraction: float = knob(0.05, "keep at least this fraction of the tokens (guard; 0 = bare rule)",
                                        low=0.0, high=1.0, search=SearchSpace("float", 0.0, 0.2))

    def counts_per_scale(self) -> bool:
        return True  # a share of the scores' energy: nothing of the block or branch

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        cfg = self.config
        if not bool(started_B(ctx, signals).any()):  # host data: nobody accelerated yet, dense
            return None
        keep_R = energy_keep_counts(scores_RN, cfg.rho, cfg.counts, cfg.min_keep_fraction)
        dense_R = ~to_rows(started_on(ctx, signals, keep_R.device), ctx.batch_size, scores_RN.shape[0], keep_R.device)
        # every row keeping N tokens: the policy runs the block dense (no host read here)
        return torch.where(dense_R, torch.full_like(keep_R, ctx.num_tokens), keep_R)
