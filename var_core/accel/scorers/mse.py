"""Feature-change token scores: FastVAR's distance to the spatial mean, SparseVAR's block input/output MSE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..attention_stats import align_rows, may_prune_next
from ..base import Needs, NO_NEEDS, Scorer, Signals
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

    def check_model(self, info) -> None:
        self._block(info.num_blocks)  # raises for a block the model does not have

    def start(self, info, signals) -> None:
        self.check_model(info)
        self._change: dict[int, torch.Tensor] = {}  # si -> [R, h, w] change map of block s (latest scale)
        self._resized: dict[int, torch.Tensor] = {}

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
        if self.config.mode == "block_change" and block == self._block(ctx.num_blocks):
            change_RN = (x_out_RNC.float() - x_in_RNC.float()).square().mean(-1)
            self._change = {ctx.scale_index: change_RN.view(-1, *ctx.hw)}  # only the latest scale is read

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
