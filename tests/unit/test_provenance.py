"""Honest provenance on a GPU, checked on the CPU with stand-ins for ``torch.cuda`` (issue 27): the SDPA kernel
that ran (not the enabled flags), whole-generation CUDA peak memory (text encoder and VAE decode included) and
``max_memory_reserved``, latency synchronised on the timed device and measured without span timers, ToProVAR's
entropy on the one-call ``log Z`` route on CUDA, and ``gpucheck``'s pytest under a time limit."""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.nn.functional as F

import var_core.engine.attention as attention


# ----- SDPA kernel that ran ---------------------------------------------------------------------------------
def test_cpu_record_names_the_kernel_the_dispatcher_ran():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    attention.sdpa_kernels_run(reset=True)
    attention.sdpa(q, k, k)
    # only the math kernel allowed: the record must follow the backend restriction, not a fixed name
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        attention.sdpa(q, k, k)
    assert attention.sdpa_kernels_run(reset=True) == {"cpu:flash": 1, "cpu:math": 1}


def test_cuda_record_follows_the_kernel_choice_for_each_call_not_the_flags(monkeypatch):
    """A stand-in for torch._fused_sdp_choice with PyTorch's CUDA rules (flash needs fp16/bf16 and no mask; the
    memory-efficient kernel takes either): every flag enabled, yet a masked or fp32 call is not recorded as flash."""
    seen = []

    def choose(q, k, v, mask, dropout, causal, scale=None):
        seen.append((q.dtype, mask is not None))
        if q.dtype in (torch.float16, torch.bfloat16) and mask is None:
            return 1
        return 2

    monkeypatch.setattr(attention, "_choose_kernel", choose)

    class FakeCudaTensor(torch.Tensor):  # reports a CUDA device; computes on the CPU
        @property
        def device(self):
            return torch.device("cuda", 1)

    def cuda_like(t):
        return t.as_subclass(FakeCudaTensor)

    attention.sdpa_kernels_run(reset=True)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    mask = torch.zeros(1, 1, 1, 6)
    assert attention.sdpa_kernel(cuda_like(q.half()), cuda_like(k.half()), cuda_like(k.half())) == "cuda:flash"
    assert attention.sdpa_kernel(cuda_like(q.half()), cuda_like(k.half()), cuda_like(k.half()),
                                 cuda_like(mask.half())) == "cuda:efficient"
    assert attention.sdpa_kernel(cuda_like(q), cuda_like(k), cuda_like(k)) == "cuda:efficient"  # fp32
    assert seen == [(torch.float16, False), (torch.float16, True), (torch.float32, False)]


def test_cached_attention_counts_each_sdpa_call(monkeypatch):
    """The engine's attention goes through the recording ``sdpa`` (one count per SDPA call, grouped rows too)."""
    from var_core.engine.attention import CachedAttention, CachedKV

    R, H, n, L, d = 2, 2, 3, 5, 4
    keys, values = torch.randn(R, H, L, d), torch.randn(R, H, L, d)
    kv = CachedKV(keys, values, None, None, torch.zeros(R, n, dtype=torch.long), None, packed=False)
    q = torch.randn(R, H, n, d)
    attention.sdpa_kernels_run(reset=True)
    out = CachedAttention(kv)(q, keys, values, None, 0.5)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, keys, values, scale=0.5))
    assert attention.sdpa_kernels_run(reset=True) == {"cpu:flash": 1}


