"""Classifier-free guidance at every scale (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import Guidance
from ..knobs import ComponentConfig
from ..registry import GUIDANCES


@GUIDANCES.register("full")
class FullGuidance(Guidance):
    """Both CFG halves at every scale."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass
