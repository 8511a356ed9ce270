"""Progress output that stays readable in a log: whole lines, no carriage returns, when the output is not a
terminal; Lightning's bar only on a terminal."""

from __future__ import annotations

import io

from var_core.eval.lightning import ConditionSet, PlainProgress, progress_callback, run_generation


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_file_gets_plain_lines_and_a_terminal_the_bar(monkeypatch):
    from lightning.pytorch.callbacks import TQDMProgressBar

    monkeypatch.delenv("VARSCOPE_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert isinstance(progress_callback("x"), PlainProgress)
    monkeypatch.setattr("sys.stderr", _Terminal())
    assert isinstance(progress_callback("x"), TQDMProgressBar)
    monkeypatch.setenv("VARSCOPE_PROGRESS", "plain")  # forced either way
    assert isinstance(progress_callback("x"), PlainProgress)
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.setenv("VARSCOPE_PROGRESS", "bar")
    assert isinstance(progress_callback("x"), TQDMProgressBar)


def test_generation_to_a_file_writes_lines_without_carriage_returns(tiny_adapter, monkeypatch):
    monkeypatch.delenv("VARSCOPE_PROGRESS", raising=False)
    out, err = io.StringIO(), io.StringIO()  # like `> log 2>&1`: neither is a terminal
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setattr("sys.stderr", err)
    run = run_generation(tiny_adapter, ConditionSet.balanced(3, 10, 0), batch_size=1, warmup=0, threads=1,
                         progress="[1/2] arm-x")
    assert run is not None and len(run) == 3
    text = out.getvalue() + err.getvalue()
    assert "\r" not in text
    lines = [line for line in out.getvalue().splitlines() if line.startswith("[1/2] arm-x:")]
    # the first batch, then (the run lasts well under the 30 s interval) the last one: 1/3 and 3/3, not 2/3
    assert [line.split(",")[0] for line in lines] == ["[1/2] arm-x: batch 1/3", "[1/2] arm-x: batch 3/3"]
    assert ", 1 images," in lines[0] and ", 3 images," in lines[1]
    assert "ETA" in lines[0] and "ETA" not in lines[1]


def test_every_batch_is_reported_with_a_zero_interval(tiny_adapter, monkeypatch):
    """The interval bounds how often a line is written: at 0 each finished batch gets its line."""
    stream = io.StringIO()

    def plain(description, stream_=None):
        return PlainProgress(description, every_seconds=0.0, stream=stream)

    monkeypatch.setattr("var_core.eval.lightning.progress_callback", plain)
    run_generation(tiny_adapter, ConditionSet.balanced(3, 10, 0), batch_size=1, warmup=0, threads=1, progress="p")
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["p: batch 1/3", "p: batch 2/3", "p: batch 3/3"]
    assert "\r" not in stream.getvalue()
