"""Bad inputs to ``python -m studies.sweep`` end in one ``error:`` line and exit 2, before the model is loaded or
any file is written: a storage URL of an unknown scheme, an in-memory SQLite database (nothing to resume, nothing
shared between workers), a storage file in a folder that does not exist, a journal that cannot be written, a
``--param`` range that is not a number, an unknown field (with a did-you-mean)."""

from __future__ import annotations

import builtins
import errno
from pathlib import Path

import pytest

from studies._cli import run_cli
from studies.sweep import main

TINY = ["--trials", "1", "--wandb", "disabled", "--constraint", "none", "--model", "official-tiny", "--samples", "2",
        "--batch-size", "2", "--warmup", "0", "--no-paired-timing", "--threads", "1"]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = run_cli(main, list(args) + TINY)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error: "), err
    assert "Traceback" not in err and not any(line.startswith("error:") for line in lines[1:]), err
    return lines[0]


@pytest.mark.parametrize("storage, expected", [
    ("foo://bar", ["unknown storage URL scheme 'foo'", "sqlite:///"]),
    ("sqlit:///x.db", ["unknown storage URL scheme 'sqlit'", "Did you mean 'sqlite'"]),
    ("sqlite:///:memory:", ["in-memory SQLite", "nothing to resume", "cannot share"]),
    ("sqlite://", ["in-memory SQLite"]),
    ("sqlite:///{tmp}/missing/study.db", ["the folder {tmp}/missing does not exist", "mkdir -p {tmp}/missing"]),
    ("{tmp}/missing/study.journal", ["the folder {tmp}/missing does not exist"]),
    ("{tmp}", ["is a folder", "{tmp}/study.journal"]),
])
def test_bad_storage_is_one_error_line(tmp_path, capsys, storage, expected):
    out = tmp_path / "sweep"
    storage = storage.format(tmp=tmp_path)
    code, stdout, err = _run(capsys, "ldpruning", "--param", "rho", "--storage", storage, "--out", str(out))
    line = _one_error_line(err)
    assert code == 2
    assert f"--storage {storage}" in line
    for text in expected:
        assert text.format(tmp=tmp_path) in line, line
    assert not (tmp_path / "missing").exists()  # nothing created for a path that was refused
    assert not (out / "arms").exists()  # refused before the baseline was generated


def test_read_only_journal_is_one_error_line(tmp_path, capsys, monkeypatch):
    """A journal on a read-only file system (simulated: the tests run as root, which writes through chmod)."""
    journal = tmp_path / "ro" / "study.journal"
    journal.parent.mkdir()
    real_open = builtins.open

    def read_only_fs(file, mode="r", *args, **kwargs):
        if Path(str(file)).resolve().parent == journal.parent.resolve() and any(c in mode for c in "wax+"):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only_fs)
    code, stdout, err = _run(capsys, "ldpruning", "--param", "rho", "--storage", str(journal), "--out",
                             str(tmp_path / "sweep"))
    line = _one_error_line(err)
    assert code == 2 and f"cannot write {journal} (Read-only file system)" in line, line
    assert not (tmp_path / "sweep" / "arms").exists()


@pytest.mark.parametrize("param, expected", [
    ("tau=abc", ["--param tau=abc", "cannot read 'abc'", "low:high"]),
    ("tau=0.5:abc", ["--param tau=0.5:abc", "cannot read 'abc'"]),
    ("taux", ["reads 'taux'", "Did you mean 'schedule.tau'"]),
    ("schedule.tua", ["reads 'schedule.tua'", "Did you mean 'schedule.tau'"]),
])
def test_bad_param_is_one_error_line(tmp_path, capsys, param, expected):
    code, stdout, err = _run(capsys, "nova", "--param", param, "--out", str(tmp_path / "sweep"))
    line = _one_error_line(err)
    assert code == 2
    for text in expected:
        assert text in line, line
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("args, expected", [
    (["tau", "--values", "0.5,abc"], ["--values 0.5,abc", "cannot read", "separate the values with spaces"]),
    (["tau", "--values", "abc"], ["--values abc", "cannot read 'abc'"]),
    (["taux", "--values", "0.5"], ["no method preset has a knob 'taux'", "Did you mean 'tau'"]),
    (["rhoo", "--values", "0.5"], ["Did you mean 'rho'"]),
])
def test_sensitivity_shares_the_checks(tmp_path, capsys, args, expected):
    """``studies.sensitivity`` resolves its field and values through the same knob parsing as the sweep."""
    from studies.sensitivity import main as sensitivity_main

    code = run_cli(sensitivity_main, args + ["--model", "official-tiny", "--samples", "2", "--wandb", "disabled",
                                             "--out", str(tmp_path / "sens")])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2
    for text in expected:
        assert text in line, line
    assert not (tmp_path / "sens").exists()
