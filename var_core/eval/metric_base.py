"""What every metric module shares: the "cannot run here" error and the 8-bit image grid metrics are taken on.

Kept apart from :mod:`.metrics` so that the metric implementations (CLIP score, ImageReward, HPSv2.1, the
registry) and the per-arm assembly in :mod:`.metrics`, which calls them, do not import each other.
"""

from __future__ import annotations

import torch


class MetricUnavailable(RuntimeError):
    """A metric that cannot be computed here; the message says why and what would enable it."""


def quantize01(images: torch.Tensor) -> torch.Tensor:
    """float ``[0, 1]`` images rounded to the 8-bit grid (uint8 input is converted)."""
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    return images.detach().float().clamp(0, 1).mul(255).round().div(255)
