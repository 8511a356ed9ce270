"""A recency window over the KV cache: the baseline every KV method should beat."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.kvcache import KVKeep
from ..base import KVPolicy
from ..knobs import ComponentConfig, knob
from ..registry import KV_POLICIES
from ._budget import capacity, device_row_lengths, top_positions, valid_mask


@KV_POLICIES.register("keep_recent")
class KeepRecent(KVPolicy):
    """Keep the most recent ``budget`` share of each block's keys after every scale (StreamingLLM-style window).

    Capacity after scale k: ``ceil(budget · (tokens of scales 0..k))`` keys per row, at least ``min_keep``; the
    kept keys are the latest in cache order (the current scale first, then the one before, ...). The same
    positions for every head (layer granularity). Not a published VAR method: the baseline of the ``kv`` family.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        budget: float = knob(0.5, "share of the dense KV length kept after each scale", low=0.0, high=1.0,
                             low_open=True)
        min_keep: int = knob(1, "fewest keys a block keeps", low=1)

    def plan_kv(self, ctx, cache, signals):
        if ctx.is_last:
            return None
        cap = capacity(self.config.budget, ctx, self.config.min_keep)
        out = {}
        for block in range(ctx.num_blocks):
            view = cache.view(block)
            if view is None or view.length <= cap:
                continue
            R, H, L, _ = view.keys.shape
            valid = valid_mask(view, device_row_lengths(cache, block, view))
            recency = torch.arange(L, device=view.keys.device, dtype=torch.float32).expand(R, H, L)
            if valid is not None:
                recency = recency.masked_fill(~valid, float("-inf"))
            index, kept = top_positions(recency[:, :1] if valid is None else recency, cap)
            out[block] = KVKeep(index[:, 0] if valid is None else index, kept[:, 0] if valid is None else kept)
        return out
