"""Bad inputs to ``python -m studies.report``: one ``error:`` line naming the file (and line or key), exit 2,
nothing in the folder changed — or, for a damaged file the table can do without, a warning naming it and the
rest of the report. One tiny study (official-tiny, baseline + FastVAR, 2 samples) is copied for every case."""

from __future__ import annotations

import builtins
import errno
import io
import json
import shutil
from pathlib import Path

import pytest

from studies._cli import run_cli
from studies.report import main

STUDY = dict(family="method", arms=("fastvar",), model="official-tiny", samples=2, batch_size=2, warmup=0,
             progress=False, seed=1, threads=1, wandb="disabled", plots=False, timing_rounds=2, timing_batch=1,
             grid_samples=2)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from ablations.runner import StudyOptions, run_study

    out = tmp_path_factory.mktemp("report_errors") / "method"
    run_study(StudyOptions(out=str(out), **STUDY), log=lambda s: None)
    return out


@pytest.fixture
def folder(study, tmp_path):
    copy = tmp_path / "method"
    shutil.copytree(study, copy)
    return copy


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _report(capsys, *args: str) -> tuple[int, str, str]:
    code = run_cli(main, [*args, "--no-plots"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _geneval_line(arm: str, prompt: int, image: int, tag="single_object", correct=True) -> str:
    return json.dumps({"filename": f"out/images/{arm}/geneval/{prompt:05d}/samples/{image:04d}.png", "tag": tag,
                       "prompt": "a photo of a cat", "correct": correct, "reason": "", "metadata": "{}"}) + "\n"


def _write_import(tmp_path: Path, case: str) -> tuple[str, Path, list[str]]:
    """(kind, file, texts the error line must hold)."""
    if case == "binary geneval":
        path = tmp_path / "geneval.jsonl"
        path.write_bytes(_geneval_line("fastvar", 0, 0).encode() + b"\x89PNG\r\n\x1a\n\xff\xfe\x00garbage\n")
        return "geneval", path, [f"{path}:2 is not UTF-8 text", "binary"]
    if case == "binary dpg":
        path = tmp_path / "dpg.csv"
        path.write_bytes(b"id,score\nimages/fastvar/0.png,0.5\n\xff\xd8\xff\xe0 JFIF")
        return "dpg", path, [f"{path} is not UTF-8 text", "binary"]
    if case == "nul dpg":
        path = tmp_path / "dpg.csv"
        path.write_bytes(b"id,score\nimages/fastvar/0.png,0.5\nimages/fastvar/1.png\x00,0.5\n")
        return "dpg", path, [f"{path}:3 holds a NUL byte"]
    if case in ("list tag", "dict tag"):
        path = tmp_path / "geneval.jsonl"
        tag = ["single_object"] if case == "list tag" else {"task": "colors"}
        path.write_text(_geneval_line("fastvar", 0, 0) + _geneval_line("fastvar", 1, 0, tag=tag))
        return "geneval", path, [f"{path}:2: 'tag' must be a string", type(tag).__name__]
    if case == "300000 geneval lines":  # more images than the arm generated (2)
        path = tmp_path / "geneval.jsonl"
        path.write_text("".join(_geneval_line("fastvar", i // 4, i % 4) for i in range(300_000)))
        return "geneval", path, [f"{path}: 300000 images for arm 'fastvar', but it generated 2 samples"]
    if case == "300000 dpg lines":
        path = tmp_path / "dpg.csv"
        path.write_text("".join(f"images/fastvar/{i:06d}.png,{i % 7 / 7}\n" for i in range(300_000)))
        return "dpg", path, [f"{path}: 300000 prompts for arm 'fastvar', but it generated 2 samples"]
    if case == "300000 garbage lines":
        path = tmp_path / "geneval.jsonl"
        path.write_text("".join(f"line {i} of something else\n" for i in range(300_000)))
        return "geneval", path, [f"{path}:1 is not JSON"]
    if case == "repeated line":
        path = tmp_path / "geneval.jsonl"
        path.write_text(_geneval_line("fastvar", 0, 0) * 2)
        return "geneval", path, [f"{path}:", "appears twice for arm 'fastvar'"]
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["binary geneval", "binary dpg", "nul dpg", "list tag", "dict tag",
                                  "300000 geneval lines", "300000 dpg lines", "300000 garbage lines",
                                  "repeated line"])
def test_bad_import_file_is_one_error_line(folder, tmp_path, capsys, case):
    kind, path, expected = _write_import(tmp_path, case)
    before = _snapshot(folder)
    code, out, err = _report(capsys, str(folder), "--import", kind, str(path))
    line = _one_error_line(err)
    assert code == 2
    for text in expected:
        assert text in line, line
    assert _snapshot(folder) == before  # nothing written, nothing lost
    assert not (folder / "imports").exists()


def test_an_import_says_what_it_imported(folder, tmp_path, capsys):
    path = tmp_path / "geneval.jsonl"
    path.write_text(_geneval_line("fastvar", 0, 0, correct=True) + _geneval_line("fastvar", 1, 0, correct=False)
                    + _geneval_line("other_arm", 0, 0))
    code, out, err = _report(capsys, str(folder), "--import", "geneval", str(path))
    assert code == 0, err
    assert f"imported geneval: {path}: 3 results, 2 into 1 arm(s), 1 matched no arm" in out
    assert "imported geneval: fastvar: overall 0.5 " in out  # 1 of 2 single-object images correct


@pytest.mark.parametrize("entry, expected", [
    ({"n_prompts": 3}, "arm 'fastvar' has no 'summary' object"),
    ({"n_prompts": 3, "summary": {"dpg_overall": {"mean": "83.4", "low": 80.0, "high": 86.0, "n": 3}}},
     "arm 'fastvar': summary.dpg_overall.mean is '83.4' (str), not a number"),
    ({"n_prompts": "3", "summary": {}}, "arm 'fastvar': 'n_prompts' is '3' (str), not a count"),
])
def test_damaged_import_file_is_one_error_line(folder, capsys, entry, expected):
    side = folder / "imports" / "dpg.json"
    side.parent.mkdir()
    side.write_text(json.dumps({"schema": "varscope.import/1", "kind": "dpg", "arms": {"fastvar": entry},
                                "sources": []}))
    before = _snapshot(folder)
    code, out, err = _report(capsys, str(folder))
    line = _one_error_line(err)
    assert code == 2 and line.startswith(f"error: {side}: {expected}"), line
    assert _snapshot(folder) == before


def test_a_record_with_numbers_as_strings_is_listed_not_a_traceback(folder, capsys):
    path = folder / "arms" / "fastvar.json"
    record = json.loads(path.read_text())
    record["summary"]["psnr"]["mean"] = str(record["summary"]["psnr"]["mean"])
    path.write_text(json.dumps(record))
    code, out, err = _report(capsys, str(folder))
    assert code == 0 and "Traceback" not in err, err
    warning = f"warning: arm 'fastvar': cannot use its record {path} (summary.psnr.mean is "
    assert sum(line.startswith(warning) for line in out.splitlines()) == 1, out
    table = (folder / "table.md").read_text()
    assert "summary.psnr.mean" in table  # the table names the arm it cannot show, and why
    assert path.read_text() == json.dumps(record)  # the record is left as it was


def test_a_non_json_interleaved_timing_is_named_and_the_sequential_speedup_shown(folder, capsys):
    source = folder / "timing_interleaved.json"
    header = (folder / "table.md").read_text().splitlines()
    assert any("speedup interleaved" in line for line in header)  # the study's own table: the re-timing
    source.write_text("{ not json")
    code, out, err = _report(capsys, str(folder))
    assert code == 0 and "Traceback" not in err, err
    assert f"warning: cannot read {source} (JSONDecodeError" in out
    assert "speedup interleaved" not in (folder / "table.md").read_text()
    assert source.read_text() == "{ not json"  # left for the user to look at


def test_a_read_only_folder_is_one_error_line(folder, capsys, monkeypatch):
    """Simulated (the tests run as root, which writes through chmod): every write under the folder fails."""
    real_open = builtins.open
    root = folder.resolve()

    def read_only_fs(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, Path)) and any(c in mode for c in "wax+") and \
                Path(file).resolve().is_relative_to(root):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", read_only_fs)
    monkeypatch.setattr(io, "open", read_only_fs)
    before = _snapshot(folder)
    code, out, err = _report(capsys, str(folder))
    line = _one_error_line(err)
    assert code == 2 and "(Read-only file system)" in line and str(folder) in line, line
    monkeypatch.undo()
    assert _snapshot(folder) == before
