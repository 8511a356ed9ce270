"""DDP on the CPU with 2 processes gives the same records as 1 process (same thread count per process)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")

from ablations.runner import StudyOptions, run_study  # noqa: E402
from var_core.eval import records as rec  # noqa: E402
from var_core.eval.lightning import GenerationRun  # noqa: E402

pytestmark = pytest.mark.slow  # two spawned processes per arm: ~30-60 s on 2 cores

SAME = ("arm", "config_hash", "key", "policy", "samples", "sampling")


def test_two_process_ddp_gives_the_same_records(tmp_path):
    # LD-Pruning: ragged per-sample keep counts and tied Haar energies, where batch dependence would show
    common = dict(family="method", model="official-tiny", samples=6, batch_size=2, warmup=0, progress=False,
                  wandb="disabled", plots=False, arms=("ldpruning",), threads=1, seed=3, timing_rounds=0)
    one = run_study(StudyOptions(out=str(tmp_path / "one"), devices=1, **common), log=lambda s: None)
    two = run_study(StudyOptions(out=str(tmp_path / "two"), devices=2, strategy="ddp_spawn", **common),
                    log=lambda s: None)
    assert one.computed == two.computed == ["baseline", "ldpruning"]
    for name in one.computed:
        a = rec.read_record(rec.record_paths(tmp_path / "one", name)[0])
        b = rec.read_record(rec.record_paths(tmp_path / "two", name)[0])
        for key in SAME:
            assert a[key] == b[key], key
        assert a["metrics"]["index"] == b["metrics"]["index"] == list(range(6))
        assert a["metrics"]["per_sample"] == b["metrics"]["per_sample"]
        assert a["metrics"]["per_scale"]["entropy"] == b["metrics"]["per_scale"]["entropy"]
        assert a["metrics"]["per_scale"]["token_agreement"] == b["metrics"]["per_scale"]["token_agreement"]
        assert a["metrics"]["activation_scale"] == b["metrics"]["activation_scale"]
        assert [p["rank"] for p in b["environment"]["processes"]] == [0, 1]
        assert sorted(x["first_index"] for x in b["timing"]["batches"]) == [0, 2, 4]
        ra = GenerationRun.load(rec.record_paths(tmp_path / "one", name)[1])
        rb = GenerationRun.load(rec.record_paths(tmp_path / "two", name)[1])
        assert torch.equal(ra.images_u8, rb.images_u8)
        for ta, tb in zip(ra.tokens, rb.tokens):
            assert all(torch.equal(x, y) for x, y in zip(ta, tb))
