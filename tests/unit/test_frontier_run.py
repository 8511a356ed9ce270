"""``run_frontier`` end to end on the tiny official-code VAR: points chosen over the common range, the published
point always evaluated, every output written, and a second run reusing every arm."""

from __future__ import annotations

import json

import pytest

from sweeps.evaluate import EvalSettings
from sweeps.frontier import FrontierSpec, run_frontier


@pytest.mark.slow
def test_frontier_end_to_end_and_resume(tmp_path):
    spec = FrontierSpec(methods=("ldpruning", "fastvar"), points=2, metrics=("ssim",), n_boot=200,
                        eval=EvalSettings(model="official-tiny", samples=4, batch_size=2, warmup=0, threads=1),
                        out=str(tmp_path))
    logs: list[str] = []
    result = run_frontier(spec, log=logs.append)
    points = result["points"]
    assert {p["method"] for p in points} == {"ldpruning", "fastvar"}
    for method in ("ldpruning", "fastvar"):
        mine = [p for p in points if p["method"] == method]
        assert 2 <= len(mine) <= 3 and sum(p["published"] for p in mine) == 1
    for name in ("frontier.png", "frontier.md", "matched_cost.csv", "matched_tests.csv", "frontier_points.csv",
                 "frontier.json", "frontier_calibration.json"):
        assert (tmp_path / name).is_file(), name
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert saved["schema"] == "varscope.frontier/1"
    assert {"ssim|flops_ratio", "ssim|speedup", "ssim|memory_ratio"} <= set(saved["analyses"])
    # a second run computes nothing: the calibration and every arm are reused
    logs2: list[str] = []
    run_frontier(spec, log=logs2.append)
    assert not any(line.startswith("calibration:") for line in logs2)
    assert any("reusing" in line for line in logs2)
