"""Helpers for the tests that drive ``python -m studies.sweep`` in subprocesses (W&B off, repo on the path)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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


def wait_for(predicate, timeout: float, interval: float = 0.5, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return predicate()
        time.sleep(interval)
    return False
