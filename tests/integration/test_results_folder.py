"""Issue 25: a results folder never loses finished work, never writes through a planted link, and says when a
timing or an arm cannot be trusted. Small: official-tiny, 2-3 samples, batch 2, no interleaved timing."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")

from ablations import loadwatch  # noqa: E402
from ablations.runner import StudyOptions, default_out_dir, run_study  # noqa: E402
from studies import report as report_cli  # noqa: E402
from studies._cli import run_cli  # noqa: E402
from var_core.eval import records as rec  # noqa: E402
from var_core.eval.lightning import ConditionSet, GenerationRun  # noqa: E402

ARM = "identity@t_est=5"
SMALL = dict(family="cache", model="official-tiny", samples=2, batch_size=2, warmup=0, progress=False, seed=1,
             threads=1, wandb="disabled", timing_rounds=0, plots=False, arms=(ARM,))
# NOVA's inflection test needs t_est < the number of scales; at t_est=7 on official-tiny's 7 scales it never tests,
# so the arm never activates and computes exactly what the baseline computes
NEVER = ("activation.t_est=7",)
# fires from scale 3 on for some samples (tests/integration/test_ablate.py): the arm really prunes
PRUNING = ("activation.t_est=2", "activation.alpha=1.0", "activation.growth_test=magnitude")


def _digests(folder: Path) -> dict[str, str]:
    """sha256 of every regular file under ``folder`` (relative path -> digest)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}


# ----- 1. finished work of another configuration is kept ------------------------------------------------------
@pytest.mark.parametrize("change", [{"samples": 3}, {"cfg": 3.0}])
def test_rerun_with_another_configuration_keeps_the_first_records(tmp_path, change):
    out = tmp_path / "run"
    run_study(StudyOptions(out=str(out), save_images=True, **SMALL), log=lambda s: None)
    first = {name: digest for name, digest in _digests(out).items() if name.startswith(("arms/", "images/"))}
    slug = rec.arm_slug(ARM)  # per arm: record, index file and samples folder (batch files)
    assert sorted({n.split("/")[1] for n in first if n.startswith("arms/")}) == [
        "baseline.json", "baseline.pt", "baseline.samples", f"{slug}.json", f"{slug}.pt", f"{slug}.samples"]
    assert f"images/{rec.arm_slug(ARM)}/flat/00001.png" in first
    logs: list[str] = []
    result = run_study(StudyOptions(out=str(out), save_images=True, **{**SMALL, **change}), log=logs.append)
    assert result.computed == ["baseline", ARM] and result.reused == []
    after = _digests(out)
    for name, digest in first.items():  # every file of the first run still exists, byte for byte, somewhere
        holders = [n for n, d in after.items() if d == digest]
        assert holders, f"{name} of the first run is gone"
        assert any(h == f"superseded/{h.split('/')[1]}/{name}" for h in holders if h.startswith("superseded/"))
    kept = [line for line in logs if "kept the finished record" in line]
    assert len(kept) == 1 and "\n" not in kept[0] and "nothing deleted" in kept[0]
    folder = Path(kept[0].split("moved to ")[1].split("/ (")[0])
    assert folder.parent == out / "superseded" and folder.name.startswith("n2_seed1_")
    assert sorted(p.name for p in (folder / "arms").iterdir()) == sorted({n.split("/")[1] for n in first
                                                                         if n.startswith("arms/")})
    assert (folder / "images" / rec.arm_slug(ARM) / "flat" / "00001.png").is_file()
    # the new records are the new configuration's
    new = rec.read_record(rec.record_paths(out, "baseline")[0])
    if "samples" in change:
        assert new["samples"]["n"] == 3
    else:
        assert new["sampling"]["cfg"] == 3.0


