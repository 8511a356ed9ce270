"""The headline numbers of an ablation study, recomputed independently from what the study saved.

One small real study on ``official-tiny`` (7 scales of 1², 2², 3², 4², 5², 6², 8² tokens, 2 blocks; 4 samples,
batch 2, 2 interleaved timing rounds) with three arms:

* ``baseline`` — the plain model (the reference);
* ``fastvar`` — the FastVAR preset: a fixed ratio table (0.4, 0.5) on the last two scales, so what it computes is
  known in advance (see ``FASTVAR_KEPT``);
* ``fastvar-never`` — FastVAR's components with the ``never`` activation: a no-op arm that goes through the policy
  path but computes exactly what the baseline computes.

Every check compares a number of the record / table with a value computed here from the raw fields the study
saved (batch seconds, round seconds, the saved images and tokens) or with an independent measurement
(``torch.utils.flop_counter.FlopCounterMode``), never with the runner's own helpers. A wrong headline number (an
inverted ratio, an arm compared with itself, a kept fraction that ignores the schedule) fails here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")

from ablations.base import Arm  # noqa: E402
from ablations.runner import StudyOptions, plan_study, run_study  # noqa: E402
from var_core.eval import records as rec  # noqa: E402

STUDY = dict(family="method", arms=("fastvar",), model="official-tiny", samples=4, batch_size=2, warmup=0,
             progress=False, seed=1, threads=1, wandb="disabled", plots=False, timing_rounds=2, timing_batch=1)
NOOP = "fastvar-never"
PSNR_CAP = 100.0  # dB the metrics give identical images (documented in var_core.eval.metrics)

# FastVAR's table on official-tiny, worked by hand: the ratios (0.4, 0.5) are aligned to the last two scales,
# and a pruned scale keeps N - floor(r*N) tokens in every block and branch:
#   scale 5 (6x6 = 36 tokens): 36 - floor(0.4*36) = 36 - floor(14.4) = 22  -> 22/36 = 0.6111
#   scale 6 (8x8 = 64 tokens): 64 - floor(0.5*64) = 64 - 32 = 32           -> 32/64 = 0.5
# every earlier scale is dense.
FASTVAR_KEPT = [1.0, 1.0, 1.0, 1.0, 1.0, 22 / 36, 32 / 64]


def _noop_arm(plan) -> Arm:
    fastvar = next(a.config for a in plan.arms if a.name == "fastvar")
    config = dataclasses.replace(fastvar.replace_component("activation", "never"), name="fastvar/never")
    return Arm(NOOP, config, "fastvar's components, never activated (computes what the baseline computes)")


def _run(out, **extra):
    options = StudyOptions(out=str(out), **STUDY, **extra)
    plan = plan_study(options)
    plan.arms.append(_noop_arm(plan))
    return run_study(options, plan=plan, log=lambda s: None)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("headline") / "method"
    result = _run(out)
    assert result.computed == ["baseline", "fastvar", NOOP]
    return out


def _records(out) -> dict[str, dict]:
    return {name: rec.read_record(rec.record_paths(out, name)[0]) for name in ("baseline", "fastvar", NOOP)}


def _table(out):
    import pandas as pd

    return pd.read_csv(out / "table.csv").set_index("arm")


def _tensors(out, name: str) -> dict:
    """The arm's stored samples (index file + samples folder), materialised."""
    from var_core.eval.lightning import GenerationRun

    run = GenerationRun.load(rec.record_paths(out, name)[1])
    return {"indices": run.indices, "labels": run.labels, "seeds": run.seeds, "images_u8": run.images_u8[:],
            "tokens": list(run.tokens), "entropy": torch.from_numpy(run.entropy),
            "activation_scale": run.activation_scale}


# ----- speedup -------------------------------------------------------------------------------------------------
def test_speedup_is_baseline_seconds_over_arm_seconds(study):
    """The table's ``speedup`` is the throughput-batch speedup of the main runs: the generate() seconds of the
    same batches (same samples), Σ baseline seconds / Σ arm seconds, paired by batch."""
    records, table = _records(study), _table(study)
    base_batches = {(b["first_index"], b["size"]): b["seconds"] for b in records["baseline"]["timing"]["batches"]}
    assert sorted(base_batches) == [(0, 2), (2, 2)]
    for name in ("fastvar", NOOP):
        arm_batches = {(b["first_index"], b["size"]): b["seconds"] for b in records[name]["timing"]["batches"]}
        assert set(arm_batches) == set(base_batches)
        expected = sum(base_batches.values()) / sum(arm_batches.values())
        inverted = sum(arm_batches.values()) / sum(base_batches.values())
        assert expected != pytest.approx(inverted, rel=1e-9)  # the check below can tell the two apart
        assert records[name]["summary"]["speedup"]["mean"] == pytest.approx(expected, rel=1e-9)
        assert table.loc[name, "speedup"] == pytest.approx(expected, rel=1e-9)
        assert "paired by batch" in records[name]["timing"]["speedup_note"]
        # latency of the same batches: 1000 · seconds / images, mean over batches
        ms = [1000 * s / 2 for s in arm_batches.values()]
        assert records[name]["summary"]["ms_per_image"]["mean"] == pytest.approx(sum(ms) / len(ms), rel=1e-9)
    assert table.loc["baseline", "speedup"] == 1.0


