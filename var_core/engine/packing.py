"""Packed execution of per-token work for ragged token selections.

A ragged :class:`~var_core.engine.policy.TokenSelection` pads every row to the batch's largest keep count with
copies of one of the row's kept tokens. Attention needs that rectangular layout (the KV cache masks the padding),
but the per-token work — projections, MLP — does not: :class:`RowPacking` gathers the valid tokens of all rows
into one ``[T, C]`` matrix, runs the per-token function once on it, and spreads the result back, giving every
padding slot the output of the token it copies (so restorers' scatters stay exact). A batch then pays for the
tokens its samples keep, not ``rows × the largest keep count``.

Host synchronisations (issue 27): a selection whose per-row valid counts the policy already holds on the host
(``engine.policy.ragged_selection``: the counts ride on the mask, :func:`host_counts`) is packed without reading
anything back — sizes from the counts, positions by a static-size ``nonzero`` and a search, no boolean-mask
indexing. A mask without counts is read as before (one ``nonzero``, its size, the lookup's width, one check).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

_HOST_COUNTS = "_varscope_host_counts"


def attach_host_counts(valid_Rn: torch.Tensor, counts_R: Sequence[int]) -> None:
    """Record on the mask itself that row ``r``'s valid slots are its first ``counts_R[r]`` (host integers)."""
    setattr(valid_Rn, _HOST_COUNTS, tuple(int(c) for c in counts_R))


_HOST_COPY = "_varscope_host_copy"


def attach_host_copy(device_t: torch.Tensor, host_t: torch.Tensor) -> torch.Tensor:
    """Record on a device tensor the same values already on the host (read once with others); returns it."""
    setattr(device_t, _HOST_COPY, host_t)
    return device_t


def host_copy(t: torch.Tensor) -> torch.Tensor | None:
    """The host copy :func:`attach_host_copy` recorded on ``t`` (None: read ``t`` to see its values)."""
    return getattr(t, _HOST_COPY, None)


_DEVICE_COUNTS = "_varscope_device_counts"


def mark_device_counts(valid_Rn: torch.Tensor, bounds_R: Sequence[int] | None = None,
                       bounds_dev: torch.Tensor | None = None) -> torch.Tensor:
    """Mark a selection's mask as one whose per-row counts stay on the device (``count_sync='bounded'`` of
    ``accel.policy.PolicyConfig``): every row's valid slots are a prefix no longer than its host-known bound
    (``bounds_R``, with ``bounds_dev`` the same on the mask's device; default: the mask's width), and nothing may
    read the counts back during the scale. Packing runs each row's bound (:class:`RowPacking`), attention masks the
    slots past each row's count, and the KV cache appends with host upper lengths
    (:meth:`~var_core.engine.kvcache.KVCache.resolve_lengths` reads the true ones once, after the scale). Returns
    the mask."""
    R, n = valid_Rn.shape
    bounds = tuple(int(b) for b in bounds_R) if bounds_R is not None else (n,) * R
    if bounds_dev is None:
        bounds_dev = torch.full((R,), n, dtype=torch.long, device=valid_Rn.device) if bounds_R is None else None
    setattr(valid_Rn, _DEVICE_COUNTS, (bounds, bounds_dev))
    return valid_Rn


def device_counts(valid_Rn: torch.Tensor | None) -> bool:
    """Whether :func:`mark_device_counts` marked this mask (its counts must not be read during the scale)."""
    return valid_Rn is not None and getattr(valid_Rn, _DEVICE_COUNTS, None) is not None


def count_bounds(valid_Rn: torch.Tensor | None) -> tuple[int, ...] | None:
    """The host bounds of a :func:`mark_device_counts` mask's per-row counts (None: not such a mask)."""
    marked = None if valid_Rn is None else getattr(valid_Rn, _DEVICE_COUNTS, None)
    return None if marked is None else marked[0]


def _bounds_on_device(valid_Rn: torch.Tensor) -> torch.Tensor:
    bounds, bounds_dev = getattr(valid_Rn, _DEVICE_COUNTS)
    if bounds_dev is None:
        raise ValueError("mark_device_counts: per-row bounds need their device copy (bounds_dev)")
    return bounds_dev


def host_counts(valid_Rn: torch.Tensor | None) -> tuple[int, ...] | None:
    """The host-known per-row valid counts of a mask (valid slots = a prefix of each row), or None (unknown: the
    caller reads the mask; a view or copy of the mask does not carry them)."""
    return None if valid_Rn is None else getattr(valid_Rn, _HOST_COUNTS, None)


def _valid_positions(valid_flat: torch.Tensor, total: int) -> torch.Tensor:
    """The positions of the ``total`` True entries, in order, without a read of the mask (``nonzero`` sizes its
    output from the values); a stable sort where a backend has no static-size ``nonzero``."""
    try:
        return torch.nonzero_static(valid_flat, size=total).squeeze(1)
    except (NotImplementedError, RuntimeError):
        return valid_flat.to(torch.uint8).sort(descending=True, stable=True).indices[:total]