def test_going_back_to_the_first_configuration_reuses_its_kept_records(tmp_path):
    out = tmp_path / "run"
    run_study(StudyOptions(out=str(out), **SMALL), log=lambda s: None)
    first = {n: d for n, d in _digests(out).items() if n.startswith("arms/")}
    run_study(StudyOptions(out=str(out), **{**SMALL, "samples": 3}), log=lambda s: None)
    second = {n: d for n, d in _digests(out).items() if n.startswith("arms/")}
    logs: list[str] = []
    result = run_study(StudyOptions(out=str(out), **SMALL), log=logs.append)
    assert result.computed == [] and result.reused == ["baseline", ARM]
    assert {n: d for n, d in _digests(out).items() if n.startswith("arms/")} == first  # the first run's files
    after = set(_digests(out).values())
    assert set(second.values()) <= after  # the second run's are kept in their turn
    assert sum("moved back and reused" in line for line in logs) == 1
    assert sum("kept the finished record" in line for line in logs) == 1


# ----- 2. the default folder and the reuse key include everything that changes results -------------------------
def test_default_out_dir_names_every_result_changing_setting():
    base = dict(family="cache", samples=4, seed=1)
    name = lambda **kw: str(default_out_dir(StudyOptions(**{**base, **kw}), "official-tiny"))  # noqa: E731
    assert name() == "results/ablate/cache_official-tiny_n4_seed1"  # unchanged for the defaults
    assert name(cfg=3.0) == "results/ablate/cache_official-tiny_n4_seed1_cfg3"
    assert name(cfg=1.5) == "results/ablate/cache_official-tiny_n4_seed1_cfg1.5"
    assert name(top_k=600, top_p=0.9) == "results/ablate/cache_official-tiny_n4_seed1_topk600_topp0.9"
    assert name(temperature=0.8) == "results/ablate/cache_official-tiny_n4_seed1_temp0.8"
    assert name(draw="inverse_cdf") == "results/ablate/cache_official-tiny_n4_seed1_draw-inverse_cdf"
    assert name(dtype="bfloat16") == "results/ablate/cache_official-tiny_n4_seed1_bfloat16"
    expected = hashlib.sha1(f"weights={Path('/data/a.safetensors').resolve()}".encode()).hexdigest()[:8]
    assert name(weights="/data/a.safetensors") == f"results/ablate/cache_official-tiny_n4_seed1_w-{expected}"
    assert name(weights="/data/a.safetensors") != name(weights="/data/b.safetensors")
    assert name(vae_weights="/data/vae.pth") != name()
    assert name(samples=8) == "results/ablate/cache_official-tiny_n8_seed1"
    assert name(seed=2) == "results/ablate/cache_official-tiny_n4_seed2"
    assert len({name(), name(cfg=3.0), name(cfg=4.0), name(precision="fp16-autocast"), name(top_k=1)}) == 5


def _record_for(config: rec.RunConfig) -> dict:
    record = rec.new_record(config)
    record["status"] = "complete"
    return record


@pytest.mark.parametrize("change", [
    {"sampling_cfg": 3.0}, {"sampling_draw": "inverse_cdf"}, {"dtype": "bfloat16"}, {"weights": "/other/w.pth"},
    {"vae_weights": "/other/vae.pth"}, {"text_encoder": "/other/t5"}, {"seed": 2}, {"samples": 3},
])
def test_reuse_refuses_a_record_of_another_configuration(tmp_path, change):
    from var_core.accel.presets import get_preset
    from var_core.engine import SamplingConfig

    def config(sampling_cfg=1.5, sampling_draw="multinomial", dtype="float32", weights="/w.pth", vae_weights=None,
               text_encoder=None, seed=0, samples=2):
        return rec.RunConfig(arm="a", family="cache", policy=get_preset("nova"), model="official-tiny",
                             weights=weights, sampling=SamplingConfig(cfg=sampling_cfg, draw=sampling_draw),
                             conditions=ConditionSet.balanced(samples, 10, seed), dtype=dtype,
                             vae_weights=vae_weights, text_encoder=text_encoder)

    rec.write_json_atomic(rec.record_paths(tmp_path, "a")[0], _record_for(config()))
    assert rec.find_reusable(tmp_path, config()) is not None  # control: the same configuration is reused
    assert rec.find_reusable(tmp_path, config(**change)) is None


