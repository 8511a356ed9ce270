"""Wait for a device's queued work before reading a clock (issue 27).

``torch.cuda.synchronize()`` without an argument waits for the CURRENT CUDA device, which is ``cuda:0`` unless the
caller set another: a run on ``cuda:1`` then reads its clock while its own kernels are still queued. Timers and
profilers here call :func:`synchronize` with the device the run uses instead.
"""

from __future__ import annotations

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Block until ``device``'s queued kernels finished: ``torch.cuda.synchronize(device)`` on a CUDA device (that
    device, not the current one), nothing on the CPU (its ops have finished when they return) or for ``None``."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["synchronize"]
