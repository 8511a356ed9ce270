"""The CUDA paths of generation, records, probes and the study runner (skipped without a GPU; run by
``python -m studies.gpucheck``). Each one guards a bug found by reading the code without a GPU (issue 13)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")

from ablations.probes import ProfilerProbe  # noqa: E402
from ablations.runner import StudyOptions, run_study  # noqa: E402
from var_core.engine import SamplingConfig  # noqa: E402
from var_core.eval import records as rec  # noqa: E402
from var_core.eval.lightning import ConditionSet, run_generation  # noqa: E402
from var_core.zoo import load_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SAMPLING = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)


def _devices(adapter) -> set[str]:
    return {str(t.device) for m in adapter.modules().values() for t in [*m.parameters(), *m.buffers()]}


@pytest.mark.parametrize("model", ["random:official-tiny", "random:infinity-tiny"])
def test_generation_on_the_gpu_records_it_and_the_model_stays_there(model):
    adapter = load_model(model)  # on the CPU: Lightning moves every module (RoPE tables, text encoder included)
    run = run_generation(adapter, ConditionSet.balanced(4, 10, 0), sampling=SAMPLING, batch_size=2, warmup=1,
                         accelerator="gpu", devices=1, probes=[ProfilerProbe(device="cpu")], progress=False)
    (proc,) = run.processes
    assert proc["device"] == "cuda:0" and proc["device_name"] == torch.cuda.get_device_name(0)
    assert "CUDA kernels enabled" in proc["attention_backend"]
    assert _devices(adapter) == {"cuda:0"}  # Lightning's teardown did not move it back to the CPU
    probe = run.batches[0]["probes"]["profile"]
    assert probe["timer"] == "cuda-events" and probe["memory_source"] == "cuda-measured"  # bound to the GPU


def test_auto_accelerator_study_measures_and_records_the_gpu(tmp_path):
    result = run_study(StudyOptions(family="method", model="random:official-tiny", samples=4, batch_size=2,
                                    warmup=0, progress=False, wandb="disabled", plots=False, arms=("ldpruning",),
                                    threads=1, accelerator="auto", timing_rounds=2, out=str(tmp_path / "s")),
                       log=lambda s: None)
    record = rec.read_record(rec.record_paths(result.out_dir, "ldpruning")[0])
    env = record["environment"]
    assert env["accelerator"] == "gpu" and env["device"] == "cuda:0"
    assert env["device_name"] == torch.cuda.get_device_name(0)
    assert record["timing"]["memory_source"] == "cuda-measured"
    import json

    interleaved = json.loads((result.out_dir / "timing_interleaved.json").read_text())
    assert interleaved["device"] == "cuda:0"  # the speedup column was re-timed on the GPU, not the CPU


def test_bf16_infinity_on_the_gpu_runs_and_records_bf16():
    adapter = load_model("random:infinity-tiny", dtype=torch.bfloat16)
    run = run_generation(adapter, ConditionSet.balanced(4, 10, 0), sampling=SAMPLING, batch_size=2, warmup=0,
                         accelerator="gpu", progress=False)
    assert run.processes[0]["dtype"] == "bfloat16" and run.processes[0]["device"] == "cuda:0"
    assert run.images_u8.shape[0] == 4 and len(run.tokens) == 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_events_are_recorded_on_the_timed_device_not_the_current_one():
    from profilers.timers import ComponentTimer

    adapter = load_model("random:official-tiny", device="cuda:1")
    torch.cuda.set_device(0)
    timer = ComponentTimer(device="cuda:1")
    from var_core.engine import GenerationOptions, generate

    generate(adapter, [1, 2], seeds=[0, 1], sampling=SAMPLING, tracer=timer,
             options=GenerationOptions(check_finite=False))
    assert timer.total_ms() > 0 and all(s.inclusive_ms >= 0 for s in timer.finalize())