# ----- ToProVAR entropy: one call with log Z on CUDA ----------------------------------------------------------
def _efficient_stand_in(calls):
    """The CUDA memory-efficient kernel's contract, computed on the CPU: (out, log Z padded to 32 queries, …)."""

    def op(q, k, v, bias, compute_lse, dropout, causal, *, scale):
        calls.append({"bias_shape": None if bias is None else tuple(bias.shape), "lse": compute_lse,
                      "dtype": q.dtype})
        s = scale * q @ k.transpose(-1, -2) + (0 if bias is None else bias)
        lse = torch.logsumexp(s, -1)
        n = q.shape[2]
        padded = torch.full((*lse.shape[:2], -(-n // 32) * 32), float("nan"))
        padded[..., :n] = lse
        return s.softmax(-1) @ v, padded, torch.empty(()), torch.empty(())

    return op


def test_entropy_takes_the_one_call_log_z_route_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "_CUDA_EFFICIENT", _efficient_stand_in(calls))

    class FakeCudaTensor(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 0)

    R, H, n, L, d = 2, 3, 5, 9, 4
    q, k = torch.randn(R, H, n, d), torch.randn(R, H, L, d)
    bias = torch.zeros(R, 1, 1, L)
    bias[1, ..., 6:] = float("-inf")  # row 1 has 6 valid keys
    qc = q.as_subclass(FakeCudaTensor)
    assert attention.fused_available(qc)
    entropy, lse = attention.attention_entropy(qc, k.as_subclass(FakeCudaTensor), 0.7, bias, "auto",
                                               return_lse=True)
    assert len(calls) == 1 and calls[0]["lse"] is True and calls[0]["bias_shape"] == (R, H, n, L)
    assert calls[0]["dtype"] == torch.float32
    # independent reference: the probabilities written out
    p = (0.7 * q @ k.transpose(-1, -2) + bias).softmax(-1)
    expected = -torch.special.xlogy(p, p).sum(-1)
    torch.testing.assert_close(entropy.as_subclass(torch.Tensor), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.as_subclass(torch.Tensor),
                               torch.logsumexp(0.7 * q @ k.transpose(-1, -2) + bias, -1), atol=1e-5, rtol=1e-5)


# ----- CUDA peak memory over the whole generation -----------------------------------------------------------
class FakeAllocator:
    """torch.cuda's allocator statistics for one device, driven by hand; records the device of every call."""

    def __init__(self):
        self.now = self.peak = self.reserved = self.reserved_peak = 0
        self.devices = []

    def alloc(self, n):
        self.now += n
        self.peak = max(self.peak, self.now)
        self.reserved = max(self.reserved, -(-self.now // 1000) * 1000 + 500)  # caching: holds more, keeps it
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def free(self, n):
        self.now -= n

    def install(self, monkeypatch):
        def rec(value):
            def f(device=None):
                self.devices.append(device)
                return value()
            return f

        def reset(device=None):
            self.devices.append(device)
            self.peak, self.reserved_peak = self.now, self.reserved

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
        monkeypatch.setattr(torch.cuda, "memory_allocated", rec(lambda: self.now))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", rec(lambda: self.peak))
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", rec(lambda: self.reserved_peak))


def test_peak_memory_includes_text_encoder_and_decode_and_reports_reserved(monkeypatch):
    from profilers.memory import PeakMemoryTracer

    gpu = FakeAllocator()
    gpu.install(monkeypatch)
    gpu.alloc(10_000)  # weights, before the generation
    tracer = PeakMemoryTracer("cuda:1")
    gpu.alloc(3_000); gpu.free(3_000)  # text encoder (before scale 0)
    for s, act in enumerate((500, 1_200)):
        tracer.scale_begin(s)
        gpu.alloc(act); gpu.free(act)
        tracer.scale_end(s)
    gpu.alloc(4_100); gpu.free(4_100)  # VAE decode (after the last scale)
    report = tracer.report()
    # hand-worked: weights 10,000 + the decode's 4,100 is the highest point of the generation
    assert report.peak_bytes == 14_100
    assert [s.peak_bytes for s in report.scales] == [10_500, 11_200]
    assert report.reserved_bytes == 15_500  # ceil(14,100 / 1000)·1000 + 500
    assert set(gpu.devices) == {torch.device("cuda", 1)}  # every statistic read on the measured device


# ----- latency: the timed device, and a number without span timers -------------------------------------------
def test_latency_wall_clock_synchronises_the_timed_device(monkeypatch):
    from profilers import latency_report

    synced = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    latency_report._sync("cuda:1")
    latency_report._sync("cpu")
    assert synced == [torch.device("cuda", 1)]


def test_latency_headline_comes_from_a_run_without_tracer(monkeypatch):
    """total_ms is a generate() with no tracer; the breakdown comes from a separate instrumented call."""
    from profilers import latency_report

    calls = []

    def fake_generate(adapter, conditions, seeds=None, sampling=None, policy=None, tracer=None, options=None):
        calls.append(tracer)

    import var_core.engine as engine

    monkeypatch.setattr(engine, "generate", fake_generate)
    ms = latency_report._plain_run(None, None, [0], None, None, None, "cpu")
    assert ms >= 0 and calls == [None]


# ----- gpucheck's pytest has a time limit -----------------------------------------------------------------
def test_gpucheck_pytest_runs_under_a_timeout(monkeypatch):
    from studies import gpucheck

    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"], seen["timeout"] = cmd, kw.get("timeout")
        raise subprocess.TimeoutExpired(cmd, kw.get("timeout"), output=b"collected 3 items\n")

    monkeypatch.setattr(gpucheck.subprocess, "run", fake_run)
    result = gpucheck.run_gpu_tests(log=lambda m: None, timeout=42)
    assert seen["timeout"] == 42 and "--timeout=42" in seen["cmd"]
    assert result["returncode"] == "timeout" and "timed out after 42 s" in result["summary"]


def test_record_states_the_kernels_that_ran(monkeypatch):
    from var_core.eval.environment import sdpa_backend

    attention.sdpa_kernels_run(reset=True)
    assert "kernels that ran in this run: none recorded" in sdpa_backend("cpu")
    q, k = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        for _ in range(3):
            attention.sdpa(q, k, k)
    attention.sdpa(q, k, k)
    assert "kernels that ran in this run: cpu:math ×3, cpu:flash ×1" in sdpa_backend("cpu")
    attention.sdpa_kernels_run(reset=True)



def test_each_arm_records_its_own_sdpa_kernel_count():
    """The kernel count is per process; a record's is per arm: the collector that builds each arm's process
    environment resets it when the arm's generation starts and reads it as its batches end. Two arms of 3 and 5
    SDPA calls (after 2 calls outside any arm) record 3 and 5. Before: each arm's record held the count at its
    start (2, then 2 + 3)."""
    from types import SimpleNamespace

    from var_core.eval.lightning import _ShardCollector

    trainer = SimpleNamespace(global_rank=0, world_size=1, local_rank=0, node_rank=0)
    module = SimpleNamespace(adapter=SimpleNamespace(attention_backend=None, modules=lambda: {}),
                             device=torch.device("cpu"))
    q, k = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4)
    for _ in range(2):
        attention.sdpa(q, k, k)  # e.g. a warm-up or an earlier study in this process
    recorded = []
    for calls in (3, 5):
        collector = _ShardCollector(folder="unused")
        collector.on_predict_start(trainer, module)
        for _ in range(calls):
            attention.sdpa(q, k, k)
        collector.on_predict_batch_end(trainer, module, {}, None, 0)
        recorded.append((collector.environment["sdpa_kernels"], collector.environment["attention_backend"]))
    assert [kernels for kernels, _ in recorded] == [{"cpu:flash": 3}, {"cpu:flash": 5}]
    assert "kernels that ran in this run: cpu:flash ×3;" in recorded[0][1]
    assert "kernels that ran in this run: cpu:flash ×5;" in recorded[1][1]
