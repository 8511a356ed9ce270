"""Kill a sweep worker with SIGKILL after >= 1 completed trial, re-run the same command: every completed trial is
kept, the trial in flight is marked FAIL (its worker is gone) and re-queued, the study reaches its target, and no
parameter set is evaluated twice (the resumed sampler is seeded differently; duplicates are pruned).

Fast cases: a trial left RUNNING by a dead worker (journal and SQLite; on SQLite resumed before optuna's heartbeat
grace period ran out) is evaluated exactly once on resume; a journal whose last line was cut while it was written
is repaired (backup kept, one line said) and the study resumes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from optuna.trial import TrialState
from sweep_cli import REPO, TINY, cli_env, load, run_cli, sweep_cmd, wait_for


@pytest.mark.slow
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
        """>= 1 trial complete and the next one in flight with its parameters drawn (killed between `ask` and the
        first `suggest`, a trial has no parameters to re-queue: the full suite once hit that window under load)."""
        if not journal.is_file():
            return False
        try:
            study = load(make_storage(None, out), "ldpruning-flops-psnr")
        except Exception:  # noqa: BLE001 - not created yet
            return False
        running = study.get_trials(states=(TrialState.RUNNING,))
        return (len(study.get_trials(states=(TrialState.COMPLETE,))) >= 1
                and len(running) >= 1 and all(len(t.params) == 2 for t in running))

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


# ----- fast: a dead worker's RUNNING trial, a cut journal line ----------------------------------------------------
STUDY = "ldpruning-flops-psnr"


def _spec(out, storage, trials):
    from sweeps.evaluate import EvalSettings
    from sweeps.optuna_study import SweepSpec

    return SweepSpec(method="ldpruning", params=("rho",), trials=trials, sampler="random", seed=0, constraint=None,
                     wandb="disabled", storage=storage, out=str(out),
                     eval=EvalSettings(model="official-tiny", samples=2, batch_size=2, warmup=0, paired_timing=False,
                                       threads=1))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_running_trial_of_a_dead_worker_is_evaluated_once_on_resume(tmp_path, kind):
    """A worker killed while evaluating rho=0.35 left its trial RUNNING (on SQLite with a fresh heartbeat: resumed
    within optuna's 120 s grace period); the resumed sweep marks it FAIL, evaluates rho=0.35 exactly once and
    ends with exactly the requested number of COMPLETE trials."""
    import optuna

    from sweeps.optuna_study import make_storage, run_sweep, worker_info

    out = tmp_path / "sweep"
    storage = f"sqlite:///{tmp_path / 'study.db'}" if kind == "sqlite" else None
    run_sweep(_spec(out, storage, 1), log=lambda m: None)  # trial 0: the preset's rho=0.5
    backend = make_storage(storage, out)
    study = load(backend, STUDY)
    study.enqueue_trial({"schedule.rho": 0.35})
    killed = study.ask()  # what the killed worker's objective did before it died: record itself, draw parameters
    killed.set_user_attr("worker", dict(worker_info(), pid=_dead_pid(), start_ticks=None))
    assert killed.suggest_float("schedule.rho", 0.2, 0.9) == 0.35
    if kind == "sqlite":
        backend.record_heartbeat(killed._trial_id)  # a heartbeat seconds old: optuna's fail_stale_trials skips it
        assert optuna.storages.fail_stale_trials(study) is None and \
            study.get_trials(states=(TrialState.RUNNING,))[0].number == killed.number
    logs: list[str] = []
    result = run_sweep(_spec(out, storage, 2), log=logs.append)
    study = load(make_storage(storage, out), STUDY)
    trials = study.get_trials()
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    assert trials[killed.number].state == TrialState.FAIL
    assert "is gone" in trials[killed.number].user_attrs["fail_reason"]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 2 == result["counts"]["COMPLETE"]  # exactly the requested number
    rhos = sorted(t.params["schedule.rho"] for t in complete)
    assert rhos == [0.35, 0.5]  # the killed trial's parameters evaluated once, the preset's once
    retry = next(t for t in complete if t.params["schedule.rho"] == 0.35)
    assert retry.user_attrs["retry_of"] == killed.number
    assert sum(f"trial {killed.number} was RUNNING" in line for line in logs) == 1


@pytest.mark.slow
def test_journal_with_a_cut_last_line_resumes_cli(tmp_path):
    """The sweep process was killed while appending to its journal: the last line holds half an operation. The
    re-run says so in one line naming the backup (the untouched original), removes only the cut bytes, recovers the
    trial whose completion was lost and reaches the requested number of COMPLETE trials."""
    out = tmp_path / "sweep"
    cmd = sweep_cmd("ldpruning", "--param", "rho", "--trials", "1", "--out", str(out), "--wandb", "disabled",
                    "--constraint", "none", "--sampler", "random", "--threads", "1", *TINY[:2], "--samples", "2",
                    "--batch-size", "2", *TINY[6:])
    first = run_cli(cmd, tmp_path)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    journal = out / "study.journal"
    data = journal.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    assert json.loads(data[last:])["op_code"] is not None  # a whole operation before we cut it
    cut = data[: last + (len(data) - last) // 2]
    journal.write_bytes(cut)
    done = run_cli(cmd, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    notes = [line for line in done.stdout.splitlines() if "cut off" in line]
    assert len(notes) == 1, done.stdout
    backups = list(out.glob("study.journal.bak-*"))
    assert len(backups) == 1 and str(backups[0]) in notes[0] and backups[0].read_bytes() == cut
    assert f"{len(cut) - last} bytes set aside" in notes[0]
    repaired = journal.read_bytes()
    assert repaired.startswith(data[:last])  # every whole line kept, byte for byte
    assert all(json.loads(line) for line in repaired.splitlines())
    from sweeps.optuna_study import make_storage

    study = load(make_storage(None, out), STUDY)
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 1
    assert not study.get_trials(states=(TrialState.RUNNING,))


def test_journal_cut_while_a_dead_worker_wrote_resumes(tmp_path):
    """In process (fast): a worker evaluating rho=0.35 died while appending its next operation to the journal, so
    the file ends in half a line. Resuming says so in one line naming the backup (the untouched original), removes
    only the cut bytes, evaluates rho=0.35 once and ends with the requested number of COMPLETE trials."""
    from sweeps.optuna_study import make_storage, run_sweep, worker_info

    out = tmp_path / "sweep"
    run_sweep(_spec(out, None, 1), log=lambda m: None)
    study = load(make_storage(None, out), STUDY)
    study.enqueue_trial({"schedule.rho": 0.35})
    killed = study.ask()
    killed.set_user_attr("worker", dict(worker_info(), pid=_dead_pid(), start_ticks=None))
    killed.suggest_float("schedule.rho", 0.2, 0.9)
    killed.set_user_attr("sampler_seed", 12345)  # the operation the worker was writing when it died
    journal = out / "study.journal"
    data = journal.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    assert json.loads(data[last:])["user_attr"] == {"sampler_seed": 12345}
    cut = data[: last + (len(data) - last) // 2]
    journal.write_bytes(cut)
    logs: list[str] = []
    result = run_sweep(_spec(out, None, 2), log=logs.append)
    notes = [line for line in logs if "cut off" in line]
    assert len(notes) == 1, logs
    backups = list(out.glob("study.journal.bak-*"))
    assert len(backups) == 1 and str(backups[0]) in notes[0] and backups[0].read_bytes() == cut
    assert f"{len(cut) - last} bytes set aside" in notes[0]
    repaired = journal.read_bytes()
    assert repaired.startswith(data[:last])  # every whole line kept, byte for byte
    assert all(isinstance(json.loads(line), dict) for line in repaired.splitlines())
    study = load(make_storage(None, out), STUDY)
    trials = study.get_trials()
    assert "sampler_seed" not in trials[killed.number].user_attrs  # the cut operation is gone, nothing else
    assert trials[killed.number].state == TrialState.FAIL and not study.get_trials(states=(TrialState.RUNNING,))
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 2 == result["counts"]["COMPLETE"]
    assert sorted(t.params["schedule.rho"] for t in complete) == [0.35, 0.5]
