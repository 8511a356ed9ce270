"""Dense attention: every query attends to every cached key (the plain model)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import AttentionSparsity
from ..knobs import ComponentConfig
from ..registry import ATTENTION_PATTERNS


@ATTENTION_PATTERNS.register("dense")
class DenseAttention(AttentionSparsity):
    """Every query attends to every cached key (no pattern; bit-identical to the plain loop)."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass
