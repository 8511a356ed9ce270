"""Acceleration never activates: the policy runs dense (the baseline arm)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Activation
from ..knobs import ComponentConfig
from ..registry import ACTIVATIONS


@ACTIVATIONS.register("never")
class NeverActive(Activation):
    """Never accelerate (baseline)."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass

    def active_B(self, ctx, signals) -> torch.Tensor:
        return torch.zeros(ctx.batch_size, dtype=torch.bool)
