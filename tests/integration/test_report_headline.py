"""What the ablation table shows and keeps: one headline speedup column naming its timing, the interleaved
re-timing kept with the study (reused on resume, re-measured with ``--retime``, the record saying when and why),
and the overview grid's arm names drawn in the image.

One small study on ``official-tiny`` (4 samples, batch 2, 2 interleaved rounds of batch 1): baseline + FastVAR.
Numbers are checked against values computed here from the raw seconds the study saved; reuse is checked from the
measurement's id and timestamp, never from timing values.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

os.environ.setdefault("WANDB_MODE", "disabled")

from ablations.runner import StudyOptions, run_study  # noqa: E402
from var_core.eval import records as rec  # noqa: E402

STUDY = dict(family="method", arms=("fastvar",), model="official-tiny", samples=4, batch_size=2, warmup=0,
             progress=False, seed=1, threads=1, wandb="disabled", plots=False, timing_rounds=2, timing_batch=1,
             grid_samples=2)


def _run(out, **extra):
    return run_study(StudyOptions(out=str(out), **{**STUDY, **extra}), log=lambda s: None)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("headline") / "method"
    result = _run(out)
    assert result.computed == ["baseline", "fastvar"]
    return out


def _copy(study, tmp_path):
    copy = tmp_path / "method"
    shutil.copytree(study, copy)
    return copy


def _interleaved(out) -> dict:
    return json.loads((out / "timing_interleaved.json").read_text())


def _markdown_table(out) -> tuple[list[str], dict[str, list[str]]]:
    text = (out / "table.md").read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("| arm | n |"))
    end = next((i for i in range(start, len(text)) if not text[i].startswith("|")), len(text))
    lines = text[start:end]  # the arms' table (the Wilcoxon table follows further down)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("*")] = cells
    return header, rows


def _sequential_expected(out) -> float:
    base = rec.read_record(rec.record_paths(out, "baseline")[0])["timing"]["batches"]
    arm = rec.read_record(rec.record_paths(out, "fastvar")[0])["timing"]["batches"]
    assert [(b["first_index"], b["size"]) for b in base] == [(b["first_index"], b["size"]) for b in arm]
    return sum(b["seconds"] for b in base) / sum(b["seconds"] for b in arm)


# ----- the headline column -------------------------------------------------------------------------------------
def test_one_headline_speedup_column_is_the_interleaved_one(study):
    import pandas as pd

    timing = _interleaved(study)
    base, arm = timing["arms"]["baseline"]["seconds"], timing["arms"]["fastvar"]["seconds"]
    assert len(base) == len(arm) == 2
    expected = sum(base) / sum(arm)  # baseline round seconds over the arm's, paired by round
    header, rows = _markdown_table(study)
    speed = [h for h in header if h.startswith("speedup")]
    assert speed == ["speedup interleaved (b=1, 2 rounds)"]  # one headline column, naming its timing
    assert header[header.index(speed[0]) - 1].startswith("latency")  # right after the latency
    detail = header.index("seq. speedup (2 batches of 2)")  # the other timing: a detail column after it
    assert detail == header.index(speed[0]) + 1
    cell = rows["fastvar"][header.index(speed[0])]
    assert cell.startswith(f"{expected:.2f} [")  # with its bootstrap CI over rounds
    assert rows["fastvar"][detail].startswith(f"{_sequential_expected(study):.2f}")
    assert rows["baseline"][header.index(speed[0])] == "1 (ref)"
    text = (study / "table.md").read_text()
    assert "**Headline speedup: `speedup interleaved (b=1, 2 rounds)`**, the interleaved re-timing" in text
    assert timing["measured"]["id"] in text and timing["measured"]["at"] in text
    # table.csv: `speedup` (sequential) and `speedup_interleaved` keep their meaning; the headline repeats one
    frame = pd.read_csv(study / "table.csv").set_index("arm")
    assert frame.loc["fastvar", "speedup"] == pytest.approx(_sequential_expected(study), rel=1e-9)
    assert frame.loc["fastvar", "speedup_interleaved"] == pytest.approx(expected, rel=1e-9)
    assert frame.loc["fastvar", "speedup_headline"] == pytest.approx(expected, rel=1e-9)
    assert frame.loc["fastvar", "speedup_headline_low"] == frame.loc["fastvar", "speedup_interleaved_low"]
    assert frame.loc["fastvar", "speedup_headline_timing"] == "interleaved re-timing, batch 1, 2 rounds"
    assert frame.loc["baseline", "speedup_headline"] == 1.0


def test_without_a_re_timing_the_headline_is_the_sequential_speedup(study, tmp_path):
    import pandas as pd

    copy = _copy(study, tmp_path)
    (copy / "timing_interleaved.json").unlink()
    result = _run(copy, timing_rounds=0)
    assert result.computed == [] and "timing_interleaved_measured" not in result.outputs
    header, rows = _markdown_table(copy)
    speed = [h for h in header if "speedup" in h]
    assert speed == ["speedup sequential (2 batches of 2)"]
    expected = _sequential_expected(copy)
    assert rows["fastvar"][header.index(speed[0])].startswith(f"{expected:.2f}")
    assert "**Headline speedup: `speedup sequential (2 batches of 2)`**, the sequential main runs" in (
        copy / "table.md").read_text()
    frame = pd.read_csv(copy / "table.csv").set_index("arm")
    assert frame.loc["fastvar", "speedup_headline"] == pytest.approx(expected, rel=1e-9)
    assert frame.loc["fastvar", "speedup_headline_timing"] == "sequential main runs, 2 batches of 2"
    assert pd.isna(frame.loc["fastvar", "speedup_interleaved"])


# ----- the re-timing kept with the study -------------------------------------------------------------------------
def test_the_re_timing_records_what_it_covered(study):
    timing = _interleaved(study)
    covers = timing["covers"]
    assert sorted(covers["arms"]) == ["baseline", "fastvar"]
    for name in ("baseline", "fastvar"):  # each arm by its record key (config, model, sampling, sample set)
        assert covers["arms"][name] == rec.read_record(rec.record_paths(study, name)[0])["key"]
    assert (covers["rounds"], covers["batch_size"], covers["threads"], covers["device"]) == (2, 1, 1, "cpu")
    m = timing["measured"]
    assert m["reason"] == "first measurement in this folder" and len(m["id"]) == 12
    assert "sha" in m["git"] and m["at"].endswith("+00:00")
    assert "history" not in timing


def test_resume_reuses_the_re_timing_and_retime_re_measures_it(study, tmp_path):
    copy = _copy(study, tmp_path)
    first = _interleaved(copy)
    before = (copy / "timing_interleaved.json").read_bytes()

    result = _run(copy)  # a resume with the same arms and settings
    assert result.computed == [] and result.outputs["timing_interleaved_measured"]["reused"] is True
    assert result.outputs["timing_interleaved_measured"]["id"] == first["measured"]["id"]
    assert (copy / "timing_interleaved.json").read_bytes() == before  # not re-measured, not rewritten

    result = _run(copy, retime=True)
    again = _interleaved(copy)
    assert result.computed == [] and result.outputs["timing_interleaved_measured"]["reused"] is False
    assert again["measured"]["id"] != first["measured"]["id"]
    assert again["measured"]["at"] > first["measured"]["at"]  # ISO timestamps in UTC sort in time order
    assert again["measured"]["reason"] == "re-measured on request (--retime)"
    assert again["history"] == [first["measured"]]  # when and why the earlier one was taken
    assert again["measured"]["id"] in (copy / "table.md").read_text()

    _run(copy, timing_rounds=3)  # a changed setting re-measures, and says why
    third = _interleaved(copy)
    assert third["measured"]["reason"] == "rounds 2 -> 3" and third["rounds"] == 3
    assert [m["id"] for m in third["history"]] == [first["measured"]["id"], again["measured"]["id"]]


def test_a_changed_arm_set_re_measures(study, tmp_path):
    copy = _copy(study, tmp_path)
    first = _interleaved(copy)
    result = _run(copy, arms=("fastvar", "nova"))
    assert result.computed == ["nova"]
    timing = _interleaved(copy)
    assert timing["measured"]["reason"] == "arms added: nova"
    assert set(timing["arms"]) == {"baseline", "fastvar", "nova"} and timing["history"] == [first["measured"]]


def test_a_re_timing_without_its_coverage_is_re_measured(study, tmp_path):
    """A file from before the coverage was recorded cannot show it timed these arms: measured again."""
    copy = _copy(study, tmp_path)
    old = _interleaved(copy)
    for key in ("covers", "measured"):
        old.pop(key)
    (copy / "timing_interleaved.json").write_text(json.dumps(old))
    _run(copy)
    assert _interleaved(copy)["measured"]["reason"].startswith("the folder's measurement does not say what it")


# ----- the overview grid's labels -------------------------------------------------------------------------------
def test_overview_rows_carry_the_arm_names(study, tmp_path):
    import torch
    from PIL import Image

    from var_core.eval.images import save_grid
    from var_core.eval.lightning import GenerationRun

    assert (study / "grids" / "overview_rows.txt").read_text().split() == ["baseline", "fastvar"]
    overview = np.asarray(Image.open(study / "grids" / "overview.png").convert("RGB"))
    runs = [GenerationRun.load(rec.record_paths(study, n)[1]) for n in ("baseline", "fastvar")]
    plain = np.asarray(Image.open(save_grid(torch.cat([r.images[:2] for r in runs]), tmp_path / "plain.png",
                                            nrow=2)).convert("RGB"))  # 128-px images: no upscale
    margin = overview.shape[1] - plain.shape[1]
    assert margin > 20 and overview.shape[0] == plain.shape[0]
    assert np.array_equal(overview[:, margin:], plain)  # the samples, unchanged
    strip = overview[:, :margin].min(axis=2)
    for r in range(2):  # every row's band of the margin holds text (dark pixels on white)
        band = strip[2 + r * 130: 2 + r * 130 + 128]
        assert (band < 128).sum() > 30, f"row {r} has no label"
    arm_grid = np.asarray(Image.open(study / "grids" / "fastvar.png").convert("RGB"))
    assert arm_grid.shape[1] == overview.shape[1]  # the arm's grid: rows baseline, fastvar, labelled alike
    assert np.array_equal(arm_grid, overview)
