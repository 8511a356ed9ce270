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
    RECONSTRUCTED) ``min(window, n)`` evenly spaced slots among the ``n`` computed ones.

    Built on the device from arange / linspace (no host list copied over, no ``unique``: issue 27)."""
    h, w = hw
    g = int(round(math.sqrt(window)))
    if n == h * w and g * g == window and h >= g and w >= g:
        hp, wp = h // g, w // g
        rows = torch.arange(g, device=device) * hp + (hp - 1) // 2
        cols = torch.arange(g, device=device) * wp + (wp - 1) // 2
        return (rows.view(-1, 1) * w + cols.view(1, -1)).flatten()
    k = min(window, n)
    # k <= n points spaced (n-1)/(k-1) >= 1 apart round to distinct integers: the slots are already unique
    return _spaced(n, k, device)


def valid_mask(view: KVBlockView, row_lengths: torch.Tensor | None = None) -> torch.Tensor | None:
    """bool ``[R, H, L]`` of the live entries (row lengths and earlier per-head evictions), None = all.
    ``row_lengths``: int64 ``[R]`` on the device, the view's row lengths (:func:`device_row_lengths`; without it
    they are copied from the host)."""
    R, H, L, _ = view.keys.shape
    valid = view.head_valid
    if view.row_lengths is not None:
        if row_lengths is None:
            row_lengths = torch.tensor(view.row_lengths, device=view.keys.device)
        in_row = (torch.arange(L, device=view.keys.device).view(1, 1, L)
                  < row_lengths.view(R, 1, 1)).expand(R, H, L)
        valid = in_row if valid is None else valid & in_row
    return valid


def device_row_lengths(cache, block: int, view: KVBlockView) -> torch.Tensor | None:
    """int64 ``[R]``: ``view.row_lengths`` on the device without a host→device copy where the cache keeps a device
    copy of them (its packed appends and per-row evictions do, issue 27); None when the rows agree."""
    if view.row_lengths is None:
        return None
    kept = getattr(cache, "_row_lengths_dev", {}).get(block)
    if kept is not None and kept.numel() == len(view.row_lengths):
        return kept
    return torch.tensor(view.row_lengths, device=view.keys.device)


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


def top_share_mass(probs: torch.Tensor, logits: torch.Tensor, share: float) -> torch.Tensor:
    """``[R, H, w]``: probability mass of each query's top ``ceil(share · L_r)`` keys, ``L_r`` the row's own valid
    keys (the batch's padding is not counted, so a sample's value does not depend on its batch neighbours)."""
    valid_R = torch.isfinite(logits[:, 0, 0, :]).sum(-1)  # [R]
    k_R = (valid_R.double() * share).ceil().clamp(min=1).long()
    ranked = probs.sort(dim=-1, descending=True).values
    rank = torch.arange(probs.shape[-1], device=probs.device)
    return (ranked * (rank.view(1, 1, 1, -1) < k_R.view(-1, 1, 1, 1))).sum(-1)


def row_window_slots(probe, hw: tuple[int, int], window: int) -> torch.Tensor:
    """int64 ``[R, w]``: each row's observation-window query slots, chosen among the row's own valid queries
    (ragged token selections pad short rows at the end: ``probe.kv.current_valid_Rn``), so a sample observes the
    same queries alone and in a batch. Dense rows: :func:`window_slots`; a row computing ``n_r`` tokens:
    ``window`` evenly spaced slots of ``0 .. n_r − 1`` (repeats where ``n_r < window``)."""
    R, _, n, _ = probe.q.shape
    device = probe.q.device
    valid = getattr(probe.kv, "current_valid_Rn", None)
    if valid is None:
        return window_slots(n, hw, window, device).view(1, -1).expand(R, -1)
    counts = valid.sum(1).tolist()  # one host read per observed ragged block
    dense = window_slots(hw[0] * hw[1], hw, window, device)
    rows = []
    for n_r in counts:
        if n_r == hw[0] * hw[1]:
            rows.append(dense if dense.numel() == window else _spaced(n_r, window, device))
        else:
            rows.append(_spaced(n_r, window, device))
    return torch.stack(rows)


def _spaced(n: int, window: int, device) -> torch.Tensor:
    return torch.linspace(0, max(n - 1, 0), window, device=device).round().long()
