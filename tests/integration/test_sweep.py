"""A tiny Optuna sweep end to end (in process): it completes, its reported Pareto front is the non-dominated set
of the feasible trials, the best trade-off is feasible and cheapest, speedup / FLOPs ratio point the right way,
re-running resumes without new trials, extending it evaluates no parameter set twice, and W&B logs one offline
run per trial."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from sweeps.evaluate import EvalSettings
from sweeps.optuna_study import SweepSpec, pareto_mask, run_sweep


def test_tiny_sweep_front_is_non_dominated_and_resume_adds_nothing(tmp_path, fixture_dir):
    out = tmp_path / "sweep"
    spec = SweepSpec(method="ldpruning", params=("rho", "delta"), trials=4, sampler="nsga2", seed=3,
                     constraint="psnr>=0", quality="psnr", cost="flops", wandb="offline",
                     eval=EvalSettings(model="official-tiny", samples=4, batch_size=4, warmup=0, paired_timing=False), out=str(out))
    logs: list[str] = []
    result = run_sweep(spec, log=logs.append)
    assert result["counts"].get("COMPLETE") == 4
    for name in ("results.json", "trials.csv", "pareto.png", "sweep_spec.json", "study.journal",
                 "arms/baseline.json", "arms/baseline.pt"):
        assert (out / name).is_file(), name
    assert "pareto_optuna" in result["plots"]
    frame = pd.read_csv(out / "trials.csv")
    done = frame[frame["state"] == "COMPLETE"]
    assert len(done) == 4 and done["param:schedule.rho"].between(0.2, 0.9).all()
    assert done["param:guidance.delta"].between(0.02, 0.5).all()
    assert (done["constraint"].notna()).all()  # trial.set_constraint on every trial
    # PSNR lies in [0, 100] dB (8-bit images, identical ones capped at 100), so psnr>=0 holds for every trial: the
    # assertions on the front below always run (a threshold inside the observed range could skip them)
    assert done["feasible"].all() and (done["constraint"] <= 0).all()
    assert np.allclose(done["constraint"], -done["psnr"])  # violation = threshold - value
    # the first trial is the preset's own values
    first = done.sort_values("number").iloc[0]
    assert first["param:schedule.rho"] == 0.5 and first["param:guidance.delta"] == 0.15
    # reported front == the non-dominated feasible trials
    feasible = done[done["feasible"] == True]  # noqa: E712
    assert len(feasible) == 4
    front = {row["number"] for row in result["pareto_front"]}
    mask = pareto_mask(feasible[["flops_ratio", "psnr"]].to_numpy(), ["minimize", "maximize"])
    assert front and front == set(feasible[mask]["number"])
    values = feasible[["flops_ratio", "psnr"]].to_numpy()
    for n in front:  # nothing feasible dominates a front trial
        v = feasible[feasible["number"] == n][["flops_ratio", "psnr"]].to_numpy()[0]
        assert not np.any((values[:, 0] <= v[0]) & (values[:, 1] >= v[1]) &
                          ((values[:, 0] < v[0]) | (values[:, 1] > v[1])))
    best = result["best_tradeoff"]
    assert best is not None and best["feasible"] and best["flops_ratio"] == feasible["flops_ratio"].min()
    # one record per trial, metrics with CIs; the baseline cached in the study's user attrs too
    record = json.loads((out / "arms" / "trial-0000.json").read_text())
    assert record["schema"] == "varscope.arm/1" and record["status"] == "complete"
    assert {"psnr", "flops_ratio", "speedup"} <= set(record["summary"])
    assert record["summary"]["psnr"]["n"] == 4
    # direction of the relative metrics, recomputed from the recorded per-batch seconds and FLOPs: speedup =
    # baseline / arm seconds (no paired timing: the cached baseline's), latency and FLOPs ratios = arm / baseline
    base_batches = json.loads((out / "arms" / "baseline.json").read_text())["timing"]["batches"]
    for number in done["number"]:
        rec = json.loads((out / "arms" / f"trial-{int(number):04d}.json").read_text())
        arm_batches = rec["timing"]["batches"]
        base_s, arm_s = sum(b["seconds"] for b in base_batches), sum(b["seconds"] for b in arm_batches)
        base_f, arm_f = sum(b["flops"] for b in base_batches), sum(b["flops"] for b in arm_batches)
        assert len(arm_batches) == len(base_batches) == 1 and arm_f < base_f  # LD-Pruning computes less
        assert rec["summary"]["speedup"]["mean"] == pytest.approx(base_s / arm_s, rel=1e-9)
        assert rec["summary"]["latency_ratio"]["mean"] == pytest.approx(arm_s / base_s, rel=1e-9)
        assert rec["summary"]["flops_ratio"]["mean"] == pytest.approx(arm_f / base_f, rel=1e-9)
        row = done[done["number"] == number].iloc[0]
        assert row["flops_ratio"] == pytest.approx(arm_f / base_f, rel=1e-9)  # the objective the study saw
    data = json.loads((out / "results.json").read_text())
    assert data["constraint"]["threshold"] == 0.0 and data["dashboard"].startswith("python -m sweeps.dashboard ")
    # W&B: one offline run per trial, under the output folder
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 4, runs
    # re-running the same spec resumes: nothing new, baseline reused
    logs.clear()
    again = run_sweep(spec, log=logs.append)
    assert again["counts"].get("COMPLETE") == 4 and len(again["counts"]) == 1
    assert any("baseline: reusing" in line for line in logs)
    assert sorted(r["number"] for r in again["pareto_front"]) == sorted(front)


def test_resume_with_other_settings_is_refused(tmp_path, fixture_dir):
    from sweeps.optuna_study import SweepError

    out = tmp_path / "sweep"
    base = dict(method="ldpruning", params=("rho",), trials=1, wandb="disabled", constraint=None,
                eval=EvalSettings(model="official-tiny", samples=4, batch_size=4, warmup=0, paired_timing=False), out=str(out))
    run_sweep(SweepSpec(**base), log=lambda m: None)
    with pytest.raises(SweepError, match="different params"):
        run_sweep(SweepSpec(**dict(base, params=("rho=0.3:0.6",), study_name="ldpruning-flops-psnr")),
                  log=lambda m: None)


def test_unmeasurable_metric_fails_before_any_trial(tmp_path, fixture_dir):
    from sweeps.optuna_study import SweepError

    spec = SweepSpec(method="ldpruning", params=("rho",), trials=2, quality="class_acc", wandb="disabled",
                     eval=EvalSettings(model="official-tiny", samples=4, batch_size=4, warmup=0, paired_timing=False),
                     out=str(tmp_path / "s"))
    with pytest.raises(SweepError, match="class_acc cannot be measured here"):
        run_sweep(spec, log=lambda m: None)
    assert not (tmp_path / "s" / "study.journal").exists()


def _param_sets(trials) -> list[tuple]:
    return [tuple(sorted((k, round(float(v), 12)) for k, v in t.params.items())) for t in trials]


def test_extending_a_sweep_evaluates_no_parameter_set_twice(tmp_path, fixture_dir):
    """--trials 2, then --trials 4 on the same study: the second start's sampler is seeded differently (it used to
    replay the first start's proposals) and no parameter set is evaluated twice or listed twice on the front."""
    import optuna
    from optuna.trial import TrialState

    from sweeps.optuna_study import make_storage

    out = tmp_path / "sweep"
    base = dict(method="ldpruning", params=("rho", "delta"), sampler="nsga2", seed=3, constraint=None,
                wandb="disabled", eval=EvalSettings(model="official-tiny", samples=4, batch_size=4, warmup=0,
                                                    paired_timing=False), out=str(out))
    run_sweep(SweepSpec(trials=2, **base), log=lambda m: None)
    result = run_sweep(SweepSpec(trials=4, **base), log=lambda m: None)
    study = optuna.load_study(study_name="ldpruning-flops-psnr", storage=make_storage(None, out))
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 4
    sets = _param_sets(complete)
    assert len(set(sets)) == 4, sets  # counted here from the storage's params
    records = [json.loads(p.read_text()) for p in sorted((out / "arms").glob("trial-*.json"))]
    evaluated = [tuple(sorted((k, round(float(v), 12)) for k, v in r["sweep"]["params"].items())) for r in records]
    assert len(evaluated) == 4 and len(set(evaluated)) == 4  # one evaluation (record) per parameter set
    seeds = result["sampler_seeds"]
    assert len(seeds) == 2 and seeds[0]["seed"] != seeds[1]["seed"]
    assert seeds[0]["trials_in_storage"] < seeds[1]["trials_in_storage"]
    front = [tuple(sorted((k[len("param:"):], round(float(v), 12)) for k, v in row.items()
                          if k.startswith("param:"))) for row in result["pareto_front"]]
    assert front and len(set(front)) == len(front)
