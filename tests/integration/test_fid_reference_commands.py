"""--fid-reference on sensitivity (and sweep, same option as ablate): every record of the evaluation carries FID
vs the reference statistics with its bootstrap interval and what the interval covers (issue 26)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")

from studies import cli  # noqa: E402


def test_sensitivity_takes_fid_reference_and_records_it_with_an_interval(tmp_path):
    flat, npz, out = tmp_path / "tb", tmp_path / "tb.npz", tmp_path / "sens"
    assert cli.dispatch(["fid-reference", "export-testbed", str(flat), "--per-class", "3"]) == 0
    assert cli.dispatch(["fid-reference", "make", str(flat), str(npz), "--threads", "1"]) == 0
    assert cli.dispatch(["sensitivity", "tau", "--values", "0.7", "--metrics", "psnr", "--model", "testbed",
                         "--samples", "4", "--batch-size", "4", "--warmup", "0", "--threads", "1",
                         "--wandb", "disabled", "--no-paired-timing", "--fid-reference", str(npz),
                         "--out", str(out)]) == 0
    records = [json.loads(p.read_text()) for p in sorted((out / "arms").glob("*.json"))]
    assert len(records) >= 2  # the baseline and the grid point
    for record in records:
        entry = record["metrics"]["set_level"]["fid_ref"]
        assert entry["n"] == 4 and entry["n_reference"] == 30 and entry["feature_space"] == "testbed-classifier"
        assert entry["low"] <= entry["mean"] <= entry["high"] and "fixed reference statistics" in entry["method"]


@pytest.mark.parametrize("command", ["sweep", "sensitivity"])
def test_fid_reference_is_an_option_of_sweep_and_sensitivity(command, tmp_path):
    import importlib

    parser = importlib.import_module(f"studies.{command}").build_parser()
    ref = tmp_path / "r.npz"
    ref.write_bytes(b"")
    argv = ["nova", "--param", "tau"] if command == "sweep" else ["tau", "--values", "0.7"]
    assert parser.parse_args([*argv, "--fid-reference", str(ref)]).fid_reference == str(ref)
