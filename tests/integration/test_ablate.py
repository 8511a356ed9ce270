"""``python -m studies.ablate`` end to end on official-tiny: --set errors, outputs, resume, interruption, W&B,
validate. Small: 4 samples per arm, batch 2."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")

from ablations import build_arms  # noqa: E402
from ablations.overrides import OverrideError, apply_overrides, parse_overrides  # noqa: E402
from ablations.runner import StudyOptions, plan_study, run_study  # noqa: E402
from studies import ablate  # noqa: E402
from var_core.eval import records as rec  # noqa: E402

SMALL = dict(model="official-tiny", samples=4, batch_size=2, warmup=0, progress=False, seed=1, threads=1)
# NOVA's default inflection test (t_est=5, alpha=0.5) never fires on official-tiny's 7 scales, so its arms would
# compute every token; testing the magnitude of the growth against the early growth g_2 alone with alpha=1 fires
# from scale 3 on for 3 of the 4 samples of this sample set (activation scales 3, 3, 7 = never, 3): the study arm
# really prunes. (The signed test, NOVA's default since issue 12, gives 7, 7, 3, 3 here.)
PRUNING = ("activation.t_est=2", "activation.alpha=1.0", "activation.growth_test=magnitude")


# ----- --set -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("item, message", [
    ("schedule.tauu=0.7", "Did you mean 'schedule.tau'"),
    ("foo=1", "Valid keys for these arms: "),
    ("schedule.tau=abc", "cannot read 'abc' as"),
    ("schedule.tau=1.5", "out of range"),
    ("granularity=layer", "is not one of"),
    ("min_keep=0", "out of range"),
    ("notakey", "expected key=value"),
])
def test_set_errors_before_anything_runs(item, message, capsys, tmp_path):
    code = ablate.main(["scorer", "--model", "official-tiny", "--out", str(tmp_path / "x"), "--set", item])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert not (tmp_path / "x").exists()  # nothing ran, nothing written


def test_set_applies_to_matching_arms_only():
    arms = build_arms("scorer")
    out = apply_overrides(arms, parse_overrides(["schedule.tau=0.7", "granularity=branch",
                                                 "scorer.extractor=sobel"]))
    by = {a.name: a for a in out}
    assert by["baseline"].config == arms[0].config  # the reference is never changed
    assert all(by[n].config.schedule.tau == 0.7 and by[n].config.granularity == "branch" for n in by if n != "baseline")
    assert by["lhep@tau=0.8"].config.scorer.extractor == "sobel"
    assert "scorer.extractor=sobel" in by["lhep@tau=0.8"].changes
    assert "scorer.extractor" not in by["mse@tau=0.8"].changes
    with pytest.raises(OverrideError, match="schedule.tau"):
        apply_overrides(arms, parse_overrides(["schedule.tua=1"]))


def test_unknown_family_and_arm(capsys, tmp_path):
    assert ablate.main(["scorr"]) == 2
    assert "Did you mean 'scorer'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown arm"):
        plan_study(StudyOptions(family="cache", arms=("nope",), **SMALL))


# ----- a real run ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def study_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("ablate") / "cache"
    result = run_study(StudyOptions(family="cache", out=str(out), arms=("identity@t_est=5",), wandb="disabled",
                                    overrides=PRUNING, **SMALL), log=lambda s: None)
    assert result.computed == ["baseline", "identity@t_est=5"] and result.reused == []
    return out


def test_outputs_are_complete_and_self_describing(study_dir):
    manifest = json.loads((study_dir / "study.json").read_text())
    assert manifest["status"] == "complete" and manifest["family"] == "cache"
    records = [rec.read_record(p) for p in sorted((study_dir / "arms").glob("*.json"))]
    assert len(records) == 2 and all(records)
    for r in records:
        rec.validate_record(r)
        env = r["environment"]
        for key in ("git", "packages", "device", "dtype", "attention_backend", "threads"):
            assert key in env
        assert r["timing"]["batch_size"] == 2 and r["timing"]["warmup_generations"] == 0
        assert "timed_region" in r["timing"] and len(r["timing"]["batches"]) == 2
        assert r["samples"]["n"] == 4 and len(r["samples"]["seeds"]) == 4
        assert r["summary"]["ms_per_image"]["n"] == 2
        assert len(r["metrics"]["per_scale"]["entropy"]) == 4
    arm = next(r for r in records if r["arm"] == "identity@t_est=5")
    assert arm["policy"]["restorer"]["name"] == "identity"
    for key in ("psnr", "ssim", "ms_ssim", "token_agreement", "speedup"):
        assert arm["summary"][key]["n"] in (2, 4) and arm["summary"][key]["mean"] is not None
    assert "flops_ratio" in arm["summary"] and "memory_ratio" in arm["summary"]
    # the arm prunes: dense before the first activation scale, fewer tokens from there on
    assert arm["metrics"]["activation_scale"] == [3, 3, 7, 3]
    kept = arm["metrics"]["per_scale"]["kept_fraction"]
    assert kept[:3] == [1.0, 1.0, 1.0] and all(k < 1.0 for k in kept[3:]), kept
    base = next(r for r in records if r["role"] == "baseline")
    assert base["metrics"]["per_scale"]["kept_fraction"] == [1.0] * 7
    ratio = arm["timing"]["flops_per_image"] / base["timing"]["flops_per_image"]
    assert ratio < 1.0 and arm["summary"]["flops_ratio"]["mean"] == pytest.approx(ratio, rel=1e-12)
    # and so its images differ from the baseline's (3 of 4 samples pruned; the never-activated one is identical)
    assert arm["metrics"]["per_sample"]["identical"] == [0.0, 0.0, 1.0, 0.0]
    assert arm["summary"]["psnr"]["mean"] < 100.0
    assert "class_correct" in arm["metrics"]["unavailable"]  # official-tiny is not the testbed
    assert "breakdown_ms_per_image" in arm["timing"]
    table = (study_dir / "table.md").read_text()
    assert "| arm | n |" in table and "identity@t_est=5" in table and "Timed region" in table
    import pandas as pd

    frame = pd.read_csv(study_dir / "table.csv")
    assert list(frame["arm"]) == ["baseline", "identity@t_est=5"] and set(frame["n"]) == {4}
    for col in ("psnr_low", "psnr_high", "psnr_n", "speedup", "ms_per_image_low"):
        assert col in frame.columns
    for plot in ("speed_quality", "entropy_per_scale", "token_agreement"):
        assert (study_dir / "plots" / f"{plot}.png").is_file()
    assert (study_dir / "grids" / "overview.png").is_file()
    interleaved = json.loads((study_dir / "timing_interleaved.json").read_text())
    assert interleaved["rounds"] == 5 and interleaved["batch_size"] == 1 and set(interleaved["arms"]) == {"baseline", "identity@t_est=5"}
    assert "speedup_interleaved" in frame.columns and "speedup interleaved" in table
    assert (study_dir / "grids" / f"{rec.arm_slug('identity@t_est=5')}.png").is_file()
    assert not (study_dir / "wandb").exists()  # disabled: W&B writes nothing


def test_resume_computes_only_missing_arms(study_dir):
    before = {p.name: p.stat().st_mtime_ns for p in (study_dir / "arms").glob("*.json")}
    # PRUNING moves the activation to scale 3, so the static cache (paired with t_est=5 at scale 5) must move before
    # it; left at 5 its first restore raises CacheMissError (never a silent identity)
    result = run_study(StudyOptions(family="cache", out=str(study_dir), wandb="disabled",
                                    overrides=PRUNING + ("restorer.cache_scale=2",),
                                    arms=("identity@t_est=5", "static_cache@t_est=5"), **SMALL), log=lambda s: None)
    assert result.reused == ["baseline", "identity@t_est=5"]
    assert result.computed == ["static_cache@t_est=5"]
    for name, mtime in before.items():
        assert (study_dir / "arms" / name).stat().st_mtime_ns == mtime  # finished arms untouched


def test_wandb_offline_run_files(study_dir, tmp_path):
    result = run_study(StudyOptions(family="cache", out=str(study_dir), wandb="offline", overrides=PRUNING,
                                    arms=("identity@t_est=5",), **SMALL), log=lambda s: None)
    assert result.computed == []  # everything reused; only the report and the W&B mirror are written
    run_dir = result.outputs["wandb"]
    assert run_dir and os.path.isdir(run_dir)
    assert list((study_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert not (tmp_path / "home-should-stay-empty").exists()


def test_interrupted_run_keeps_finished_arms(tmp_path, monkeypatch):
    import ablations.runner as runner

    real = runner.run_generation
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the second arm
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_generation", flaky)
    options = StudyOptions(family="cache", out=str(tmp_path / "run"), wandb="disabled",
                           arms=("identity@t_est=5",), **SMALL)
    with pytest.raises(KeyboardInterrupt):
        run_study(options, log=lambda s: None)
    arms_dir = tmp_path / "run" / "arms"
    assert rec.read_record(arms_dir / "baseline.json") is not None
    assert not (arms_dir / f"{rec.arm_slug('identity@t_est=5')}.json").exists()
    assert not list(arms_dir.glob("*.tmp")) and not list(arms_dir.glob(".*.tmp"))
    monkeypatch.setattr(runner, "run_generation", real)
    result = run_study(options, log=lambda s: None)
    assert result.reused == ["baseline"] and result.computed == ["identity@t_est=5"]


# ----- ls / validate -------------------------------------------------------------------------------------------
def test_ls_lists_families_components_and_presets(capsys):
    assert ablate.main(["ls"]) == 0
    out = capsys.readouterr().out
    for word in ("scorer", "linkage", "options", "entropy", "residual_reuse", "nova", "fastvar", "Presets"):
        assert word in out


def test_validate_passes(capsys):
    code = ablate.main(["validate", "--family", "cache", "--family", "guidance", "--max-scales", "5",
                        "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "0 failed" in out and "ok   evaluator" in out


@pytest.mark.slow
def test_validate_every_family(capsys):
    code = ablate.main(["validate", "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 0, out


def test_ctrl_c_inside_trainer_predict_keeps_finished_arms(tmp_path, monkeypatch):
    """A KeyboardInterrupt in the middle of an arm's batches: Lightning shuts down (SystemExit); the arms
    finished before stay valid and a re-run computes only the rest."""
    import signal

    import ablations.probes as probes

    real = probes.ProfilerProbe.after_batch
    calls = {"n": 0}

    def interrupting(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # second arm, first batch (the baseline has two batches)
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(probes.ProfilerProbe, "after_batch", interrupting)
    options = StudyOptions(family="cache", out=str(tmp_path / "run"), wandb="disabled", timing_rounds=0,
                           arms=("identity@t_est=5",), **SMALL)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises((SystemExit, KeyboardInterrupt)):
            run_study(options, log=lambda s: None)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores SIGINT while it shuts down
    arms_dir = tmp_path / "run" / "arms"
    assert rec.read_record(arms_dir / "baseline.json") is not None
    assert not (arms_dir / f"{rec.arm_slug('identity@t_est=5')}.json").exists()
    monkeypatch.setattr(probes.ProfilerProbe, "after_batch", real)
    result = run_study(options, log=lambda s: None)
    assert result.reused == ["baseline"] and result.computed == ["identity@t_est=5"]


def test_changed_metric_context_recomputes_metrics_not_samples(tmp_path):
    """E.g. another FID input pipeline after a run: the arms are not regenerated, their metrics are. (A classifier
    named by --classifier that cannot load is an error now, not a changed context: test_bad_input_files.)"""
    options = dict(family="cache", out=str(tmp_path / "run"), wandb="disabled", timing_rounds=0, plots=False,
                   arms=("identity@t_est=5",), **SMALL)
    first = run_study(StudyOptions(**options), log=lambda s: None)
    assert first.computed == ["baseline", "identity@t_est=5"]
    before = rec.read_record(rec.record_paths(tmp_path / "run", "identity@t_est=5")[0])
    again = run_study(StudyOptions(fid_protocol="pytorch-fid", **options), log=lambda s: None)
    assert again.computed == [] and again.reused == ["baseline", "identity@t_est=5"]
    after = rec.read_record(rec.record_paths(tmp_path / "run", "identity@t_est=5")[0])
    assert after["metrics_refreshed"] and after["timing"] == before["timing"]
    assert after["metrics"]["signature"] != before["metrics"]["signature"]
    assert after["metrics"]["per_sample"]["psnr"] == before["metrics"]["per_sample"]["psnr"]
    assert after["metrics"]["signature"]["fid_protocol"] == "pytorch-fid"


def test_method_family_on_infinity_tiny_end_to_end(tmp_path):
    """The whole pipeline on the text-to-image family: every preset that fits the 5-scale schedule runs (with FLOPs
    from the recorded text length); ToProVAR's paper s_rep=6 does not fit and is reported with its fix, and
    ``--set schedule.s_rep=3`` makes it run."""
    options = dict(model="random:infinity-tiny", samples=2, batch_size=2, warmup=0, progress=False, seed=0,
                   threads=1, wandb="disabled", plots=False, timing_rounds=0, family="method")
    logs: list[str] = []
    result = run_study(StudyOptions(out=str(tmp_path / "a"), **options), log=logs.append)
    assert [a.name for a in result.unavailable] == ["toprovar", "code"]
    assert "--set schedule.s_rep=" in result.unavailable[0].error
    assert "testbed-small" in result.unavailable[1].error  # CoDe's refiner is a VAR testbed: named, not run
    assert {r["arm"] for r in result.records} == {"baseline", "nova", "fastvar", "fastvar_toprovar", "ldpruning",
                                                  "ldpruning_skip", "sparsevar", "skipvar", "stagevar", "stepvar",
                                                  "scalekv", "hack", "sparvar"}
    fastvar = next(r for r in result.records if r["arm"] == "fastvar")  # recorded as resolved for Infinity
    assert fastvar["policy"]["schedule"]["widths"] == [32, 40, 48, 64] and fastvar["policy"]["per_model"] == ""
    for record in result.records:
        assert record["metrics"]["set_level"] is not None
        assert record["timing"].get("flops_per_image"), record["timing"]
    fixed = run_study(StudyOptions(out=str(tmp_path / "b"), arms=("toprovar",), overrides=("schedule.s_rep=3",),
                                   **options), log=logs.append)
    assert not fixed.unavailable and {r["arm"] for r in fixed.records} == {"baseline", "toprovar"}


def test_only_the_first_generation_of_a_process_warms_with_a_full_batch(tmp_path):
    """A full-batch warm-up per arm was a third of the default study; the process is warm at the timed shapes
    after the first arm, so later arms warm with one sample (and their records say so)."""
    out = tmp_path / "warm"
    options = dict(SMALL, warmup=1, batch_size=2)
    run_study(StudyOptions(family="cache", out=str(out), arms=("identity@t_est=5",), wandb="disabled",
                           overrides=PRUNING, **options), log=lambda s: None)
    records = {r["arm"]: r for r in (rec.read_record(p) for p in sorted((out / "arms").glob("*.json")))}
    assert records["baseline"]["timing"]["warmup_batch_size"] == 2
    assert records["identity@t_est=5"]["timing"]["warmup_batch_size"] == 1
