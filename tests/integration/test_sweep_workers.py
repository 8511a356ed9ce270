"""Two local worker processes on one study (a new SQLite file, created by the parent before the workers start):
distinct trials, both workers contribute, the target count is reached."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from optuna.trial import TrialState

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "official-tiny", "--samples", "4", "--batch-size", "4", "--warmup", "0", "--no-paired-timing"]


def cli_env(tmp_path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"]
                                                   if os.environ.get("PYTHONPATH") else ""),
               WANDB_MODE="disabled", WANDB_SILENT="true", WANDB_X_DISABLE_STATS="true", PYTHONUNBUFFERED="1")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        env[var] = str(tmp_path / "wandb-env" / var.lower())
    return env


def sweep_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "studies.sweep", *args]


def run_cli(cmd: list[str], tmp_path: Path, timeout: float = 500) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=cli_env(tmp_path), capture_output=True, text=True, timeout=timeout)


def load(storage, name: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=storage)


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
    assert "optuna-dashboard sqlite:///" in proc.stdout
