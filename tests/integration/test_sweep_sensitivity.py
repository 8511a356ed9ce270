"""A two-point sensitivity grid: CSV/JSON/PNG with 95 % CIs per point; re-running reuses the finished points."""

from __future__ import annotations

import json

import pandas as pd

from sweeps.evaluate import EvalSettings
from sweeps.sensitivity import SensitivitySpec, run_sensitivity


def test_tiny_sensitivity_grid(tmp_path, fixture_dir):
    out = tmp_path / "sens"
    spec = SensitivitySpec("rho", ("0.3", "0.8"), method="ldpruning", wandb="disabled", out=str(out),
                           eval=EvalSettings(model="official-tiny", samples=4, batch_size=2, warmup=0, timing_repeats=2))
    result = run_sensitivity(spec, log=lambda m: None)
    for name in ("sensitivity.csv", "sensitivity.json", "sensitivity.png", "arms/baseline.json"):
        assert (out / name).is_file(), name
    frame = pd.read_csv(out / "sensitivity.csv")
    assert set(frame["value"]) == {0.3, 0.8}
    assert {"speedup", "flops_ratio", "psnr", "ssim"} <= set(frame["metric"])
    assert {"class_acc", "fid_proxy"} <= set(result["unavailable"])  # official-tiny: no testbed classifier
    psnr = frame[frame["metric"] == "psnr"].set_index("value")
    assert (psnr["low"] <= psnr["mean"]).all() and (psnr["mean"] <= psnr["high"]).all() and (psnr["n"] == 4).all()
    flops = frame[frame["metric"] == "flops_ratio"].set_index("value")["mean"]
    assert flops[0.3] < flops[0.8] < 1.0  # keeping less energy computes less
    record = json.loads((out / "arms" / "rho=0.3.json").read_text())  # speedup paired with a fresh baseline run
    assert len(record["timing"]["reference_batches"]) == 2 and "reproduced" in record["timing"]["reference_note"]
    assert record["timing"]["reference_note"].endswith("True")  # the re-run baseline is bit-identical
    for batch in record["timing"]["batches"] + record["timing"]["reference_batches"]:  # min of 2 interleaved repeats
        assert len(batch["seconds_repeats"]) == 2 and batch["seconds"] == min(batch["seconds_repeats"])
    data = json.loads((out / "sensitivity.json").read_text())
    assert data["field"]["paths"] == ["schedule.rho"] and data["field"]["default"] == 0.5
    again = run_sensitivity(spec, log=lambda m: None)
    assert [p["config_hash"] for p in again["points"]] == [p["config_hash"] for p in result["points"]]
    assert again["seconds"] < result["seconds"]
