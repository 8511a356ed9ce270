"""Shared test fixtures: the official VAR golden fixture and small models, loaded once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# W&B must never hang or write to $HOME in tests (specs/environment.md).
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_X_DISABLE_STATS", "true")

REPO = Path(__file__).resolve().parents[1]


def var_fixture_dir() -> Path:
    env = os.environ.get("VARSCOPE_VAR_FIXTURE")
    return Path(env) if env else REPO.parent / "shared" / "fixtures" / "official_var_tiny"


@pytest.fixture(scope="session")
def fixture_dir() -> Path:
    folder = var_fixture_dir()
    if not (folder / "config.json").exists():
        pytest.skip(f"official VAR fixture not found at {folder} (set VARSCOPE_VAR_FIXTURE)")
    return folder


@pytest.fixture(scope="session")
def tiny_adapter(fixture_dir):
    from var_core.zoo import load_model

    return load_model("official-tiny", weights=fixture_dir)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
