"""StepVAR's restoration: a pruned position takes the output of the nearest kept token of the same scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Restorer, Signals
from ..knobs import ComponentConfig, knob
from ..registry import RESTORERS

METRICS = ("euclidean", "manhattan", "chebyshev")
_CHUNK_ELEMENTS = 1 << 24  # bound on the [R, chunk, n] distance table built at once


def grid_coordinates(hw: tuple[int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every flat position of an ``h x w`` grid (int64 ``[N]`` each)."""
    h, w = hw
    flat = torch.arange(h * w, device=device)
    return flat // w, flat % w


def nearest_source_slots(keep_Rn: torch.Tensor, hw: tuple[int, int], metric: str = "euclidean",
                         candidate_Rn: torch.Tensor | None = None) -> torch.Tensor:
    """For every position of the grid, the slot (index into ``keep_Rn``'s second axis) of its nearest kept token.

    ``[R, N]`` int64, per row. Distances are on the 2-D grid (squared Euclidean, Manhattan or Chebyshev); ties go
    to the kept token with the lowest flat position (then the lowest slot, which only matters between padding
    duplicates of the same position, whose outputs are identical), so the result is deterministic and depends on
    the row's own kept set only. A kept position maps to itself. ``candidate_Rn`` (bool) restricts the sources to
    some kept slots (e.g. anchors); every row must have at least one candidate.
    """
    R, n = keep_Rn.shape
    N = hw[0] * hw[1]
    device = keep_Rn.device
    rows_N, cols_N = grid_coordinates(hw, device)
    keep_Rn = keep_Rn.long()
    kr_Rn, kc_Rn = keep_Rn // hw[1], keep_Rn % hw[1]
    # Key = distance · (N·n) + position · n + slot: unique per slot, ordered by (distance, position, slot).
    tie_Rn = keep_Rn * n + torch.arange(n, device=device).view(1, n)
    big = torch.iinfo(torch.int64).max
    chunk = max(1, _CHUNK_ELEMENTS // max(1, R * n))
    out = torch.empty(R, N, dtype=torch.long, device=device)
    for start in range(0, N, chunk):  # chunks of positions (not a loop over tokens: bounds memory only)
        stop = min(N, start + chunk)
        dr = (rows_N[start:stop].view(1, -1, 1) - kr_Rn.view(R, 1, n)).abs()
        dc = (cols_N[start:stop].view(1, -1, 1) - kc_Rn.view(R, 1, n)).abs()
        if metric == "euclidean":
            dist = dr * dr + dc * dc
        elif metric == "manhattan":
            dist = dr + dc
        elif metric == "chebyshev":
            dist = torch.maximum(dr, dc)
        else:
            raise ValueError(f"unknown metric {metric!r}; choose one of {METRICS}")
        key = dist * (N * n) + tie_Rn.view(R, 1, n)
        if candidate_Rn is not None:
            key = key.masked_fill(~candidate_Rn.view(R, 1, n), big)
        out[:, start:stop] = key.argmin(dim=2)
    return out


def gather_slots(out_kept_RnC: torch.Tensor, slots_RN: torch.Tensor) -> torch.Tensor:
    """``out[r, slots[r, i]]`` for every position: ``[R, N, C]``."""
    return torch.gather(out_kept_RnC, 1, slots_RN.unsqueeze(-1).expand(-1, -1, out_kept_RnC.shape[-1]))


@RESTORERS.register("nearest")
class NearestKept(Restorer):
    """StepVAR §9: pruned positions get the branch output of the nearest kept token of the same scale and row.

    Knob: ``metric`` of the 2-D grid distance (the write-up says "nearest kept neighbour" without a metric:
    RECONSTRUCTED, default ``euclidean``). Ties go to the kept token with the lowest flat (row-major) position.
    Kept positions keep their own fresh outputs, so a row that keeps every token comes out exactly as computed.
    The position → source map is reused across the branches of a block that share one selection tensor.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        metric: str = knob("euclidean", "RECONSTRUCTED: grid distance defining the nearest kept token",
                           choices=METRICS, reconstructed=True)

    def start(self, info, signals: Signals) -> None:
        self._last: tuple[torch.Tensor, tuple[int, int], torch.Tensor] | None = None

    def source_slots(self, keep_Rn: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        # The held reference keeps ``keep_Rn`` alive, so an identity match cannot be a recycled object.
        if self._last is not None and self._last[0] is keep_Rn and self._last[1] == tuple(hw):
            return self._last[2]
        slots = nearest_source_slots(keep_Rn, hw, self.config.metric)
        self._last = (keep_Rn, tuple(hw), slots)
        return slots

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC, signals):
        return gather_slots(out_kept_RnC, self.source_slots(keep_Rn, ctx.hw))
