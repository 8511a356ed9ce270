"""The second-model seam: a generation that switches from one adapter (the drafter) to another (the refiner) at a
scale, the two sharing one tokenizer (VQVAE), so tokens and the accumulated latent mean the same to both.

The loop (``engine.loop.generate(..., switch=ModelSwitch(refiner, at_scale))``) runs scales ``< at_scale`` on the
drafter, then hands over: the refiner encodes the same conditions with its own weights, *prefills* its own KV cache
by running its blocks over the earlier scales' inputs rebuilt from what was generated (teacher forcing:
``ModelAdapter.replay_latent`` advances its latent by each generated scale's residual), takes the drafter's latent
(``ModelAdapter.adopt_latent``) and continues. A method that uses this (CoDe, arXiv 2411.17787) is a config that
names the refiner and the scale; nothing here knows a method.

``at_scale == 0`` runs the refiner alone; ``at_scale >= num_scales`` the drafter alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import UserError


class TokenizerMismatchError(UserError, ValueError):
    """Two models meant to share one generation do not share a tokenizer (or a scale schedule)."""


@dataclass(frozen=True)
class ModelSwitch:
    """Hand generation over to ``adapter`` (the refiner) at scale ``at_scale`` (index from 0)."""

    adapter: Any  # a ModelAdapter
    at_scale: int

    def __post_init__(self) -> None:
        if int(self.at_scale) < 0:
            raise ValueError(f"a model switch needs at_scale >= 0 (0 = the refiner alone), got {self.at_scale}")


def model_label(adapter) -> str:
    return str(getattr(adapter, "model_name", None) or f"a {getattr(adapter, 'family', 'model')} model")


def check_shared_tokenizer(drafter, refiner) -> None:
    """Raise :class:`TokenizerMismatchError` unless ``drafter`` and ``refiner`` can hand a generation over: the same
    family, the same scale schedule and the same tokenizer (``ModelAdapter.tokenizer_fingerprint``: the VQVAE's
    configuration and weights, hashed)."""
    a, b = model_label(drafter), model_label(refiner)
    fix = "pick a refiner built on the drafter's VQVAE (e.g. testbed -> testbed-small, var-d30 -> var-d16)"
    if getattr(drafter, "family", None) != getattr(refiner, "family", None):
        raise TokenizerMismatchError(f"{a} ({drafter.family}) and {b} ({refiner.family}) are different model "
                                     f"families and cannot share a generation; {fix}")
    if tuple(drafter.scale_hw) != tuple(refiner.scale_hw):
        raise TokenizerMismatchError(f"{a} and {b} generate different scale schedules ({list(drafter.scale_hw)} vs "
                                     f"{list(refiner.scale_hw)}); {fix}")
    fa, fb = drafter.tokenizer_fingerprint(), refiner.tokenizer_fingerprint()
    if fa is None or fb is None:
        raise TokenizerMismatchError(f"the {drafter.family} adapter cannot tell whether {a} and {b} share a tokenizer "
                                     f"(no tokenizer_fingerprint); a second model needs one")
    if fa != fb:
        raise TokenizerMismatchError(f"{a} and {b} do not share a tokenizer (VQVAE hash {fa[:12]} vs {fb[:12]}): "
                                     f"the refiner would read the drafter's tokens as other codes; {fix}")
