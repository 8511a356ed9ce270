"""optuna-dashboard for varscope sweeps, with Optuna 5's trial constraints honoured.

optuna-dashboard 0.21 reads a trial's constraints only from the old list-valued system attr ``constraints``;
Optuna 5's ``trial.set_constraint(key, value)`` stores ``constraints:<key>`` instead, so the dashboard sends every
trial with ``constraints: []`` (all drawn as feasible) and its "Best Trials" of a multi-objective study are the
Pareto front of all COMPLETE trials — an infeasible trial (e.g. one that lost more than the allowed class
accuracy) is shown as best. This entry point serves the same dashboard with both fixed:

* each trial's ``constraints`` are Optuna's own reading (``FrozenTrial.constraints``: both formats);
* best trials of a multi-objective study (every sweep: cost and quality) are the Pareto front of the feasible
  COMPLETE trials (every constraint ≤ 0), as ``study.best_trials`` gives them.

CLI: ``python -m sweeps.dashboard STORAGE [--host 127.0.0.1] [--port 8080]`` (STORAGE: a journal file or an RDB URL,
as ``--storage`` of ``varscope sweep``). :func:`wsgi` is the WSGI app (used by the tests)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["wsgi", "feasible", "constrained_best_trials", "main"]


def feasible(trial) -> bool:
    """Optuna's rule: feasible when every constraint value is ≤ 0 (no constraint: feasible)."""
    return all(v <= 0.0 for v in trial.constraints.values())


def constrained_best_trials(trials, directions) -> list:
    """Best trials among the feasible COMPLETE ones (the dashboard's own Pareto code on that subset)."""
    from optuna.study import StudyDirection
    from optuna.trial import TrialState
    from optuna_dashboard._pareto_front import get_pareto_front_trials

    done = [t for t in trials if t.state == TrialState.COMPLETE and feasible(t)]
    if len(directions) > 1:
        return get_pareto_front_trials(trials=done, directions=directions)
    if not done:
        return []
    pick = min if directions[0] == StudyDirection.MINIMIZE else max
    return [pick(done, key=lambda t: t.value)]


_PATCHED = False


def _patch() -> None:
    """Route optuna-dashboard's Pareto front and trial serialisation through the constraint-aware versions above
    (module globals of the dashboard's own modules; the public API has no hook for this)."""
    global _PATCHED
    if _PATCHED:
        return
    import optuna_dashboard._app as app
    import optuna_dashboard._serializer as ser

    plain_serialize = ser.serialize_frozen_trial

    def serialize_frozen_trial(study_id: int, trial, study_system_attrs: dict[str, Any]) -> dict[str, Any]:
        out = plain_serialize(study_id, trial, study_system_attrs)
        out["constraints"] = [float(v) for v in trial.constraints.values()]
        return out

    serialize_frozen_trial.__wrapped_plain__ = plain_serialize
    ser.serialize_frozen_trial = serialize_frozen_trial
    app.get_pareto_front_trials = constrained_best_trials
    _PATCHED = True


def _storage(storage: str):
    from pathlib import Path

    from .optuna_study import make_storage

    return make_storage(storage, Path("."))


def wsgi(storage):
    """The dashboard's WSGI app for ``storage`` (a URL / journal path, or an Optuna storage object)."""
    import optuna_dashboard

    _patch()
    store = _storage(storage) if isinstance(storage, str) else storage
    return optuna_dashboard.wsgi(store)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sweeps.dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("storage", help="the sweep's journal file or RDB URL (its --storage)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args(argv)
    from wsgiref.simple_server import make_server

    from .optuna_study import SweepError

    try:
        app = wsgi(args.storage)
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with make_server(args.host, args.port, app) as server:
        print(f"optuna-dashboard (varscope, constraints honoured) at http://{args.host}:{args.port}/", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
