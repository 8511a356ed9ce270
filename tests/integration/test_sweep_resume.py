"""Kill a sweep worker with SIGKILL after >= 1 completed trial, re-run the same command: every completed trial is
kept, the trial in flight is marked FAIL (its worker is gone) and re-queued, the study reaches its target, and no
parameter set is evaluated twice (the resumed sampler is seeded differently; duplicates are pruned)."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
from optuna.trial import TrialState
from sweep_cli import REPO, TINY, cli_env, load, run_cli, sweep_cmd, wait_for

pytestmark = pytest.mark.slow


def test_sigkill_then_resume_keeps_completed_trials(tmp_path, fixture_dir):
    from sweeps.optuna_study import make_storage

    out = tmp_path / "sweep"
    # 48 samples per trial (~1-3 s each) leave a wide window in which one trial is complete and the next is in
    # flight; with 4 samples a trial took 0.2 s and the whole sweep could finish between two polls
    slow_trials = TINY[:2] + ["--samples", "48", "--batch-size", "16"] + TINY[6:]
    cmd = sweep_cmd("ldpruning", "--param", "rho", "--param", "delta", "--trials", "4", "--out", str(out),
                    "--wandb", "disabled", "--constraint", "none", *slow_trials)
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    journal = out / "study.journal"

    def killable() -> bool:
        """>= 1 trial complete and the next one in flight."""
        if not journal.is_file():
            return False
        try:
            study = load(make_storage(None, out), "ldpruning-flops-psnr")
        except Exception:  # noqa: BLE001 - not created yet
            return False
        return (len(study.get_trials(states=(TrialState.COMPLETE,))) >= 1
                and len(study.get_trials(states=(TrialState.RUNNING,))) >= 1)

    try:
        assert wait_for(killable, timeout=400, proc=proc), proc.communicate()[0][-3000:]
        assert proc.poll() is None, "the sweep finished before it could be killed (too fast?)"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    study = load(make_storage(None, out), "ldpruning-flops-psnr")
    before = {t.number: (tuple(t.values), t.params) for t in study.get_trials(states=(TrialState.COMPLETE,))}
    in_flight = [t.number for t in study.get_trials(states=(TrialState.RUNNING,))]
    assert 1 <= len(before) < 4 and len(in_flight) == 1
    done = run_cli(cmd, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    study = load(make_storage(None, out), "ldpruning-flops-psnr")
    trials = {t.number: t for t in study.get_trials()}
    for number, (values, params) in before.items():  # every completed trial kept, unchanged
        assert trials[number].state == TrialState.COMPLETE
        assert tuple(trials[number].values) == values and trials[number].params == params
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) >= 4
    assert not study.get_trials(states=(TrialState.RUNNING,))
    for number in in_flight:  # the trial the killed worker was running
        assert trials[number].state == TrialState.FAIL
        assert "is gone" in trials[number].user_attrs["fail_reason"]
        retries = [t for t in trials.values() if t.user_attrs.get("retry_of") == number]
        assert len(retries) == 1 and retries[0].params == trials[number].params
    assert "marked FAIL" in done.stdout
    # no parameter set evaluated twice: counted here from the storage's params and from the arm records
    def key(params: dict) -> tuple:
        return tuple(sorted((k, round(float(v), 12)) for k, v in params.items()))

    complete = study.get_trials(states=(TrialState.COMPLETE,))
    sets = [key(t.params) for t in complete]
    assert len(set(sets)) == len(sets), sets
    for t in study.get_trials(states=(TrialState.PRUNED,)):  # a pruned proposal repeats an evaluated set
        assert key(t.params) == key(trials[t.user_attrs["duplicate_of"]].params)
    numbers = {t.number for t in complete}  # (a kill between writing a record and `tell` leaves an extra record)
    records = [json.loads(p.read_text()) for p in sorted((out / "arms").glob("trial-*.json"))]
    evaluated = [key(r["sweep"]["params"]) for r in records if r["sweep"]["trial"] in numbers]
    assert len(evaluated) == len(complete) and len(set(evaluated)) == len(evaluated)
    result = json.loads((out / "results.json").read_text())
    front = [tuple(sorted((k, round(float(v), 12)) for k, v in row.items() if k.startswith("param:")))
             for row in result["pareto_front"]]
    assert front and len(set(front)) == len(front)
    seeds = result["sampler_seeds"]  # the killed start and the resumed one, seeded differently
    assert len(seeds) == 2 and seeds[0]["seed"] != seeds[1]["seed"]
