"""Per-arm activity from the scales' records (var_core.eval.activity) on a hand-worked example, the components
that never acted in the table, and width-keyed knob tables that do not fit the model (issue 31)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from var_core.accel import component_config
from var_core.accel.presets import INFINITY_1M, REFERENCE_MODELS
from var_core.eval.activity import activity, activity_lines

POLICY = {"activation": {"name": "fixed"}, "scorer": {"name": "entropy"}, "schedule": {"name": "fixed_table"},
          "restorer": {"name": "static_cache"}, "guidance": {"name": "sats"}, "skip": {"name": "none"}}
HW = ((1, 1), (2, 2))


def batches(stop_mask):
    # batch A: 2 samples, 1 block x 2 branches; scale 1 keeps 2 of 4 tokens; guidance stops per `stop_mask`
    a = {"size": 2, "valid_tokens": [[[1, 1]], [[2, 2]]], "skipped": [False, False], "guidance": ["both", "both"],
         "history": [{"guidance": "both", "cond_only": None}, {"guidance": "both", "cond_only": stop_mask}]}
    # batch B: 1 sample whose scale 1 was skipped
    b = {"size": 1, "kept_tokens": [[[1, 1]], []], "skipped": [False, True], "guidance": ["both", "both"],
         "history": []}
    return [a, b]


def test_activity_hand_worked():
    act = activity(batches([True, False]), [1, 2, 2], HW, POLICY)
    assert act["samples"] == 3
    assert act["activation"] == {"scale_per_sample": [1, 2, 2], "activated": 1, "of": 3}
    # scale 0: every sample dense; scale 1: (2 samples x 0.5 + 1 skipped x 0) / 3
    assert act["kept_per_scale"] == pytest.approx([1.0, 1 / 3])
    assert act["pruned_scales"] == 1
    assert act["guidance_stopped"] == {"samples": 1, "of": 3}
    assert act["scales_skipped"] == pytest.approx(1 / 3)
    # filled slots: batch A scale 1, 2 samples x 2 branches x (4 - 2); computed: A 2x(1+1) + 2x(2+2), B 1x(1+1)
    assert act["restorer"] == {"hits": 8, "misses": 14}
    assert act["inactive"] == []
    assert {k: v["acted"] for k, v in act["components"].items()} == {
        "activation": True, "scorer": True, "schedule": True, "restorer": True, "guidance": True, "skip": False}


def test_a_guidance_stop_that_never_fires_is_reported():
    act = activity(batches([False, False]), [1, 2, 2], HW, POLICY)
    assert act["guidance_stopped"] == {"samples": 0, "of": 3}
    assert act["inactive"] == ["guidance sats"]  # skip "none" is the no-op of its kind: not reported
    records = [{"arm": "nova_sats", "activity": act}, {"arm": "baseline", "activity": activity(
        batches([False, False]), None, HW, None)}]
    text = "\n".join(activity_lines(records))
    assert "| nova_sats | act 1/3 · pruned 1 sc · cfg stop 0/3 · skip 0.3 · fill 36% | 1.00 0.33 | guidance sats |" \
        in text
    assert "Components that never acted in this study: `nova_sats`: guidance sats" in text


def test_guidance_that_starts_without_cfg_is_not_a_stop():
    b = batches([False, False])
    for batch in b:
        batch["guidance"] = ["cond_only", "cond_only"]
        for step in batch["history"]:
            step["guidance"] = "cond_only"
    assert activity(b, None, HW, POLICY)["guidance_stopped"]["samples"] == 0


def _info(family: str, scale_hw, blocks: int = 16):
    return SimpleNamespace(family=family, scale_hw=scale_hw, num_blocks=blocks, block_chunks=None)


VAR_TABLE = component_config("schedule", "fixed_table", widths=(13, 16), ratios=(0.4, 0.5))


@pytest.mark.parametrize("family", ["infinity", "hart"])
def test_a_var_width_table_is_refused_on_another_model(family):
    from var_core.accel.schedules.fixed_table import FixedTable

    key = REFERENCE_MODELS[family][1]
    with pytest.raises(ValueError) as info:
        FixedTable(VAR_TABLE).check_model(_info(family, key.scale_hw, key.num_blocks))
    message = str(info.value)
    assert message.startswith("schedule.widths=(13, 16) names width(s) [13] that the " + family + " model")
    assert f"{len(key.scale_hw)} scales, {key.num_blocks} blocks" in message


def test_width_tables_that_fit_are_accepted():
    from var_core.accel.schedules.fixed_table import FixedTable

    FixedTable(VAR_TABLE).check_model(_info("var", REFERENCE_MODELS["var"][1].scale_hw))
    # FastVAR's Infinity table on a 256 px Infinity schedule (widths up to 16): not reached, dense as in the code
    FixedTable(component_config("schedule", "fixed_table", widths=(32, 40, 48, 64), ratios=(0.4, 0.5, 1.0, 1.0))
               ).check_model(_info("infinity", INFINITY_1M[:7]))


def test_recipes_receive_the_study_model(tmp_path):
    """plan_study hands the recipe the model it will run (from the zoo spec / testbed card, nothing loaded)."""
    import json

    from ablations import base
    from ablations.runner import StudyOptions, plan_study
    from var_core import zoo
    from var_core.accel.presets import ModelKey

    seen = []

    def recipe(ctx):
        seen.append((ctx.model, ctx.model_name))
        return [base.baseline_arm()]

    base.family("test_model_key", "test only")(recipe)
    try:
        plan_study(StudyOptions(family="test_model_key", model="testbed", out=str(tmp_path / "x"), wandb="disabled"))
        plan_study(StudyOptions(family="test_model_key", model="var-d16", out=str(tmp_path / "y"), wandb="disabled"))
    finally:
        base.FAMILIES.pop("test_model_key", None)
        base.FAMILY_INFO.pop("test_model_key", None)
    card = json.loads((zoo.testbed_folder("testbed") / "testbed.json").read_text())["var_config"]
    assert seen[0] == (ModelKey("var", card["depth"], tuple((p, p) for p in card["patch_nums"])), "testbed")
    assert seen[1] == (ModelKey("var", 16, ((1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6), (8, 8), (10, 10), (13, 13),
                                            (16, 16))), "var-d16")
