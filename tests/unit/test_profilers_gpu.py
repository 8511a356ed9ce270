"""CUDA paths of the profilers (skipped without a GPU): event timing without in-loop sync, measured peaks."""

from __future__ import annotations

import time

import pytest
import torch

from var_core.engine import GenerationOptions, SamplingConfig, generate
from var_core.zoo import load_model

from profilers.memory import PeakMemoryTracer
from profilers.timers import ComponentTimer
from profilers.torch_profiler import CompositeTracer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def adapter():
    return load_model("random:official-tiny", device="cuda")


def test_cuda_timer_and_peak_memory(adapter):
    options = GenerationOptions(check_finite=False, decode=False)
    sampling = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)
    generate(adapter, [1, 2], seeds=[0, 1], sampling=sampling, options=options)  # warm-up
    timer, memory = ComponentTimer(device="cuda"), PeakMemoryTracer(device="cuda")
    assert timer.device_kind == "cuda-events" and memory.active
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    generate(adapter, [1, 2], seeds=[0, 1], sampling=sampling, options=options,
             tracer=CompositeTracer(timer, memory))
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter_ns() - t0) / 1e6
    spans = timer.finalize()
    assert spans and all(s.inclusive_ms >= 0 for s in spans)
    assert timer.total_ms() <= wall_ms * 1.01 + 0.5
    report = memory.report()
    assert [s.scale for s in report.scales] == list(range(adapter.num_scales))
    assert all(s.peak_bytes > 0 and s.delta_peak_bytes >= 0 for s in report.scales)
