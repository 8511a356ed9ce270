"""ScaleKV (Li et al., arXiv 2505.19602, "Memory-Efficient Visual Autoregressive Modeling with Scale-Aware KV
Cache Compression"): drafter and refiner layers per scale, per-layer KV budgets.

Read for understanding (nothing copied): the authors' README (``StargazerX0/ScaleKV``: 10 % KV cache on Infinity-2B
and 8B) and the port in ``Weepingchestnut/Lvar`` ``models/scalekv/scale_kv.py`` (its budget files are not in the
public copies we read).

FOUND (Lvar port): after a block's attention at a scale, its whole cache (earlier scales and this scale's keys) is
cut to the block's capacity at that scale; the capacity is the scale's ``Max`` for drafter blocks and ``Min`` for
refiner blocks (budget files, per scale and block); the kept positions are, per head, (1) the keys of an
observation window of the current scale — the centre tokens of a ``√w × √w`` grid, ``w = 16`` — and (2) the
``capacity − w`` other keys with the highest score, where a key's score is the window queries' scaled logits
``q·k/√d`` summed over the window queries (window keys excluded) and max-pooled along the sequence (kernel 5);
kept keys stay in cache order; the cache is not cut while it holds fewer keys than the base capacity.

RECONSTRUCTED (no budget file): the drafter/refiner split is made at every scale from the window queries' own
attention (``selection="online"``), with an attention-selectivity index per block and row ``ASI = (mass on the
current scale's keys) + (mass of the top budget-share keys)``, both averaged over heads and window queries: the
``drafter_fraction`` of blocks with the LOWEST index (dispersed attention across scales) are drafters, the rest
refiners (attention concentrated on the current map). Capacities: drafters ``c``, refiners ``refiner_share · c``,
with ``c`` chosen so the mean over blocks is ``budget ×`` the dense cache length (tokens of scales 0..k), at least
the window; where ``c`` exceeds the dense length the drafters keep everything and the refiners get the rest of the
budget (so a 100 % budget keeps every key); ``selection="uniform"`` gives every block the budget (the ablation of the split). The classification is
per network row, so a sample's keys do not depend on its batch. ``granularity="layer"`` (alternative): one set of
positions per block, scores summed over heads; the default ``head`` keeps each head's own positions (as found).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...engine.kvcache import KVKeep
from ..base import KVPolicy, Needs, NO_NEEDS
from ..knobs import ComponentConfig, knob
from ..registry import KV_POLICIES
from ._budget import (dense_length, device_row_lengths, rounded, top_positions, top_share_mass, valid_mask,
                      row_window_slots)


@KV_POLICIES.register("scalekv")
class ScaleKV(KVPolicy):
    """ScaleKV (arXiv 2505.19602): drafter/refiner blocks by attention selectivity, per-block KV budgets (10 %)."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        budget: float = knob(0.1, "mean share of the dense KV length kept after each scale (paper: 10 %)",
                             low=0.0, high=1.0, low_open=True)
        window: int = knob(16, "observation-window queries of the current scale (a √w × √w grid; FOUND: 16)",
                           low=1)
        kernel: int = knob(5, "max-pooling kernel over the key scores (FOUND: 5)", low=1)
        drafter_fraction: float = knob(0.25, "share of blocks that are drafters at each scale (RECONSTRUCTED)",
                                       low=0.0, high=1.0, reconstructed=True)
        refiner_share: float = knob(0.25, "a refiner's capacity relative to a drafter's (RECONSTRUCTED)", low=0.0,
                                    high=1.0, low_open=True)
        selection: str = knob("online", "drafter/refiner split: 'online' (attention-selectivity index of each "
                              "scale, per row) or 'uniform' (every block the same budget)",
                              choices=("online", "uniform"), reconstructed=True)
        granularity: str = knob("head", "kept positions per head ('head', FOUND) or one set per block ('layer', "
                                "scores summed over heads)", choices=("head", "layer"))

    def start(self, info, signals):
        self._scores: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def needs(self, ctx, signals):
        if ctx.is_last:
            return NO_NEEDS
        return Needs(attention_blocks=frozenset(range(ctx.num_blocks)))

    def observe_attention(self, ctx, block, probe, keep_Rn, signals):
        q = probe.q  # [R, H, n, d]: the queries the attention used (after RoPE / normalisation)
        keys = probe.kv.keys  # [R, H, L, d]
        R, H, n, d = q.shape
        L = keys.shape[2]
        slots = row_window_slots(probe, ctx.hw, self.config.window)  # [R, w]
        w = slots.shape[1]
        logits = torch.matmul(q.gather(2, slots.view(R, 1, -1, 1).expand(R, H, slots.shape[1], d)).float(),
                              keys.float().transpose(2, 3)) * probe.scale  # [R, H, w, L]
        if probe.kv.bias is not None:
            logits = logits + probe.kv.bias.float()
        probe.flops += 2 * R * H * w * L * d  # charged to this component (ScaleRecord.attention_stats_flops)
        window_pos = probe.kv.current_Rn.to(q.device).gather(1, slots)  # [R, w] cache positions of the window's keys
        is_window = torch.zeros(R, L, dtype=torch.bool, device=q.device).scatter_(1, window_pos, True)
        masked = logits.masked_fill(is_window.view(R, 1, 1, L), float("-inf"))
        summed = masked.sum(2)  # [R, H, L] (FOUND: raw logits summed over the window queries)
        summed = torch.nan_to_num(summed, nan=float("-inf"), neginf=float("-inf"))
        k = self.config.kernel
        pooled = F.max_pool1d(summed.reshape(R * H, 1, L), k, stride=1, padding=k // 2).view(R, H, L)[..., :L]
        pooled = pooled.masked_fill(is_window.view(R, 1, L), float("-inf"))
        invalid = torch.isinf(logits[:, :, 0]) & (logits[:, :, 0] < 0)  # masked keys stay out
        pooled = pooled.masked_fill(invalid, float("-inf"))
        probs = logits.softmax(-1)  # [R, H, w, L]
        current = torch.zeros(R, L, dtype=torch.bool, device=q.device).scatter_(
            1, probe.kv.current_Rn.to(q.device), True)
        on_current = (probs * current.view(R, 1, 1, L)).sum(-1)
        concentration = top_share_mass(probs, logits, self.config.budget)
        asi_R = (on_current + concentration).mean(dim=(1, 2))
        self._scores[block] = (pooled, is_window, asi_R)

    def _capacities(self, ctx, blocks: list[int], asi_RB: torch.Tensor) -> torch.Tensor:
        """int64 ``[R, blocks]``: each row's capacity per block (drafters: lowest ASI), on ``asi_RB``'s device (the
        same element-wise arithmetic on the host and on the device: the two copies agree)."""
        cfg = self.config
        B = len(blocks)
        mean = cfg.budget * dense_length(ctx)
        if cfg.selection == "uniform" or cfg.drafter_fraction in (0.0, 1.0):
            return torch.full(asi_RB.shape, max(cfg.window, math.ceil(mean)), dtype=torch.long, device=asi_RB.device)
        D = max(1, round(cfg.drafter_fraction * B))
        c = B * mean / (D + (B - D) * cfg.refiner_share)
        drafter = min(c, dense_length(ctx))  # a drafter cannot keep more than every key: the rest goes to refiners
        refiner = cfg.refiner_share * c if D == B else max(cfg.refiner_share * c, (B * mean - D * drafter) / (B - D))
        rank = rounded(asi_RB).argsort(dim=1, stable=True).argsort(dim=1)  # 0 = lowest ASI
        caps = torch.where(rank < D, float(drafter), float(refiner))  # float32, as the capacities always were
        return caps.ceil().long().clamp(min=cfg.window)

    def plan_kv(self, ctx, cache, signals):
        scores, self._scores = self._scores, {}
        if ctx.is_last or not scores:
            return None
        blocks = sorted(scores)
        asi_dev = torch.stack([scores[b][2].float() for b in blocks], dim=1)  # [R, blocks]
        # the scale's one host read: the host needs the capacities for shapes, the device computes its own copy
        caps = self._capacities(ctx, blocks, asi_dev.cpu())
        caps_dev = self._capacities(ctx, blocks, asi_dev)
        out = {}
        for j, block in enumerate(blocks):
            view = cache.view(block)
            pooled, is_window, _ = scores[block]
            if view is None or pooled.shape[-1] < view.length:
                continue
            # kept counts known on the device only (count_sync='bounded') attend over each row's upper-bound length;
            # the exact lengths read after the scale end earlier, and the slots past them were masked padding
            pooled, is_window = pooled[..., :view.length], is_window[:, :view.length]
            counts_host = caps[:, j].clamp(max=view.length)
            if bool((counts_host >= view.length).all()):  # host data: no device read
                continue
            m = int(counts_host.max())
            counts_R = caps_dev[:, j].clamp(max=view.length)
            valid = valid_mask(view, device_row_lengths(cache, block, view))
            s = rounded(pooled)
            if valid is not None:
                s = s.masked_fill(~valid, float("-inf"))
            forced = is_window.view(is_window.shape[0], 1, -1)
            if self.config.granularity == "layer":
                summed = rounded(s.sum(1, keepdim=True))  # [R, 1, L]; a key masked in any head stays out
                index, kept = top_positions(summed, m, forced, counts_R.view(-1, 1))
                index, kept = index[:, 0], kept[:, 0]
            else:
                index, kept = top_positions(s, m, forced.expand_as(s), counts_R.view(-1, 1))
            out[block] = KVKeep(index, kept)  # the cache drops an all-true mask
        return out
