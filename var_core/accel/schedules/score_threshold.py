"""An adaptive kept count: the share of tokens whose max-normalised score exceeds a threshold."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import Schedule
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCHEDULES

SHARE_GRIDS = ("tokens", "previous")


def first_positions(source_hw: tuple[int, int], hw: tuple[int, int], device=None) -> torch.Tensor:
    """int64 ``[M]``: for every cell of ``source_hw`` that a ``'nearest'`` resize to ``hw`` reaches, the first flat
    position of ``hw`` holding it (cells in flat order). The mapping is torch's own (``F.interpolate`` of the cell
    indices), so it is exact for maps resized that way. An upsampling (``hw`` at least ``source_hw`` on both axes,
    every next scale of a VAR) reaches every cell, so no value-dependent selection (a host sync) is needed."""
    hs, ws = source_hw
    cells = torch.arange(hs * ws, dtype=torch.float32, device=device).view(1, 1, hs, ws)
    source_N = F.interpolate(cells, size=tuple(hw), mode="nearest").flatten().long()
    N = source_N.numel()
    first = torch.full((hs * ws,), N, dtype=torch.long, device=device)
    first.scatter_reduce_(0, source_N, torch.arange(N, device=device), reduce="amin")
    if hw[0] >= hs and hw[1] >= ws:  # 'nearest' maps output row i to floor(i·hs/h): steps of 0 or 1, from 0 to hs-1
        return first
    return first[first < N]


def threshold_counts(scores_RN: torch.Tensor, threshold: float, num_tokens: int,
                     cells_M: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[R]``: ``floor(N · share_r)`` with ``share_r`` the fraction of row ``r``'s scored cells whose score
    divided by the row's largest exceeds ``threshold`` (``cells_M``: the positions measured, default all).

    Forced keeps (``+inf``) are not scores: left out of the maximum and the share. The product is taken in float32
    as ``int(N * share)`` of the third-party code does; a row with no positive maximum (0/0) keeps every token,
    as that code's ``sort()[-0:]`` does.
    """
    s = scores_RN.float()
    if cells_M is not None:
        s = s.index_select(1, cells_M.to(s.device))
    finite = torch.isfinite(s)
    peak_R1 = torch.where(finite, s, torch.full_like(s, float("-inf"))).amax(1, keepdim=True)
    above = finite & ((s / peak_R1) > threshold)
    share_R = above.float().sum(1) / finite.float().sum(1).clamp_min(1.0)
    counts = (num_tokens * share_R).floor().long()
    return torch.where(counts > 0, counts, torch.full_like(counts, num_tokens))


@SCHEDULES.register("score_threshold")
class ScoreThreshold(Schedule):
    """Adaptive kept count: as many tokens as the share whose score / row maximum exceeds ``threshold``.

    Third-party SparseVAR code (``Weepingchestnut/Lvar``, ``models/sparsevar/sparsevar_model.py``: its
    ``compress_ratio=0.6`` applied as ``((mse / mse.max()) > 0.6).float().mean()``, then ``int(N · share)`` top
    tokens of the map resized to this scale). Knob that matters: ``threshold``. Per row: ``k = floor(N · share)``;
    the policy then keeps the ``k`` highest scores (ties to the lower position), so the kept set is the tokens
    above the threshold up to ties and resizing. Option ``share_grid``: measure the share over this scale's
    ``tokens`` (default), or over the cells of the ``previous`` computed scale's grid — each cell read once at the
    first position a ``'nearest'`` resize puts it (exact for a scorer that resized a previous-scale map with
    ``upsample='nearest'``, as the third-party code measures its share before resizing). Not that code's batch
    rule: it takes one maximum over the whole batch and the largest share of any sample for every sample; here
    each sample has its own (identical at batch 1, and a sample's result does not depend on its batch).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        threshold: float = knob(0.6, "keep the share of tokens whose score / row maximum exceeds this (the "
                                "third-party SparseVAR code's compress_ratio 0.6)", low=0.0, high=1.0,
                                high_open=True, search=SearchSpace("float", low=0.3, high=0.9))
        share_grid: str = knob("tokens", "where the share is measured: this scale's tokens, or the previous "
                               "computed scale's grid cells (each at its first 'nearest'-resized position)",
                               choices=SHARE_GRIDS)

    def start(self, info, signals) -> None:
        self._cells: dict[tuple, torch.Tensor] = {}

    def _measured_cells(self, ctx, device) -> torch.Tensor | None:
        if self.config.share_grid == "tokens":
            return None
        previous = ctx.last_computed()
        if previous is None or tuple(previous.hw) == tuple(ctx.hw):
            return None
        key = (tuple(previous.hw), tuple(ctx.hw), str(device))
        if key not in self._cells:
            self._cells[key] = first_positions(previous.hw, ctx.hw, device)
        return self._cells[key]

    def counts_per_scale(self) -> bool:
        return True  # the share of scores above the threshold: nothing of the block or branch

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        cells = self._measured_cells(ctx, scores_RN.device)
        return threshold_counts(scores_RN, self.config.threshold, ctx.num_tokens, cells)
