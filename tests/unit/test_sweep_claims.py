"""Sampler seeds of worker starts on several machines sharing one storage (``claim_sampler_seed``): machines number
their workers from 0, so without a claim two machines started together would draw the same proposals."""

from __future__ import annotations

import hashlib

import optuna
import pytest

from sweeps import optuna_study as osw


@pytest.fixture
def study():
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(storage=optuna.storages.InMemoryStorage(), directions=["minimize", "maximize"])


def _as(monkeypatch, host: str, pid: int) -> None:
    monkeypatch.setattr(osw.socket, "gethostname", lambda: host)
    monkeypatch.setattr(osw.os, "getpid", lambda: pid)


def _expected(base, trials, worker) -> int:  # the documented formula, written out
    digest = hashlib.sha256(f"varscope-sampler:{base}:{trials}:{worker}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def test_a_second_machine_with_the_same_worker_index_gets_its_own_seed(study, monkeypatch):
    spec = osw.SweepSpec(method="ldpruning", seed=3)
    _as(monkeypatch, "machine-a", 100)
    a = osw.claim_sampler_seed(study, spec, 1, 0)
    _as(monkeypatch, "machine-b", 100)  # same pid on another host: still another process
    b = osw.claim_sampler_seed(study, spec, 1, 0)
    assert a == _expected(3, 1, 0)  # the first claim keeps the worker index's seed
    own = int.from_bytes(hashlib.sha256(b"varscope-sampler:3:1:0:machine-b:100").digest()[:4], "big")
    assert b == own != a
    assert sorted(s["seed"] for s in osw.sampler_seeds(study)) == sorted([a, b])  # the given-up claim is left out


def test_racing_claims_never_keep_one_seed(study, monkeypatch):
    """B wrote its claim but had not read yet when A claimed: A sees B and moves; B then sees only A's
    superseded claim and A's own seed, and keeps the shared one. One of them moved, never neither."""
    spec = osw.SweepSpec(method="ldpruning", seed=3)
    shared = _expected(3, 0, 0)
    study.set_user_attr(f"{osw.SEED_ATTR}:0:0:200@machine-b", {"seed": shared, "host": "machine-b", "pid": 200,
                                                       "started": 1.0, "worker": 0})
    _as(monkeypatch, "machine-a", 100)
    a = osw.claim_sampler_seed(study, spec, 0, 0)
    _as(monkeypatch, "machine-b", 200)
    b = osw.claim_sampler_seed(study, spec, 0, 0)
    assert a != shared and b == shared
    assert len({s["seed"] for s in osw.sampler_seeds(study)}) == 2


def test_workers_of_one_machine_keep_their_index_seeds(study, monkeypatch):
    spec = osw.SweepSpec(method="ldpruning", seed=3)
    seeds = []
    for pid, worker in ((300, 0), (301, 1)):
        _as(monkeypatch, "machine-a", pid)
        seeds.append(osw.claim_sampler_seed(study, spec, 0, worker))
    assert seeds == [_expected(3, 0, 0), _expected(3, 0, 1)]


def test_no_base_seed_stays_unseeded(study, monkeypatch):
    _as(monkeypatch, "machine-a", 1)
    assert osw.claim_sampler_seed(study, osw.SweepSpec(method="ldpruning", seed=None), 0, 0) is None
