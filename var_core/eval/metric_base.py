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


def _no_process_group() -> bool:
    return False


#: keyword arguments of every torchmetrics ``Metric`` varscope makes: no cross-process sync. The metrics of a run are
#: computed in one process (global rank 0 of a ``ddp`` / torchrun / SLURM launch, on the merged samples) while the
#: other ranks wait for rank 0's next message; torchmetrics' default all-gather on ``compute`` would wait for ranks
#: that never join it (issue 25: every multi-process testbed study hung).
LOCAL_METRIC = dict(sync_on_compute=False, dist_sync_on_step=False, distributed_available_fn=_no_process_group)
