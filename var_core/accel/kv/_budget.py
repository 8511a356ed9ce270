"""Shared pieces of the KV policies: budgets, observation windows, stable top-k over cached positions."""

from __future__ import annotations

import functools
import math

import torch

from ...engine.kvcache import KVBlockView


def dense_length(ctx) -> int:
    """Keys a dense generation holds per block after scale ``ctx`` (every token of scales ``0..k``): the length a
    budget fraction refers to."""
    return ctx.token_offset + ctx.num_tokens


def capacity(fraction: float, ctx, floor: int = 1) -> int:
    """``ceil(fraction · dense length)`` keys, at least ``floor``."""
    return max(int(floor), int(math.ceil(fraction * dense_length(ctx) - 1e-9)))


def window_slots(n: int, hw: tuple[int, int], window: int, device) -> torch.Tensor:
    return _window_slots(n, tuple(hw), window, str(device))


@functools.lru_cache(maxsize=256)
def _window_slots(n: int, hw: tuple[int, int], window: int, device: str) -> torch.Tensor:
    """Query slots observed for the eviction scores (ScaleKV's observation window, FOUND in the Lvar port): with
    all ``h·w`` tokens computed and ``h, w ≥ g = √window``, the centre token of each cell of a ``g × g`` grid
    (``i·(h//g) + (h//g − 1)//2``); otherwise (small scales, or pruned scales computing ``n < h·w`` tokens:
    RECONSTRUCTED) ``min(window, n)`` evenly spaced slots among the ``n`` computed ones."""
    h, w = hw
    g = int(round(math.sqrt(window)))
    if n == h * w and g * g == window and h >= g and w >= g:
        hp, wp = h // g, w // g
        rows = [i * hp + (hp - 1) // 2 for i in range(g)]
        cols = [j * wp + (wp - 1) // 2 for j in range(g)]
        return torch.tensor([r * w + c for r in rows for c in cols], device=device)
    k = min(window, n)
    return torch.unique(torch.linspace(0, n - 1, k, device=device).round().long())


def valid_mask(view: KVBlockView) -> torch.Tensor | None:
    """bool ``[R, H, L]`` of the live entries (row lengths and earlier per-head evictions), None = all."""
    R, H, L, _ = view.keys.shape
    valid = view.head_valid
    if view.row_lengths is not None:
        in_row = (torch.arange(L, device=view.keys.device).view(1, 1, L)
                  < torch.tensor(view.row_lengths, device=view.keys.device).view(R, 1, 1)).expand(R, H, L)
        valid = in_row if valid is None else valid & in_row
    return valid


def rounded(scores: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """Scores rounded to ``2^-bits`` of each row's largest finite |score| (as ``policy.rank_grid``), so float noise
    of batch-size-dependent kernels cannot reorder near-ties: a sample keeps the same keys alone and in a batch."""
    from ..policy import rank_grid

    shape = scores.shape
    return rank_grid(scores.reshape(-1, shape[-1]).float(), bits).reshape(shape)


def top_positions(scores: torch.Tensor, count: int, forced: torch.Tensor | None = None,
                  counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` positions per leading index of ``scores [..., L]`` (``-inf`` = not a candidate), sorted by position:
    ``forced`` (bool ``[..., L]``) first, then the highest scores, ties to the lower position. ``counts`` (int,
    broadcastable to ``scores.shape[:-1]``): fewer than ``count`` for some leading indices. Returns ``(index,
    valid)``; ``valid`` is False on padding (fewer candidates, or a smaller count): the index repeats a kept one."""
    scores = torch.nan_to_num(scores.float(), nan=float("-inf"))
    if forced is not None:
        scores = torch.where(forced, torch.full_like(scores, float("inf")), scores)
    order = scores.sort(dim=-1, descending=True, stable=True)
    index = order.indices[..., :count]
    valid = order.values[..., :count] > float("-inf")
    if counts is not None:
        rank = torch.arange(index.shape[-1], device=index.device)
        valid = valid & (rank < counts.to(index.device).unsqueeze(-1))
    L = scores.shape[-1]
    keyed = torch.where(valid, index, torch.full_like(index, L)).sort(dim=-1).values
    valid = keyed < L
    index = torch.where(valid, keyed, keyed[..., :1].clamp(max=L - 1))
    return index, valid
