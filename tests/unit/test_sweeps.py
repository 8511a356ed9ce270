"""Sweep spaces read from the knob metadata: alias resolution, unknown / unread fields, ranges, constraints."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sweeps.spaces import (SpaceError, apply_overrides, apply_values, build_space, knob_infos, resolve_field,
                           resolve_param, tunable_fields)
from var_core.accel.knobs import knob_fields
from var_core.accel.policy import COMPONENT_KINDS
from var_core.accel.presets import PRESETS, get_preset
from var_core.accel.registry import REGISTRIES


# ----- alias resolution ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("alias, method, path", [
    ("tau", "nova", "schedule.tau"),
    ("τ", "nova", "schedule.tau"),
    ("t_est", "nova", "activation.t_est"),
    ("alpha", "nova", "activation.alpha"),
    ("rho", "ldpruning", "schedule.rho"),
    ("delta", "ldpruning", "guidance.delta"),
    ("tau", "toprovar", "activation.tau"),  # the same symbol, another method: another knob
    ("beta", "toprovar", "schedule.beta"),
    ("stride", "sparsevar", "restorer.stride"),  # a bare, unique knob name
    ("schedule.tau", "nova", "schedule.tau"),
    ("min_keep", "nova", "min_keep"),  # policy-level option
])
def test_alias_resolves_against_the_method(alias, method, path):
    assert resolve_field(alias, get_preset(method)) == [path]


def test_lambda_is_ambiguous_for_nova_and_the_tie_sets_both():
    nova = get_preset("nova")
    for alias in ("lambda", "lam", "λ"):
        with pytest.raises(SpaceError, match="ambiguous") as err:
            resolve_field(alias, nova)
        assert "schedule.scale_lam" in str(err.value) and "schedule.layer_lam" in str(err.value)
        assert "schedule.scale_lam+schedule.layer_lam" in str(err.value)  # the suggested tie
    param = resolve_param("schedule.scale_lam+schedule.layer_lam", nova)
    assert param.paths == ("schedule.scale_lam", "schedule.layer_lam")
    policy = apply_values(nova, {param.name: 0.37}, params=[param])
    assert policy.schedule.scale_lam == policy.schedule.layer_lam == 0.37


def test_lambda_resolves_where_unique():
    from ablations.base import swap

    arm = swap("nova", "schedule", "scale_linkage")  # NOVA with the scale-linkage schedule: one λ knob
    assert arm.ok, arm.error
    assert resolve_field("lambda", arm.config) == ["schedule.lam"]


@pytest.mark.parametrize("name, method", [("tau", "ldpruning"), ("schedule.tau", "ldpruning"), ("rho", "nova"),
                                          ("delta", "nova"), ("guidance.delta", "nova"), ("t_est", "fastvar")])
def test_field_the_policy_does_not_read_lists_the_tunable_fields(name, method):
    policy = get_preset(method)
    with pytest.raises(SpaceError) as err:
        build_space(policy, [name])
    message = str(err.value)
    assert "no component of the policy" in message and repr(method) in message
    for path in tunable_fields(policy):
        assert path in message  # the method's tunable fields are listed


def test_unknown_kind_and_typo():
    with pytest.raises(SpaceError, match="not a component kind"):
        resolve_field("sched.tau", get_preset("nova"))
    with pytest.raises(SpaceError, match="Did you mean 'schedule.tau'"):
        resolve_field("schedule.tua", get_preset("nova"))


# ----- ranges from the knob metadata ----------------------------------------------------------------------------
@pytest.mark.parametrize("method", sorted(PRESETS))
def test_default_space_is_every_knob_with_a_search_space(method):
    policy = get_preset(method)
    infos = knob_infos(policy)
    expected = [p for p, k in infos.items() if k.search is not None]
    if not expected:
        with pytest.raises(SpaceError, match="no knob with a search space"):
            build_space(policy)
        return
    space = build_space(policy)
    assert space.names() == expected
    for param in space.params:
        field_ = infos[param.paths[0]].field
        assert param.space == field_.metadata["search"]  # the range is the knob's, not a copy
        assert param.default == infos[param.paths[0]].value


def test_every_registered_search_space_endpoint_is_a_valid_config():
    """Knob metadata consistency: a search space never proposes a value its own validation rejects."""
    for kind in COMPONENT_KINDS:
        for name, cls in REGISTRIES[kind]:
            for f in knob_fields(cls.Config):
                search = f.metadata.get("search")
                if search is None:
                    continue
                values = list(search.choices) if search.kind == "categorical" else [search.low, search.high]
                for value in values:
                    if search.kind == "int":
                        value = int(value)
                    cls.Config(**{f.name: value})  # raises on an inconsistent range


def test_range_overrides_and_their_validation():
    nova = get_preset("nova")
    p = resolve_param("tau=0.5:0.95", nova)
    assert (p.space.kind, p.space.low, p.space.high, p.space.log) == ("float", 0.5, 0.95, False)
    p = resolve_param("schedule.scale_lam=0.02:0.5:log", nova)
    assert p.space.log and p.space.low == 0.02
    p = resolve_param("t_est=3:6", nova)
    assert (p.space.kind, p.space.low, p.space.high) == ("int", 3, 6)
    p = resolve_param("restorer.interpolation=area,nearest", nova)
    assert p.space.kind == "categorical" and p.space.choices == ("area", "nearest")
    with pytest.raises(SpaceError, match="not valid for this knob"):
        resolve_param("tau=0:0.5", nova)  # tau is in (0, 1]
    with pytest.raises(SpaceError, match="declares no search space"):
        resolve_param("min_keep", nova)
    assert resolve_param("min_keep=1:4", nova).space.kind == "int"
    with pytest.raises(SpaceError, match="swept twice"):
        build_space(nova, ["tau", "schedule.tau"])


def test_suggest_and_apply_stay_inside_the_space():
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ld = get_preset("ldpruning")
    space = build_space(ld, ["rho", "delta", "restorer.interpolation", "restorer.cache_scale"])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        values = space.suggest(trial)
        assert space.in_space(values)
        policy = space.apply(values, name="x")
        assert policy.schedule.rho == values["schedule.rho"]
        assert policy.guidance.delta == values["guidance.delta"]
        assert policy.restorer.cache_scale == values["restorer.cache_scale"]
        assert 0.02 <= policy.guidance.delta <= 0.5
        study.tell(trial, 0.0)
    assert space.apply(space.defaults()).config_hash() == ld.config_hash()


def test_apply_overrides_typed():
    nova = get_preset("nova")
    p = apply_overrides(nova, ["tau=0.7", "schedule.ratio_is=kept", "min_keep=3"])
    assert p.schedule.tau == 0.7 and p.schedule.ratio_is == "kept" and p.min_keep == 3
    with pytest.raises(SpaceError, match="out of range"):
        apply_overrides(nova, ["tau=1.5"])
    with pytest.raises(SpaceError, match="cannot read"):
        apply_overrides(nova, ["activation.t_est=abc"])


# ----- constraint / Pareto ------------------------------------------------------------------------------------
def test_constraint_parsing_and_violation():
    from sweeps.optuna_study import Constraint, SweepError

    c = Constraint.parse("class_acc>=baseline-1")
    base = {"summary": {"class_acc": {"mean": 90.0}}}
    assert c.relative and c.threshold(base) == 89.0
    assert c.violation({"class_acc": {"mean": 89.5}}, base) == pytest.approx(-0.5)  # feasible
    assert c.violation({"class_acc": {"mean": 88.0}}, base) == pytest.approx(1.0)
    assert math.isinf(c.violation({}, base))
    c = Constraint.parse("fid_proxy <= baseline + 2.5")
    assert c.op == "<=" and c.value == 2.5
    c = Constraint.parse("psnr>=30")
    assert not c.relative and c.violation({"psnr": {"mean": 31.0}}, base) == -1.0
    for bad in ("psnr", "psnr>30", "nonsense>=1", "class_acc>=baseline*2"):
        with pytest.raises(SweepError):
            Constraint.parse(bad)


def test_pareto_mask():
    from sweeps.optuna_study import pareto_mask

    values = np.array([[0.5, 20.0], [0.6, 25.0], [0.6, 19.0], [0.4, 10.0], [0.5, 20.0], [0.9, 24.0]])
    mask = pareto_mask(values, ["minimize", "maximize"])
    assert mask.tolist() == [True, True, False, True, True, False]


def test_sweep_fails_before_any_trial_for_a_field_the_method_does_not_read(tmp_path):
    """The CLI exits with the method's tunable fields before the model is loaded (no study, no output)."""
    out = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "studies.sweep", "ldpruning", "--param", "tau", "--out", str(out),
                           "--wandb", "disabled"], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 2, proc.stderr
    assert "no component of the policy 'ldpruning'" in proc.stderr
    assert "schedule.rho" in proc.stderr and "guidance.delta" in proc.stderr
    assert not out.exists()


