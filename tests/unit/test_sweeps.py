"""Sweep spaces read from the knob metadata: alias resolution, unknown / unread fields, ranges, constraints."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sweeps.spaces import SpaceError, apply_overrides, apply_values, build_space, resolve_field, resolve_param
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


# The tunable fields of the presets, written out by hand from the knobs' declarations (``search=SearchSpace(...)``
# in var_core/accel/*/*.py) and the presets' values (var_core/accel/presets.py; the papers' defaults):
# (path, kind, low, high, log, choices, default)
EXPECTED_SPACES = {
    "baseline": [],
    "scalekv": [],  # KV policies (issue 29): budgets are ablated by the kv family, not searched
    "hack": [],
    "nova": [
        ("scorer.source", "categorical", None, None, False, ("predictive", "lens"), "predictive"),
        ("activation.t_est", "int", 2, 7, False, None, 5),
        ("activation.alpha", "float", 0.1, 1.0, False, None, 0.5),
        ("schedule.tau", "float", 0.3, 1.0, False, None, 0.8),
        ("schedule.scale_lam", "float", 0.01, 1.0, True, None, 0.1),
        ("schedule.layer_lam", "float", 0.01, 1.0, True, None, 0.1),
        ("restorer.interpolation", "categorical", None, None, False, ("area", "bilinear", "nearest"), "area"),
    ],
    "fastvar": [
        ("scorer.upsample", "categorical", None, None, False, ("nearest", "bilinear", "area"), "bilinear"),
        ("restorer.cache_scale", "int", -5, -2, False, None, -3),
        ("restorer.interpolation", "categorical", None, None, False, ("area", "bilinear", "nearest"), "area"),
    ],
    "fastvar_toprovar": [  # its generic config is the Infinity-2B setting: the 24x24 cache is scale 8 of 13
        ("scorer.upsample", "categorical", None, None, False, ("nearest", "bilinear", "area"), "bilinear"),
        ("restorer.cache_scale", "int", -5, -2, False, None, 8),
        ("restorer.interpolation", "categorical", None, None, False, ("area", "bilinear", "nearest"), "area"),
    ],
    "ldpruning": [
        ("scorer.extractor", "categorical", None, None, False, ("haar", "fft", "laplacian", "sobel"), "haar"),
        ("scorer.window", "categorical", None, None, False, (1, 3, 5), 3),
        ("scorer.interpolation", "categorical", None, None, False, ("trilinear", "bicubic", "area", "nearest"),
         "trilinear"),
        ("schedule.rho", "float", 0.2, 0.9, False, None, 0.5),
        ("schedule.min_keep_fraction", "float", 0.0, 0.2, False, None, 0.05),
        ("guidance.delta", "float", 0.02, 0.5, True, None, 0.15),
    ],
    "ldpruning_skip": [  # ldpruning's, plus the number of skipped last scales (2: the paper's 11 and 12)
        ("scorer.extractor", "categorical", None, None, False, ("haar", "fft", "laplacian", "sobel"), "haar"),
        ("scorer.window", "categorical", None, None, False, (1, 3, 5), 3),
        ("scorer.interpolation", "categorical", None, None, False, ("trilinear", "bicubic", "area", "nearest"),
         "trilinear"),
        ("schedule.rho", "float", 0.2, 0.9, False, None, 0.5),
        ("schedule.min_keep_fraction", "float", 0.0, 0.2, False, None, 0.05),
        ("guidance.delta", "float", 0.02, 0.5, True, None, 0.15),
        ("skip.count", "int", 0, 3, False, None, 2),
    ],
    "toprovar": [
        ("scorer.signal", "categorical", None, None, False, ("query_entropy", "received_mass"), "query_entropy"),
        ("scorer.source", "categorical", None, None, False, ("previous_scale", "previous_block"), "previous_scale"),
        ("activation.tau", "float", 0.2, 0.6, False, None, 0.4),
        ("schedule.s_rep", "int", 4, 8, False, None, 6),
        ("schedule.beta", "float", 0.01, 2.0, True, None, 0.05),
        ("schedule.detail_threshold", "float", 0.2, 0.8, False, None, 0.5),
        ("schedule.alpha_min", "float", 0.0, 0.5, False, None, 0.1),
        ("schedule.alpha_max", "float", 0.5, 1.0, False, None, 0.9),
    ],
    "sparsevar": [
        ("scorer.upsample", "categorical", None, None, False, ("nearest", "bilinear", "area"), "bilinear"),
        ("restorer.stride", "int", 2, 8, False, None, 4),
    ],
    "sparsevar_lvar": [  # the third-party code's setting: 'nearest' resize, threshold 0.6, stride 4
        ("scorer.upsample", "categorical", None, None, False, ("nearest", "bilinear", "area"), "nearest"),
        ("schedule.threshold", "float", 0.3, 0.9, False, None, 0.6),
        ("restorer.stride", "int", 2, 8, False, None, 4),
    ],
    "skipvar": [
        ("guidance.start_scale", "int", -4, -1, False, None, -3),
    ],
    "skipvar_static": [
        ("guidance.start_scale", "int", -4, -1, False, None, -3),
    ],
    "stagevar": [
        ("restorer.interpolation", "categorical", None, None, False, ("area", "bilinear", "nearest"), "area"),
        ("guidance.count", "int", 1, 4, False, None, 3),
    ],
    "stagevar_sampled": [  # stagevar's generic config (its VAR / HART setting) under its own name
        ("restorer.interpolation", "categorical", None, None, False, ("area", "bilinear", "nearest"), "area"),
        ("guidance.count", "int", 1, 4, False, None, 3),
    ],
    "code": [],  # its knobs (refiner, switch_scale) are the policy's, not a component's: --set, no search space
    "stepvar": [
        ("scorer.structure_weight", "float", 0.0, 4.0, False, None, 1.0),
    ],
    "sparvar": [
        ("attention.decision_scale", "int", -5, -2, False, None, -3),
        ("attention.top_keys", "float", 0.05, 0.5, False, None, 0.2),
    ],
}


@pytest.mark.parametrize("name, method", [("tau", "ldpruning"), ("schedule.tau", "ldpruning"), ("rho", "nova"),
                                          ("delta", "nova"), ("guidance.delta", "nova"), ("t_est", "fastvar")])
def test_field_the_policy_does_not_read_lists_the_tunable_fields(name, method):
    policy = get_preset(method)
    with pytest.raises(SpaceError) as err:
        build_space(policy, [name])
    message = str(err.value)
    assert "no component of the policy" in message and repr(method) in message
    table = message.split("current value):\n", 1)[1]
    listed = [line.split()[0] for line in table.splitlines() if line.strip()]
    assert listed == [row[0] for row in EXPECTED_SPACES[method]]  # the method's tunable fields, in order


def test_unknown_kind_and_typo():
    with pytest.raises(SpaceError, match="not a component kind"):
        resolve_field("sched.tau", get_preset("nova"))
    with pytest.raises(SpaceError, match="Did you mean 'schedule.tau'"):
        resolve_field("schedule.tua", get_preset("nova"))


# ----- ranges from the knob metadata ----------------------------------------------------------------------------
def test_every_preset_has_hand_written_expectations():
    assert sorted(PRESETS) == sorted(EXPECTED_SPACES)


@pytest.mark.parametrize("method", sorted(EXPECTED_SPACES))
def test_default_space_is_every_knob_with_a_search_space(method):
    policy = get_preset(method)
    expected = EXPECTED_SPACES[method]
    if not expected:
        with pytest.raises(SpaceError, match="no knob with a search space"):
            build_space(policy)
        return
    space = build_space(policy)
    got = [(p.name, p.space.kind, p.space.low, p.space.high, bool(p.space.log),
            None if p.space.choices is None else tuple(p.space.choices), p.default) for p in space.params]
    assert got == expected
    assert all(p.paths == (p.name,) for p in space.params)


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
    # LD-Pruning with FastVAR-style cache restoration (the option beside its sparse residual tokens)
    ld = get_preset("ldpruning").replace_component("restorer", "static_cache", cache_scale=-4, refresh="latest")
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


# ----- no parameter set evaluated twice ------------------------------------------------------------------------
def test_canonical_values_round_to_the_space_steps():
    from sweeps.spaces import Param
    from var_core.accel.knobs import SearchSpace

    stepped = Param("x", ("x",), SearchSpace("float", 0.2, 0.9, step=0.05), 0.5, "")
    assert stepped.canonical(0.29999999) == 0.3 and stepped.canonical(0.31) == 0.3  # nearest grid point
    assert stepped.canonical(0.33) == 0.35
    free = Param("y", ("y",), SearchSpace("float", 0.0, 1.0), 0.5, "")
    assert free.canonical(0.1 + 0.2) == 0.3  # 0.30000000000000004: storage noise, 12 significant digits
    assert free.canonical(0.3001) == 0.3001  # a real difference is kept
    ints = Param("n", ("n",), SearchSpace("int", 1, 9, step=2), 5, "")
    assert ints.canonical(4.2) == 5 and ints.canonical(8.1) == 9  # 1 + 2 * round(1.6), 1 + 2 * round(3.55)
    cat = Param("c", ("c",), SearchSpace("categorical", choices=("a", "b")), "a", "")
    assert cat.canonical("b") == "b"
    space = build_space(get_preset("ldpruning"), ["rho", "delta"])
    assert space.key({"guidance.delta": 0.15, "schedule.rho": 0.1 + 0.4}) == (("schedule.rho", 0.5),
                                                                               ("guidance.delta", 0.15))
    assert space.key({"schedule.rho": 0.5}) == (("schedule.rho", 0.5), ("guidance.delta", None))


def test_sampler_seed_depends_on_trials_in_storage_and_worker():
    import hashlib

    from sweeps.optuna_study import sampler_seed

    def expected(base, n, w):  # the documented derivation, computed here
        return int(hashlib.sha256(f"varscope-sampler:{base}:{n}:{w}".encode()).hexdigest()[:8], 16)

    assert sampler_seed(3, 0, 0) == expected(3, 0, 0)
    assert sampler_seed(3, 2, 1) == expected(3, 2, 1)
    seeds = {sampler_seed(3, n, w) for n in (0, 1, 2, 4) for w in (0, 1)}
    assert len(seeds) == 8  # a resumed / extended start or another worker gets another seed
    assert sampler_seed(None, 5, 0) is None


def test_find_duplicate_prefers_complete_and_lets_the_lowest_running_trial_go_on():
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState, create_trial

    from sweeps.optuna_study import find_duplicate

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = build_space(get_preset("ldpruning"), ["rho"])
    dist = {"schedule.rho": FloatDistribution(0.2, 0.9)}
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.add_trial(create_trial(params={"schedule.rho": 0.4}, distributions=dist, values=[0.4, 20.0]))  # 0
    study.add_trial(create_trial(params={"schedule.rho": 0.6}, distributions=dist, state=TrialState.RUNNING))  # 1
    study.add_trial(create_trial(params={"schedule.rho": 0.6}, distributions=dist, state=TrialState.RUNNING))  # 2
    study.add_trial(create_trial(params={"schedule.rho": 0.7}, distributions=dist, state=TrialState.FAIL))  # 3
    assert find_duplicate(study, space, 9, {"schedule.rho": 0.4000000000000001}).number == 0
    assert find_duplicate(study, space, 1, {"schedule.rho": 0.6}) is None  # the lowest running one goes on
    assert find_duplicate(study, space, 2, {"schedule.rho": 0.6}).number == 1
    assert find_duplicate(study, space, 9, {"schedule.rho": 0.7}) is None  # a failed trial evaluated nothing
    assert find_duplicate(study, space, 9, {"schedule.rho": 0.41}) is None


class StubEvaluator:
    """Stands in for SweepEvaluator: FLOPs ratio = rho, PSNR = 10 + 30 rho (no model); counts evaluations."""

    model = "stub"
    notes: list = []

    def __init__(self, out_dir):
        self.out_dir = Path(out_dir)
        self.calls: list[float] = []
        self.log = lambda m: None

    def available(self, metric):
        return None

    def unread_fields(self, policy, paths):
        return []

    def describe(self):
        return {"model": "stub"}

    def baseline(self):
        one = {"mean": 1.0, "low": 1.0, "high": 1.0, "n": 4}
        return {"summary": {"flops_ratio": one, "speedup": one}, "environment": {}}

    def evaluate(self, name, policy, *, description="", extra=None):
        rho = policy.schedule.rho
        self.calls.append(rho)

        def s(v):
            return {"mean": v, "low": v, "high": v, "n": 4}

        return {"summary": {"flops_ratio": s(rho), "psnr": s(10 + 30 * rho)}, "config_hash": policy.config_hash()}


def _stub_sweep(out, trials):
    from sweeps.optuna_study import SweepSpec, prepare, run_sweep

    spec = SweepSpec(method="ldpruning", params=("rho=0.3,0.5,0.7",), trials=trials, sampler="random", seed=0,
                     constraint="psnr>=20", quality="psnr", cost="flops", wandb="disabled", out=str(out))
    stub = StubEvaluator(out)
    prep = prepare(spec, log=lambda m: None, evaluator=stub)
    return run_sweep(spec, log=lambda m: None, prep=prep), stub, prep


def test_extended_stub_sweep_evaluates_each_parameter_set_once_and_the_front_is_hand_computed(tmp_path,
                                                                                             monkeypatch):
    """3 possible parameter sets; --trials 2, then 3, then 4: three evaluations in all, three distinct COMPLETE
    trials, the fourth request stops on an exhausted space. Front and best trade-off worked out by hand."""
    import hashlib

    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    from sweeps.optuna_study import make_storage, write_report

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    monkeypatch.setattr("sweeps.optuna_study.MAX_CONSECUTIVE_DUPLICATES", 8)  # the exhausted run stops sooner
    out = tmp_path / "stub"
    _, first, _ = _stub_sweep(out, 2)
    assert first.calls[0] == 0.5 and len(first.calls) == 2  # the preset default first
    _, second, _ = _stub_sweep(out, 3)
    _, third, prep = _stub_sweep(out, 4)
    calls = first.calls + second.calls + third.calls
    assert sorted(calls) == [0.3, 0.5, 0.7]  # every set evaluated exactly once over the three runs
    study = optuna.load_study(study_name="ldpruning-flops-psnr", storage=make_storage(None, out))
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert sorted(t.params["schedule.rho"] for t in complete) == [0.3, 0.5, 0.7]
    by_rho = {t.params["schedule.rho"]: t for t in complete}
    assert by_rho[0.3].values == pytest.approx([0.3, 19.0]) and by_rho[0.7].values == pytest.approx([0.7, 31.0])
    assert by_rho[0.3].constraints == {"psnr": pytest.approx(1.0)}  # 20 - 19: infeasible
    assert by_rho[0.5].constraints == {"psnr": pytest.approx(-5.0)}
    assert by_rho[0.7].constraints == {"psnr": pytest.approx(-11.0)}
    pruned = study.get_trials(states=(TrialState.PRUNED,))
    assert len(pruned) >= 8  # the --trials 4 run: 8 duplicates in a row, then it stopped
    for t in pruned:  # every other proposal was a duplicate of a complete trial, pruned unevaluated
        assert by_rho[t.params["schedule.rho"]].number == t.user_attrs["duplicate_of"]
    # seeds: one per worker start, each the hash of (base seed 0, trials in the storage, worker 0), all distinct
    seeds = [v for k, v in study.user_attrs.items() if k.startswith("varscope.sampler_seed:")]
    assert len(seeds) == 3 and len({v["trials_in_storage"] for v in seeds}) == 3
    for v in seeds:
        digest = hashlib.sha256(f"varscope-sampler:0:{v['trials_in_storage']}:0".encode()).hexdigest()
        assert v["seed"] == int(digest[:8], 16)
    assert {t.user_attrs["sampler_seed"] for t in complete[1:]} <= {v["seed"] for v in seeds}
    # a study written before duplicates were pruned may hold a set twice: the report lists it once
    study.add_trial(create_trial(params={"schedule.rho": 0.7},
                                 distributions={"schedule.rho": CategoricalDistribution([0.3, 0.5, 0.7])},
                                 values=[0.7, 31.0], constraints={"psnr": -11.0}))
    result = write_report(prep, log=lambda m: None)
    front = sorted(row["number"] for row in result["pareto_front"])
    assert front == sorted([by_rho[0.5].number, by_rho[0.7].number])  # 0.3 is infeasible; 0.7 listed once
    assert result["best_tradeoff"]["number"] == by_rho[0.5].number
    assert result["best_tradeoff"]["flops_ratio"] == pytest.approx(0.5)
    assert len(result["sampler_seeds"]) == 3


# ----- evaluator: direction of speedup / latency ratio / FLOPs ratio -------------------------------------------
def test_relative_metrics_are_baseline_over_arm_for_speedup_and_arm_over_baseline_for_ratios():
    from types import SimpleNamespace

    from sweeps.evaluate import EvalSettings, SweepEvaluator

    def batches(seconds, flops):
        return [{"first_index": 2 * i, "size": 2, "seconds": s, "flops": f} for i, (s, f) in
                enumerate(zip(seconds, flops))]

    base = {"timing": {"batches": batches([2.0, 4.0], [100.0, 100.0])},
            "metrics": {"index": [0, 1, 2, 3], "per_sample": {"class_correct": [1, 1, 0, 0]}}}
    arm = {"timing": {"batches": batches([1.0, 1.0], [30.0, 50.0])},
           "metrics": {"index": [0, 1, 2, 3], "per_sample": {"class_correct": [1, 0, 0, 0]}}}
    fake = SimpleNamespace(settings=EvalSettings(seed=0))
    summary: dict = {}
    SweepEvaluator._relative(fake, summary, arm, base)
    # baseline 6 s over 2 batches, arm 2 s: the arm is 3x faster
    assert summary["speedup"]["mean"] == pytest.approx(3.0)
    assert summary["latency_ratio"]["mean"] == pytest.approx(1 / 3)
    assert summary["flops_ratio"]["mean"] == pytest.approx(0.4)  # (30 + 50) / (100 + 100)
    assert summary["class_acc_delta"]["mean"] == pytest.approx(-25.0)  # one of 4 samples lost: -25 points
    # with paired timing, the seconds of the re-timed baseline (3 s, 5 s) are the reference, not the cached ones
    arm["timing"]["reference_batches"] = [{"first_index": 0, "size": 2, "seconds": 3.0},
                                          {"first_index": 2, "size": 2, "seconds": 5.0}]
    summary = {}
    SweepEvaluator._relative(fake, summary, arm, base)
    assert summary["speedup"]["mean"] == pytest.approx(4.0)
    assert summary["latency_ratio"]["mean"] == pytest.approx(0.25)
    assert summary["flops_ratio"]["mean"] == pytest.approx(0.4)  # FLOPs are always vs the cached baseline
