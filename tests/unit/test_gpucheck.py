"""``studies.gpucheck``: refuses to run without a GPU, and its steps (as a CPU dry run on a tiny model) give a
table whose FLOPs-ideal column is the baseline's FLOPs over the method's (read back from the latency CSV)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from studies import gpucheck
from studies._cli import run_cli


def test_without_a_gpu_it_is_a_user_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert run_cli(gpucheck.main, ["--skip-tests"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_dry_run_table_puts_the_flops_ideal_speedup_next_to_the_measured_one(tmp_path):
    out = tmp_path / "gc"
    assert gpucheck.main(["--device", "cpu", "--skip-tests", "--model", "random:infinity-tiny", "--repeats", "1",
                          "--warmup", "0", "--methods", "baseline", "ldpruning", "--out", str(out)]) == 0
    summary = pd.read_csv(out / "latency" / "summary.csv").set_index("method")
    ideal = summary.loc["baseline", "gflops_transformer"] / summary.loc["ldpruning", "gflops_transformer"]
    assert ideal > 1.2  # LD-Pruning computes fewer tokens on the last scales
    measured = summary.loc["baseline", "transformer_ms"] / summary.loc["ldpruning", "transformer_ms"]
    text = (out / "gpucheck.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| ldpruning |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == f"{measured:.2f}x" and cells[4] == f"{ideal:.2f}x"
    assert "| baseline |" in text and "1.00x | 1.00x" in text
    # on a CPU the default precision is fp32 (the official samplers' autocast modes are the GPU defaults, issue 27)
    assert "random:infinity-tiny` at 128 px (5 scales), batch 1, fp32" in text
