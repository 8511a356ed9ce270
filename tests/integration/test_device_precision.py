"""Issue 27: every command runs on the device it states, in the precision it states (``--precision``), and a
record of one device / precision is never reused by a run on another.

No GPU here: the device decisions are checked with a CUDA stand-in (``torch.cuda.is_available`` and the device
name patched), the precisions on the CPU, where bf16 and fp16 autocast run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from var_core.engine import GenerationOptions, SamplingConfig
from var_core.engine.loop import generate, generation_info
from var_core.engine.precision import PRECISIONS, default_precision, parse_precision

FIXTURE = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "official_var_tiny"

#: what a Linear layer of a transformer block must output in each mode (hand-written from the torch.autocast docs:
#: linear is on the lower-precision list of both the CPU and the CUDA autocast; bf16 casts the parameters)
LINEAR_OUTPUT = {"fp32": torch.float32, "tf32": torch.float32, "bf16-autocast": torch.bfloat16,
                 "fp16-autocast": torch.float16, "bf16": torch.bfloat16}
MATMUL = {"fp32": "highest", "tf32": "high", "bf16-autocast": "highest", "fp16-autocast": "highest",
          "bf16": "highest"}


def _load(model: str, precision: str):
    from var_core.zoo import load_model

    kwargs = {"weights": FIXTURE} if model == "official-tiny" else {}
    adapter = load_model(model, dtype=parse_precision(precision).params, **kwargs)
    adapter.precision = precision
    return adapter


def _block_linears(adapter) -> list[torch.nn.Linear]:
    """The Linear layers inside the transformer blocks (not the heads, whose output is cast to fp32 on purpose)."""
    found = []
    for module in adapter.modules().values():
        for name, sub in module.named_modules():
            if isinstance(sub, torch.nn.Linear) and name.startswith(("blocks.", "block_chunks.")) \
                    and ".ffn." in name:
                found.append(sub)
    return found


@pytest.mark.parametrize("model", ["official-tiny", "random:infinity-tiny", "random:hart-tiny"])
def test_every_preset_runs_in_every_precision_and_the_record_is_what_ran(model):
    """Each mode × each preset that applies to the family: the blocks' Linear layers output the mode's dtype (seen
    by a hook inside the run), the matmul precision inside the run is the mode's, the logits that reach guidance,
    softmax and the draw stay fp32, the record (``adapter.precision_ran``) says the same, and torch's state is
    restored afterwards."""
    if model == "official-tiny" and not (FIXTURE / "config.json").exists():
        pytest.skip("official VAR fixture not found")
    from var_core.accel.policy import build_policy
    from var_core.accel.presets import PRESETS, get_preset, resolve_config

    torch.set_num_threads(1)
    before = torch.get_float32_matmul_precision()
    for precision in PRECISIONS:
        adapter = _load(model, precision)
        seen: list[tuple[torch.dtype, str]] = []
        hooks = [layer.register_forward_hook(
            lambda mod, inp, out: seen.append((out.dtype, torch.get_float32_matmul_precision())))
            for layer in _block_linears(adapter)]
        assert hooks, "no Linear layer found in the transformer blocks"
        sampling = getattr(adapter, "default_sampling", SamplingConfig())
        info = generation_info(adapter, 1, adapter.initial_guidance(sampling), sampling=sampling)
        conditions = torch.tensor([1]) if adapter.family == "var" else ["a red cube"]
        ran = []
        for name in sorted(PRESETS):
            try:
                policy = build_policy(resolve_config(get_preset(name), info))
                if hasattr(policy, "check_model"):
                    policy.check_model(info)
            except ValueError:  # a preset of another family (e.g. fastvar_toprovar off Infinity / HART)
                continue
            seen.clear()
            result = generate(adapter, conditions, seeds=[0], sampling=sampling, policy=policy,
                              options=GenerationOptions(decode=False))
            assert seen, f"{name} / {precision}: no block Linear ran"
            assert {dtype for dtype, _ in seen} == {LINEAR_OUTPUT[precision]}, (name, precision)
            assert {matmul for _, matmul in seen} == {MATMUL[precision]}, (name, precision)
            logits = [r.raw_logits_RNV for r in result.records if r.raw_logits_RNV is not None]
            assert logits and all(t.dtype == torch.float32 for t in logits), (name, precision)
            expected_autocast = {"bf16-autocast": "bfloat16", "fp16-autocast": "float16"}.get(precision)
            assert adapter.precision_ran == {"precision": precision, "matmul_precision": MATMUL[precision],
                                             "autocast_dtype": expected_autocast,
                                             "param_dtype": "bfloat16" if precision == "bf16" else "float32"}
            assert not torch.is_autocast_enabled("cpu") and torch.get_float32_matmul_precision() == before
            ran.append(name)
        for hook in hooks:
            hook.remove()
        assert len(ran) >= 11, ran  # every preset but the one or two of other families


def test_official_precision_per_family_on_gpu_and_fp32_on_cpu():
    assert default_precision("var", "cuda") == "fp16-autocast+tf32"  # VAR's demo: fp16 autocast, TF32 enabled
    assert default_precision("infinity", "cuda:1") == "bf16-autocast"
    assert default_precision("hart", "cuda") == "fp16-autocast"
    for family in ("var", "infinity", "hart"):
        assert default_precision(family, "cpu") == "fp32"
    spec = parse_precision("fp16-autocast+tf32")
    assert (spec.params, spec.autocast, spec.matmul_precision) == (torch.float32, torch.float16, "high")
    with pytest.raises(ValueError):
        parse_precision("bf16+tf32")  # +tf32 only on an autocast mode


# ----- the device decision with a CUDA stand-in -------------------------------------------------------------
@pytest.fixture
def fake_cuda(monkeypatch):
    """torch says it has one CUDA GPU named 'Stand-in H100' (nothing is run on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stand-in H100")
    return "Stand-in H100"


def test_auto_is_one_decision_and_is_stated(fake_cuda, monkeypatch):
    """``auto`` picks the GPU for ablate, sweep / sensitivity, bench, latency and gpucheck alike, and the first line
    names the device and the family's official precision; without the GPU the same commands pick the CPU in fp32."""
    from argparse import Namespace

    from ablations.runner import StudyOptions, default_out_dir
    from studies import ablate, bench, gpucheck, latency, sensitivity, sweep
    from studies._args import launch_banner, resolve_device
    from studies._evaluation_cli import evaluation_banner
    from sweeps.evaluate import EvalSettings, launch_tag

    assert ablate.build_parser().parse_args(["scorer"]).accelerator == "auto"
    assert sweep.build_parser().parse_args(["nova"]).accelerator == "auto"
    assert sensitivity.build_parser().parse_args(["tau", "--values", "0.5"]).accelerator == "auto"
    assert latency.build_parser().parse_args([]).device == "auto"
    assert gpucheck.build_parser().parse_args([]).device == "auto"
    assert resolve_device("auto") == "cuda"
    line = launch_banner("bench presets", "auto", "cuda", None, "var")
    assert "device cuda (Stand-in H100) [auto: torch sees a CUDA GPU]" in line
    assert "precision fp16-autocast+tf32 (the official var sampler's mode on a GPU; autocast float16" in line
    args = Namespace(accelerator="auto", devices=1, precision=None, dtype=None, model="official-tiny", weights=None)
    assert "device cuda:0 (Stand-in H100)" in evaluation_banner("sweep", args)
    assert "precision fp16-autocast+tf32" in evaluation_banner("sweep", args)
    # the default folders name the device and precision (a CPU fp32 run keeps its old name)
    gpu = default_out_dir(StudyOptions(family="cache", samples=4, seed=1, accelerator="auto"), "official-tiny")
    assert str(gpu) == "results/ablate/cache_official-tiny_n4_seed1_gpu_fp16-autocast+tf32"
    assert launch_tag(EvalSettings(), "infinity-2b") == "_gpu_bf16-autocast"
    assert launch_tag(EvalSettings(precision="fp32"), "hart-0.7b") == "_gpu_fp32"
    assert launch_tag(EvalSettings(accelerator="cpu"), "hart-0.7b") == ""
    assert launch_tag(EvalSettings(accelerator="cpu", precision="bf16-autocast"), "var-d16") == "_cpu_bf16-autocast"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    cpu = default_out_dir(StudyOptions(family="cache", samples=4, seed=1, accelerator="auto"), "official-tiny")
    assert str(cpu) == "results/ablate/cache_official-tiny_n4_seed1"
    assert "precision fp32 (the default on a CPU" in launch_banner("latency", "auto", "cpu", None, "infinity")
    assert bench  # imported: its parser is checked in test_bench_presets_times_on_the_device_it_states


# ----- the must-show commands -------------------------------------------------------------------------------
def _cli(argv, capsys):
    from studies.cli import main

    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    return out.out


def _env(path: Path) -> dict:
    return json.loads(path.read_text())["environment"]


@pytest.mark.skipif(not (FIXTURE / "config.json").exists(), reason="official VAR fixture not found")
def test_sweep_records_the_device_and_precision_that_ran(tmp_path, capsys):
    out = _cli(["sweep", "nova", "--trials", "2", "--accelerator", "cpu", "--precision", "bf16-autocast",
                "--model", "official-tiny", "--weights", str(FIXTURE), "--samples", "2", "--batch-size", "2",
                "--warmup", "0", "--no-paired-timing", "--threads", "1", "--wandb", "disabled",
                "--out", str(tmp_path / "sweep")], capsys)
    assert out.splitlines()[0].startswith("sweep: device cpu (") and "precision bf16-autocast (given" in out
    records = sorted((tmp_path / "sweep" / "arms").glob("*.json"))
    assert len(records) == 3  # baseline + 2 trials
    for path in records:
        env = _env(path)
        assert (env["accelerator"], env["device"]) == ("cpu", "cpu")
        assert (env["precision"], env["autocast_dtype"], env["matmul_precision"], env["dtype"]) == \
            ("bf16-autocast", "bfloat16", "highest", "float32")
        assert json.loads(path.read_text())["key"]["precision"] == "bf16-autocast"


@pytest.mark.skipif(not (FIXTURE / "config.json").exists(), reason="official VAR fixture not found")
def test_sensitivity_records_the_device_and_precision_that_ran(tmp_path, capsys):
    out = _cli(["sensitivity", "tau", "--values", "0.7", "0.9", "--accelerator", "cpu", "--precision",
                "fp16-autocast", "--model", "official-tiny", "--weights", str(FIXTURE), "--samples", "2",
                "--batch-size", "2", "--warmup", "0", "--no-paired-timing", "--threads", "1", "--wandb", "disabled",
                "--out", str(tmp_path / "sens")], capsys)
    assert out.splitlines()[0].startswith("sensitivity: device cpu (") and "precision fp16-autocast (given" in out
    records = sorted((tmp_path / "sens" / "arms").glob("*.json"))
    assert len(records) == 3
    for path in records:
        env = _env(path)
        assert (env["accelerator"], env["device"], env["precision"], env["autocast_dtype"]) == \
            ("cpu", "cpu", "fp16-autocast", "float16")


@pytest.mark.skipif(not (FIXTURE / "config.json").exists(), reason="official VAR fixture not found")
def test_bench_presets_times_on_the_device_it_states(capsys):
    out = _cli(["bench", "presets", "--device", "cpu", "--precision", "bf16-autocast", "--model", "official-tiny",
                "--weights", str(FIXTURE), "--presets", "nova", "--repeats", "1", "--threads", "1"], capsys)
    lines = out.splitlines()
    assert lines[0].startswith("bench presets: device cpu (") and "precision bf16-autocast (given" in lines[0]
    header = next(line for line in lines if line.startswith("# model="))
    assert " device=cpu " in header and "precision=bf16-autocast autocast=bfloat16" in header
    assert "dtype=float32" in header


# ----- reuse across devices and precisions ------------------------------------------------------------------
@pytest.mark.skipif(not (FIXTURE / "config.json").exists(), reason="official VAR fixture not found")
def test_a_cpu_record_is_not_reused_by_a_gpu_run_and_the_reverse(tmp_path):
    """A CPU baseline written by a real run is found by the same CPU configuration, never by the GPU-labelled one
    (what ``--accelerator gpu`` builds into the same folder), nor by another precision; a GPU-labelled record alone
    in a folder is not reused by a CPU run."""
    import dataclasses

    from sweeps.evaluate import EvalSettings, SweepEvaluator
    from var_core.accel.presets import get_preset
    from var_core.eval import records as rec

    torch.set_num_threads(1)
    settings = EvalSettings(model="official-tiny", weights=str(FIXTURE), samples=2, batch_size=2, warmup=0,
                            paired_timing=False, accelerator="cpu")
    evaluator = SweepEvaluator(settings, tmp_path / "cpu", log=lambda s: None)
    evaluator.baseline()
    base = get_preset("baseline")
    cpu_config = evaluator.run_config("baseline", base, baseline=True)
    assert rec.find_reusable(tmp_path / "cpu", cpu_config, need_tensors=True) is not None
    gpu_config = dataclasses.replace(cpu_config, accelerator="gpu", precision="fp16-autocast+tf32")
    assert rec.find_reusable(tmp_path / "cpu", gpu_config) is None
    gpu_fp32 = dataclasses.replace(cpu_config, accelerator="gpu")  # same precision, other device
    assert rec.find_reusable(tmp_path / "cpu", gpu_fp32) is None
    other_precision = dataclasses.replace(cpu_config, precision="bf16-autocast")  # same device, other precision
    assert rec.find_reusable(tmp_path / "cpu", other_precision) is None
    # the reverse: a folder filled by a GPU run holds GPU-keyed records
    record = json.loads((tmp_path / "cpu" / "arms" / "baseline.json").read_text())
    record["key"] = rec.to_jsonable(gpu_fp32.key())
    (tmp_path / "gpu" / "arms").mkdir(parents=True)
    (tmp_path / "gpu" / "arms" / "baseline.json").write_text(json.dumps(record))
    assert rec.find_reusable(tmp_path / "gpu", gpu_fp32) is not None
    assert rec.find_reusable(tmp_path / "gpu", cpu_config) is None


# ----- on a GPU (skipped without one) -----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not (FIXTURE / "config.json").exists(), reason="official VAR fixture not found")
def test_on_a_gpu_sweep_and_bench_run_there_in_the_official_precision(tmp_path, capsys):
    """``auto`` picks the GPU; VAR runs in fp16 autocast with TF32 (its demo's setting), and the records and the
    bench header say so."""
    out = _cli(["sweep", "nova", "--trials", "1", "--model", "official-tiny", "--weights", str(FIXTURE),
                "--samples", "2", "--batch-size", "2", "--warmup", "0", "--no-paired-timing", "--wandb", "disabled",
                "--out", str(tmp_path / "sweep")], capsys)
    assert out.splitlines()[0].startswith("sweep: device cuda:0 (") and "fp16-autocast+tf32" in out.splitlines()[0]
    for path in sorted((tmp_path / "sweep" / "arms").glob("*.json")):
        env = _env(path)
        assert (env["accelerator"], env["device"], env["precision"], env["autocast_dtype"],
                env["matmul_precision"], env["dtype"]) == ("gpu", "cuda:0", "fp16-autocast+tf32", "float16", "high",
                                                           "float32")
    out = _cli(["bench", "presets", "--model", "official-tiny", "--weights", str(FIXTURE), "--presets", "nova",
                "--repeats", "1"], capsys)
    header = next(line for line in out.splitlines() if line.startswith("# model="))
    assert " device=cuda" in header and "precision=fp16-autocast+tf32 autocast=float16 matmul=high" in header


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["materialised", "chunked", "fused"])
def test_attention_entropy_stays_fp32_under_autocast(method, dtype):
    """ToProVAR's / the attention scorers' entropy is computed in fp32 inside an autocast generation: the same bits
    as outside autocast (before the fix QK^T ran in bf16 / fp16: 0.018 nats off, and the chunked pass overflowed
    clamping to the fp32 minimum)."""
    from var_core.engine.attention import attention_entropy, fused_available

    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 64, 16, generator=generator), torch.randn(2, 4, 80, 16, generator=generator)
    bias = torch.zeros(2, 1, 64, 80).masked_fill_(torch.rand(2, 1, 64, 80, generator=generator) < 0.2, float("-inf"))
    bias[..., 0] = 0.0  # every query sees a key
    if method == "fused" and not fused_available(q):
        pytest.skip("no fused kernel on this build")
    reference = attention_entropy(q, k, 0.25, bias, method=method, return_lse=True)
    with torch.autocast("cpu", dtype=dtype):
        inside = attention_entropy(q, k, 0.25, bias, method=method, return_lse=True)
    for ref, got in zip(reference, inside):
        assert got.dtype == torch.float32 and torch.equal(got, ref)
