"""Feature-change token scores: FastVAR's distance to the spatial mean, SparseVAR's block input/output MSE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..attention_stats import align_rows, may_prune_next
from ..base import Needs, NO_NEEDS, Scorer, Signals, block_chunk, last_block_of_chunk
from ..frequency import RESIZE_MODES, resize_map
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCORERS


@SCORERS.register("mse")
class MSEScorer(Scorer):
    """FastVAR / SparseVAR: how much a token differs (from the mean, or across a block); high = keep. Knob: ``mode``.

    * ``mean_distance`` (default; FastVAR PTS, specs/methods.md §5, FOUND(code)): ``s_i = ‖x_i − x̄‖²`` of the
      hidden state handed to the scorer (the input of the block, or of each sub-layer with the policy's
      ``granularity='branch'``), ``x̄`` the mean over the scale's tokens of the same row. ``[R, N]``.
    * ``block_change`` (SparseVAR §6, RECONSTRUCTED from the method figure): ``ΔF(i) = mean_c (out_s(i) − in_s(i))²``
      of block ``s`` (knob ``block``) at the last computed scale, resized to the current grid with ``upsample``
      (RECONSTRUCTED, default ``bilinear``); the same score for every block of the scale. Declares
      ``Needs(block_io=True)`` on scales followed by a scale that may be pruned. ``[R, N]``; 0 at the first scale.

    Options of ``block_change`` (RECONSTRUCTED; the values in brackets are the third-party SparseVAR code's,
    ``Weepingchestnut/Lvar`` ``models/sparsevar/sparsevar_model.py``, preset ``sparsevar_lvar``): ``span`` —
    the change across block ``s`` alone (default) or across the whole block chunk holding it, from the chunk's
    input to its last block's output [chunk 3 of Infinity's 8]; chunks are the model's own (``block_chunks``),
    else groups of L/8 blocks. ``cfg_halves`` — each network row's own change (default; with the policy's
    ``cfg_rows='shared'`` the conditional row's decides) or one map per sample, the mean of its conditional and
    unconditional rows' changes [``stack([mse[:B], mse[B:]]).mean(0)``] (``[B, N]``).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        mode: str = knob("mean_distance", "FastVAR distance to the spatial mean of the current hidden state, or "
                         "SparseVAR block-s input/output MSE at the previous scale",
                         choices=("mean_distance", "block_change"))
        # Optional[int], not ``int | None``: knobs.coerce reads "--set ...block=none" only for the former
        block: Optional[int] = knob(None, "SparseVAR's block s (0-indexed; negative counts from the end; None = "
                                    "the middle block L//2)", reconstructed=True, unit="block")
        upsample: str = knob("bilinear", "resize of the previous scale's change map to the current grid",
                             choices=RESIZE_MODES, reconstructed=True,
                             search=SearchSpace("categorical", choices=("nearest", "bilinear", "area")))
        span: str = knob("block", "block_change across block s alone, or across the block chunk holding it (the "
                         "model's own chunks, else L/8 blocks each)", choices=("block", "chunk"), reconstructed=True)
        cfg_halves: str = knob("own", "block_change of each network row, or per sample the mean over its two CFG "
                               "halves", choices=("own", "mean"), reconstructed=True)

    def check_model(self, info) -> None:
        self._block(info.num_blocks)  # raises for a block the model does not have

    def start(self, info, signals) -> None:
        self.check_model(info)
        self._change: dict[int, torch.Tensor] = {}  # si -> [R or B, h, w] change map of block s (latest scale)
        self._resized: dict[int, torch.Tensor] = {}
        self._span_input: torch.Tensor | None = None  # [R, N, C] entering the measured span at this scale
        s = self._block(info.num_blocks)
        if self.config.span == "chunk":
            chunk = block_chunk(s, info.num_blocks, info.block_chunks)
            first = min(b for b in range(info.num_blocks) if block_chunk(b, info.num_blocks, info.block_chunks)
                        == chunk)
            self._span_blocks = (first, last_block_of_chunk(s, info.num_blocks, info.block_chunks))
        else:
            self._span_blocks = (s, s)

    def _block(self, num_blocks: int) -> int:
        s = self.config.block
        if s is None:
            return num_blocks // 2
        if not -num_blocks <= s < num_blocks:
            raise ValueError(f"scorer 'mse': block={s} does not exist in a {num_blocks}-block model")
        return s % num_blocks

    def needs(self, ctx, signals: Signals) -> Needs:
        if self.config.mode == "block_change" and may_prune_next(ctx.scale_index, ctx.num_scales, signals):
            return Needs(block_io=True)
        return NO_NEEDS

    def observe_block(self, ctx, block, x_in_RNC, x_out_RNC, signals: Signals) -> None:
        if self.config.mode != "block_change":
            return
        first, last = self._span_blocks
        if block == first:
            self._span_input = x_in_RNC
        if block == last and self._span_input is not None:
            change_RN = (x_out_RNC.float() - self._span_input.float()).square().mean(-1)
            self._span_input = None
            B = ctx.batch_size
            if self.config.cfg_halves == "mean" and change_RN.shape[0] == 2 * B:
                change_RN = torch.stack([change_RN[:B], change_RN[B:]]).mean(0)
            self._change = {ctx.scale_index: change_RN.view(-1, *ctx.hw)}  # only the latest scale is read

    def scores_per_scale(self) -> bool:
        return self.config.mode == "block_change"  # the previous scale's change map; mean_distance reads x

    def score(self, ctx, block, branch, x_RNC, signals: Signals) -> torch.Tensor:
        if self.config.mode == "mean_distance":
            x = x_RNC.float()
            return (x - x.mean(1, keepdim=True)).square().sum(-1)
        si = ctx.scale_index
        if si not in self._resized:
            record = ctx.last_computed()
            change = None if record is None else self._change.get(record.scale_index)
            if change is None:
                scores = torch.zeros(ctx.batch_size, ctx.num_tokens, device=x_RNC.device)
            else:
                change = align_rows(change, record.guidance, ctx)
                scores = resize_map(change, ctx.hw, self.config.upsample).flatten(1)
            self._resized = {si: scores}
        return self._resized[si]
