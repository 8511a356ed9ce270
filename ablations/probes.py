"""Profilers attached to the evaluator from above, as probes of :func:`var_core.eval.lightning.run_generation`.

:class:`ProfilerProbe` gives each timed batch a ``profilers.timers.ComponentTimer`` (plus a CUDA peak-memory tracer
on GPU) and, after the batch, reduces them to JSON: the latency breakdown per component, the analytic FLOPs of what
the loop actually computed (``profilers.flops.count_flops``; logit-lens heads included where the timer saw them),
and peak memory (measured on CUDA, the analytic estimate of ``profilers.memory`` elsewhere). When ``profilers`` is
not importable the probe degrades to wall-clock only and says so in every batch.

The device is the one each generating process runs on: ``GenerationModule`` calls :meth:`ProfilerProbe.bind` with
it before the first batch, so a DDP rank on ``cuda:1`` times with CUDA events on ``cuda:1`` and a CPU process with
the CPU clock, whatever ``device`` the probe was built with (that is only the default before binding).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ProfilerProbe"]


class ProfilerProbe:
    name = "profile"

    def __init__(self, device: str | torch.device = "cpu", flops: bool = True, memory: bool = True,
                 timer: bool = True):
        self.device = str(device)
        self.want_flops, self.want_memory, self.want_timer = flops, memory, timer
        self._timer = None
        self._peak = None
        try:
            import profilers  # noqa: F401

            self.available = True
            self.reason = None
        except Exception as exc:  # noqa: BLE001 - measured per batch by wall-clock only
            self.available = False
            self.reason = f"profilers not importable ({type(exc).__name__}: {exc}); wall-clock only"

    def bind(self, device: str | torch.device) -> None:
        """Measure on ``device`` (the generating process's own; called by ``GenerationModule``)."""
        self.device = str(device)

    def tracer(self):
        if not self.available:
            return None
        from profilers.memory import PeakMemoryTracer
        from profilers.timers import ComponentTimer

        tracers = []
        self._timer = ComponentTimer(self.device) if self.want_timer else None
        if self._timer is not None:
            tracers.append(self._timer)
        self._peak = None
        if self.want_memory and torch.cuda.is_available() and torch.device(self.device).type == "cuda":
            self._peak = PeakMemoryTracer(self.device)
            tracers.append(self._peak)
        if not tracers:
            return None
        if len(tracers) == 1:
            return tracers[0]
        from var_core.engine.tracing import CompositeTracer

        return CompositeTracer(*tracers)

    def after_batch(self, result, *, adapter, policy, batch_size: int, seconds: float) -> dict[str, Any]:
        if not self.available:
            return {"note": self.reason}
        out: dict[str, Any] = {}
        attention_blocks: dict[int, list[int]] = {}
        if self._timer is not None:
            per_component = self._timer.per_component()
            out["component_self_ms"] = {k: float(v) for k, v in per_component["self_ms"].items()}
            out["component_inclusive_ms"] = {k: float(v) for k, v in per_component["inclusive_ms"].items()}
            out["timer"] = self._timer.device_kind
        if self.want_flops:
            try:
                from profilers.flops import count_flops

                report = count_flops(adapter, result, batch_size=batch_size)
                out["flops"] = int(report.total)
                out["flops_by_component"] = {str(k): int(v) for k, v in
                                             report.frame().groupby("component")["flops"].sum().items()}
            except Exception as exc:  # noqa: BLE001 - e.g. a family without formulas
                out["flops_error"] = f"{type(exc).__name__}: {exc}"
        kv = kv_cache_bytes(result.records, batch_size)
        if kv:
            out.update(kv)
        if self.want_memory:
            try:
                if self._peak is not None:
                    report = self._peak.report()
                    out["peak_memory_bytes"] = int(report.peak_bytes)  # text encoder and VAE decode included
                    out["reserved_memory_bytes"] = int(report.reserved_bytes)
                    out["memory_source"] = "cuda-measured"
                else:
                    from profilers.memory import analytic_memory

                    for (si, block), _ in getattr(getattr(policy, "signals", None), "attention_entropy",
                                                  {}).items():
                        attention_blocks.setdefault(si, []).append(block)
                    if getattr(result, "refiner", None) is not None:  # two models (engine.switch: CoDe)
                        from profilers.memory import two_model_memory

                        report = two_model_memory(adapter, result, batch_size, attention_blocks or None)
                    else:
                        report = analytic_memory(adapter, result.records, batch_size,
                                                 eager_attention=attention_blocks or None)
                    out["peak_memory_bytes"] = int(report.peak_bytes)
                    out["memory_source"] = "analytic"
            except Exception as exc:  # noqa: BLE001
                out["memory_error"] = f"{type(exc).__name__}: {exc}"
        return out


def kv_cache_bytes(records, batch_size: int) -> dict[str, float]:
    """KV-cache bytes per image measured from the cache's tensors (``ScaleRecord.kv_bytes*``, engine.kvcache):
    ``kv_bytes_per_image``, the largest cache carried from one scale to a later one (after the KV policy's
    eviction: what a KV method saves), and ``kv_peak_bytes_per_image``, the largest cache any scale's attention
    read (the last scale's own keys included); and what the buffers hold allocated (their storages, slack
    included): ``kv_alloc_bytes_per_image`` during the last scale run (where the largest activations coexist
    with the cache; an eviction re-allocates smaller buffers before it) and ``kv_alloc_peak_bytes_per_image``
    over all scales (the buffers are first allocated for every token, so this is the dense allocation). Empty
    when no record carries them."""
    carried = [r.kv_bytes for r in records[:-1] if getattr(r, "kv_bytes", None) is not None]
    peak = [r.kv_bytes_peak for r in records if getattr(r, "kv_bytes_peak", None) is not None]
    allocated = [r.kv_bytes_allocated_peak for r in records
                 if getattr(r, "kv_bytes_allocated_peak", None) is not None]
    out = {}
    if allocated:
        out["kv_alloc_bytes_per_image"] = allocated[-1] / max(batch_size, 1)
        out["kv_alloc_peak_bytes_per_image"] = max(allocated) / max(batch_size, 1)
    if carried:
        out["kv_bytes_per_image"] = max(carried) / max(batch_size, 1)
    if peak:
        out["kv_peak_bytes_per_image"] = max(peak) / max(batch_size, 1)
    return out