def test_interleaved_speedup_is_baseline_rounds_over_arm_rounds(study):
    """``speedup_interleaved``: the batch-1 re-timing, Σ baseline round seconds / Σ arm round seconds."""
    timing = json.loads((study / "timing_interleaved.json").read_text())
    table = _table(study)
    assert timing["rounds"] == 2 and timing["batch_size"] == 1
    base = timing["arms"]["baseline"]["seconds"]
    assert len(base) == 2
    for name in ("fastvar", NOOP):
        arm = timing["arms"][name]["seconds"]
        expected = sum(base) / sum(arm)
        assert timing["arms"][name]["speedup"]["mean"] == pytest.approx(expected, rel=1e-9)
        assert table.loc[name, "speedup_interleaved"] == pytest.approx(expected, rel=1e-9)


# ----- FLOPs ---------------------------------------------------------------------------------------------------
def _measured_flops(record: dict, policy) -> float:
    """FlopCounterMode FLOPs per image of the record's batches (same labels, seeds, sampling; no decode). The
    MATH attention backend runs attention as plain matmuls, which FlopCounterMode counts by itself."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from var_core.engine import GenerationOptions, SamplingConfig, generate
    from var_core.zoo import load_model

    adapter = load_model("official-tiny")
    sampling = SamplingConfig(**record["sampling"])
    labels, seeds = record["metrics"]["label"], record["samples"]["seeds"]
    total = 0
    for b in record["timing"]["batches"]:
        i, n = b["first_index"], b["size"]
        with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
            generate(adapter, torch.tensor(labels[i:i + n]), seeds=seeds[i:i + n], sampling=sampling,
                     policy=policy() if policy else None, options=GenerationOptions(decode=False,
                                                                                    check_finite=False))
        total += counter.get_total_flops()
    return total / len(labels)


def test_flops_ratio_is_arm_over_baseline_and_matches_flop_counter(study):
    from var_core.accel import build_policy
    from var_core.accel.presets import get_preset

    records, table = _records(study), _table(study)
    fastvar = get_preset("fastvar")
    # the arm is the preset as resolved for official-tiny: a VAR, for which FastVAR publishes no setting, so the
    # generic mapping made concrete (per_model cleared)
    assert records["fastvar"]["config_hash"] == dataclasses.replace(fastvar, per_model="").config_hash()
    base_f = records["baseline"]["timing"]["flops_per_image"]
    arm_f = records["fastvar"]["timing"]["flops_per_image"]
    # from the records: arm FLOPs / baseline FLOPs (fewer tokens computed -> below 1)
    assert records["fastvar"]["summary"]["flops_ratio"]["mean"] == pytest.approx(arm_f / base_f, rel=1e-12)
    assert table.loc["fastvar", "flops_ratio"] == pytest.approx(arm_f / base_f, rel=1e-12)
    # independently: FlopCounterMode on the same generations
    measured_base = _measured_flops(records["baseline"], None)
    measured_arm = _measured_flops(records["fastvar"], lambda: build_policy(fastvar))
    assert base_f == pytest.approx(measured_base, rel=1e-6)
    assert arm_f == pytest.approx(measured_arm, rel=1e-6)
    assert table.loc["fastvar", "flops_ratio"] == pytest.approx(measured_arm / measured_base, rel=1e-6)
    assert measured_arm / measured_base < 0.8  # 22/36 and 32/64 of the two largest scales' tokens
    # the no-op arm computes what the baseline computes
    assert records[NOOP]["timing"]["flops_per_image"] == pytest.approx(measured_base, rel=1e-6)
    assert table.loc[NOOP, "flops_ratio"] == 1.0


# ----- kept fraction -------------------------------------------------------------------------------------------
def test_kept_fraction_is_the_fixed_table(study):
    records = _records(study)
    assert records["fastvar"]["metrics"]["per_scale"]["kept_fraction"] == pytest.approx(FASTVAR_KEPT, abs=1e-12)
    assert records[NOOP]["metrics"]["per_scale"]["kept_fraction"] == [1.0] * 7
    assert records["baseline"]["metrics"]["per_scale"]["kept_fraction"] == [1.0] * 7


# ----- fidelity against the baseline ---------------------------------------------------------------------------
def _psnr(a_u8: torch.Tensor, b_u8: torch.Tensor) -> list[float]:
    a, b = a_u8.double() / 255, b_u8.double() / 255
    mse = (a - b).pow(2).flatten(1).mean(1)
    return [PSNR_CAP if m == 0 else 10 * math.log10(1 / float(m)) for m in mse]


def _agreement(arm_tokens, base_tokens) -> list[list[float]]:
    return [[float((x == y).double().mean()) for x, y in zip(arm, base)] for arm, base in zip(arm_tokens, base_tokens)]


def _check_fidelity(out):
    from torchmetrics.functional.image import structural_similarity_index_measure as ssim

    records, table = _records(out), _table(out)
    base, arm, noop = _tensors(out, "baseline"), _tensors(out, "fastvar"), _tensors(out, NOOP)
    assert base["indices"] == arm["indices"] == noop["indices"] == [0, 1, 2, 3]

    # the no-op arm: the baseline's images and tokens exactly → PSNR at the cap, identical, SSIM 1, agreement 1
    assert torch.equal(noop["images_u8"], base["images_u8"])
    ps = records[NOOP]["metrics"]["per_sample"]
    assert ps["psnr"] == [PSNR_CAP] * 4 and ps["identical"] == [1.0] * 4
    assert ps["ssim"] == pytest.approx([1.0] * 4, abs=1e-6)
    assert ps["token_agreement"] == [1.0] * 4
    assert table.loc[NOOP, "identical_fraction"] == 1.0 and table.loc[NOOP, "psnr"] == PSNR_CAP

    # the pruning arm, recomputed from the saved images / tokens of the arm and of the baseline
    ps = records["fastvar"]["metrics"]["per_sample"]
    expected_psnr = _psnr(arm["images_u8"], base["images_u8"])
    assert all(v < 60 for v in expected_psnr)  # the images really differ (not the self-comparison cap)
    assert ps["psnr"] == pytest.approx(expected_psnr, rel=1e-5)
    assert ps["identical"] == [0.0] * 4
    assert records["fastvar"]["summary"]["psnr"]["mean"] == pytest.approx(sum(expected_psnr) / 4, rel=1e-5)
    assert table.loc["fastvar", "psnr"] == pytest.approx(sum(expected_psnr) / 4, rel=1e-5)
    assert table.loc["fastvar", "identical_fraction"] == 0.0
    expected_ssim = ssim(arm["images_u8"].float() / 255, base["images_u8"].float() / 255, data_range=1.0,
                         reduction="none", kernel_size=11).tolist()  # Gaussian σ = 1.5 window, 128-px images
    assert max(expected_ssim) < 0.99
    assert ps["ssim"] == pytest.approx(expected_ssim, rel=1e-4)
    agreement = _agreement(arm["tokens"], base["tokens"])
    for got, want in zip(records["fastvar"]["metrics"]["per_scale"]["token_agreement"], agreement, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    for row in agreement:  # identical before the first pruned scale, different after
        assert row[:5] == [1.0] * 5 and min(row[5:]) < 1.0
    assert ps["token_agreement"] == pytest.approx([sum(r) / len(r) for r in agreement], abs=1e-6)
    assert table.loc["fastvar", "token_agreement"] == pytest.approx(
        sum(sum(r) / len(r) for r in agreement) / 4, abs=1e-6)
    self_agreement = _agreement(arm["tokens"], arm["tokens"])
    assert ps["token_agreement"] != pytest.approx([sum(r) / len(r) for r in self_agreement], abs=1e-6)


def test_fidelity_is_against_the_baseline_images(study):
    _check_fidelity(study)


def test_fidelity_recomputed_from_stored_samples_is_against_the_baseline(study, tmp_path):
    """A changed metric context recomputes the metrics from the stored tensors: still against the baseline."""
    copy = tmp_path / "method"
    shutil.copytree(study, copy)
    result = _run(copy, fid_protocol="pytorch-fid")
    assert result.computed == [] and result.reused == ["baseline", "fastvar", NOOP]
    records = _records(copy)
    assert all(r.get("metrics_refreshed") for r in records.values())
    _check_fidelity(copy)