def test_reuse_refuses_other_weights_at_the_same_path(tmp_path):
    """A checkpoint replaced in place (same path, same size) is other weights: its old records are not reused."""
    from var_core.accel.presets import get_preset
    from var_core.engine import SamplingConfig

    weights = tmp_path / "w.safetensors"
    weights.write_bytes(bytes(3 << 20))  # 3 MiB of zeros: head and tail are read

    def config():
        return rec.RunConfig(arm="a", family="cache", policy=get_preset("nova"), model="var-d16",
                             weights=str(weights), sampling=SamplingConfig(), conditions=ConditionSet.balanced(2, 10, 0))

    out = tmp_path / "out"
    rec.write_json_atomic(rec.record_paths(out, "a")[0], _record_for(config()))
    assert rec.find_reusable(out, config()) is not None
    data = bytearray(weights.read_bytes())
    data[-1] = 1  # the last byte differs
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(1, 1))
    assert rec.find_reusable(out, config()) is None
    # the fingerprint by hand: sha256 over the size, the first and the last MiB, then over name and digest
    part = hashlib.sha256(str(3 << 20).encode())
    part.update(bytes(data[: 1 << 20]))
    part.update(bytes(data[-(1 << 20):]))
    expected = hashlib.sha256(f"\0{part.hexdigest()}\0".encode()).hexdigest()[:16]
    assert config().key()["weights_fingerprint"] == {"weights": expected}


# ----- 3. never write through a planted link ------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("links") / "run"
    run_study(StudyOptions(out=str(out), **SMALL), log=lambda s: None)
    return out


