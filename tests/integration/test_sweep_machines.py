"""N workers on N machines sharing one RDB storage URL: each machine runs the same ``studies.sweep`` command with
its own ``--out`` and the same ``--storage``. Stood in for by two independent invocations on this host (two
processes that know nothing of each other, as two machines): distinct trials and seeds, both contribute, the study
reaches its target, and each machine's folder has a report of the whole study."""

from __future__ import annotations

import json
import subprocess

import pytest
from optuna.trial import TrialState
from sweep_cli import TINY, cli_env, load, sweep_cmd, wait_for, REPO

pytestmark = pytest.mark.slow


def test_two_machines_share_one_rdb_study(tmp_path, fixture_dir):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    args = ["ldpruning", "--param", "rho", "--param", "delta", "--trials", "12", "--storage", url, "--wandb",
            "disabled", "--constraint", "none", *TINY]
    env = cli_env(tmp_path)
    first = subprocess.Popen(sweep_cmd(*args, "--out", str(tmp_path / "machine-a")), cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # the second machine starts once the first has created the study (as a second machine would join)
        assert wait_for(lambda: _has_study(url), timeout=240, proc=first)
        second = subprocess.run(sweep_cmd(*args, "--out", str(tmp_path / "machine-b")), cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=500)
        out_a, _ = first.communicate(timeout=500)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out_a[-3000:]
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    study = load(url, "ldpruning-flops-psnr")
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(done) >= 12
    params = [tuple(sorted(t.params.items())) for t in done]
    assert len(set(params)) == len(params), params
    pids = {t.user_attrs["worker"]["pid"] for t in study.get_trials() if "worker" in t.user_attrs}
    assert len(pids) == 2, pids  # both machines ran trials
    for folder in ("machine-a", "machine-b"):
        result = json.loads((tmp_path / folder / "results.json").read_text())
        assert len({s["seed"] for s in result["sampler_seeds"]}) == len(result["sampler_seeds"]) == 2


def _has_study(url: str) -> bool:
    import optuna

    try:
        return any(s.study_name == "ldpruning-flops-psnr" for s in optuna.get_all_study_summaries(url))
    except Exception:  # noqa: BLE001 - the database is not created yet
        return False
