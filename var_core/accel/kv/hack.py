"""HACK (arXiv 2504.09261, "Head-Aware KV Cache Compression for Visual Autoregressive Modeling"): structural and
contextual attention heads, asymmetric per-head budgets, pattern-specific eviction.

RECONSTRUCTED throughout (the paper's code is not in the public copies we can read, and the paper is not in
``/work/shared/papers``; built from the abstract and the issue's text). What the abstract states: attention heads
of a VAR model fall into two kinds — **contextual** heads, whose attention is vertical (every query attends to the
same few keys, semantic consistency), and **structural** heads, whose attention follows multi-diagonal patterns
(each query attends to its spatial neighbourhood across scales, spatial coherence); the kinds come from an offline
analysis, budgets are asymmetric between them and each kind gets its own eviction rule. Our reading:

* classification (``varscope calibrate hack`` writes it, the ``calibration`` knob reads it): on dense generations,
  per block and head, the **recency mass** (attention of the observation queries on the keys of the current and the
  previous scale: the diagonals' neighbourhood) against the **column concentration** (mass on the top
  ``budget``-share keys: the vertical columns), averaged over samples and scales; a head is structural when its
  recency mass is larger. Without a file (``calibration=""``) the same test runs online on each row's first
  compressed scale and is kept for the rest of the generation (``classification`` knob);
* budgets: a structural head keeps ``structural_share ×`` what a contextual head keeps, the mean over heads
  being ``budget ×`` the dense cache length (a structural head keeps at most every key; the excess goes to the
  contextual heads, so a 100 % budget keeps everything); the per-head counts differ, so they are realised by padding + mask
  (``engine.kvcache``: every head stores the largest count, the mask hides the rest);
* eviction: a contextual head keeps the keys receiving the most attention mass from the observation queries
  (ScaleKV's window of the current scale); a structural head keeps the most recent keys (cache order).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...engine.kvcache import KVKeep
from ...errors import UserError
from ..base import KVPolicy, Needs, NO_NEEDS
from ..knobs import ComponentConfig, knob
from ..registry import KV_POLICIES
from ._budget import (dense_length, device_row_lengths, rounded, top_positions, top_share_mass, valid_mask,
                      row_window_slots)


def head_statistics(probe, ctx, window: int, budget: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(recency [R, H], concentration [R, H], received [R, H, L])`` of the observation queries' attention: mass
    on the keys of this scale and the previous one, mass of the top ``budget``-share keys, and the mass each key
    receives (summed over the queries). Charges its FLOPs to the probe."""
    q, keys = probe.q, probe.kv.keys
    R, H, n, d = q.shape
    L = keys.shape[2]
    slots = row_window_slots(probe, ctx.hw, window)  # [R, w]
    logits = torch.matmul(q.gather(2, slots.view(R, 1, -1, 1).expand(R, H, slots.shape[1], d)).float(),
                              keys.float().transpose(2, 3)) * probe.scale
    if probe.kv.bias is not None:
        logits = logits + probe.kv.bias.float()
    probe.flops += 2 * R * H * slots.shape[1] * L * d
    probs = logits.softmax(-1)  # [R, H, w, L]
    previous = ctx.history[-1].hw[0] * ctx.history[-1].hw[1] if ctx.history else 0
    first = probe.kv.current_Rn.min(1).values.to(q.device)  # [R] first cache position of this scale
    recent = torch.arange(L, device=q.device).view(1, L) >= (first - previous).clamp(min=0).view(R, 1)
    recency = (probs * recent.view(R, 1, 1, L)).sum(-1).mean(2)
    concentration = top_share_mass(probs, logits, budget).mean(2)
    return recency, concentration, probs.sum(2)


def head_capacities(structural: torch.Tensor, length: int, mean: float, share: float) -> torch.Tensor:
    """int64 ``[R, H]``: each head's kept keys (1 to ``length``) from the classification ``structural [R, H]`` (bool)
    on its device: per row, a contextual head keeps ``c = H·mean / (n_s·share + H − n_s)``, a structural head
    ``min(share·c, length)`` and the excess over every key goes to the contextual heads (``n_s`` structural heads
    of ``H``). Element-wise float64 arithmetic: the host and the device give the same counts."""
    H = structural.shape[1]
    n_s = structural.sum(1, keepdim=True).double()  # per row
    contextual_cap = H * mean / (n_s * share + (H - n_s))  # [R, 1]
    structural_cap = (contextual_cap * share).clamp(max=length)
    spread = (H * mean - n_s * structural_cap) / (H - n_s).clamp(min=1)
    contextual_cap = torch.maximum(contextual_cap, spread)
    return torch.where(structural, structural_cap, contextual_cap).ceil().long().clamp(1, length)