class RowPacking:
    """Valid-token packing of a padded ``[R, n, ·]`` selection: ``keep_Rn`` token indices, ``valid_Rn`` False on
    padding slots, each of which repeats a kept index of its row (valid slots sorted by token, as selections are)."""

    def __init__(self, keep_Rn: torch.Tensor, valid_Rn: torch.Tensor):
        R, n = valid_Rn.shape
        self.valid_Rn = valid_Rn
        bounds = count_bounds(valid_Rn)
        if bounds is not None:  # counts on the device: each row's bound runs (its prefix), nothing read back
            self.total = sum(bounds)
            in_bound = torch.arange(n, device=valid_Rn.device).view(1, n) < _bounds_on_device(valid_Rn).view(R, 1)
            self._flat_valid = _valid_positions(in_bound.reshape(-1), self.total)
            self._row_of_token = torch.div(self._flat_valid, n, rounding_mode="floor")
            packed_pos = in_bound.reshape(-1).long().cumsum(0).view(R, n) - 1
            # every slot past its row's count reads the output of the kept token it repeats (a valid slot)
            self._source_Rn = packed_pos.gather(1, padding_sources(keep_Rn, valid_Rn))
            return
        counts = host_counts(valid_Rn)
        if counts is not None:  # sizes known on the host: nothing read back
            self.total = sum(counts)
            self._flat_valid = _valid_positions(valid_Rn.reshape(-1), self.total)
            self._row_of_token = torch.div(self._flat_valid, n, rounding_mode="floor")
            # packed position of each slot's token: the valid slot holding it (itself for a valid slot), counted
            # over the valid slots before it
            packed_pos = valid_Rn.reshape(-1).long().cumsum(0).view(R, n) - 1
            self._source_Rn = packed_pos.gather(1, padding_sources(keep_Rn, valid_Rn))
            return
        self._flat_valid = valid_Rn.reshape(-1).nonzero().squeeze(1)
        self._row_of_token = torch.div(self._flat_valid, n, rounding_mode="floor")
        self.total = int(self._flat_valid.numel())
        # packed position of every valid slot; a padding slot reads the packed position of the token it repeats
        packed_pos = torch.full((R * n,), -1, dtype=torch.long, device=valid_Rn.device)
        packed_pos[self._flat_valid] = torch.arange(self.total, device=valid_Rn.device)
        lookup = torch.full((R, int(keep_Rn.max()) + 1), -1, dtype=torch.long, device=valid_Rn.device)
        rows = torch.arange(R, device=valid_Rn.device).view(R, 1).expand(R, n)
        lookup[rows[valid_Rn], keep_Rn[valid_Rn]] = packed_pos[self._flat_valid]
        self._source_Rn = lookup.gather(1, keep_Rn)
        if bool((self._source_Rn < 0).any()):
            raise ValueError("a padding slot repeats a token index that is not kept in its row")

    @staticmethod
    def worthwhile(valid_Rn: torch.Tensor | None, min_saving: float = 0.1) -> bool:
        """Whether packing saves at least ``min_saving`` of the rows' tokens (it costs two copies of the data)."""
        if valid_Rn is None:
            return False
        counts = count_bounds(valid_Rn) or host_counts(valid_Rn)  # counts on the device: their host bounds
        if counts is not None:  # the mask's mean from the host counts (in float64: exact where float32 rounds)
            return sum(counts) / valid_Rn.numel() <= 1.0 - min_saving
        return float(valid_Rn.float().mean()) <= 1.0 - min_saving

    def pack(self, x_RnC: torch.Tensor) -> torch.Tensor:
        """``[T, C]``: the valid tokens of every row, row after row. Per-row ``[R, 1, C]`` inputs (AdaLN
        modulations) are repeated for each of the row's valid tokens."""
        R, n = self.valid_Rn.shape
        if x_RnC.shape[1] == 1 and n != 1:
            return x_RnC[:, 0].expand(R, x_RnC.shape[-1]).index_select(0, self._row_of_token)
        return x_RnC.reshape(R * n, -1).index_select(0, self._flat_valid)

    def unpack(self, y_TC: torch.Tensor) -> torch.Tensor:
        """``[R, n, C]`` with padding slots holding the output of the token they copy."""
        R, n = self.valid_Rn.shape
        return y_TC.index_select(0, self._source_Rn.reshape(-1)).view(R, n, -1)

    def apply(self, fn: Callable[..., torch.Tensor], *per_token: torch.Tensor) -> torch.Tensor:
        """``fn`` on the packed tokens of each ``[R, n|1, C]`` argument, spread back to ``[R, n, C']``."""
        return self.unpack(fn(*(self.pack(t) for t in per_token)))


def padding_sources(keep_Rn: torch.Tensor, valid_Rn: torch.Tensor) -> torch.Tensor:
    """int64 ``[R, n]``: for every slot of a padded selection, the slot that holds its token — itself for a valid
    slot, the valid slot of the kept index it repeats for a padding slot. Valid slots are sorted and distinct per
    row, so a search over them (padding masked to the end) finds the source."""
    sentinel = torch.iinfo(keep_Rn.dtype).max
    sorted_valid = torch.where(valid_Rn, keep_Rn, torch.full_like(keep_Rn, sentinel))
    return torch.searchsorted(sorted_valid.contiguous(), keep_Rn.contiguous())


def copy_padding_outputs(out_RnC: torch.Tensor, sources_Rn: torch.Tensor) -> torch.Tensor:
    """``out`` with every padding slot replaced by the output of the slot it copies (:func:`padding_sources`).

    On the padded (not packed) path a padding query is computed in its own position of the rectangle, and the
    attention kernel may round it differently from the real query; restorers scatter every slot, so without this
    the last write could put that differently rounded copy in the kept position."""
    return out_RnC.gather(1, sources_Rn.unsqueeze(-1).expand(-1, -1, out_RnC.shape[-1]))
