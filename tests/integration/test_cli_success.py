"""The success path of the small entry points, in-process through ``run_cli`` on the tiniest settings:
``studies.demo``, ``studies.bench`` (engine, presets), ``studies.sensitivity`` and ``studies.report`` — checking the
values they print and write, not only their exit status."""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest

from studies import ablate, bench, demo, report, sensitivity
from studies._cli import run_cli


def _row(text: str, name: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.split()[:1] == [name])
    return line.split()


def test_demo_writes_one_row_grid(tmp_path, fixture_dir, capsys):
    from PIL import Image

    out = tmp_path / "sub" / "grid.png"
    rc = run_cli(demo.main, ["--model", "official-tiny", "--weights", str(fixture_dir), "--per-class", "1",
                             "--classes", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert f"wrote {out} (2 samples of official-tiny" in printed
    image = Image.open(out)
    width, height = image.size  # one row of two 128-px images, upscaled 2x, with a thin padding
    assert 2 * 128 <= height < 2 * 128 + 32 and 4 * 128 <= width < 4 * 128 + 32
    lo, hi = image.convert("L").getextrema()
    assert hi > lo  # not a blank image


def test_bench_engine_ratios(capsys):
    rc = run_cli(bench.main, ["engine", "--model", "random:official-tiny", "--batch-sizes", "1", "--repeats", "1"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "# model=random:official-tiny batch=1" in printed
    assert _row(printed, "reference")[-1] == "1.000"  # the reference is its own unit
    last = dict(kv.split("=") for kv in printed.strip().splitlines()[-1].split())
    assert set(last) == {"engine_vs_reference", "half_prune_time_ratio", "half_prune_flops_ratio",
                         "loop_vs_reference_same_draw"}
    assert 0.4 < float(last["half_prune_flops_ratio"]) < 0.6  # every other token of the last scale: about half
    assert float(last["engine_vs_reference"]) > 0
    # the default draw is the official one: no duplicate "official draw" row, and the loop ratio is the engine's
    assert "official draw" not in printed
    assert last["loop_vs_reference_same_draw"] == last["engine_vs_reference"]


def test_bench_engine_adds_the_official_draw_row_for_another_draw(capsys):
    rc = run_cli(bench.main, ["engine", "--model", "random:official-tiny", "--batch-sizes", "1", "--repeats", "1",
                              "--draw", "inverse_cdf"])
    printed = capsys.readouterr().out
    assert rc == 0
    rows = [line for line in printed.splitlines() if line.startswith("engine, empty slots, official draw ")]
    assert len(rows) == 1 and float(rows[0].split()[-1]) > 0  # its ratio to the reference


def test_bench_presets_flops_ratios(capsys):
    rc = run_cli(bench.main, ["presets", "--presets", "fastvar", "--repeats", "1", "--threads", "1"])
    printed = capsys.readouterr().out
    assert rc == 0
    baseline, fastvar = _row(printed, "baseline"), _row(printed, "fastvar")
    assert baseline[1] == "1.000" and baseline[2] == "1.00"  # FLOPs ratio, ideal speedup of the reference
    flops_ratio, ideal = float(fastvar[1]), float(fastvar[2])
    assert 0.3 < flops_ratio < 0.95 and ideal == pytest.approx(1 / flops_ratio, abs=0.01)
    last = printed.strip().splitlines()[-1]
    assert re.fullmatch(r"speedup_vs_ideal_min=\d+\.\d{3} entropy_overhead=nan scoring_overhead_max=\S+ "
                        r"lens_share=nan speedup_vs_bw_ideal_min=\d+\.\d{3}", last), last
    bw_ideal = float(fastvar[4])  # bandwidth-aware ideal: at most the FLOPs ideal (weights stream at every scale)
    assert 1.0 < bw_ideal <= ideal + 0.01


def test_sensitivity_grid_values(tmp_path, fixture_dir, capsys):
    out = tmp_path / "sens"
    rc = run_cli(sensitivity.main, ["rho", "--values", "0.3", "0.9", "--method", "ldpruning", "--model",
                                    "official-tiny", "--weights", str(fixture_dir), "--samples", "2", "--batch-size",
                                    "2", "--warmup", "0", "--no-paired-timing", "--threads", "1", "--out", str(out),
                                    "--wandb", "disabled"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert f"table : {out / 'sensitivity.csv'}" in printed
    result = json.loads((out / "sensitivity.json").read_text())
    assert result["method"] == "ldpruning" and result["field"]["paths"] == ["schedule.rho"]
    assert result["values"] == [0.3, 0.9] and result["field"]["default"] == 0.5
    frame = pd.read_csv(out / "sensitivity.csv")
    flops = frame[frame["metric"] == "flops_ratio"].set_index("value")["mean"]
    assert 0 < flops[0.3] < flops[0.9] < 1  # keeping fewer tokens costs fewer FLOPs
    assert (out / "sensitivity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_rebuilds_the_table(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = run_cli(ablate.main, ["cache", "--arms", "identity@t_est=5", "--model", "official-tiny", "--samples", "2",
                               "--batch-size", "2", "--warmup", "0", "--timing-rounds", "0", "--threads", "1",
                               "--out", str(run_dir), "--wandb", "disabled", "--no-progress", "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    table = run_dir / "table.md"
    original = table.read_text()
    table.unlink()
    (run_dir / "table.csv").unlink()
    capsys.readouterr()

    rc = run_cli(report.main, [str(run_dir), "--no-plots"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert f"table : {table}" in printed
    rebuilt = table.read_text()
    rows = [line for line in rebuilt.splitlines() if line.startswith("| ")]
    assert any(line.startswith("| **baseline** | 2 |") for line in rows)
    assert any(line.startswith("| identity@t_est=5 | 2 |") for line in rows)
    csv = pd.read_csv(run_dir / "table.csv")
    assert len(csv) == 2
    assert rebuilt.splitlines()[0] == original.splitlines()[0]
