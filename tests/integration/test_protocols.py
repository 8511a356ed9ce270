"""The papers' protocols from ``varscope ablate`` (issue 26): ``--fid-reference`` (an .npz made from the testbed's
training images, and a per-category folder: per-category columns, read back by ``varscope report``), the
``--protocol imagenet-50k`` preset, ``--aspect`` on Infinity's schedule, ``--more-smooth`` recorded, and one-line
errors (exit 2) for every impossible combination."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")

from studies import ablate, cli, report  # noqa: E402
from studies._cli import run_cli  # noqa: E402
from studies._evaluation_cli import protocol_settings  # noqa: E402

FAST = ["--arms", "baseline", "--samples", "20", "--batch-size", "20", "--timing-rounds", "0", "--threads", "1",
        "--wandb", "disabled", "--no-plots", "--no-progress", "--warmup", "0"]


def _records(out):
    return {r["arm"]: r for r in (json.loads(p.read_text()) for p in sorted((out / "arms").glob("*.json")))}


def test_fid_reference_npz_then_per_category_folder(tmp_path, capsys):
    flat, per_cat, npz = tmp_path / "tb", tmp_path / "tb_cat", tmp_path / "tb.npz"
    assert cli.dispatch(["fid-reference", "export-testbed", str(flat), "--per-class", "6"]) == 0
    assert cli.dispatch(["fid-reference", "export-testbed", str(per_cat), "--per-class", "6", "--per-category"]) == 0
    assert len(list(flat.glob("*.png"))) == 60 and len(list((per_cat / "photo").glob("*.png"))) == 6
    assert cli.dispatch(["fid-reference", "make", str(flat), str(npz), "--threads", "1"]) == 0
    out = tmp_path / "study"
    capsys.readouterr()
    assert ablate.main(["method", "--model", "testbed", "--fid-reference", str(npz), "--out", str(out), *FAST]) == 0
    printed = capsys.readouterr().out
    assert "| FID vs ref (testbed-classifier) |" in printed  # the column names its feature space
    base = _records(out)["baseline"]
    entry = base["summary"]["fid_ref"]
    assert base["protocol"]["fid_reference"]["sha256"] == hashlib.sha256(npz.read_bytes()).hexdigest()
    assert base["protocol"]["fid_reference"]["n_reference"] == {"all": 60} and entry["n"] == 20
    assert entry["n_reference"] == 60 and entry["feature_space"] == "testbed-classifier"
    # the same images as a per-category folder: the metrics are recomputed from the stored samples (the reference
    # is part of the metric signature), "all" is the same statistics, and one column per class appears
    assert ablate.main(["method", "--model", "testbed", "--fid-reference", str(per_cat), "--out", str(out),
                        *FAST]) == 0
    printed = capsys.readouterr().out
    assert "FID vs ref [photo]" in printed and "FID vs ref [wood_grain]" in printed
    base2 = _records(out)["baseline"]
    assert base2["summary"]["fid_ref"]["mean"] == pytest.approx(entry["mean"], rel=1e-5)  # batch-order float noise
    assert base2["summary"]["fid_ref_photo"]["n"] == 2 and base2["summary"]["fid_ref_photo"]["n_reference"] == 6
    assert base2["protocol"]["fid_reference"]["kind"] == "folder"
    (out / "table.md").unlink()
    assert report.main([str(out)]) == 0
    table = (out / "table.md").read_text()
    assert "FID vs ref [photo]" in table and "FID vs ref: FID vs reference (testbed-classifier)" in table


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "testbed", "--aspect", "0.5"], "square images only (valid --aspect: 1)"),
    (["--model", "random:infinity-tiny", "--aspect", "0.7"], "valid: 0.333, 0.4, 0.5"),
    (["--model", "random:infinity-tiny", "--resolution", "2048"], "valid: 0.06M (256px)"),
    (["--model", "random:infinity-tiny", "--protocol", "imagenet-50k"], "is text-to-image"),
    (["--model", "testbed", "--fid-reference", "/nonexistent/ref.npz"], "no such file or folder"),
    (["--model", "testbed", "--prompts-rewritten", "/nonexistent.txt"], "no such file"),
])
def test_impossible_protocol_is_one_error_line(argv, fragment, capsys, tmp_path):
    rc = run_cli(ablate.main, ["method", *argv, "--out", str(tmp_path / "o"), *FAST])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err and lines[0].startswith("error:") and len(lines) <= 3, err
    assert fragment in err, err
    assert not (tmp_path / "o" / "arms").exists()


def test_reference_of_other_features_and_more_smooth_on_var_are_refused(tmp_path, capsys):
    import numpy as np

    np.savez(tmp_path / "inception.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    for extra, fragment in ((["--fid-reference", str(tmp_path / "inception.npz")], "2048-d statistics"),
                            (["--no-more-smooth"], "HART's Gumbel smoothing")):
        rc = run_cli(ablate.main, ["method", "--model", "testbed", *extra, "--out", str(tmp_path / "o"), *FAST])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err and err.startswith("error:") and fragment in err, err
        assert not list((tmp_path / "o").glob("arms/*.json"))


def test_imagenet_50k_preset_expands_on_the_testbed():
    args = ablate.build_parser().parse_args(["method", "--model", "testbed", "--protocol", "imagenet-50k"])
    settings = protocol_settings(args)
    assert (args.samples, args.cfg, args.top_k, args.top_p) == (500, 1.5, 900, 0.96)  # 50 x 10 classes
    assert settings["protocol"] == "imagenet-50k"
    args = ablate.build_parser().parse_args(["method", "--model", "testbed", "--protocol", "imagenet-50k",
                                             "--samples", "40"])
    protocol_settings(args)
    assert args.samples == 40 and args.top_k == 900  # an explicit flag wins (recorded as a deviation)


def test_aspect_gives_infinity_the_transposed_template():
    from ablations.runner import load_study_model

    # dynamic_resolution's h/w = 2 template starts (1,1) (2,2) (4,2) (6,3) (10,5): h/w = 0.5 is its transpose
    adapter = load_study_model("random:infinity-tiny", None, aspect=0.5)
    assert adapter._scale_hw == ((1, 1), (2, 2), (2, 4), (3, 6), (5, 10))


def test_no_more_smooth_is_recorded_on_hart(tmp_path):
    from ablations.runner import StudyOptions, run_study

    out = tmp_path / "hart"
    run_study(StudyOptions(family="method", model="random:hart-tiny", samples=2, batch_size=2, warmup=0,
                           progress=False, threads=1, timing_rounds=0, wandb="disabled", plots=False,
                           grid_samples=2, arms=("baseline",), more_smooth=False, out=str(out)), log=lambda s: None)
    base = _records(out)["baseline"]
    assert base["sampling"]["more_smooth"] is False and base["protocol"]["more_smooth"] is False


def test_rewritten_prompts_and_resolution_on_infinity_tiny(tmp_path):
    from ablations.runner import StudyOptions, run_study

    rows = [{"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
            {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a red car"}]
    meta = tmp_path / "evaluation_metadata.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewritten = tmp_path / "rewritten.txt"
    rewritten.write_text("a detailed photo of a single cat\na shiny red car\n")
    out = tmp_path / "inf"
    run_study(StudyOptions(family="method", model="random:infinity-tiny", samples=2, batch_size=2, warmup=0,
                           progress=False, threads=1, timing_rounds=0, wandb="disabled", plots=False, grid_samples=2,
                           arms=("baseline",), prompts=str(meta), prompts_rewritten=str(rewritten),
                           resolution="256", save_images=True, out=str(out)), log=lambda s: None)
    base = _records(out)["baseline"]
    assert base["protocol"]["prompts_rewritten"] == str(rewritten)
    assert base["protocol"]["prompts_rewritten_sha256"] == hashlib.sha256(rewritten.read_bytes()).hexdigest()
    assert base["model"]["num_scales"] == 7  # pn 0.06M: 7 scales, 16 x 16 tokens last = 256 px
    assert "a shiny red car" in json.dumps(base["samples"])  # generated from the rewritten text ...
    geneval = out / "images" / "baseline" / "geneval"
    lines = [json.loads(p.read_text()) for p in sorted(geneval.glob("*/metadata.jsonl"))]
    assert rows[1] in lines and rows[0] in lines  # ... while GenEval's evaluator reads the original rows


def test_fid_reference_make_errors_are_one_line(tmp_path, capsys):
    from studies.cli import main

    (tmp_path / "one").mkdir()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(tmp_path / "one" / "a.png")
    for argv, fragment in (([str(tmp_path), str(tmp_path / "x.npz"), "--model", "infinity-2b"], "--inception-weights"),
                           ([str(tmp_path / "one"), str(tmp_path / "x.npz")], "need at least 2")):
        rc = main(["fid-reference", "make", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error:") and "Traceback" not in err and fragment in err, err
    assert not (tmp_path / "x.npz").exists()


def test_another_aspect_is_not_reused_from_the_square_run(tmp_path):
    from ablations.runner import StudyOptions, run_study

    kw = dict(family="method", model="random:infinity-tiny", samples=2, batch_size=2, warmup=0, progress=False,
              threads=1, timing_rounds=0, wandb="disabled", plots=False, grid_samples=2, arms=("baseline",),
              out=str(tmp_path / "o"))
    run_study(StudyOptions(**kw), log=lambda s: None)
    again = run_study(StudyOptions(**kw), log=lambda s: None)
    assert again.reused == ["baseline"]
    wide = run_study(StudyOptions(aspect=0.5, **kw), log=lambda s: None)
    assert wide.computed == ["baseline"] and wide.reused == []  # a 1:2 schedule is another generation
    assert _records(tmp_path / "o")["baseline"]["protocol"]["aspect"] == 0.5