def test_sweep_spec_roundtrip():
    from sweeps.evaluate import EvalSettings
    from sweeps.optuna_study import SweepSpec

    spec = SweepSpec(method="ldpruning", params=("rho",), eval=EvalSettings(samples=4))
    again = SweepSpec.from_dict(spec.to_dict())
    assert again == spec and dataclasses.asdict(again.eval)["samples"] == 4


def test_sensitivity_grid_validation():
    from sweeps.sensitivity import SensitivityError, SensitivitySpec, default_method_for, resolve_grid

    assert default_method_for("tau") == "nova"
    assert default_method_for("rho") == "ldpruning"
    assert default_method_for("delta") == "ldpruning"
    method, _, paths, values, info = resolve_grid(SensitivitySpec("tau", ("0.6", "0.7")))
    assert (method, paths, values, info.value) == ("nova", ["schedule.tau"], [0.6, 0.7], 0.8)
    with pytest.raises(SensitivityError, match="out of range"):
        resolve_grid(SensitivitySpec("rho", ("0.5", "1.5")))
    with pytest.raises(SensitivityError, match="no component"):
        resolve_grid(SensitivitySpec("rho", ("0.5",), method="nova"))


def test_stale_running_trial_of_a_dead_worker_is_failed_and_requeued(tmp_path):
    """Journal storage: a RUNNING trial whose worker process is gone is marked FAIL and its parameters re-queued."""
    import optuna
    from optuna.trial import TrialState

    from sweeps.optuna_study import SweepSpec, make_storage, recover_stale_trials, worker_info

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = build_space(get_preset("ldpruning"), ["rho"])
    storage = make_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s", directions=["minimize", "maximize"])
    done = study.ask()
    space.suggest(done)
    study.tell(done, [0.5, 20.0])
    live = study.ask()
    space.suggest(live)
    live.set_user_attr("worker", worker_info())  # this process: alive, left alone
    dead_proc = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_proc.wait()
    dead = study.ask()
    values = space.suggest(dead)
    info = worker_info()
    info.update(pid=dead_proc.pid, start_ticks=None)
    dead.set_user_attr("worker", info)
    failed = recover_stale_trials(study, SweepSpec(), space, log=lambda m: None)
    assert failed == [dead.number]
    states = {t.number: t.state for t in study.get_trials()}
    assert states[done.number] == TrialState.COMPLETE and states[live.number] == TrialState.RUNNING
    assert states[dead.number] == TrialState.FAIL
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs["retry_of"] == dead.number
    assert waiting[0].system_attrs.get("fixed_params") == values  # the retry carries the dead trial's parameters
    assert recover_stale_trials(study, SweepSpec(), space, log=lambda m: None) == []  # idempotent
