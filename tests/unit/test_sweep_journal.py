"""Journal files a killed worker left damaged (``sweeps.optuna_study.repair_journal`` through ``make_storage``): a
cut last line is set aside; a cut line that a later append completed (what an older varscope wrote on resume)
keeps the later operation; a damaged line in the middle that holds no whole operation is one error naming it."""

from __future__ import annotations

import json

import optuna
import pytest

from sweeps.optuna_study import SweepError, make_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _journal(tmp_path, trials: int = 2):
    path = tmp_path / "study.journal"
    study = optuna.create_study(storage=make_storage(str(path), tmp_path), study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=trials)
    return path, path.read_bytes().splitlines(keepends=True)


def test_a_cut_line_completed_by_a_later_append_keeps_the_later_operation(tmp_path):
    path, lines = _journal(tmp_path)
    cut = lines[-1][: len(lines[-1]) // 2]  # trial 1's completion, cut
    later = json.dumps({"op_code": 2, "worker_id": "w", "study_id": 0, "user_attr": {"note": "after the cut"}},
                       separators=(",", ":")).encode()
    tail = json.dumps({"op_code": 2, "worker_id": "w", "study_id": 0, "user_attr": {"more": 1}}).encode()
    path.write_bytes(b"".join(lines[:-1]) + cut + later + b"\n" + tail + b"\n")
    with pytest.raises(ValueError):  # what optuna makes of it
        optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    logs: list[str] = []
    study = optuna.load_study(study_name="s", storage=make_storage(str(path), tmp_path, log=logs.append))
    assert study.user_attrs == {"note": "after the cut", "more": 1}
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "RUNNING"]  # only the cut operation lost
    assert path.read_bytes() == b"".join(lines[:-1]) + later + b"\n" + tail + b"\n"
    assert len(logs) == 1 and f"{len(cut)} bytes set aside" in logs[0]


def test_an_unreadable_line_in_the_middle_is_one_error_naming_it(tmp_path):
    path, lines = _journal(tmp_path)
    damaged = b"".join(lines[:3]) + b"garbage\n" + b"".join(lines[3:])
    path.write_bytes(damaged)
    with pytest.raises(SweepError, match=rf"{path}:4 is not an Optuna journal line"):
        make_storage(str(path), tmp_path, log=lambda m: None)
    assert path.read_bytes() == damaged and not list(tmp_path.glob("*.bak-*"))  # nothing touched


def test_a_whole_journal_is_left_alone(tmp_path):
    path, lines = _journal(tmp_path)
    before = path.read_bytes()
    logs: list[str] = []
    make_storage(str(path), tmp_path, log=logs.append)
    assert path.read_bytes() == before and not logs and not list(tmp_path.glob("*.bak-*"))
