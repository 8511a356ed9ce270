"""Benchmarks and profilers synchronise the device the run uses, not the current CUDA device (issue 27), checked on
the CPU with a stand-in for ``torch.cuda.synchronize`` that records its device argument."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


@pytest.fixture
def synced(monkeypatch):
    """The devices ``torch.cuda.synchronize`` was called with (a CUDA machine as far as the code can tell)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def _as_device(value):
    return None if value is None else torch.device(value)


def test_synchronize_takes_the_device_and_no_ops_on_the_cpu(synced):
    from profilers.device_sync import synchronize

    synchronize(torch.device("cuda", 1))
    synchronize("cuda:2")
    synchronize("cpu")
    synchronize(None)
    assert [_as_device(d) for d in synced] == [torch.device("cuda", 1), torch.device("cuda", 2)]


def test_scale_clock_and_interleaved_medians_sync_the_timed_device(synced):
    from profilers.benchmarks import ScaleClock, interleaved_medians

    clock = ScaleClock(torch.device("cuda", 1))
    clock.scale_begin(0)
    clock.scale_end(0)
    assert [_as_device(d) for d in synced] == [torch.device("cuda", 1)] * 2 and 0 in clock.per_scale
    synced.clear()
    times = interleaved_medians({"a": lambda: None, "b": lambda: None}, repeats=2, warmup=0, device="cuda:3")
    assert [_as_device(d) for d in synced] == [torch.device("cuda", 3)] * 4 and len(times["a"]) == 2
    synced.clear()
    ScaleClock("cpu").scale_begin(0)
    interleaved_medians({"a": lambda: None}, repeats=1, warmup=0, device="cpu")
    assert synced == []


def test_bench_overhead_brackets_generate_with_the_adapters_device(synced, monkeypatch):
    import profilers.bench_overhead as bench_overhead

    order = []
    monkeypatch.setattr(bench_overhead, "generate", lambda *a, **k: order.append(len(synced)))
    adapter = SimpleNamespace(device=torch.device("cuda", 1))
    bench_overhead.run_once("null", adapter, None, [0], None, None)
    assert [_as_device(d) for d in synced] == [torch.device("cuda", 1)] * 2
    assert order == [1]  # one sync before generate(), one after


def test_profiler_steps_sync_the_runs_device(synced, monkeypatch):
    import profilers.torch_profiler as torch_profiler

    class FakeProfile:  # torch.profiler.profile without a CUDA build behind it
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def step(self):
            pass

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    adapter = SimpleNamespace(device=torch.device("cuda", 1))
    monkeypatch.setattr("var_core.engine.generate", lambda *a, **k: None)
    schedule = torch_profiler.ProfileSchedule(wait=0, warmup=1, active=1)
    torch_profiler.profile_generate(adapter, None, schedule=schedule, activities=("cpu", "cuda"))
    assert synced and all(_as_device(d) == torch.device("cuda", 1) for d in synced)
    synced.clear()
    torch_profiler.profile_generations(lambda tracer: None, schedule, activities=("cpu", "cuda"),
                                       device=torch.device("cuda", 2))
    assert synced and all(_as_device(d) == torch.device("cuda", 2) for d in synced)
