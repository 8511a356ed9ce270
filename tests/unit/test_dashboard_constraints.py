"""optuna-dashboard 0.21 and Optuna 5's constraints: the dashboard served by ``sweeps.dashboard`` must not show an
infeasible trial as best (the stock 0.21 app does: it reads only the old ``constraints`` list attr). Checked
through the dashboard's own JSON API (``GET /api/studies/<id>``) on a journal study built by hand."""

from __future__ import annotations

import io
import json
from wsgiref.util import setup_testing_defaults

import optuna
import pytest
from optuna.trial import TrialState, create_trial
from optuna.distributions import FloatDistribution

pytest.importorskip("optuna_dashboard")


def _study(tmp_path):
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    path = tmp_path / "study.journal"
    study = optuna.create_study(storage=JournalStorage(JournalFileBackend(str(path))), study_name="s",
                                directions=["minimize", "maximize"])
    dist = {"x": FloatDistribution(0, 1)}
    # (cost ↓, quality ↑, violation): trial 0 is the cheapest but infeasible, trial 1 is the feasible front,
    # trial 2 is feasible and dominated by trial 1, trial 3 is infeasible and dominated by nothing feasible-wise
    for cost, quality, violation in ((0.2, 0.5, 1.0), (0.5, 0.9, -0.1), (0.6, 0.8, 0.0), (0.9, 0.95, 2.5)):
        trial = study.ask()
        trial.suggest_float("x", 0, 1)
        trial.set_constraint("class_acc>=", violation)
        study.tell(trial, [cost, quality])
    return path, study


def _get(app, url):
    environ = {}
    setup_testing_defaults(environ)
    environ.update(PATH_INFO=url, REQUEST_METHOD="GET", QUERY_STRING="", **{"wsgi.input": io.BytesIO()})
    status = []
    body = b"".join(app(environ, lambda s, h, exc=None: status.append(s)))
    assert status[0].startswith("200"), (status, body[:300])
    return json.loads(body)


def test_best_trials_are_feasible_and_constraints_are_sent(tmp_path):
    from sweeps.dashboard import wsgi

    path, study = _study(tmp_path)
    app = wsgi(str(path))
    studies = _get(app, "/api/studies")["study_summaries"]
    detail = _get(app, f"/api/studies/{studies[0]['study_id']}")
    # hand-worked: feasible = trials 1 (0.5, 0.9) and 2 (0.6, 0.8); 1 dominates 2 -> best = {1}
    assert sorted(t["number"] for t in detail["best_trials"]) == [1]
    constraints = {t["number"]: t["constraints"] for t in detail["trials"]}
    assert constraints == {0: [1.0], 1: [-0.1], 2: [0.0], 3: [2.5]}
    # the same answer as Optuna's own constrained best_trials
    assert sorted(t.number for t in study.best_trials) == [1]


def test_stock_dashboard_reads_the_new_constraints_wrong(tmp_path):
    """Documents why the wrapper exists; if a newer optuna-dashboard fixes this, the wrapper can go."""
    import optuna_dashboard
    import optuna_dashboard._app as app_module
    from optuna_dashboard._pareto_front import get_pareto_front_trials

    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path, _ = _study(tmp_path)
    stock = app_module.get_pareto_front_trials
    app_module.get_pareto_front_trials = get_pareto_front_trials  # undo a patch from the test above
    try:
        import optuna_dashboard._serializer as ser

        patched = ser.serialize_frozen_trial
        ser.serialize_frozen_trial = getattr(patched, "__wrapped_plain__", patched)
        app = optuna_dashboard.wsgi(JournalStorage(JournalFileBackend(str(path))))
        detail = _get(app, "/api/studies/0")
    finally:
        app_module.get_pareto_front_trials = stock
        ser.serialize_frozen_trial = patched
    assert 0 in {t["number"] for t in detail["best_trials"]}
