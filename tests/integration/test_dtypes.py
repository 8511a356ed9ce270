"""Half-precision studies on every model family (issue 11: ``--dtype bfloat16`` crashed every VAR-family model).

A study in bf16 must run, say bf16 in its records, and really compute in bf16: its images are close to the fp32
ones of the same samples but not equal (equal images would mean the dtype was silently ignored).
"""

from __future__ import annotations

import pytest
import torch

from ablations.runner import StudyOptions, run_study
from var_core.eval import records as rec
from var_core.eval.lightning import GenerationRun

pytestmark = pytest.mark.slow

MODELS = ["testbed", "official-tiny", "random:infinity-tiny"]


def _images(out, arm):
    return GenerationRun.load(rec.record_paths(out, arm)[1]).images_u8


@pytest.mark.parametrize("model", MODELS)
def test_bfloat16_study_runs_and_records_its_dtype(tmp_path, model, fixture_dir):
    common = dict(family="method", model=model, samples=2, batch_size=2, warmup=0, progress=False,
                  wandb="disabled", plots=False, arms=("fastvar",), threads=1, timing_rounds=0)
    half = run_study(StudyOptions(out=str(tmp_path / "bf16"), dtype="bfloat16", **common), log=lambda s: None)
    full = run_study(StudyOptions(out=str(tmp_path / "fp32"), dtype="float32", **common), log=lambda s: None)
    assert half.computed == ["baseline", "fastvar"]
    for arm in half.computed:
        record = rec.read_record(rec.record_paths(tmp_path / "bf16", arm)[0])
        assert record["environment"]["dtype"] == "bfloat16"
        a, b = _images(tmp_path / "bf16", arm), _images(tmp_path / "fp32", arm)
        assert a.shape == b.shape and a.dtype == torch.uint8
        difference = (a.float() - b.float()).abs().mean()
        assert 0 < difference < 64, f"{arm}: mean |bf16 - fp32| = {difference:.2f} levels"


def test_half_precision_generation_runs_every_preset(fixture_dir):
    from var_core.accel.policy import build_policy
    from var_core.accel.presets import PRESETS, get_preset
    from var_core.engine import SamplingConfig, generate
    from var_core.engine.loop import generation_info
    from var_core.zoo import load_model

    sampling = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)
    for dtype in (torch.bfloat16, torch.float16):
        adapter = load_model("official-tiny", weights=fixture_dir, dtype=dtype)
        assert adapter.var.head.weight.dtype == dtype
        info = generation_info(adapter, 2, adapter.initial_guidance(sampling), sampling=sampling)
        for name in PRESETS:
            policy = build_policy(get_preset(name))
            try:
                policy.check_model(info)
            except ValueError:  # a preset with no setting for this family (fastvar_toprovar on a VAR)
                continue
            result = generate(adapter, torch.tensor([1, 2]), seeds=[1, 2], sampling=sampling, policy=policy)
            assert result.images.dtype == torch.float32 and torch.isfinite(result.images).all(), (dtype, name)
