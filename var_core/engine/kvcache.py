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

**Eviction (the KV-cache policy seam, issue 29).** After a scale, ``Policy.plan_kv`` may return, per block, the
cached positions that stay for later scales (:class:`KVKeep`); :meth:`KVCache.evict` compacts them to the front of
the block's buffers, in cache order, so later appends follow them and attention reads exactly the kept keys.
A keep is per row and, where a method needs it, per head (``index [R, H, m]``: each head keeps its own positions).
Per-head budgets of different sizes (HACK's asymmetric budgets) are realised by **padding + mask**: every head
stores ``m = max`` entries, ``valid [R, H, m]`` marks the real ones and attention gets an additive ``[R, H, 1, L]``
mask (one SDPA call; a varlen per-head kernel would skip the padding, SDPA computes it and the mask discards it).
The FLOPs counter sees the kept pairs (``attention_pairs``: valid keys averaged over heads, times valid queries)
and the kept key length (``attention_lengths``); the bytes (:meth:`KVCache.nbytes`) are measured from the cached
tensors' shapes and element sizes: ``kept`` counts the valid entries, ``stored`` the entries the buffers hold
for them (padding included). :func:`apply_kv_policy` is the loop's one call: it asks the policy, evicts, and
returns the scale record with the bytes (peak during the scale, kept after it).

**Eviction frees memory.** The buffers are allocated at ``max_len`` (every token of every scale), so compacting
in place would leave the evicted slots allocated. When the capacity a block still needs after an eviction — the
``m`` kept keys plus every token not yet appended (``max_len`` minus the tokens the block consumed, an upper bound
whatever later pruning does) — is at most ``SHRINK_BELOW`` of the buffer's length, :meth:`KVCache.evict` gathers
the kept keys into fresh buffers of that capacity instead (the same one copy; the old buffers are released when
the last view of them dies, so during the copy both exist for that one block). ``shrink=False`` keeps the
full-length buffers (the reference the tests compare against: outputs are bitwise the same). The memory actually
held is measured by :meth:`KVCache.allocated_nbytes` (the buffers' storages, slack and dropped guidance rows
included) and recorded per scale (``ScaleRecord.kv_bytes_allocated*``, ``kv_slots``).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .attention import CachedKV
from .packing import count_bounds, device_counts, host_counts

KV_LAYOUTS = ("packed", "padded")
#: re-allocate a block's buffers after an eviction when the capacity it still needs is at most this share of the
#: buffer's length (below it the copy frees at least a quarter of the block's cache; above it, it is not worth a
#: fresh allocation)
SHRINK_BELOW = 0.75


class KVKeep(NamedTuple):
    """Cached positions of one block that stay for later scales.

    ``index``: int64 ``[R, m]`` (every head keeps the same positions: layer granularity) or ``[R, H, m]`` (each
    head its own: head granularity), positions into the block's cache as it stands (``0 .. length-1``), sorted
    ascending per row (and head), each row (head) keeping the same count ``m``. ``valid``: bool ``[R, H, m]`` or
    ``[R, m]``, False for padding entries (a head or row keeping fewer than ``m``: repeat one of its kept positions
    there); None = all real. Every (row, head) must keep at least one real position.
    """

    index: torch.Tensor
    valid: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class KVBlockView:
    """What a KV policy reads of one block's cache: the live keys/values ``[R, H, L, d]`` (views, no copy), each
    row's valid length (``row_lengths``; None = all ``L``) and the valid mask of earlier per-head evictions
    (``head_valid [R, H, L]``, None = all valid)."""

    keys: torch.Tensor
    values: torch.Tensor
    row_lengths: tuple[int, ...] | None
    head_valid: torch.Tensor | None

    @property
    def length(self) -> int:
        return self.keys.shape[2]


class KVCache:
    """``with KVCache(...) as cache:`` — the buffers are released on exit, also after an exception."""

    def __init__(self, num_blocks: int, max_len: int, layout: str = "packed", shrink: bool = True):
        self.num_blocks = num_blocks
        self.max_len = max_len
        self.layout = layout
        self.shrink = shrink  # re-allocate smaller buffers after an eviction (module docstring); False: keep max_len
        self.consumed: list[int] = []  # per block: token slots appended so far (padding of ragged appends included)
        self._check_layout(layout)
        self.keys: list[torch.Tensor | None] = []
        self.values: list[torch.Tensor | None] = []
        self.lengths: list[int] = []  # per block: the longest row's length (the filled part of the buffers)
        self.row_lengths: list[list[int] | None] = []  # per block, packed layout: per-row lengths once rows differ
        self.valid: list[torch.Tensor | None] = []  # per block, padded layout: [R, max_len] bool once padding came
        self.ragged: list[bool] = []  # per block: a ragged append happened (attention pairs are then recorded)
        self.attention_pairs: dict[int, int] = {}  # block -> query-key pairs of its latest attention call
        self._row_lengths_dev: dict[int, torch.Tensor] = {}  # packed layout: row_lengths on the device
        self.head_valid: list[torch.Tensor | None] = []  # per block, after a per-head eviction: [R, H, max_len]
        self.evicted: list[bool] = []  # per block: an eviction happened (attention pairs / lengths recorded)
        self.attention_lengths: dict[int, int] = {}  # evicted blocks: kept keys per row of the latest attention
        self._kept_pairs: dict[int, int] = {}  # per-head masked blocks: kept query-key pairs of the latest append
        self._pending_lengths: set[int] = set()  # blocks whose host row lengths are upper bounds (device counts)
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
        self.consumed = [0] * self.num_blocks
        self.row_lengths = [None] * self.num_blocks
        self.valid = [None] * self.num_blocks
        self.ragged = [False] * self.num_blocks
        self.attention_pairs = {}
        self._row_lengths_dev = {}
        self.head_valid = [None] * self.num_blocks
        self.evicted = [False] * self.num_blocks
        self.attention_lengths = {}
        self._kept_pairs = {}
        self._pending_lengths = set()
        self._open = True
        return self

    def __exit__(self, *exc) -> None:
        self.keys, self.values, self.lengths, self.row_lengths, self.valid, self.ragged = [], [], [], [], [], []
        self.consumed = []
        self.attention_pairs = {}
        self.head_valid, self.evicted, self.attention_lengths, self._kept_pairs = [], [], {}, {}
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
        self.consumed[block] += n
        counts = None
        if device_counts(valid_Rn):  # counts stay on the device (count_sync='bounded'): no read, always ragged
            self.ragged[block] = True
            if self.layout == "packed":
                return self._after_append(block, self._append_device_counts(block, k_RHnd, v_RHnd, valid_Rn),
                                          valid_Rn)
        elif valid_Rn is not None:
            # the append's one host synchronisation (lengths are shapes), none where the selection knows its counts
            counts = list(host_counts(valid_Rn) or valid_Rn.sum(1).tolist())
            if all(c == n for c in counts):
                valid_Rn, counts = None, None
        if valid_Rn is not None:
            self.ragged[block] = True
        if self.layout == "packed" and (valid_Rn is not None or self.row_lengths[block] is not None):
            return self._after_append(block, self._append_packed(block, k_RHnd, v_RHnd, valid_Rn, counts),
                                      valid_Rn)
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
        return self._after_append(block, CachedKV(
            self.keys[block][:, :, :end], self.values[block][:, :, :end], bias, None, current, valid_Rn,
            packed=self.layout == "packed", on_pairs=self._pairs_recorder(block)), valid_Rn)

    def _after_append(self, block: int, kv: CachedKV, valid_Rn: torch.Tensor | None) -> CachedKV:
        """An evicted block: record the kept key length; a per-head masked block: fold the head mask into the
        attention mask (``[R, H, 1, L]``, one masked SDPA call instead of the varlen path) and record the kept
        query-key pairs (valid keys averaged over heads, times valid queries)."""
        if not self.evicted[block]:
            return kv
        L = kv.keys.shape[2]
        R, H = kv.keys.shape[:2]
        head_valid = self.head_valid[block]
        if head_valid is None:
            self.attention_lengths[block] = L if kv.lengths is None else max(kv.lengths)
            return kv
        valid_RHL = head_valid[:, :, :L].clone()
        if kv.bias is not None:
            valid_RHL &= (kv.bias[:, :, 0, :] == 0).expand(R, H, L)
        keys_RH = valid_RHL.sum(2)  # kept keys per row and head
        queries_R = (torch.full((R,), kv.current_Rn.shape[1], device=keys_RH.device) if valid_Rn is None
                     else valid_Rn.sum(1))
        # on the device (0-d, rounded half to even as round() does); apply_kv_policy reads them once per scale
        self._kept_pairs[block] = (queries_R.double() * keys_RH.double().mean(1)).sum().round().long()
        self.attention_lengths[block] = keys_RH.double().mean().round().long()
        return CachedKV(kv.keys, kv.values, _bias(valid_RHL, kv.keys.dtype, per_head=True), None, kv.current_Rn,
                        kv.current_valid_Rn, packed=False, on_pairs=kv.on_pairs)

    def _append_device_counts(self, block: int, k_RHnd: torch.Tensor, v_RHnd: torch.Tensor,
                              valid_Rn: torch.Tensor) -> CachedKV:
        """Packed layout, counts known on the device only (:func:`~var_core.engine.packing.mark_device_counts`):
        the same one scatter as :meth:`_append_packed` (each row's valid slots first, from its device length), but
        the host takes row ``r``'s length as ``before_r + bound_r`` (an upper bound) and attention masks the slots
        past each row's device length (the mask rides on the result, also into the varlen row groups).
        :meth:`resolve_lengths` reads the true lengths once after the scale, so later scales see exact lengths (and,
        rows agreeing, no mask)."""
        R, H, n, _ = k_RHnd.shape
        device = k_RHnd.device
        before = self.row_lengths[block] or [self.lengths[block]] * R
        if max(before) + n > self.keys[block].shape[2]:
            raise RuntimeError(f"KV cache overflow in block {block}: {max(before) + n} > "
                               f"{self.keys[block].shape[2]} tokens")
        start_R = self._row_lengths_dev.get(block)
        if start_R is None:
            start_R = (torch.full((R,), before[0], dtype=torch.long, device=device) if len(set(before)) == 1
                       else torch.tensor(before, device=device))
        start_R1 = start_R.view(R, 1)
        valid_long = valid_Rn.long()
        rank_valid = valid_long.cumsum(1) - 1
        rank_pad = (1 - valid_long).cumsum(1) - 1
        count_R1 = valid_long.sum(1, keepdim=True)
        position_Rn = start_R1 + torch.where(valid_Rn, rank_valid, count_R1 + rank_pad)
        self.keys[block].scatter_(2, position_Rn.view(R, 1, n, 1).expand(R, H, n, k_RHnd.shape[-1]), k_RHnd)
        self.values[block].scatter_(2, position_Rn.view(R, 1, n, 1).expand(R, H, n, v_RHnd.shape[-1]), v_RHnd)
        after_R1 = start_R1 + count_R1
        upper = [b + c for b, c in zip(before, count_bounds(valid_Rn) or (n,) * R)]
        low, end = min(before), max(upper)
        # slots past a row's length up to the longest upper length: masked, but never uninitialised memory
        stale = (torch.arange(low, end, device=device).view(1, end - low) >= after_R1).view(R, 1, end - low, 1)
        self.keys[block][:, :, low:end].masked_fill_(stale, 0)
        self.values[block][:, :, low:end].masked_fill_(stale, 0)
        self.lengths[block] = end
        self.row_lengths[block] = upper  # upper bounds until resolve_lengths
        self._row_lengths_dev[block] = after_R1.view(R)
        self._pending_lengths.add(block)
        in_row = torch.arange(end, device=device).view(1, end) < after_R1
        current = torch.where(valid_Rn, start_R1 + rank_valid, start_R1.clamp(max=end - 1).expand(R, n))
        return CachedKV(self.keys[block][:, :, :end], self.values[block][:, :, :end], _bias(in_row, k_RHnd.dtype),
                        None if len(set(upper)) == 1 else tuple(upper), current, valid_Rn, packed=True,
                        on_pairs=self._pairs_recorder(block), exact_lengths=False)

    def resolve_lengths(self) -> None:
        """Read back, in one transfer, the row lengths of every block appended with device-only counts since the
        last call (:meth:`_append_device_counts`), so the host lengths (views, masks, bytes, KV policies) are exact
        again. The loop calls it once per scale, after the scale's blocks (:func:`apply_kv_policy`)."""
        pending = sorted(self._pending_lengths)
        if not pending:
            return
        self._pending_lengths = set()
        exact = torch.stack([self._row_lengths_dev[b] for b in pending]).tolist()
        for block, lengths in zip(pending, exact):
            self.row_lengths[block] = [int(v) for v in lengths]
            self.lengths[block] = max(self.row_lengths[block])

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
            kept = self._kept_pairs.pop(block, pairs)  # a per-head masked block's: a 0-d device tensor, read later
            self.attention_pairs[block] = kept if isinstance(kept, torch.Tensor) else int(kept)
        return record

    def take_attention_pairs(self, block: int) -> int | None:
        """Query-key pairs of ``block``'s latest attention call when its rows were ever ragged (the FLOPs counter's
        own model is exact otherwise), else None; cleared by the call."""
        pairs = self.attention_pairs.pop(block, None)
        return pairs if self.ragged[block] or self.evicted[block] else None

    def take_attention_lengths(self) -> tuple[int | None, ...]:
        """Per block: kept keys per row its latest attention read, for evicted blocks (None elsewhere); empty when
        no block was evicted. Cleared by the call."""
        if not any(self.evicted):
            return ()
        out = tuple(self.attention_lengths.get(b) for b in range(self.num_blocks))
        self.attention_lengths = {}
        return out

    # ------------------------------------------------------------------------------------------ eviction
    def view(self, block: int) -> KVBlockView | None:
        """The live part of ``block``'s cache (None before its first append)."""
        k = self.keys[block]
        if k is None:
            return None
        L = self.lengths[block]
        rows = self.row_lengths[block]
        valid = self.head_valid[block]
        if self.valid[block] is not None:  # padded layout: padding entries of ragged appends
            pad = self.valid[block][:, None, :L].expand(k.shape[0], k.shape[1], L)
            valid = pad if valid is None else valid[:, :, :L] & pad
        return KVBlockView(k[:, :, :L], self.values[block][:, :, :L], None if rows is None else tuple(rows),
                           None if valid is None else valid[:, :, :L])

    def evict(self, block: int, keep: KVKeep, deferred: list | None = None) -> None:
        """Keep only ``keep``'s positions of ``block`` (see :class:`KVKeep`), compacted to the front in order.

        The checks (positions in range, no empty head) and whether padding is left need one host read; with
        ``deferred`` (a list) they are appended there and :meth:`settle` reads every block's at once."""
        view = self.view(block)
        if view is None:
            raise RuntimeError(f"KVCache.evict: block {block} holds no keys yet")
        R, H, L, d = view.keys.shape
        index = keep.index.to(device=view.keys.device, dtype=torch.long)
        if index.dim() == 2:
            index = index.unsqueeze(1).expand(R, H, index.shape[-1])
        if index.dim() != 3 or index.shape[:2] != (R, H):
            raise ValueError(f"KVKeep.index must be [R, m] or [R, H, m] with R={R}, H={H}; got "
                             f"{tuple(keep.index.shape)}")
        m = index.shape[2]
        if m > L or m == 0:
            raise ValueError(f"KVKeep of block {block}: keep 1 to {L} positions, got {m}")
        valid = None
        if keep.valid is not None:
            valid = keep.valid.to(view.keys.device, torch.bool)
            if valid.dim() == 2:
                valid = valid.unsqueeze(1).expand(R, H, m)
        old = view.head_valid
        if view.row_lengths is not None:
            lengths_R = self._row_lengths_dev.get(block)  # the device copy of the lengths, where one is kept
            if lengths_R is None or lengths_R.numel() != R:
                lengths_R = torch.tensor(view.row_lengths, device=index.device)
            in_row = (torch.arange(L, device=index.device).view(1, 1, L) < lengths_R.view(R, 1, 1)).expand(R, H, L)
            old = in_row if old is None else old & in_row
        if old is not None:
            carried = old.gather(2, index)
            valid = carried if valid is None else valid & carried
        # positions in range, whether any padding is left, no empty head: one host read (here or in settle)
        false = torch.zeros((), dtype=torch.bool, device=index.device)
        checks = torch.stack([(index < 0).any() | (index >= L).any(), false if valid is None else ~valid.all(),
                              false if valid is None else ~valid.any(2).all()]).long()
        if valid is not None:  # per-row counts, and whether every head of a row keeps the same prefix count
            counts_RH = valid.sum(2)
            prefix = (valid == (torch.arange(m, device=valid.device).view(1, 1, m) < counts_RH.unsqueeze(-1))).all()
            rows_only = prefix & (counts_RH == counts_RH[:, :1]).all()
            checks = torch.cat([checks, rows_only.long().view(1), counts_RH[:, 0]])
        index_d = index.unsqueeze(-1).expand(R, H, m, d)
        kept_k = view.keys.gather(2, index_d)
        kept_v = view.values.gather(2, index.unsqueeze(-1).expand(R, H, m, view.values.shape[-1]))
        capacity = m + max(self.max_len - self.consumed[block], 0)  # kept keys + every token still to come
        if self.shrink and capacity <= SHRINK_BELOW * self.keys[block].shape[2]:
            # fresh buffers at the capacity still needed (also drops guidance rows select_rows only sliced off)
            self.keys[block] = kept_k.new_empty(R, H, capacity, d)
            self.values[block] = kept_v.new_empty(R, H, capacity, kept_v.shape[-1])
        self.keys[block][:, :, :m] = kept_k
        self.values[block][:, :, :m] = kept_v
        self.lengths[block] = m
        self.row_lengths[block] = None
        self._row_lengths_dev.pop(block, None)
        self.valid[block] = None
        self.evicted[block] = True
        self.head_valid[block] = None
        if valid is not None:
            buffer = torch.ones(R, H, self.keys[block].shape[2], dtype=torch.bool, device=valid.device)
            buffer[:, :, :m] = valid
            self.head_valid[block] = buffer
        if deferred is None:
            self.settle([(block, L, checks)])
        else:
            deferred.append((block, L, checks))

    def settle(self, deferred: list) -> None:
        """Read the deferred checks of :meth:`evict` (one host read for all blocks): raise on a bad keep, drop the
        head masks that hold no padding (those blocks attend without a mask)."""
        if not deferred:
            return
        flags = torch.cat([c for _, _, c in deferred]).tolist()
        at = 0
        for block, L, c in deferred:
            out_of_range, padded, empty = flags[at:at + 3]
            rows_only, counts = (flags[at + 3], flags[at + 4:at + c.numel()]) if c.numel() > 3 else (0, [])
            at += c.numel()
            if out_of_range:
                raise ValueError(f"KVKeep of block {block}: positions must lie in [0, {L})")
            if empty:
                raise ValueError(f"KVKeep of block {block}: a row/head keeps no valid position")
            if not padded:
                self.head_valid[block] = None
            elif rows_only and self.layout == "packed":
                # rows keep different counts, every head of a row the same prefix: each row's own length (the
                # packed layout's varlen attention, as for ragged token selections), no mask
                self.head_valid[block] = None
                self.row_lengths[block] = [int(n) for n in counts]
                self._row_lengths_dev[block] = c[4:]  # their device copy: the next append copies none over
                self.lengths[block] = max(counts)
                self.ragged[block] = True

    def select_rows(self, rows: slice) -> None:
        """Keep only the given network rows (e.g. the conditional half when guidance stops)."""
        self.resolve_lengths()
        self.keys = [None if k is None else k[rows] for k in self.keys]
        self.values = [None if v is None else v[rows] for v in self.values]
        self.valid = [None if m is None else m[rows] for m in self.valid]
        self.head_valid = [None if m is None else m[rows] for m in self.head_valid]
        self.row_lengths = [None if lens is None else lens[rows] for lens in self.row_lengths]
        self._row_lengths_dev = {}
        for block, lens in enumerate(self.row_lengths):
            if lens is not None and len(set(lens)) <= 1:  # the remaining rows agree again
                self.row_lengths[block] = None
                self.lengths[block] = lens[0] if lens else 0

    def allocated_nbytes(self) -> int:
        """Bytes the key/value buffers hold allocated (their storages: pre-allocated slack and guidance rows
        dropped by :meth:`select_rows` included), what the cache occupies on the allocator."""
        return sum(t.untyped_storage().nbytes() for t in (*self.keys, *self.values) if t is not None)

    def slots(self) -> tuple[int, ...]:
        """Per block: token slots the key buffer's storage holds, summed over rows (``rows × capacity``; 0 before
        the block's first append). The analytic memory model multiplies them by ``2·C·e``
        (profilers.memory)."""
        out = []
        for k in self.keys:
            if k is None:
                out.append(0)
            else:
                out.append(k.untyped_storage().nbytes() // (k.element_size() * k.shape[1] * k.shape[3]))
        return tuple(out)

    def nbytes(self, kept: bool = True, lazy: bool = False) -> int | torch.Tensor:
        """Bytes of the cached keys and values (not the pre-allocated slack), from the buffers' shapes and element
        sizes: ``kept=True`` counts valid entries only (each row's own length, per-head masks of an eviction, the
        padded layout's padding excluded); ``kept=False`` the entries the buffers hold for them (padding included:
        what a padded store occupies). ``lazy``: where per-head masks are counted, a 0-d device tensor instead of
        reading it (the caller reads it with others)."""
        total, masked = 0, []
        for block, (k, n) in enumerate(zip(self.keys, self.lengths)):
            if k is None:
                continue
            rows, heads, _, hd = k.shape
            per_entry = hd * k.element_size() + self.values[block].shape[-1] * self.values[block].element_size()
            if not kept:
                total += per_entry * heads * sum(self.row_lengths[block] or [n] * rows)
                continue
            view = self.view(block)
            if view.head_valid is not None:
                entries = view.head_valid
                if view.row_lengths is not None:
                    entries = entries & (torch.arange(n, device=entries.device).view(1, 1, n) < torch.tensor(
                        view.row_lengths, device=entries.device).view(rows, 1, 1))
                masked.append(entries.sum() * per_entry)
            else:
                total += per_entry * heads * sum(self.row_lengths[block] or [n] * rows)
        if not masked:
            return total
        counted = torch.stack(masked).sum() + total
        return counted if lazy else int(counted)  # one host read for the masked blocks


def apply_kv_policy(policy, ctx, cache: KVCache, record):
    """The loop's KV-cache step after scale ``ctx``: ``policy.plan_kv`` decides, per block, the positions that stay
    (None / missing block: all of them); the cache evicts the rest. Returns ``record`` with the KV bytes: the
    cache during the scale (``kv_bytes_peak``, what this scale's attention read) and kept for later scales
    (``kv_bytes``, ``kv_bytes_stored`` with padding), the bytes the buffers hold allocated during the scale and
    after the eviction (``kv_bytes_allocated_peak``, ``kv_bytes_allocated``) with the per-block slots during the
    scale (``kv_slots``), and the kept key lengths the attention read (``attention_lengths``, evicted blocks only).
    """
    cache.resolve_lengths()  # blocks appended with device-only counts: their exact lengths, one read
    peak = cache.nbytes(lazy=True)
    allocated_peak, slots = cache.allocated_nbytes(), cache.slots()
    decisions = policy.plan_kv(ctx, cache)
    deferred: list = []
    for block, keep in (decisions or {}).items():
        if keep is not None:
            cache.evict(block, keep, deferred)
    cache.settle(deferred)
    pairs, lengths, (peak, kept) = _host_numbers(record.attention_pairs, cache.take_attention_lengths(),
                                                 (peak, cache.nbytes(lazy=True)))
    return dataclasses.replace(record, kv_bytes_peak=peak, kv_bytes=kept,
                               kv_bytes_stored=cache.nbytes(kept=False), kv_bytes_allocated_peak=allocated_peak,
                               kv_bytes_allocated=cache.allocated_nbytes(), kv_slots=slots,
                               attention_pairs=pairs, attention_lengths=lengths)


def _host_numbers(*groups: tuple) -> list[tuple]:
    """The groups with every 0-d device tensor (per-head masked blocks' kept pairs, key lengths and kept bytes,
    computed on the device during the scale) replaced by its integer, all read in one transfer."""
    lazy = [v for group in groups for v in group if isinstance(v, torch.Tensor)]
    if not lazy:
        return list(groups)
    values = iter(torch.stack([v.reshape(()).long() for v in lazy]).tolist())
    return [tuple(next(values) if isinstance(v, torch.Tensor) else v for v in group) for group in groups]


def _bias(valid_RL: torch.Tensor, dtype: torch.dtype, per_head: bool = False) -> torch.Tensor:
    """Additive mask: ``valid [R, L]`` -> ``[R, 1, 1, L]``; ``per_head``: ``valid [R, H, L]`` -> ``[R, H, 1, L]``."""
    bias = torch.zeros(valid_RL.shape, dtype=dtype, device=valid_RL.device).masked_fill_(~valid_RL, float("-inf"))
    return bias[:, :, None, :] if per_head else bias[:, None, None, :]