@pytest.fixture
def folder(finished, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


@pytest.fixture
def outside(tmp_path):
    target = tmp_path / "outside"
    target.mkdir()
    (target / "precious.txt").write_text("precious\n")
    return target


@pytest.mark.parametrize("link", ["grids/overview.png", f"grids/{rec.arm_slug(ARM)}.png", "table.md"])
def test_report_refuses_a_planted_file_link(folder, outside, capsys, link):
    (folder / link).unlink(missing_ok=True)
    (folder / link).symlink_to(outside / "precious.txt")
    assert run_cli(report_cli.main, [str(folder), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and str(folder / link) in err and "symbolic link" in err
    assert (outside / "precious.txt").read_text() == "precious\n"
    assert (folder / link).is_symlink()


def test_resumed_ablate_refuses_a_planted_grid_link(folder, outside):
    from var_core.errors import UserError

    link = folder / "grids" / f"{rec.arm_slug(ARM)}.png"
    link.unlink()
    link.symlink_to(outside / "precious.txt")
    (folder / "arms" / f"{rec.arm_slug(ARM)}.json").unlink()  # the arm is recomputed: its grid would be written
    with pytest.raises(UserError, match="symbolic link"):
        run_study(StudyOptions(out=str(folder), **SMALL), log=lambda s: None)
    assert (outside / "precious.txt").read_text() == "precious\n"


def test_resumed_ablate_refuses_a_planted_images_folder_link(folder, outside):
    from var_core.errors import UserError

    (folder / "images").mkdir()
    (folder / "images" / rec.arm_slug(ARM)).symlink_to(outside, target_is_directory=True)
    before = sorted(p.name for p in outside.iterdir())
    with pytest.raises(UserError) as info:
        run_study(StudyOptions(out=str(folder), save_images=True, **SMALL), log=lambda s: None)
    assert str(folder / "images" / rec.arm_slug(ARM)) in str(info.value)
    assert sorted(p.name for p in outside.iterdir()) == before
    assert (outside / "precious.txt").read_text() == "precious\n"


def test_writers_refuse_links_on_their_own(tmp_path, outside):
    """Without the folder check up front: the grid writer, the image export and the JSON writer refuse too."""
    from ablations.grids import save_labelled_grid
    from var_core.eval.export import export_images

    root = tmp_path / "res"
    (root / "grids").mkdir(parents=True)
    (root / "grids" / "a.png").symlink_to(outside / "precious.txt")
    with pytest.raises(rec.UnsafeResultsPath):
        save_labelled_grid(torch.zeros(1, 3, 8, 8), root / "grids" / "a.png", nrow=1, row_labels=["a"], root=root)
    with pytest.raises(rec.UnsafeResultsPath):  # no root: the final component is still checked
        save_labelled_grid(torch.zeros(1, 3, 8, 8), root / "grids" / "a.png", nrow=1, row_labels=["a"])
    (root / "images").mkdir()
    (root / "images" / "arm").symlink_to(outside, target_is_directory=True)
    with pytest.raises(rec.UnsafeResultsPath):
        export_images(root, "arm", torch.zeros(2, 3, 8, 8, dtype=torch.uint8), ConditionSet.balanced(2, 10, 0))
    (root / "sub").symlink_to(outside, target_is_directory=True)
    with pytest.raises(rec.UnsafeResultsPath):
        rec.write_json_atomic(root / "sub" / "x.json", {"a": 1}, root=root)
    assert sorted(p.name for p in outside.iterdir()) == ["precious.txt"]
    assert (outside / "precious.txt").read_text() == "precious\n"
    # control: without links the same writes succeed
    rec.write_json_atomic(root / "ok" / "x.json", {"a": 1}, root=root)
    assert json.loads((root / "ok" / "x.json").read_text()) == {"a": 1}


# ----- 4. timing honesty ----------------------------------------------------------------------------------------
def test_timing_rule_with_hand_made_readings():
    flag = loadwatch.timing_flag
    # an idle machine warming up under our one busy thread for 60 s: the load may rise to 0 + 1·(1 − e^−1) = 0.632,
    # and 0.5 more is tolerated: 0.65 and 1.13 pass, 1.14 does not
    assert abs((1 - math.exp(-1)) - 0.63212) < 1e-5
    assert flag(0.0, 0.65, 60.0, 60.0, 1) == [] and flag(0.0, 1.13, 60.0, 60.0, 1) == []
    moved = flag(0.0, 1.14, 60.0, 60.0, 1)
    assert len(moved) == 1 and "load moved" in moved[0]
    # a fall: another job stopped (below L0 − 0.5)
    assert flag(1.0, 0.55, 60.0, 60.0, 1) == [] and "load moved" in flag(1.0, 0.45, 60.0, 60.0, 1)[0]
    # a short arm: 6 s from 2.0 with our thread busy: at most 2 + (1 − e^−0.1) + 0.5 = 2.595
    assert flag(2.0, 2.59, 6.0, 6.0, 1) == [] and flag(2.0, 2.60, 6.0, 6.0, 1) != []
    # the others' load at the start (L0 − our 1 busy thread) against 2 cores − 1 thread + 0.5 = 1.5
    assert flag(2.4, 2.4, 6.0, 6.0, 1, cores=2) == []
    busy = flag(2.6, 2.6, 6.0, 6.0, 1, cores=2)
    assert len(busy) == 1 and "busy machine" in busy[0]
    assert flag(2.6, 2.6, 6.0, 6.0, 1, cores=4) == []  # the same load on 4 cores leaves ours free
    # the process got 80 % of a core: it waited; 85 % is accepted
    waited = flag(1.0, 1.0, 48.0, 60.0, 1)
    assert len(waited) == 1 and "waited for a core" in waited[0]
    assert flag(1.0, 1.0, 51.0, 60.0, 1) == []
    # 2 threads set, 2.6 cores used: more than threads + 0.5
    assert "more threads" in flag(2.0, 2.0, 156.0, 60.0, 2)[0] and flag(2.0, 2.0, 150.0, 60.0, 2) == []
    # on a GPU the host's CPU share and the busy test say nothing: only the band [L0 − 0.5, L0 + 0.5]
    assert flag(2.0, 1.6, 6.0, 60.0, 1, "cuda", cores=1) == [] and flag(2.0, 1.4, 6.0, 60.0, 1, "cuda") != []


def _scripted(monkeypatch, loads):
    """Inject readings: the load average steps through ``loads`` (the last repeats); CPU time = wall time."""
    state = {"i": 0, "t": 0.0}

    def load():
        value = loads[min(state["i"], len(loads) - 1)]
        state["i"] += 1
        return value

    def clock():
        state["t"] += 1.0
        return state["t"]

    monkeypatch.setattr(loadwatch, "read_load", load)
    monkeypatch.setattr(loadwatch, "read_wall", clock)
    monkeypatch.setattr(loadwatch, "read_cpu", lambda: state["t"])  # one full core, in step with the wall clock
    monkeypatch.setattr(loadwatch, "read_cores", lambda: 2)
    return state


def test_injected_load_change_flags_the_arm_and_the_table(tmp_path, monkeypatch):
    # batches of the baseline read 1.0 then 1.0; the arm's read 1.0 then 3.0: only the arm's load moved
    _scripted(monkeypatch, [1.0, 1.0, 1.0, 3.0])
    out = tmp_path / "run"
    run_study(StudyOptions(out=str(out), **{**SMALL, "samples": 2}), log=lambda s: None)
    base = rec.read_record(rec.record_paths(out, "baseline")[0])
    arm = rec.read_record(rec.record_paths(out, ARM)[0])
    assert base["timing"]["load"]["flag"] == []
    assert base["timing"]["load"]["load_1min_before"] == 1.0 and base["timing"]["load"]["cpu_per_wall"] == 1.0
    assert arm["timing"]["load"]["load_1min_after"] == 3.0 and len(arm["timing"]["load"]["flag"]) == 1
    table = (out / "table.md").read_text()
    rows: dict[str, str] = {}
    for line in table.splitlines():  # the main table comes first (the Wilcoxon table repeats arm names)
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line)
    assert "†" in rows[ARM] and "†" not in rows["**baseline**"]
    assert rows[ARM].count("†") == 2  # its latency and its sequential speedup
    assert "† sequential timing not trustworthy" in table and f"`{ARM}`: the 1-min load moved" in table
    import pandas as pd

    frame = pd.read_csv(out / "table.csv").set_index("arm")
    assert "load moved" in frame.loc[ARM, "timing_flag"] and pd.isna(frame.loc["baseline", "timing_flag"])


def _tokens_equal_by_hand(out: Path) -> bool:
    """A second implementation: every token tensor and image of the arm's file equals the baseline's."""
    from var_core.eval.lightning import GenerationRun

    base = GenerationRun.load(rec.record_paths(out, "baseline")[1])  # index file + samples folder
    arm = GenerationRun.load(rec.record_paths(out, ARM)[1])
    same_tokens = all(torch.equal(a, b) for ra, rb in zip(arm.tokens, base.tokens) for a, b in zip(ra, rb))
    return same_tokens and torch.equal(arm.images_u8[:], base.images_u8[:])


def test_an_arm_that_never_activates_is_marked_identical(tmp_path):
    out = tmp_path / "never"
    logs: list[str] = []
    run_study(StudyOptions(out=str(out), overrides=NEVER, **SMALL), log=logs.append)
    assert _tokens_equal_by_hand(out)
    record = rec.read_record(rec.record_paths(out, ARM)[0])
    assert record["identical_to_baseline"] == {"identical": True, "samples": 2, "tokens_equal": 2, "images_equal": 2}
    warned = [line for line in logs if line.startswith("warning:") and ARM in line]
    assert len(warned) == 1 and "identical to the baseline" in warned[0] and "never activated" in warned[0]
    table = (out / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith(f"| {ARM} |"))
    header = next(line for line in table.splitlines() if line.startswith("| arm | n |"))
    cells = dict(zip([c.strip() for c in header.strip("|").split("|")], [c.strip() for c in row.strip("|").split("|")]))
    assert cells["identical"] == "2/2 (= baseline)" and "changed nothing" in table
    # a resumed study reuses the record and warns again
    again: list[str] = []
    result = run_study(StudyOptions(out=str(out), overrides=NEVER, **SMALL), log=again.append)
    assert result.reused == ["baseline", ARM] and any("identical to the baseline" in line for line in again)


def test_a_pruning_arm_is_not_marked_identical(tmp_path):
    out = tmp_path / "pruning"
    logs: list[str] = []
    run_study(StudyOptions(out=str(out), overrides=PRUNING, **{**SMALL, "samples": 3}), log=logs.append)
    assert not _tokens_equal_by_hand(out)
    record = rec.read_record(rec.record_paths(out, ARM)[0])
    assert record["identical_to_baseline"]["identical"] is False
    assert record["identical_to_baseline"]["tokens_equal"] < 3
    assert not any("identical to the baseline" in line for line in logs)
    assert "(= baseline)" not in (out / "table.md").read_text()
