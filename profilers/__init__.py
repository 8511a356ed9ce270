"""Profilers for the generation loop: they attach through the engine's tracing seam, never the reverse.

* :mod:`profilers.timers` — :class:`ComponentTimer` (CUDA events / ``perf_counter_ns`` per span);
* :mod:`profilers.torch_profiler` — ``record_function`` ranges, scheduled ``torch.profiler`` runs, op tables;
  :class:`CompositeTracer` to combine tracers;
* :mod:`profilers.flops` — analytic FLOPs following the kept tokens, FlopCounterMode support, Figure 2b;
* :mod:`profilers.memory` — per-scale peak memory (CUDA measured, analytic on CPU);
* :mod:`profilers.breakdown` — DataFrames and seaborn plots from the above.
"""

from .flops import ArchSpec, FlopReport, arch_from_adapter, count_flops, gflops_vs_resolution, measure_flops
from .memory import MemoryReport, PeakMemoryTracer, analytic_memory
from .timers import ComponentTimer
from .torch_profiler import CompositeTracer, ProfileSchedule, RecordFunctionTracer, profile_generations

__all__ = [
    "ArchSpec", "ComponentTimer", "CompositeTracer", "FlopReport", "MemoryReport", "PeakMemoryTracer",
    "ProfileSchedule", "RecordFunctionTracer", "analytic_memory", "arch_from_adapter", "count_flops",
    "gflops_vs_resolution", "measure_flops", "profile_generations",
]
