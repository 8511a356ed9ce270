"""Pruned tokens receive nothing: their hidden state passes through the branch unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.policy import scatter_into_zeros
from ..base import Restorer
from ..knobs import ComponentConfig
from ..registry import RESTORERS


@RESTORERS.register("identity")
class IdentityRestorer(Restorer):
    """Zero update for pruned tokens (ToProVAR's default reading: pruned tokens skip the layer)."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC, signals):
        return scatter_into_zeros(out_kept_RnC, keep_Rn, x_RNC.shape[1])
