"""What a record says ran: the device name on CUDA (with a stand-in for torch.cuda), per-process environments,
the one decision for ``--accelerator auto``, and the module staying where it ran after Lightning's teardown."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from var_core.eval import records as rec
from var_core.eval.lightning import ConditionSet, GenerationModule, run_generation
from var_core.engine import SamplingConfig


def _cpu_model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    pytest.skip("no /proc/cpuinfo model name on this machine")


class FakeCuda:
    """Stands in for ``torch.cuda`` on a machine without a GPU: two devices with distinct names."""

    names = {0: "Stand-in H200", 1: "Stand-in A100"}
    current = 1

    def is_available(self):
        return True

    def device_count(self):
        return 2

    def current_device(self):
        return self.current

    def get_device_name(self, device=None):
        index = device.index if isinstance(device, torch.device) else device
        return self.names[self.current if index is None else index]


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("is_available", "device_count", "current_device", "get_device_name"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_device_name_on_cuda_uses_get_device_name(fake_cuda):
    assert rec.device_name("cuda:0") == "Stand-in H200"
    assert rec.device_name(torch.device("cuda", 1)) == "Stand-in A100"
    assert rec.device_name("cuda") == "Stand-in A100"  # no index: the current device (1 here)


def test_device_name_on_cpu_is_the_cpu_model():
    assert rec.device_name("cpu") == _cpu_model_name()


def test_environment_reports_what_the_processes_ran_on_not_the_callers_copy(tiny_adapter):
    processes = [
        {"rank": 1, "device": "cuda:1", "device_name": "Stand-in A100", "dtype": "bfloat16",
         "attention_backend": "sdpa (flash)", "threads": 4, "interop_threads": 4, "hostname": "node-b"},
        {"rank": 0, "device": "cuda:0", "device_name": "Stand-in H200", "dtype": "bfloat16",
         "attention_backend": "sdpa (flash)", "threads": 4, "interop_threads": 4, "hostname": "node-a"},
    ]
    env = rec.environment_info(tiny_adapter, accelerator="gpu", devices=[0, 1], strategy="ddp",
                               processes=processes, num_nodes=2)
    assert tiny_adapter.device.type == "cpu"  # the caller's copy: not what the record must name
    assert (env["device"], env["device_name"], env["dtype"], env["threads"]) == ("cuda:0", "Stand-in H200",
                                                                                "bfloat16", 4)
    assert env["hostname"] == "node-a" and env["num_nodes"] == 2 and env["devices"] == [0, 1]
    assert env["devices_used"] == ["node-a:cuda:0", "node-b:cuda:1"]


def test_each_process_records_its_device_name_dtype_backend_and_threads(tiny_adapter):
    run = run_generation(tiny_adapter, ConditionSet.balanced(2, 10, 0), sampling=SamplingConfig(cfg=1.5, top_k=20),
                         batch_size=2, warmup=0, progress=False, threads=1)
    (proc,) = run.processes
    assert proc["rank"] == 0 and proc["world_size"] == 1
    assert proc["device"] == "cpu" and proc["device_name"] == _cpu_model_name()
    assert proc["dtype"] == "float32" and proc["threads"] == 1
    assert proc["attention_backend"].startswith("torch.nn.functional.scaled_dot_product_attention (CPU kernel)")


def test_sdpa_backend_names_the_enabled_cuda_kernels(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "mem_efficient_sdp_enabled", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "math_sdp_enabled", lambda: True)
    assert "(CUDA kernels enabled: flash, math)" in rec.sdpa_backend("cuda:0")
    assert "(CPU kernel)" in rec.sdpa_backend("cpu")


def test_module_stays_on_its_device_after_lightning_teardown(tiny_adapter, monkeypatch):
    # Lightning's strategy teardown calls module.cpu() after predict; a module that stays must not move
    for stay, moves in ((True, 0), (False, 1)):
        module = GenerationModule(tiny_adapter, stay_on_device=stay)
        calls = []
        monkeypatch.setattr(module, "_apply", lambda fn, *a, _calls=calls, _m=module, **k: _calls.append(fn) or _m)
        assert module.cpu() is module
        assert len(calls) == moves
        module.to("cpu")  # an explicit move still moves
        assert len(calls) == moves + 1


def test_auto_accelerator_is_one_decision_for_loading_lightning_and_probes(fake_cuda, monkeypatch, tmp_path):
    """With a GPU present, ``--accelerator auto`` loads the model on cuda:0, hands Lightning the GPU and makes the
    probes time with CUDA events on cuda:0 (before: the probes chose the CPU while Lightning chose the GPU)."""
    import ablations.runner as runner
    from var_core.zoo import load_model

    seen = {}

    def load(model, weights, *, device="cpu", **kwargs):
        seen["load_device"] = torch.device(device)
        return load_model("official-tiny")  # built on the CPU: there is no real GPU here

    class Stop(Exception):
        pass

    def generation(adapter, conditions, *, launch=None, probes=(), **kwargs):
        seen["launch"] = launch
        seen["probe_device"] = next(p.device for p in probes if hasattr(p, "device"))  # the profiler probe
        raise Stop

    monkeypatch.setattr(runner, "load_study_model", load)
    monkeypatch.setattr(runner, "run_generation", generation)
    options = runner.StudyOptions(family="method", model="official-tiny", samples=2, batch_size=2, warmup=0,
                                  progress=False, wandb="disabled", plots=False, arms=("ldpruning",), threads=1,
                                  accelerator="auto", out=str(tmp_path / "auto"), timing_rounds=0)
    with pytest.raises(Stop):
        runner.run_study(options, log=lambda s: None)
    assert seen["load_device"] == torch.device("cuda", 0)
    assert seen["launch"].accelerator == "gpu" and seen["launch"].mode == "single"
    assert seen["probe_device"] == "cuda:0"


def test_interleaved_timing_runs_on_the_requested_device_and_names_it(tiny_adapter):
    from ablations.base import build_arms
    from ablations.runner import interleaved_timing

    arms = [a for a in build_arms("method") if a.role == "baseline" or a.name == "ldpruning"]
    moved = []

    class Spy(type(tiny_adapter)):  # records the move, keeps the (shared) modules where they are
        def to(self, device):
            moved.append(str(device))
            return self

    spy = Spy.__new__(Spy)
    spy.__dict__.update(vars(tiny_adapter))
    out = interleaved_timing(spy, arms, ConditionSet.balanced(2, 10, 0), SamplingConfig(cfg=1.5, top_k=20), 1, 1,
                             threads=1, device="cpu")
    assert moved == []  # already there: no move
    assert out["device"] == "cpu" and out["device_name"] == _cpu_model_name() and out["dtype"] == "float32"
    out = interleaved_timing(spy, arms, ConditionSet.balanced(2, 10, 0), SamplingConfig(cfg=1.5, top_k=20), 1, 1,
                             threads=1, device="meta")
    assert moved == ["meta"]  # asked for another device: the adapter is moved there before timing
    assert len(out["arms"]["ldpruning"]["seconds"]) == 1