def load_calibration(path: str) -> dict:
    """The JSON ``varscope calibrate hack`` wrote (``structural``: per block, per head)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"hack.calibration={path!r} is not a file; write one with `varscope calibrate hack` "
                        f"(or set hack.calibration='' to classify heads online)")
    data = json.loads(file.read_text())
    if data.get("method") != "hack" or "structural" not in data:
        raise UserError(f"{path} is not a HACK calibration (no 'structural' table); rerun `varscope calibrate hack`")
    return data


@KV_POLICIES.register("hack")
class HACK(KVPolicy):
    """HACK (arXiv 2504.09261, RECONSTRUCTED): structural vs contextual heads, asymmetric per-head KV budgets."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        budget: float = knob(0.1, "mean share of the dense KV length kept per head after each scale", low=0.0,
                             high=1.0, low_open=True)
        structural_share: float = knob(3.0, "a structural head's budget relative to a contextual head's "
                                       "(RECONSTRUCTED)", low=0.0, low_open=True)
        window: int = knob(16, "observation queries of the current scale (ScaleKV's grid window)", low=1)
        calibration: str = knob("", "JSON of `varscope calibrate hack` (per block and head: structural or not); "
                                "'' = classify online")
        classification: str = knob("recency", "structural test: 'recency' (recency mass > column concentration) "
                                   "or 'all_contextual' (every head contextual: no asymmetry)",
                                   choices=("recency", "all_contextual"), reconstructed=True)
        calibrating: bool = knob(False, "observe only and accumulate head statistics (the calibration command)")

    def start(self, info, signals):
        self._stats: dict[int, tuple] = {}
        self._online: dict[int, torch.Tensor] = {}  # block -> structural [R, H], fixed at its first compression
        self._table = None
        self._table_dev = None  # (device, the table on it)
        if self.config.calibration and not self.config.calibrating:
            data = load_calibration(self.config.calibration)
            table = data["structural"]
            if len(table) != info.num_blocks:
                raise UserError(f"{self.config.calibration} classifies {len(table)} blocks, the model has "
                                f"{info.num_blocks}: calibrate this model with `varscope calibrate hack`")
            self._table = torch.tensor(table, dtype=torch.bool)
        if self.config.calibrating:
            signals.extras.setdefault("hack_stats", {})

    def needs(self, ctx, signals):
        if ctx.is_last:
            return NO_NEEDS
        return Needs(attention_blocks=frozenset(range(ctx.num_blocks)))

    def observe_attention(self, ctx, block, probe, keep_Rn, signals):
        recency, concentration, received = head_statistics(probe, ctx, self.config.window, self.config.budget)
        if self.config.calibrating:
            if dense_length(ctx) <= 2 * self.config.window:  # scales this small are never compressed
                return
            signals.extras["hack_stats"].setdefault(block, []).append(
                (recency.double().sum(0).cpu(), concentration.double().sum(0).cpu(), recency.shape[0]))
            return
        self._stats[block] = (recency, concentration, received)

    def _structural(self, block: int, recency, concentration) -> torch.Tensor:
        if self.config.classification == "all_contextual":
            return torch.zeros_like(recency, dtype=torch.bool)
        if self._table is not None:
            key = str(recency.device)
            if self._table_dev is None or self._table_dev[0] != key:  # one host->device copy per generation
                self._table_dev = (key, self._table.to(recency.device))
            row = self._table_dev[1][block]
            if row.numel() != recency.shape[1]:
                raise UserError(f"{self.config.calibration}: block {block} has {row.numel()} heads classified, the "
                                f"model {recency.shape[1]}; recalibrate with `varscope calibrate hack`")
            return row.view(1, -1).expand_as(recency)
        if block not in self._online or self._online[block].shape != recency.shape:
            self._online[block] = rounded(recency) > rounded(concentration)
        return self._online[block]

    def plan_kv(self, ctx, cache, signals):
        stats, self._stats = self._stats, {}
        if ctx.is_last or not stats or self.config.calibrating:
            return None
        mean = self.config.budget * dense_length(ctx)
        share = self.config.structural_share
        blocks = sorted(stats)
        structural_dev = torch.stack([self._structural(b, stats[b][0], stats[b][1]) for b in blocks])
        # every block's head classification in one host read (the budgets are shapes); the device computes its own
        # copy of the budgets from its classification (the same arithmetic: no host->device copy)
        structural_all = structural_dev.cpu()
        plans = []  # (j, block, m)
        for j, block in enumerate(blocks):
            view = cache.view(block)
            if view is None or stats[block][2].shape[-1] < view.length:  # longer: upper-bound lengths (ScaleKV)
                continue
            L = view.length
            caps = head_capacities(structural_all[j], L, mean, share)  # [R, H], host
            if not bool((caps >= L).all()):
                plans.append((j, block, int(caps.max())))
        if not plans:
            return None
        out = {}
        for j, block, m in plans:
            view = cache.view(block)
            R, H, L, _ = view.keys.shape
            received = stats[block][2][..., :L]
            device = received.device
            structural = structural_dev[j]
            counts = head_capacities(structural, L, mean, share)  # [R, H], device
            valid = valid_mask(view, device_row_lengths(cache, block, view))
            recency_score = torch.arange(L, device=device, dtype=torch.float32).expand(R, H, L)
            scores = torch.where(structural.unsqueeze(-1), recency_score, rounded(received))
            if valid is not None:
                scores = scores.masked_fill(~valid, float("-inf"))
            index, kept = top_positions(scores, m, counts=counts)
            out[block] = KVKeep(index, kept)  # the cache drops an all-true mask
        return out


def calibration_table(extras: dict, num_blocks: int) -> dict:
    """Average the accumulated ``hack_stats`` (per block: per-head sums) into the calibration file's content."""
    stats = extras.get("hack_stats", {})
    recency, concentration, structural = [], [], []
    for block in range(num_blocks):
        entries = stats.get(block, [])
        if not entries:
            raise ValueError(f"no attention statistics for block {block}: the model has no scale whose cache exceeds "
                             f"twice the observation window")
        count = sum(e[2] for e in entries)
        r = sum(e[0] for e in entries) / count
        c = sum(e[1] for e in entries) / count
        recency.append([round(float(v), 6) for v in r])
        concentration.append([round(float(v), 6) for v in c])
        structural.append([bool(a > b) for a, b in zip(r.tolist(), c.tolist())])
    return {"method": "hack", "structural": structural, "recency": recency, "concentration": concentration}
