"""Integration tests write W&B runs: keep W&B's directories inside each test's tmp folder, and quiet."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _wandb_out_of_home(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-env" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")
