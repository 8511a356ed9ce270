"""No whole-scale skipping."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import ScaleSkip
from ..knobs import ComponentConfig
from ..registry import SKIPS


@SKIPS.register("none")
class NoSkip(ScaleSkip):
    """Every scale is generated."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass
