"""A results folder is data, never code; one study at a time works in it; a recomputed baseline invalidates the arms
measured against the old one (issue 11, "Trustworthy numbers"). Small: official-tiny, 4 samples, batch 2."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")

from ablations.runner import (LOCK_NAME, ResultsFolderBusy, StudyOptions, baseline_identity,  # noqa: E402
                              results_lock, run_study)
from studies import report as report_cli  # noqa: E402
from var_core.errors import UserError  # noqa: E402
from var_core.eval import records as rec  # noqa: E402
from var_core.eval.lightning import GenerationRun, ResultFileError, load_shard  # noqa: E402

SMALL = dict(family="cache", model="official-tiny", samples=4, batch_size=2, warmup=0, progress=False, seed=1,
             threads=1, wandb="disabled", timing_rounds=0, plots=False, arms=("identity@t_est=5",))
ARM = "identity@t_est=5"


class _Payload:
    """Unpickling this runs a shell command that writes ``marker``: what a crafted results file would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"echo ran > {shlex.quote(self.marker)}",)


def _craft(path, marker) -> bytes:
    """Overwrite ``path`` with a file shaped like a saved run whose labels unpickle by running code."""
    torch.save({"indices": [0, 1, 2, 3], "labels": _Payload(marker), "seeds": [0, 1, 2, 3], "images_u8": None,
                "tokens": [[], [], [], []], "entropy": torch.zeros(4, 1), "activation_scale": [None] * 4}, path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("safety") / "run"
    result = run_study(StudyOptions(out=str(out), **SMALL), log=lambda s: None)
    assert result.computed == ["baseline", ARM]
    return out


@pytest.fixture
def folder(finished, tmp_path):
    """A private copy of the finished folder."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def _record(out, arm):
    return rec.read_record(rec.record_paths(out, arm)[0])


def test_the_crafted_file_would_run_code(tmp_path):
    """Control: the payload used below does run when the file is unpickled the old way."""
    marker = tmp_path / "marker"
    _craft(tmp_path / "x.pt", marker)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.read_text().strip() == "ran"


# ----- (a) no code runs; the file is named; resume moves it aside and recomputes ------------------------------------
def test_load_refuses_crafted_file_naming_it(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "arm.pt"
    _craft(path, marker)
    with pytest.raises(ResultFileError) as info:
        GenerationRun.load(path)
    assert isinstance(info.value, UserError) and info.value.path == path
    message = str(info.value)
    assert str(path) in message and "\n" not in message and "posix.system" in message
    assert "weights_only` set to `False`" not in message  # torch's advice to load it unsafely is not repeated
    assert not marker.exists()


def test_report_runs_no_code_and_names_the_files(folder, tmp_path, capsys):
    marker = tmp_path / "marker"
    arm_pt, base_pt = rec.record_paths(folder, ARM)[1], rec.record_paths(folder, "baseline")[1]
    crafted = _craft(arm_pt, marker)
    _craft(base_pt, marker)
    assert report_cli.main([str(folder), "--no-plots"]) == 0
    assert not marker.exists()
    out = capsys.readouterr().out
    assert str(arm_pt) in out and str(base_pt) in out
    table = (folder / "table.md").read_text()
    assert "Files that could not be read" in table and str(arm_pt) in table and str(base_pt) in table
    import pandas as pd

    frame = pd.read_csv(folder / "table.csv")  # the records are fine: both arms keep their numbers
    assert list(frame["arm"]) == ["baseline", ARM] and frame["ms_per_image"].notna().all()
    assert arm_pt.read_bytes() == crafted  # the report only reads: nothing is moved
    assert not (folder / "grids" / "overview.png").exists()


def test_resume_moves_crafted_baseline_aside_and_recomputes(folder, tmp_path):
    marker = tmp_path / "marker"
    base_pt = rec.record_paths(folder, "baseline")[1]
    old_identity = _record(folder, ARM)["baseline"]["identity"]
    crafted = _craft(base_pt, marker)
    logs: list[str] = []
    result = run_study(StudyOptions(out=str(folder), **SMALL), log=logs.append)
    assert not marker.exists()
    moved = [line for line in logs if "cannot read" in line]
    assert len(moved) == 1 and str(base_pt) in moved[0] and "baseline.pt.corrupt" in moved[0]
    assert (folder / "arms" / "baseline.pt.corrupt").read_bytes() == crafted
    # (c) the baseline was recomputed, so the arm measured against the old one was recomputed as well
    assert result.computed == ["baseline", ARM] and result.reused == []
    base = _record(folder, "baseline")
    identity = baseline_identity(base, GenerationRun.load(base_pt))
    assert identity != old_identity
    assert _record(folder, ARM)["baseline"]["identity"] == identity == base["baseline"]["identity"]


def test_resume_moves_crafted_arm_tensors_aside_and_recomputes_only_that_arm(folder, tmp_path):
    marker = tmp_path / "marker"
    arm_pt = rec.record_paths(folder, ARM)[1]
    crafted = _craft(arm_pt, marker)
    logs: list[str] = []
    result = run_study(StudyOptions(out=str(folder), **SMALL), log=logs.append)
    assert not marker.exists()
    assert result.reused == ["baseline"] and result.computed == [ARM]
    assert any(str(arm_pt) in line and f"{arm_pt.name}.corrupt" in line for line in logs)
    assert arm_pt.with_name(arm_pt.name + ".corrupt").read_bytes() == crafted
    fresh = GenerationRun.load(arm_pt)
    assert _record(folder, ARM)["tensors"]["sha256"] == fresh.content_hash()


def test_tensors_that_do_not_match_their_record_are_recomputed(folder):
    """A readable tensor file of another arm copied over this one's: its hash differs from the record's."""
    arm_pt = rec.record_paths(folder, ARM)[1]
    base_pt = rec.record_paths(folder, "baseline")[1]
    run = GenerationRun.load(base_pt)
    # written in the one-file format (varscope.run/1, still read): the samples in memory, not a samples folder
    run.images_u8, run.tokens, run.samples_dir = 255 - run.images_u8[:], list(run.tokens), None
    run.save(arm_pt)
    logs: list[str] = []
    result = run_study(StudyOptions(out=str(folder), **SMALL), log=logs.append)
    assert result.computed == [ARM]
    assert any("are not those of its record" in line for line in logs)


def test_ddp_shards_are_read_without_running_code(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"environment": {"rank": 0}, "outputs": [{"indices": _Payload(marker)}]}, tmp_path / "rank0.pt")
    with pytest.raises(Exception, match="posix.system"):
        load_shard(tmp_path / "rank0.pt")
    assert not marker.exists()


# ----- (b) the study report never drops an arm ----------------------------------------------------------------------
def test_report_lists_an_arm_whose_record_is_unreadable(folder, capsys):
    json_path = rec.record_paths(folder, ARM)[0]
    json_path.write_text('{"schema": "varscope.arm/1", "arm": ')  # truncated
    assert report_cli.main([str(folder), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert str(json_path) in out and "not JSON" in out
    import pandas as pd

    frame = pd.read_csv(folder / "table.csv")
    assert list(frame["arm"]) == ["baseline", ARM]
    status = frame.set_index("arm")["status"]
    assert status["baseline"] == "reference"
    assert "cannot be read" in status[ARM] and f"arms/{json_path.name}" in status[ARM]
    table = (folder / "table.md").read_text()
    assert f"- `{ARM}`: record arms/{json_path.name} cannot be read" in table


def test_report_lists_an_arm_whose_record_is_missing(folder, capsys):
    rec.record_paths(folder, ARM)[0].unlink()
    assert report_cli.main([str(folder), "--no-plots"]) == 0
    assert f"arm '{ARM}': no finished record" in capsys.readouterr().out
    import pandas as pd

    frame = pd.read_csv(folder / "table.csv").set_index("arm")
    assert "no finished record" in frame.loc[ARM, "status"]


def test_report_with_no_readable_record_names_the_files(folder):
    for arm in ("baseline", ARM):
        rec.record_paths(folder, arm)[0].write_text("garbage")
    with pytest.raises(UserError) as info:
        report_cli.main([str(folder), "--no-plots"])
    message = str(info.value)
    assert "baseline.json" in message and rec.record_paths(folder, ARM)[0].name in message and "\n" not in message


def test_resume_moves_an_unreadable_record_aside_and_recomputes(folder):
    json_path = rec.record_paths(folder, ARM)[0]
    json_path.write_text("{not json")
    result = run_study(StudyOptions(out=str(folder), **SMALL), log=lambda s: None)
    assert result.reused == ["baseline"] and result.computed == [ARM]
    assert json_path.with_name(json_path.name + ".corrupt").read_text() == "{not json"
    assert _record(folder, ARM)["status"] == "complete"


# ----- (c) the baseline an arm was measured against --------------------------------------------------------------
def test_arms_follow_their_baseline(folder):
    base_pt = rec.record_paths(folder, "baseline")[1]
    first = _record(folder, ARM)
    identity = baseline_identity(_record(folder, "baseline"), GenerationRun.load(base_pt))
    assert first["baseline"] == {"arm": "baseline", "identity": identity,
                                 "created": _record(folder, "baseline")["created"]}
    # unchanged baseline: everything is reused (the identity is recomputed identically from the stored files)
    again = run_study(StudyOptions(out=str(folder), **SMALL), log=lambda s: None)
    assert again.computed == [] and again.reused == ["baseline", ARM]
    # an arm recorded against another baseline is recomputed, the baseline is kept
    json_path = rec.record_paths(folder, ARM)[0]
    record = json.loads(json_path.read_text())
    record["baseline"]["identity"] = "0" * 16
    rec.write_json_atomic(json_path, record)
    logs: list[str] = []
    stale = run_study(StudyOptions(out=str(folder), **SMALL), log=logs.append)
    assert stale.reused == ["baseline"] and stale.computed == [ARM]
    assert any("measured against another baseline" in line for line in logs)
    assert _record(folder, ARM)["baseline"]["identity"] == identity
    # the baseline's files are gone: it is recomputed, and so is the arm
    rec.record_paths(folder, "baseline")[0].unlink()
    base_pt.unlink()
    fresh = run_study(StudyOptions(out=str(folder), **SMALL), log=lambda s: None)
    assert fresh.computed == ["baseline", ARM]
    new_identity = baseline_identity(_record(folder, "baseline"), GenerationRun.load(base_pt))
    assert new_identity != identity and _record(folder, ARM)["baseline"]["identity"] == new_identity


# ----- (d) one study per folder ----------------------------------------------------------------------------------
HOLDER = textwrap.dedent("""
    import sys
    from ablations.runner import results_lock
    with results_lock(sys.argv[1], log=lambda s: None):
        print("locked", flush=True)
        sys.stdin.read()
""")


@pytest.fixture
def holder(folder):
    """Another process holding the folder's lock (until its stdin closes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("LOCAL_RANK", "RANK", "NODE_RANK"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=os.getcwd())
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def test_second_process_on_a_locked_folder_is_refused(folder, holder):
    before = (folder / LOCK_NAME).read_text()
    assert json.loads(before)["pid"] == holder.pid
    with pytest.raises(ResultsFolderBusy) as info:
        run_study(StudyOptions(out=str(folder), **SMALL), log=lambda s: None)
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message
    assert f"pid {holder.pid} on host {socket.gethostname()}" in message and f"kill {holder.pid}" in message
    assert (folder / LOCK_NAME).read_text() == before  # the holder's lock is left alone
    holder.stdin.close()
    holder.wait(timeout=60)
    assert not (folder / LOCK_NAME).exists()  # released by its holder on the way out


def test_ddp_child_does_not_trip_over_the_lock(folder, holder, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with results_lock(folder, log=lambda s: None) as taken:
        assert taken is None
    assert json.loads((folder / LOCK_NAME).read_text())["pid"] == holder.pid


def _write_lock(folder, **info):
    (folder / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "started": "2020-01-01T00:00:00+00:00",
                                                "proc_start": None, **info}))


def test_stale_lock_of_a_dead_process_is_taken_over(folder):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(folder, pid=dead.pid)
    logs: list[str] = []
    result = run_study(StudyOptions(out=str(folder), **SMALL), log=logs.append)
    assert result.reused == ["baseline", ARM]
    notes = [line for line in logs if "took over the lock" in line]
    assert len(notes) == 1 and f"pid {dead.pid}" in notes[0] and "no longer running" in notes[0]
    assert not (folder / LOCK_NAME).exists()


def test_lock_of_a_reused_pid_is_stale(folder):
    """pid 1 is alive, but it is not the process that wrote the lock (another start time)."""
    _write_lock(folder, pid=1, proc_start="-1")
    logs: list[str] = []
    with results_lock(folder, log=logs.append) as taken:
        assert taken == folder / LOCK_NAME
        assert json.loads(taken.read_text())["pid"] == os.getpid()
    assert any("pid 1 " in line for line in logs) and not (folder / LOCK_NAME).exists()


def test_lock_from_another_host_is_respected(folder):
    _write_lock(folder, pid=12345, host="elsewhere.example")
    with pytest.raises(ResultsFolderBusy, match=r"pid 12345 on host elsewhere\.example.*delete .*study\.lock"):
        with results_lock(folder, log=lambda s: None):
            pass
    assert json.loads((folder / LOCK_NAME).read_text())["host"] == "elsewhere.example"


def test_lock_is_released_on_ctrl_c(folder):
    with pytest.raises(KeyboardInterrupt):
        with results_lock(folder, log=lambda s: None):
            assert (folder / LOCK_NAME).is_file()
            raise KeyboardInterrupt
    assert not (folder / LOCK_NAME).exists()


# ----- finished work survives an interruption ----------------------------------------------------------------------
def test_interrupted_save_keeps_the_previous_file(folder, monkeypatch):
    pt = rec.record_paths(folder, ARM)[1]
    before = pt.read_bytes()
    run = GenerationRun.load(pt)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run.save(pt)
    monkeypatch.setattr(rec.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        rec.write_json_atomic(rec.record_paths(folder, ARM)[0], {"x": 1})
    assert pt.read_bytes() == before and _record(folder, ARM) is not None
    assert not [p.name for p in (folder / "arms").iterdir() if p.name.endswith(".tmp")]
