"""Per-block self-attention KV cache across scales, as a context manager.

Buffers are pre-allocated for the longest possible sequence and filled in place, so appending a scale costs a
copy of that scale's K/V only (the official code re-concatenates the whole history at every scale). With token
pruning a block appends only its kept tokens, so each block keeps its own length.
"""

from __future__ import annotations

import torch


class KVCache:
    """``with KVCache(...) as cache:`` — the buffers are released on exit, also after an exception."""

    def __init__(self, num_blocks: int, max_len: int):
        self.num_blocks = num_blocks
        self.max_len = max_len
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.lengths: list[int] = []
        self.valid: list[torch.Tensor | None] = []  # per block [R, max_len] bool, only once a ragged append came
        self._open = False

    def __enter__(self) -> "KVCache":
        # Buffers are allocated at a block's first append, with the dtype/device the keys arrive in
        # (so autocast decides the cache precision, as it does for the official concatenated cache).
        self.keys = [None] * self.num_blocks
        self.values = [None] * self.num_blocks
        self.lengths = [0] * self.num_blocks
        self.valid = [None] * self.num_blocks
        self._open = True
        return self

    def __exit__(self, *exc) -> None:
        self.keys, self.values, self.lengths, self.valid = [], [], [], []
        self._open = False

    @property
    def rows(self) -> int:
        return next((k.shape[0] for k in self.keys if k is not None), 0)

    def append(self, block: int, k_RHnd: torch.Tensor, v_RHnd: torch.Tensor, valid_Rn: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Append this scale's keys/values of ``block``; return views over everything cached so far.

        ``valid_Rn`` marks padding entries of a ragged token selection (rows keeping fewer tokens than others
        are padded to the same count). Once a block has seen padding, the third return value is an additive
        attention bias ``[R, 1, 1, L]`` (0 for valid keys, −inf for padding); otherwise it is None.
        """
        if not self._open:
            raise RuntimeError("KVCache used outside its `with` block")
        if self.keys[block] is None:
            R, H, _, hd = k_RHnd.shape
            self.keys[block] = k_RHnd.new_empty(R, H, self.max_len, hd)
            self.values[block] = v_RHnd.new_empty(R, H, self.max_len, v_RHnd.shape[-1])
        start = self.lengths[block]
        end = start + k_RHnd.shape[2]
        if end > self.keys[block].shape[2]:
            raise RuntimeError(f"KV cache overflow in block {block}: {end} > {self.keys[block].shape[2]} tokens")
        self.keys[block][:, :, start:end] = k_RHnd
        self.values[block][:, :, start:end] = v_RHnd
        self.lengths[block] = end
        if valid_Rn is not None and self.valid[block] is None:
            self.valid[block] = torch.ones(k_RHnd.shape[0], self.max_len, dtype=torch.bool, device=k_RHnd.device)
        bias = None
        if self.valid[block] is not None:
            if valid_Rn is not None:
                self.valid[block][:, start:end] = valid_Rn
            else:
                self.valid[block][:, start:end] = True
            valid = self.valid[block][:, :end]
            bias = torch.zeros(valid.shape, dtype=k_RHnd.dtype, device=k_RHnd.device).masked_fill_(~valid, float("-inf"))
            bias = bias[:, None, None, :]
        return self.keys[block][:, :, :end], self.values[block][:, :, :end], bias

    def select_rows(self, rows: slice) -> None:
        """Keep only the given network rows (e.g. the conditional half when guidance stops)."""
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]
        self.valid = [None if m is None else m[rows] for m in self.valid]

    def nbytes(self) -> int:
        """Bytes actually holding cached keys and values (not the pre-allocated slack)."""
        total = 0
        for k, n in zip(self.keys, self.lengths):
            if k is not None:
                rows, heads, _, hd = k.shape
                total += 2 * rows * heads * n * hd * k.element_size()
        return total
