"""Two local worker processes on one study (a new SQLite file, created by the parent before the workers start):
distinct trials, both workers contribute, the target count is reached."""

from __future__ import annotations

import json

import pytest
from optuna.trial import TrialState
from sweep_cli import TINY, load, run_cli, sweep_cmd

pytestmark = pytest.mark.slow


def test_two_workers_on_one_sqlite_study(tmp_path, fixture_dir):
    out = tmp_path / "sweep"
    url = f"sqlite:///{tmp_path / 'study.db'}"
    proc = run_cli(sweep_cmd("ldpruning", "--param", "rho", "--param", "delta", "--trials", "6", "--workers", "2",
                             "--storage", url, "--out", str(out), "--wandb", "disabled", "--constraint", "none",
                             *TINY), tmp_path, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = load(url, "ldpruning-flops-psnr")
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(done) >= 6
    numbers = [t.number for t in study.get_trials()]
    assert len(numbers) == len(set(numbers))
    params = [tuple(sorted(t.params.items())) for t in done]
    assert len(set(params)) == len(params), params  # distinct parameter sets (per-worker sampler seeds)
    workers = {t.user_attrs["worker"]["pid"] for t in study.get_trials() if "worker" in t.user_attrs}
    assert len(workers) == 2, workers  # both worker processes ran trials
    assert (out / "results.json").is_file() and (out / "pareto.png").is_file()
    result = json.loads((out / "results.json").read_text())
    seeds = {(v["worker"], v["seed"]) for v in result["sampler_seeds"]}
    assert len(seeds) == 2 and len({seed for _, seed in seeds}) == 2  # one seed per worker, distinct
    front = [tuple(sorted((k, v) for k, v in row.items() if k.startswith("param:"))) for row in result["pareto_front"]]
    assert front and len(set(front)) == len(front)
    assert "python -m sweeps.dashboard sqlite:///" in proc.stdout
