"""Per-block self-attention KV cache across scales, as a context manager.

Buffers are pre-allocated for the longest possible sequence and filled in place, so appending a scale costs a
copy of that scale's K/V only (the official code re-concatenates the whole history at every scale). With token
pruning a block appends only its kept tokens, so each block keeps its own length.

Ragged selections (rows keeping different numbers of tokens, padded to a common count) have two layouts:

* ``packed`` (default): each row's VALID keys are stored contiguously, row ``r`` holding ``len_r`` keys at
  ``[0, len_r)``; padding slots are never stored. Attention can then run on each row's own keys without copies
  (``var_core.engine.attention.CachedAttention``), and the mask only marks positions beyond a row's length.
* ``padded``: every row appends the padded count and padding entries are masked (the layout before issue 16;
  kept as the reference the packed path is tested against).

A dense generation is the same in both: every row has the same length and no mask exists.
"""

from __future__ import annotations

import torch

from .attention import CachedKV
from .packing import host_counts

KV_LAYOUTS = ("packed", "padded")


class KVCache:
    """``with KVCache(...) as cache:`` — the buffers are released on exit, also after an exception."""

    def __init__(self, num_blocks: int, max_len: int, layout: str = "packed"):
        self.num_blocks = num_blocks
        self.max_len = max_len
        self.layout = layout
        self._check_layout(layout)
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.lengths: list[int] = []  # per block: the longest row's length (the filled part of the buffers)
        self.row_lengths: list[list[int] | None] = []  # per block, packed layout: per-row lengths once rows differ
        self.valid: list[torch.Tensor | None] = []  # per block, padded layout: [R, max_len] bool once padding came
        self.ragged: list[bool] = []  # per block: a ragged append happened (attention pairs are then recorded)
        self.attention_pairs: dict[int, int] = {}  # block -> query-key pairs of its latest attention call
        self._row_lengths_dev: dict[int, torch.Tensor] = {}  # packed layout: row_lengths on the device
        self._open = False

    @staticmethod
    def _check_layout(layout: str) -> None:
        if layout not in KV_LAYOUTS:
            raise ValueError(f"unknown KV-cache layout {layout!r}; choose one of {KV_LAYOUTS}")

    def set_layout(self, layout: str) -> None:
        """Choose the ragged layout before the first append (the loop applies ``GenerationOptions``)."""
        self._check_layout(layout)
        if any(k is not None for k in self.keys):
            raise RuntimeError("KVCache.set_layout after keys were appended")
        self.layout = layout

    def __enter__(self) -> "KVCache":
        # Buffers are allocated at a block's first append, with the dtype/device the keys arrive in
        # (so autocast decides the cache precision, as it does for the official concatenated cache).
        self.keys = [None] * self.num_blocks
        self.values = [None] * self.num_blocks
        self.lengths = [0] * self.num_blocks
        self.row_lengths = [None] * self.num_blocks
        self.valid = [None] * self.num_blocks
        self.ragged = [False] * self.num_blocks
        self.attention_pairs = {}
        self._row_lengths_dev = {}
        self._open = True
        return self

    def __exit__(self, *exc) -> None:
        self.keys, self.values, self.lengths, self.row_lengths, self.valid, self.ragged = [], [], [], [], [], []
        self.attention_pairs = {}
        self._open = False

    @property
    def rows(self) -> int:
        return next((k.shape[0] for k in self.keys if k is not None), 0)

    def append(self, block: int, k_RHnd: torch.Tensor, v_RHnd: torch.Tensor, valid_Rn: torch.Tensor | None = None
               ) -> CachedKV:
        """Append this scale's keys/values of ``block``; return views over everything cached so far.

        ``valid_Rn`` marks padding entries of a ragged token selection (rows keeping fewer tokens than others
        are padded to the same count). The result unpacks as ``keys, values, bias`` with ``bias`` an additive
        attention mask ``[R, 1, 1, L]`` (0 for valid keys, −inf elsewhere) once rows differ, else None; see
        :class:`~var_core.engine.attention.CachedKV` for the rest.
        """
        if not self._open:
            raise RuntimeError("KVCache used outside its `with` block")
        R, H, n, hd = k_RHnd.shape
        if self.keys[block] is None:
            self.keys[block] = k_RHnd.new_empty(R, H, self.max_len, hd)
            self.values[block] = v_RHnd.new_empty(R, H, self.max_len, v_RHnd.shape[-1])
        counts = None
        if valid_Rn is not None:
            # the append's one host synchronisation (lengths are shapes), none where the selection knows its counts
            counts = list(host_counts(valid_Rn) or valid_Rn.sum(1).tolist())
            if all(c == n for c in counts):
                valid_Rn, counts = None, None
        if valid_Rn is not None:
            self.ragged[block] = True
        if self.layout == "packed" and (valid_Rn is not None or self.row_lengths[block] is not None):
            return self._append_packed(block, k_RHnd, v_RHnd, valid_Rn, counts)
        start = self.lengths[block]
        end = start + n
        if end > self.keys[block].shape[2]:
            raise RuntimeError(f"KV cache overflow in block {block}: {end} > {self.keys[block].shape[2]} tokens")
        self.keys[block][:, :, start:end] = k_RHnd
        self.values[block][:, :, start:end] = v_RHnd
        self.lengths[block] = end
        if valid_Rn is not None and self.valid[block] is None:
            self.valid[block] = torch.ones(R, self.max_len, dtype=torch.bool, device=k_RHnd.device)
        bias = None
        if self.valid[block] is not None:
            if valid_Rn is not None:
                self.valid[block][:, start:end] = valid_Rn
            else:
                self.valid[block][:, start:end] = True
            bias = _bias(self.valid[block][:, :end], k_RHnd.dtype)
        current = torch.arange(start, end, device=k_RHnd.device).expand(R, n)
        return CachedKV(self.keys[block][:, :, :end], self.values[block][:, :, :end], bias, None, current,
                        valid_Rn, packed=self.layout == "packed", on_pairs=self._pairs_recorder(block))

    def _append_packed(self, block: int, k_RHnd: torch.Tensor, v_RHnd: torch.Tensor,
                       valid_Rn: torch.Tensor | None, counts: list[int] | None) -> CachedKV:
        """Packed layout: row ``r``'s valid keys go to ``[len_r, len_r + n_r)``, in slot order.

        One indexed copy for every row (a scatter along the sequence): each row's ``n`` slots are permuted into
        ``[len_r, len_r + n)``, its valid slots first in slot order, its padding slots after them (overwritten by
        zeros up to the longest row, or by a later append: never read). ``len_r + n`` fits the buffer because no
        row holds more than the dense length of the scales before. The per-row counts reach the host once (the
        lengths are shapes of the views)."""
        R, H, n, _ = k_RHnd.shape
        device = k_RHnd.device
        before = self.row_lengths[block] or [self.lengths[block]] * R
        if valid_Rn is None:
            counts = [n] * R
            valid = torch.ones(R, n, dtype=torch.bool, device=device)
        else:
            valid = valid_Rn
        after = [b + c for b, c in zip(before, counts)]
        if max(after) > self.keys[block].shape[2] or max(before) + n > self.keys[block].shape[2]:
            raise RuntimeError(f"KV cache overflow in block {block}: {max(max(after), max(before) + n)} > "
                               f"{self.keys[block].shape[2]} tokens")
        if self.row_lengths[block] is None:
            start_R = torch.full((R,), before[0], dtype=torch.long, device=device)
        else:  # the device copy of the lengths kept by the previous append (a host copy after select_rows)
            start_R = self._row_lengths_dev.get(block)
            if start_R is None:
                start_R = torch.tensor(before, device=device)
        start_R1 = start_R.view(R, 1)
        valid_long = valid.long()
        rank_valid = valid_long.cumsum(1) - 1  # among the row's valid slots
        rank_pad = (1 - valid_long).cumsum(1) - 1  # among its padding slots
        count_R1 = valid_long.sum(1, keepdim=True)
        position_Rn = start_R1 + torch.where(valid, rank_valid, count_R1 + rank_pad)  # a permutation per row
        index_RHnd = position_Rn.view(R, 1, n, 1).expand(R, H, n, k_RHnd.shape[-1])
        self.keys[block].scatter_(2, index_RHnd, k_RHnd)
        self.values[block].scatter_(2, position_Rn.view(R, 1, n, 1).expand(R, H, n, v_RHnd.shape[-1]), v_RHnd)
        end = max(after)
        low = min(after)
        if low < end:  # a shorter row's slots up to the longest row's end: masked, but never stale or uninitialised
            after_R1 = start_R1 + count_R1  # memory (NaN there would survive the -inf mask)
            stale = (torch.arange(low, end, device=device).view(1, end - low) >= after_R1).view(R, 1, end - low, 1)
            self.keys[block][:, :, low:end].masked_fill_(stale, 0)
            self.values[block][:, :, low:end].masked_fill_(stale, 0)
        self.lengths[block] = end
        self.row_lengths[block] = after
        self._row_lengths_dev[block] = (start_R1 + count_R1).view(R)
        uniform = low == end
        bias = None
        if not uniform:
            in_row = torch.arange(end, device=device).view(1, end) < (start_R1 + count_R1)
            bias = _bias(in_row, k_RHnd.dtype)
        position_Rn = start_R1 + rank_valid
        current = torch.where(valid, position_Rn, start_R1.clamp(max=end - 1).expand(R, n))
        return CachedKV(self.keys[block][:, :, :end], self.values[block][:, :, :end], bias,
                        None if uniform else tuple(after), current, valid_Rn, packed=True,
                        on_pairs=self._pairs_recorder(block))

    def _pairs_recorder(self, block: int):
        def record(pairs: int) -> None:
            self.attention_pairs[block] = int(pairs)
        return record

    def take_attention_pairs(self, block: int) -> int | None:
        """Query-key pairs of ``block``'s latest attention call when its rows were ever ragged (the FLOPs counter's
        own model is exact otherwise), else None; cleared by the call."""
        pairs = self.attention_pairs.pop(block, None)
        return pairs if self.ragged[block] else None

    def select_rows(self, rows: slice) -> None:
        """Keep only the given network rows (e.g. the conditional half when guidance stops)."""
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]
        self.valid = [None if m is None else m[rows] for m in self.valid]
        self.row_lengths = [None if lens is None else lens[rows] for lens in self.row_lengths]
        self._row_lengths_dev = {}
        for block, lens in enumerate(self.row_lengths):
            if lens is not None and len(set(lens)) <= 1:  # the remaining rows agree again
                self.row_lengths[block] = None
                self.lengths[block] = lens[0] if lens else 0

    def nbytes(self) -> int:
        """Bytes actually holding cached keys and values (not the pre-allocated slack)."""
        total = 0
        for block, (k, n) in enumerate(zip(self.keys, self.lengths)):
            if k is not None:
                rows, heads, _, hd = k.shape
                per_row = self.row_lengths[block] or [n] * rows
                total += 2 * heads * sum(per_row) * hd * k.element_size()
        return total


def _bias(valid_RL: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    bias = torch.zeros(valid_RL.shape, dtype=dtype, device=valid_RL.device).masked_fill_(~valid_RL, float("-inf"))
    return bias[:, None, None, :]
