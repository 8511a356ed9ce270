"""What ran a measurement: the device's name, the attention kernels, the model's dtype (recorded per process).

Kept apart from :mod:`.records` so that the generation module (:mod:`.lightning`), which records itself, and the
record writer both read it without importing each other.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

import torch


def device_name(device: torch.device | str) -> str:
    """The GPU's name, or the CPU model from /proc/cpuinfo (what every record and report names as the machine)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        if device.index is None:  # "cuda": the current device
            device = torch.device("cuda", torch.cuda.current_device())
        return str(torch.cuda.get_device_name(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def attention_backend(adapter: Any, device: torch.device | str | None = None) -> str:
    """The adapter's own ``attention_backend`` if it names one, else :func:`sdpa_backend` of ``device`` (default:
    the adapter's device)."""
    explicit = getattr(adapter, "attention_backend", None)
    if explicit:
        return str(explicit)
    return sdpa_backend(device if device is not None else getattr(adapter, "device", torch.device("cpu")))


def sdpa_backend(device: torch.device | str) -> str:
    """Which attention kernels generation on ``device`` may use (recorded with every measurement)."""
    device = torch.device(device)
    text = "torch.nn.functional.scaled_dot_product_attention"
    if device.type == "cuda" and torch.cuda.is_available():
        flags = [name for name, on in (("flash", torch.backends.cuda.flash_sdp_enabled()),
                                       ("mem_efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
                                       ("math", torch.backends.cuda.math_sdp_enabled())) if on]
        text += f" (CUDA kernels enabled: {', '.join(flags)})"
    else:
        text += " (CPU kernel)"
    # what ran, call by call, as the dispatcher chose for the actual inputs (an additive mask or float32 rules out
    # CUDA flash): var_core.engine.attention.sdpa counts it; the enabled flags above are only what was allowed
    from ..engine.attention import describe_kernels_run, sdpa_kernels_run

    ran = {k: v for k, v in sdpa_kernels_run().items() if k.split(":", 1)[0] == device.type}
    text += f"; kernels that ran in this run: {describe_kernels_run(ran)}"
    return text + "; eager softmax(QK^T) on blocks whose attention a policy observes"


def model_dtype(adapter: Any) -> str | None:
    """dtype of the adapter's first module with parameters (``"float32"``, ``"bfloat16"`` …)."""
    from ..engine.adapters.base import adapter_modules

    modules = adapter.modules() if callable(getattr(adapter, "modules", None)) else adapter_modules(adapter)
    for module in modules.values():
        param = next(module.parameters(), None)
        if param is not None:
            return str(param.dtype).replace("torch.", "")
    return None
