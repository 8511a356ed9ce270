"""LPIPS and the FID Inception network inside an ablation study (issue 14), with the official fixture's weights.

The arm's LPIPS per sample must equal LPIPS recomputed here from the saved images of the arm and of the baseline
(not of the arm against itself), and the table must name the FID protocol.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ablations.runner import StudyOptions, run_study
from var_core.eval import records as rec
from var_core.eval.lightning import GenerationRun
from var_core.eval.lpips import load_lpips

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def metrics_fixture() -> Path:
    env = os.environ.get("VARSCOPE_METRICS_FIXTURE")
    folder = Path(env) if env else REPO.parent / "shared" / "fixtures" / "official_metrics_tiny"
    if not (folder / "lpips_alex_backbone.pth").exists():
        pytest.skip(f"official metrics fixture not found at {folder} (set VARSCOPE_METRICS_FIXTURE)")
    return folder


def test_lpips_and_inception_fid_in_a_study(tmp_path, fixture_dir, metrics_fixture):
    out = tmp_path / "study"
    result = run_study(StudyOptions(
        family="method", model="official-tiny", samples=4, batch_size=2, warmup=0, progress=False,
        wandb="disabled", plots=False, arms=("fastvar",), threads=1, timing_rounds=0, out=str(out),
        lpips_backbone=str(metrics_fixture / "lpips_alex_backbone.pth"),
        lpips_lin=str(metrics_fixture / "lpips_alex_lin_v0.1.pth"),
        inception_weights=str(metrics_fixture / "fid_inception_random.pth")), log=lambda s: None)
    assert result.computed == ["baseline", "fastvar"]
    record = rec.read_record(rec.record_paths(out, "fastvar")[0])
    ours = np.asarray(record["metrics"]["per_sample"]["lpips_alex"], dtype=float)

    arm = GenerationRun.load(rec.record_paths(out, "fastvar")[1]).images_u8.float() / 255
    base = GenerationRun.load(rec.record_paths(out, "baseline")[1]).images_u8.float() / 255
    model = load_lpips("alex", metrics_fixture / "lpips_alex_backbone.pth", metrics_fixture / "lpips_alex_lin_v0.1.pth")
    expected = model(arm * 2 - 1, base * 2 - 1).flatten().detach().numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-7)
    assert (expected > 0).any(), "fastvar prunes: some image must differ from the baseline"

    fid = record["metrics"]["set_level"]["fid_inception"]
    assert fid["protocol"] == "torch-fidelity" and np.isfinite(fid["mean"])
    table = (out / "table.md").read_text()
    assert "LPIPS (alex)" in table and "FID (Inception)" in table and "input protocol torch-fidelity" in table
