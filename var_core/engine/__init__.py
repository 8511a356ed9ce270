"""The generation engine: one next-scale loop with hook slots (see DESIGN.md)."""

from .attention import AttentionProbe
from .context import GenerationInfo, GuidanceMode, ScaleContext, ScalePlan, ScaleRecord
from .lens_probe import LensProbe
from .loop import GenerationOptions, GenerationResult, NonFiniteLogitsError, generate
from .policy import Policy, TokenSelection, pad_ragged_selection
from .sampling import SamplingConfig
from .tracing import NULL_TRACER, Tracer

__all__ = [
    "AttentionProbe", "GenerationInfo", "GenerationOptions", "GenerationResult", "GuidanceMode", "LensProbe",
    "NonFiniteLogitsError", "Policy", "SamplingConfig", "TokenSelection", "pad_ragged_selection", "ScaleContext",
    "ScalePlan", "ScaleRecord", "Tracer", "NULL_TRACER", "generate",
]
