"""Acceleration active from a fixed scale on (NOVA Table 5's fixed-scale arms; FastVAR's texture stage)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Activation
from ..knobs import ComponentConfig, knob
from ..registry import ACTIVATIONS


@ACTIVATIONS.register("fixed")
class FixedActivation(Activation):
    """Active at every scale ``si >= start_scale`` (0-indexed); negative values count from the end."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        start_scale: int = knob(-2, "first accelerated scale, 0-indexed; -k means the k-th scale from the end",
                                unit="scale")

    def first_scale(self, num_scales: int) -> int:
        s = self.config.start_scale
        return s if s >= 0 else num_scales + s

    def start(self, info, signals) -> None:
        first = self.first_scale(info.num_scales)
        signals.activation_scale_B = torch.full((info.batch_size,), first, dtype=torch.long)

    def active_B(self, ctx, signals) -> torch.Tensor:
        return torch.full((ctx.batch_size,), ctx.scale_index >= self.first_scale(ctx.num_scales), dtype=torch.bool)
