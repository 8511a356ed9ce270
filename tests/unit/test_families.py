"""The ablation families arm for arm against the papers' tables (issue 12), and the measurements they add.

Expected arm lists are written by hand from the papers (NOVA Tables 4–7, ToProVAR Table 10, LD-Pruning Table 1);
the IoU, τ and pixel-change numbers are hand-worked below each test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ablations.base import build_arms, family_info, family_names


def names(family: str) -> list[str]:
    return [a.name for a in build_arms(family)]


def by_name(family: str) -> dict:
    return {a.name: a for a in build_arms(family)}


# ------------------------------------------------------------------------------------------------ arm lists
def test_scorer_family_is_nova_table_4_at_three_pruning_levels():
    # NOVA Table 4: Attn, MSE, Entropy; beyond the paper: FastVAR's mean distance, LHEP, random; each at tau 0.2/0.5/0.8
    expected = ["baseline"] + [f"{s}@tau={t}" for s in ("entropy", "attention", "mse", "mean_distance", "lhep",
                                                        "random") for t in ("0.2", "0.5", "0.8")]
    assert names("scorer") == expected
    arms = by_name("scorer")
    assert all(a.ok for a in arms.values())
    # the MSE arm is SparseVAR's block input/output change; FastVAR's distance to the mean is a separate arm
    assert arms["mse@tau=0.8"].config.scorer.mode == "block_change"
    assert arms["mean_distance@tau=0.8"].config.scorer.mode == "mean_distance"
    assert arms["entropy@tau=0.8"].role == "base"
    # one pruning rule per level, whatever the scorer: the kept-token counts follow the schedule alone
    for tau in (0.2, 0.5, 0.8):
        schedules = {arms[f"{s}@tau={tau:g}"].config.schedule for s in ("entropy", "attention", "mse", "lhep")}
        assert len(schedules) == 1 and schedules.pop().tau == tau


def test_activation_family_has_the_6th_and_10th_scale_arms():
    assert names("activation") == ["baseline", "fixed@6th", "fixed@7th", "fixed@8th", "fixed@9th", "fixed@10th",
                                   "entropy_inflection", "low_entropy_ratio"]
    arms = by_name("activation")
    # 1-indexed scale numbers: the 6th scale is 0-indexed 5, the 10th is 9
    assert [arms[f"fixed@{n}th"].config.activation.start_scale for n in (6, 7, 8, 9, 10)] == [5, 6, 7, 8, 9]
    assert {arms[n].config.schedule.component_name for n in arms if n != "baseline"} == {"dual_linkage"}


def test_linkage_family_is_nova_table_6_with_fastvars_real_table():
    # two no-linkage (FastVAR †, SparseVAR ‡), three single-linkage (scale, layer †, layer ‡), dual
    assert names("linkage") == ["baseline", "no-linkage†", "no-linkage‡", "scale-only", "layer-only†", "layer-only‡",
                                "dual"]
    arms = by_name("linkage")
    assert all(a.ok for a in arms.values())
    # FastVAR's released Infinity table {32: 0.4, 40: 0.5, 48: 1.0, 64: 1.0} on the last four scales
    assert arms["no-linkage†"].config.schedule.ratios == (0.4, 0.5, 1.0, 1.0)
    assert arms["scale-only"].config.schedule.component_name == "scale_linkage"
    assert arms["layer-only†"].config.schedule.component_name == "layer_linkage"
    # the layer-only arms carry the no-linkage arms' tables as their per-scale base (issue 28)
    assert arms["layer-only†"].config.schedule.scale_ratios == (0.4, 0.5, 1.0, 1.0)
    assert arms["layer-only‡"].config.schedule.scale_ratios == arms["no-linkage‡"].config.schedule.ratios
    assert arms["dual"].config.schedule.component_name == "dual_linkage"


def test_cache_family_pairs_the_static_cache_scale_with_the_activation_scale():
    assert names("cache") == ["baseline", "residual_reuse@t_est=4", "static_cache@t_est=4", "residual_reuse@t_est=5",
                              "static_cache@t_est=5", "residual_reuse@t_est=6", "static_cache@t_est=6",
                              "identity@t_est=5"]
    arms = by_name("cache")
    for t_est in (4, 5, 6):
        static, residual = arms[f"static_cache@t_est={t_est}"].config, arms[f"residual_reuse@t_est={t_est}"].config
        assert static.activation == residual.activation and static.activation.t_est == t_est
        assert static.activation.first_accelerated == "after"
        # t_est = T (1-indexed): the first test runs at the end of 1-indexed scale T+1 = 0-indexed T, so the earliest
        # accelerated scale is 0-indexed T+1 and FastVAR's rule (cache = last scale before the pruned ones) gives T
        assert static.restorer.component_name == "static_cache" and static.restorer.cache_scale == t_est
        assert residual.restorer.component_name == "residual_reuse"


def test_depth_family_is_toprovar_table_10():
    assert names("depth") == ["baseline", "fixed-scale-exit", "scale-depth-loc", "scale-depth-loc+token-pruning",
                              "scale-depth-loc+layer-ident", "toprovar"]
    arms = by_name("depth")
    assert arms["fixed-scale-exit"].config.skip.component_name == "skip_last"
    assert arms["fixed-scale-exit"].config.skip.count == 3  # the 5.1x row: 5.46x FLOPs-ideal on Infinity-2B
    if arms["scale-depth-loc"].ok:
        assert arms["scale-depth-loc"].config.skip.component_name == "depth_exit"
    else:
        assert "depth_exit" in arms["scale-depth-loc"].error
    layer = arms["scale-depth-loc+layer-ident"].config.schedule
    assert (layer.alpha_min, layer.alpha_max) == (1.0, 1.0)  # Detail layers lose every token: skipped


def test_criterion_family_is_ld_pruning_table_1():
    # the five criteria at one kept count (issue 28), then LD-Pruning's own energy rule as the reference point
    assert names("criterion") == ["baseline", "lhep", "pixel_change", "attention", "entropy", "random", "lhep@energy"]
    arms = by_name("criterion")
    assert arms["lhep"].role == "base" and arms["pixel_change"].config.scorer.component_name == "pixel_change"
    assert (arms["lhep"].config.schedule.counts, arms["lhep"].config.schedule.rho) == ("tokens", 0.21)
    assert arms["lhep@energy"].config.schedule.counts == "energy" and arms["lhep@energy"].config.schedule.rho == 0.5
    # everything but the criterion is the base's (LD-Pruning at the matched count)
    base = arms["lhep"].config
    for name in ("pixel_change", "attention", "entropy", "random"):
        cfg = arms[name].config
        assert (cfg.activation, cfg.schedule, cfg.restorer, cfg.guidance) == (base.activation, base.schedule,
                                                                               base.restorer, base.guidance)


def test_options_family_sets_the_third_party_sparsevar_reading_beside_ours():
    from ablations.base import FamilyContext

    # one swap per alternative of each RECONSTRUCTED option of sparsevar, then the whole third-party reading
    arms = build_arms("options", FamilyContext(method="sparsevar"))
    assert [a.name for a in arms] == [
        "baseline", "sparsevar", "scorer.upsample=nearest", "scorer.upsample=bicubic", "scorer.upsample=area",
        "scorer.upsample=trilinear", "scorer.span=chunk", "scorer.cfg_halves=mean", "restorer.recovery=bilinear",
        "restorer.recovery=most_similar", "restorer.source=anchors", "restorer.grid=with_last",
        "restorer.forced=False", "restorer.target=final", "reading=sparsevar_lvar"]
    assert all(a.ok for a in arms)
    lvar = arms[-1]
    assert lvar.config.name == "sparsevar_lvar" and lvar.config.per_model == "sparsevar_lvar"
    assert "third-party" in lvar.description and lvar.changes == "method: sparsevar_lvar"
    # and the other way round: our reconstruction is an arm of the third-party reading's options
    back = build_arms("options", FamilyContext(method="sparsevar_lvar"))
    assert back[1].name == "sparsevar_lvar" and back[-1].name == "reading=sparsevar"


def test_every_family_names_its_paper_table():
    tables = {name: family_info(name).table for name in family_names()}
    assert tables["scorer"] == "NOVA Table 4" and tables["activation"] == "NOVA Table 5"
    assert tables["linkage"] == "NOVA Table 6" and tables["cache"] == "NOVA Table 7"
    assert tables["depth"] == "ToProVAR Table 10" and tables["criterion"].startswith("LD-Pruning Table 1")


def test_ls_families_and_presets(capsys):
    from studies.ablate import cmd_ls
    from var_core.accel import presets
    from var_core.errors import UserError

    cmd_ls("families")
    out = capsys.readouterr().out
    assert "reproduces: NOVA Table 7" in out and "static_cache@t_est=5" in out and "Components" not in out
    cmd_ls("presets")
    out = capsys.readouterr().out
    # the whole description, not its first line only
    second = [line for line in presets.PRESETS["nova"].__doc__.strip().splitlines()[1:] if line.strip()][0].strip()
    assert second in out
    if hasattr(presets, "resolved_settings"):
        assert "resolved setting per model family" in out
    with pytest.raises(UserError, match="Did you mean 'presets'"):
        cmd_ls("preset")


# ------------------------------------------------------------------------------------------------ restorer misses
def test_static_cache_without_a_cache_raises_in_a_generation(tiny_adapter):
    """NOVA activating at scale 5 with the cache taken at scale 6: the first pruned restore finds no cache."""
    from var_core.accel import PolicyConfig, build_policy
    from var_core.accel.policy import component_config
    from var_core.accel.restorers.static_cache import CacheMissError
    from var_core.engine import SamplingConfig, generate

    config = PolicyConfig(name="t", activation=component_config("activation", "fixed", start_scale=5),
                          schedule=component_config("schedule", "fixed_table", ratios=(0.5, 0.5)),
                          restorer=component_config("restorer", "static_cache", cache_scale=6))
    with pytest.raises(CacheMissError, match="scale 5 block 0 .*taken at scale 6"):
        generate(tiny_adapter, torch.arange(2), seeds=[0, 1], sampling=SamplingConfig(cfg=1.5),
                 policy=build_policy(config))
    # paired as the cache family pairs it (cache at 4 for a start at 5): no miss
    ok = build_policy(PolicyConfig(name="t", activation=config.activation, schedule=config.schedule,
                                   restorer=component_config("restorer", "static_cache", cache_scale=4)))
    generate(tiny_adapter, torch.arange(2), seeds=[0, 1], sampling=SamplingConfig(cfg=1.5), policy=ok)
    assert ok.signals.extras["static_cache_misses"] == 0


# ------------------------------------------------------------------------------------------------ criterion IoU
def test_criterion_iou_hand_worked():
    from ablations.criterion import iou_at_rates

    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3]])
    changed = torch.tensor([[0.2, 0.8, 0.6, 0.1]])
    # p=0.25 keeps 3: {0, 2, 3} vs {0, 1, 2} -> 2 / 4; p=0.5 keeps 2: {0, 2} vs {1, 2} -> 1 / 3;
    # p=0.75 keeps 1: {0} vs {1} -> 0
    assert iou_at_rates(scores, changed, (0.25, 0.5, 0.75))[0].tolist() == pytest.approx([0.5, 1 / 3, 0.0])
    # ties go to the lower position: flat scores keep {0, 1}; the change is at {2, 3}
    flat = iou_at_rates(torch.full((1, 4), 0.5), torch.tensor([[0.0, 0.0, 1.0, 1.0]]), (0.5,))
    assert flat.tolist() == [[0.0]]
    # a perfect criterion: IoU 1 at every rate
    assert iou_at_rates(changed, changed, (0.1, 0.5, 0.9)).tolist() == [[1.0, 1.0, 1.0]]


def test_pixel_change_map_hand_worked():
    from var_core.accel.scorers.pixel_change import pixel_change_map

    now = torch.zeros(1, 3, 4, 4)
    before = torch.zeros(1, 3, 4, 4)
    before[0, :, 0, 0] = 0.6  # |dI| = 0.6 in every channel at pixel (0, 0)
    before[0, 0, 3, 3] = 0.3  # 0.3 in one channel at (3, 3): channel mean 0.1
    # 2x2 token grid, each token covers 2x2 pixels: area = mean (0.6 / 4, 0.1 / 4), max = the largest
    assert pixel_change_map(now, before, (2, 2), "area")[0].tolist() == pytest.approx([0.15, 0, 0, 0.025])
    assert pixel_change_map(now, before, (2, 2), "max")[0].tolist() == pytest.approx([0.6, 0, 0, 0.1])


def test_decoded_images_are_recorded_only_where_asked(tiny_adapter):
    from ablations.calibrate import TracePolicy
    from var_core.engine import SamplingConfig, generate

    K = tiny_adapter.num_scales
    policy = TracePolicy(decode=lambda si: si in (2, K - 1))
    result = generate(tiny_adapter, torch.arange(2), seeds=[0, 1], sampling=SamplingConfig(cfg=1.5), policy=policy)
    decoded = [r.scale_index for r in result.records if r.image_B3HW is not None]
    assert decoded == [2, K - 1]
    assert torch.equal(result.records[-1].image_B3HW, result.images)  # the last scale's latent is the image's


# ------------------------------------------------------------------------------------------------ ToProVAR tau
NAN = math.nan
RHO = np.array([[NAN, 0.6, 0.45, 0.3, 0.2],
                [NAN, 0.5, 0.5, 0.35, 0.3],
                [NAN, 0.7, 0.6, 0.5, 0.4]])
SSIM = np.array([[0.3, 0.5, 0.85, 0.9, 1.0],
                 [0.2, 0.81, 0.7, 0.9, 1.0],  # scale 1 is above 0.8 only transiently
                 [0.9, 0.95, 0.97, 0.99, 1.0]])


def test_implied_tau_hand_worked():
    from ablations.calibrate import implied_tau

    c = implied_tau(RHO, SSIM, ssim_threshold=0.8)
    # good depths: A from scale 2 on, B from 3 (its scale-1 peak does not last), C from 0
    assert c.good_depth == [2, 3, 0]
    # rho*: A 0.45 (scale 2), B 0.35 (scale 3), C: scale 0 is untested, so the first tested one, scale 1: 0.7
    assert c.rho_star == pytest.approx([0.45, 0.35, 0.7]) and c.star_scale == [2, 3, 1]
    assert c.ceiling[0] == pytest.approx(0.6) and c.ceiling[1] == pytest.approx(0.5) and c.ceiling[2] is None
    assert c.tau == pytest.approx(0.45)  # median of 0.35, 0.45, 0.7
    # exits at tau 0.45: A at 2, B at 3, C at 4 (0.4): all at or after their good depth
    assert c.depth["tau"] == [2, 3, 4] and c.safe_share["tau"] == 1.0
    assert c.depth["paper"] == [3, 3, 4] and c.safe_share["paper"] == 1.0
    # the largest tau keeping all three safe: B fires at scale 1 from 0.5 on, so 0.45 (the next smaller rho)
    assert c.tau_safe == pytest.approx(0.45)
    # pooled rho of the exits above 0.8 (tested scales only): A 0.45, 0.3, 0.2; B 0.5, 0.35, 0.3; C 0.7 ... 0.4
    assert sorted(c.pooled) == pytest.approx(sorted([0.45, 0.3, 0.2, 0.5, 0.35, 0.3, 0.7, 0.6, 0.5, 0.4]))


def test_implied_tau_mean_cuts_one_sample_too_early():
    from ablations.calibrate import implied_tau

    c = implied_tau(RHO, SSIM, statistic="mean", safe_target=0.6)
    assert c.tau == pytest.approx(0.5)  # mean of 0.45, 0.35, 0.7
    # at 0.5: A exits at 2 (0.45), B at 1 (0.5 <= 0.5, before its good depth 3), C at 3 (0.5)
    assert c.depth["tau"] == [2, 1, 3] and c.safe_share["tau"] == pytest.approx(2 / 3)
    # two of three safe is allowed: A stays safe up to 0.6 (exclusive), so the largest tau is 0.5
    assert c.tau_safe == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------------ plots
def test_analysis_plots_from_hand_made_files(tmp_path):
    import json

    from ablations.report import write_analysis_plots

    folder = tmp_path / "analysis"
    folder.mkdir()
    (folder / "criterion_iou.json").write_text(json.dumps({"scales": [2], "summary": [
        {"criterion": c, "rate": p, "mean": m, "low": m - 0.1, "high": m + 0.1, "n": 4}
        for c, m0 in (("lhep", 0.8), ("random", 0.5)) for p, m in ((0.1, m0), (0.5, m0 - 0.2))]}))
    (folder / "gamma_per_scale.json").write_text(json.dumps({"gamma": [[None, 0.5, 0.2], [None, 0.4, 0.1]],
                                                             "delta": 0.15}))
    (folder / "layer_entropy.json").write_text(json.dumps({"scale": 1, "hw": [2, 2], "indices": [0], "labels": [3],
                                                           "maps": [[[[0.1, 0.2], [0.3, 0.4]]] * 2]}))
    plots = write_analysis_plots(tmp_path, tmp_path)
    assert set(plots) == {"criterion_iou", "gamma_per_scale", "layer_entropy"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in plots.values())


# ------------------------------------------------------------------------------------------------ end to end
def test_criterion_study_writes_its_iou_analysis(tmp_path, fixture_dir):
    """The runner runs a family's analysis after its arms: the IoU table lands in table.md and is plotted."""
    from ablations.runner import StudyOptions, run_study

    options = StudyOptions(family="criterion", model="official-tiny", weights=str(fixture_dir), samples=2,
                           batch_size=2, out=str(tmp_path / "study"), wandb="disabled", arms=("lhep",), warmup=0,
                           progress=False, threads=1, timing_rounds=0)
    result = run_study(options, log=lambda line: None)
    data = __import__("json").loads((result.out_dir / "analysis" / "criterion_iou.json").read_text())
    assert set(data["iou"]) == {"lhep", "pixel_change", "attention", "entropy", "random"}
    assert len(data["iou"]["lhep"]) == 2 and len(data["iou"]["lhep"][0]) == len(data["rates"])
    assert all(0.0 <= v <= 1.0 for row in data["iou"]["pixel_change"] for v in row)
    assert "Criterion IoU with the tokens that change" in (result.out_dir / "table.md").read_text()
    assert (result.out_dir / "plots" / "criterion_iou.png").is_file()
    assert result.outputs["analysis"]["criterion_iou"].endswith("criterion_iou.json")


def test_calibrate_cli_prints_and_writes_tau(tmp_path, fixture_dir, capsys):
    import json

    from studies.calibrate import main

    out = tmp_path / "cal"
    assert main(["toprovar", "--model", "official-tiny", "--weights", str(fixture_dir), "--samples", "2",
                 "--threads", "1", "--min-test-tokens", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "implied tau (median of rho*)" in printed and "paper tau = 0.4" in printed
    data = json.loads((out / "calibration.json").read_text())
    rho = np.array([[np.nan if v is None else v for v in row] for row in data["table"]["rho"]])
    assert rho.shape == (2, 7) and np.isnan(rho[:, 0]).all() and np.isfinite(rho[:, 1:]).all()  # 1x1 < 4 tokens
    assert data["table"]["ssim"][0][-1] == pytest.approx(1.0)  # exiting after the last scale is the image itself
    assert (out / "rho_calibration.png").is_file()
