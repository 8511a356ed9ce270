"""The house plan of ``studies/`` (issue 17; DESIGN.md: "studies/ holds no logic a test would need"): every entry
point is a short command line over one library call, so no file there is longer than 250 lines."""

from __future__ import annotations

from pathlib import Path

STUDIES = Path(__file__).resolve().parents[2] / "studies"
MAX_LINES = 250


def test_the_line_counter_counts_lines(tmp_path):
    (tmp_path / "x.py").write_text("a = 1\n\nb = 2\n")  # three lines, the last one ended by its newline
    assert _lines(tmp_path / "x.py") == 3
    (tmp_path / "y.py").write_text("a = 1\nb = 2")  # no newline at the end: still two lines
    assert _lines(tmp_path / "y.py") == 2


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_every_studies_file_is_at_most_250_lines():
    files = sorted(STUDIES.glob("*.py"))
    assert len(files) > 10  # the folder was found
    too_long = {p.name: _lines(p) for p in files if _lines(p) > MAX_LINES}
    assert too_long == {}, f"move the library parts of {sorted(too_long)} into profilers/, ablations/ or sweeps/"
