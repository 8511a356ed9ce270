"""FastVAR = its released code: ``get_preset("fastvar")`` on the official FastVAR-Infinity goldens, and the
per-model resolution of presets (issue 12).

Fixture: ``shared/fixtures/official_fastvar_tiny`` (goldens of csguoh/FastVAR ``Infinity/`` on the tiny random
model of ``official_infinity_tiny``; read its README). Its ``w3_*`` setting is the official rule unchanged (the
depth-2 model has no block in range(3, 28), so only the 48 and 64 scales go); the ``w1_*`` settings ran the
official code with its block window moved to range(1, 28) (patch D1), which is the one change made here too.
The golden tests skip when the fixtures are absent; the mechanism tests need no model.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from profilers.flops import count_record_flops, dense_records, infinity_arch
from profilers.plan_flops import ideal_speedup, planned_records
from var_core.accel import build_policy, component_config
from var_core.accel.policy import AccelPolicy
from var_core.accel.presets import (REFERENCE_MODELS, ModelKey, describe_config, get_preset, resolve_config,
                                    resolved_settings)
from var_core.accel.registry import SCHEDULES
from var_core.engine import GenerationInfo, GenerationOptions, GuidanceMode, SamplingConfig, ScaleContext, generate
from var_core.engine.context import ScaleRecord
from var_core.engine.tracing import NULL_TRACER

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "fixtures"
FASTVAR_DIR = Path(os.environ.get("VARSCOPE_FASTVAR_FIXTURE", SHARED / "official_fastvar_tiny"))
INFINITY_DIR = Path(os.environ.get("VARSCOPE_INFINITY_FIXTURE", SHARED / "official_infinity_tiny"))
needs_fixture = pytest.mark.skipif(
    not (FASTVAR_DIR / "config.json").exists() or not (INFINITY_DIR / "infinity.pth").exists(),
    reason=f"official FastVAR / Infinity fixtures not found at {FASTVAR_DIR}, {INFINITY_DIR}")

INFINITY = REFERENCE_MODELS["infinity"][1]
VAR = REFERENCE_MODELS["var"][1]
HART = REFERENCE_MODELS["hart"][1]
# the fixture README's table: bits that differ from the plain Infinity run at scales 9 and 10
BITS_OFF_PLAIN = {"w1_cfg6_n1": (1355, 2156), "w1_cfg5_p0": (678, 520), "w1_cfg2.5_p1": (1470, 2782),
                  "w1_cfg1_n1p0": (1769, 3374), "w3_cfg6_p0": (0, 0)}


# ----------------------------------------------------------------------------------------- the goldens
@pytest.fixture(scope="module")
def tiny():
    from var_core.verify.infinity import load_fixture_models

    model, vae, _ = load_fixture_models(INFINITY_DIR)
    return model, vae


def _golden(name):
    return torch.load(FASTVAR_DIR / name, weights_only=False)


def _run(tiny, setting, decode=False):
    """Our run of the setting: ``get_preset("fastvar")`` (block window moved for w1), kept selections recorded."""
    from var_core.engine.adapters.infinity_adapter import InfinityAdapter
    from var_core.models.text_encoder import TextTokens

    g = _golden(f"golden_fastvar_{setting}.pt")
    model, vae = tiny
    adapter = InfinityAdapter(model, vae, schedule=[tuple(int(v) for v in s) for s in g["scale_schedule"]])
    text = TextTokens.from_official(g["label_B_or_BLT"])
    args = g["args"]
    assert set(args["cfg_list"]) == {args["cfg_list"][0]} and args["top_k"] == 1 and args["tau_list"][0] == 1
    sampling = SamplingConfig(cfg=float(args["cfg_list"][0]), top_k=1, top_p=0.0, temperature=1.0)
    config = get_preset("fastvar")
    first, end = g["layer_window"]
    if first != 3:  # the fixture's patch D1 (w1_*): the window starts at block `first`; nothing else changes
        config = dataclasses.replace(config, exempt_first_blocks=first)
    policy = build_policy(config)
    selections = {}
    plan_block = policy.plan_block

    def recording(ctx, block, branch, x):
        selection = plan_block(ctx, block, branch, x)
        if selection is not None:
            selections[(ctx.scale_index, block, branch)] = selection
        return selection

    policy.plan_block = recording
    result = generate(adapter, text, seeds=[0] * text.rows, sampling=sampling, policy=policy,
                      options=GenerationOptions(decode=decode))
    assert (policy.config.exempt_first_blocks, policy.config.pruned_blocks_end) == (first, end)
    return g, result, selections


@needs_fixture
@pytest.mark.parametrize("setting", sorted(BITS_OFF_PLAIN))
def test_fastvar_preset_reproduces_the_official_code(tiny, setting):
    g, result, selections = _run(tiny, setting)
    records = result.records
    # the scales generated: 0-10 computed, 48x48 and 64x64 not generated
    assert len(records) == 13 and result.stopped_at is None
    assert [list((1,) + r.hw) for r in records if r.skipped] == [list(s) for s in g["skipped_scales"]]
    computed = [r for r in records if not r.skipped]
    assert [list((1,) + r.hw) for r in computed] == [list(s) for s in g["computed_scales"]]
    # every bit (README: bits of the last computed scale with a golden gap below 1e-4 may differ; none did)
    for si, (r, bits, logits) in enumerate(zip(computed, g["bits"], g["cfg_logits"], strict=True)):
        ours = r.tokens_BN.to(torch.uint8)
        differ = ours != bits
        if si == len(computed) - 1:
            gap = (logits[..., 1] - logits[..., 0]).abs().view_as(differ)
            differ &= gap >= 1e-4
        assert not bool(differ.any()), f"scale {si}: {int(differ.sum())} bits differ"
        assert (r.guided_logits_BNV.reshape(logits.shape) - logits).abs().max() <= 3e-4
    assert (result.latent - g["summed_codes_last"]).abs().max() <= 1e-6
    # pruning changed the image where it should (README table: bits off the plain run at scales 9, 10)
    plain = _golden(f"golden_plain_{setting}.pt")["bits"]
    off = tuple(int((computed[si].tokens_BN.to(torch.uint8) != plain[si]).sum()) for si in (9, 10))
    assert off == BITS_OFF_PLAIN[setting]
    assert all(int((computed[si].tokens_BN.to(torch.uint8) != plain[si]).sum()) == 0 for si in range(9))
    # kept counts: the pruned block keeps 615 of 1024 / 800 of 1600 in every branch, the others are dense
    pruned = set(g["pruned_blocks"])
    for si in (9, 10):
        N = computed[si].hw[0] * computed[si].hw[1]
        keep = N - int((0.4 if si == 9 else 0.5) * N)
        assert keep == (615 if si == 9 else 800)
        assert computed[si].kept_tokens == tuple((keep,) * 3 if b in pruned else (N,) * 3 for b in range(2))
    # the kept index sets of every pruned sub-layer (re-selected before attn, cross and ffn, per row)
    assert len(selections) == len(g.get("selections", []))
    for s in g.get("selections", []):
        assert torch.equal(selections[(s["scale_index"], s["block"], s["branch"])], s["keep_sorted"].long())


@needs_fixture
def test_fastvar_official_image(tiny):
    """The decoded 1024 px image of ``w1_cfg6_n1`` (official return value: truncated BGR uint8): within one level;
    the random decoder amplifies float noise (README), measured 1.1 % of the values one level off."""
    g, result, _ = _run(tiny, "w1_cfg6_n1", decode=True)
    ours = result.images.permute(0, 2, 3, 1).mul(255).to(torch.uint8).flip(dims=(3,))
    diff = (ours.int() - g["img_uint8_bgr"].int()).abs()
    assert diff.shape == (1, 1024, 1024, 3) and int(diff.max()) <= 1
    assert (diff > 0).float().mean() < 0.02


# ------------------------------------------------------------------------------------ resolution per model
def test_fastvar_resolves_to_each_familys_released_setting():
    generic = get_preset("fastvar")
    assert generic.per_model == "fastvar"
    inf = resolve_config(generic, INFINITY)
    assert inf.schedule.widths == (32, 40, 48, 64) and inf.schedule.ratios == (0.4, 0.5, 1.0, 1.0)
    assert inf.restorer.cache_scale == 8 and INFINITY.scale_hw[8] == (24, 24) and inf.restorer.refresh == "fixed"
    assert inf.restorer.interpolation == "area" and inf.activation.start_scale == 0 and inf.per_model == ""
    assert (inf.exempt_first_blocks, inf.pruned_blocks_end, inf.exempt_last_blocks) == (3, 28, 0)
    assert (inf.rank_bits, inf.cfg_rows, inf.granularity, inf.scorer.mode) == (0, "per_row", "branch",
                                                                                "mean_distance")
    hart = resolve_config(generic, HART)
    assert hart.schedule.widths == (48, 64) and hart.schedule.ratios == (0.5, 0.75)
    assert hart.restorer.cache_scale == 11 and HART.scale_hw[11] == (36, 36)
    assert (hart.exempt_first_blocks, hart.pruned_blocks_end) == (0, None) and hart.skip.component_name == "none"
    var = resolve_config(generic, VAR)  # no published VAR setting: the documented mapping = the generic config
    assert var == dataclasses.replace(generic, per_model="")
    assert var.schedule.ratios == (0.4, 0.5) and var.schedule.widths == ()
    assert var.restorer.cache_scale == -3 and var.activation.start_scale == -2
    # resolved configs are concrete: their hash says what runs, resolving again changes nothing
    assert len({generic.config_hash(), inf.config_hash(), var.config_hash(), hart.config_hash()}) == 4
    assert resolve_config(inf, INFINITY) == inf and resolve_config(inf, VAR) == inf
    # the cache scale is the schedule's 24x24 scale (512 px: index 8 of 10); without one, the scale before the
    # first tabulated width (here none: the last scale, never read since nothing is pruned)
    low = ModelKey("infinity", 4, INFINITY.scale_hw[:10])
    assert resolve_config(generic, low).restorer.cache_scale == 8
    tiny = ModelKey("infinity", 4, INFINITY.scale_hw[:5])
    assert resolve_config(generic, tiny).restorer.cache_scale == 4
    odd = ModelKey("infinity", 4, ((1, 1), (2, 2), (16, 16), (32, 32)))
    assert resolve_config(generic, odd).restorer.cache_scale == 2


def test_values_changed_from_the_generic_config_win():
    generic = get_preset("fastvar")
    moved = resolve_config(dataclasses.replace(generic, exempt_first_blocks=1, name="mine"), INFINITY)
    assert (moved.exempt_first_blocks, moved.pruned_blocks_end, moved.name) == (1, 28, "mine")
    bilinear = generic.replace_component("restorer", "static_cache", cache_scale=-3, interpolation="bilinear")
    restorer = resolve_config(bilinear, INFINITY).restorer
    assert (restorer.interpolation, restorer.cache_scale) == ("bilinear", 8)
    earlier = resolve_config(generic.replace_component("restorer", "static_cache", cache_scale=-6), INFINITY)
    assert earlier.restorer.cache_scale == -6
    # a value equal to the generic one is taken for untouched (documented caveat): resolve first, then change
    resolved = resolve_config(generic, INFINITY)
    minus3 = resolved.replace_component("restorer", "static_cache", cache_scale=-3)
    policy = build_policy(minus3)
    policy.check_model(GenerationInfo(1, 13, 32, ("attn", "cross", "ffn"), INFINITY.scale_hw, "infinity",
                                      GuidanceMode.BOTH, None))
    assert policy.config.restorer.cache_scale == -3
    table = generic.replace_component("schedule", "fixed_table", ratios=(0.3, 0.6, 1.0, 1.0))
    assert resolve_config(table, INFINITY).schedule.ratios == (0.3, 0.6, 1.0, 1.0)
    with pytest.raises(ValueError, match="one ratio per width"):
        resolve_config(generic.replace_component("schedule", "fixed_table", ratios=(0.3, 0.6)), INFINITY)
    swapped = generic.replace_component("restorer", "identity")  # a swapped component is kept whole
    assert resolve_config(swapped, INFINITY).restorer.component_name == "identity"
    as_given = dataclasses.replace(generic, per_model="")
    assert resolve_config(as_given, INFINITY) == as_given


def test_the_policy_resolves_at_start_and_check():
    def info(key):
        return GenerationInfo(1, len(key.scale_hw), key.num_blocks, ("attn", "cross", "ffn"), key.scale_hw,
                              key.family, GuidanceMode.BOTH, None)

    policy = build_policy(get_preset("fastvar"))
    assert isinstance(policy, AccelPolicy)
    policy.check_model(info(INFINITY))
    assert policy.config == resolve_config(get_preset("fastvar"), INFINITY)
    assert policy.schedule.config.widths == (32, 40, 48, 64) and policy.restorer.config.cache_scale == 8
    policy.check_model(info(VAR))  # the same policy object on another model: that model's setting
    assert policy.config == dataclasses.replace(get_preset("fastvar"), per_model="")
    assert policy.schedule.config.widths == ()
    toprovar = build_policy(get_preset("fastvar_toprovar"))
    with pytest.raises(ValueError, match="use the preset 'fastvar'"):
        toprovar.check_model(info(VAR))
    toprovar.check_model(info(INFINITY))
    assert toprovar.config.schedule.ratios == (0.4, 0.6, 1.0, 1.0)


def test_resolved_settings_describe_each_family():
    settings = resolved_settings("fastvar")
    assert set(settings) == {"var", "infinity", "hart"}
    assert settings["infinity"].startswith("Infinity-2B, 1024 px, 13 scales: ")
    for text in ("widths=(32, 40, 48, 64)", "ratios=(0.4, 0.5, 1, 1)", "cache_scale=8", "exempt_first_blocks=3",
                 "pruned_blocks_end=28", "rank_bits=0"):
        assert text in settings["infinity"]
    assert "ratios=(0.4, 0.5), widths=()" in settings["var"] and "cache_scale=-3" in settings["var"]
    assert "widths=(48, 64)" in settings["hart"] and "cache_scale=11" in settings["hart"]
    assert resolved_settings("fastvar_toprovar")["var"].startswith("not available: ")
    assert set(resolved_settings("baseline").values()) == {f"{label}: the plain model"
                                                          for label, _ in REFERENCE_MODELS.values()}
    assert describe_config(get_preset("baseline")) == "the plain model"


# ------------------------------------------------------------------------------ width-keyed fixed tables
def _ctx(hw, si=0, K=13, B=1):
    return ScaleContext(si, K, hw, 0, B, GuidanceMode.BOTH, 1, ("attn",), "infinity", ())


def test_fixed_table_by_width_and_ratio_one():
    table = SCHEDULES.get("fixed_table")(component_config("schedule", "fixed_table", widths=(32, 40, 48, 64),
                                                          ratios=(0.4, 0.5, 1.0, 1.0)))
    scores = torch.zeros(2, 1)
    for hw, keep in (((32, 32), 615), ((40, 40), 800)):  # 1024 - int(409.6), 1600 - 800
        assert table.prunes_scale(_ctx(hw), None) and not table.skips_scale(_ctx(hw), None)
        assert table.keep_counts(_ctx(hw), 0, "attn", scores, None).tolist() == [keep, keep]
    for hw in ((48, 48), (64, 64)):
        assert table.skips_scale(_ctx(hw), None)
    assert not table.prunes_scale(_ctx((24, 24)), None) and table.keep_counts(_ctx((24, 24)), 0, "attn", scores,
                                                                              None) is None
    assert table.ratio(_ctx((32, 16))) == 0.0 and table.ratio(_ctx((16, 32))) == 0.4  # keyed on the width
    by_position = SCHEDULES.get("fixed_table")(component_config("schedule", "fixed_table", ratios=(0.5, 1.0)))
    assert [by_position.ratio(_ctx((4, 4), si, K=4)) for si in range(4)] == [0.0, 0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="out of range"):
        component_config("schedule", "fixed_table", ratios=(0.5, 1.5))
    with pytest.raises(ValueError, match="one ratio per width"):
        component_config("schedule", "fixed_table", widths=(32,), ratios=(0.4, 0.5))


def test_ratio_one_skips_the_scale_only_when_active():
    info = GenerationInfo(1, 3, 1, ("attn",), ((1, 1), (2, 2), (4, 4)), "var", GuidanceMode.BOTH, NULL_TRACER)

    def plans(activation):
        policy = build_policy(get_preset("baseline").replace_component("schedule", "fixed_table", ratios=(0.5, 1.0))
                              .replace_component("activation", *activation))
        policy.start(info)
        return [policy.plan_scale(ScaleContext(si, 3, hw, 0, 1, GuidanceMode.BOTH, 1, ("attn",), "var", ()))
                for si, hw in enumerate(info.scale_hw)]

    fixed = plans(("fixed",))  # start_scale -2: active at scales 1 and 2
    assert [(p.skip, p.prune) for p in fixed] == [(False, False), (False, True), (True, False)]
    never = plans(("never",))
    assert [(p.skip, p.prune) for p in never] == [(False, False)] * 3


# --------------------------------------------------------------------------------- FLOPs-ideal speedups
def _infinity_2b_arch():
    from var_core.models.infinity import INFINITY_2B

    return infinity_arch(INFINITY_2B, INFINITY.scale_hw, text_len=64)


def test_planned_records_of_fastvar_on_infinity_2b():
    """The dry-run plan of ``fastvar`` on Infinity-2B equals the records written by hand from the released rule
    (blocks 3..27 keep 615 / 800 at 32 / 40, 48 and 64 not generated), and its FLOPs-ideal speedup is 4.22x
    (today's pre-issue preset, the generic mapping by position: 1.54x; issue 12's figures)."""
    arch = _infinity_2b_arch()
    records = planned_records(get_preset("fastvar"), arch)
    expected = []
    for si, hw in enumerate(INFINITY.scale_hw):
        N = hw[0] * hw[1]
        if hw[1] in (48, 64):
            expected.append(ScaleRecord(si, hw, skipped=True, guidance=GuidanceMode.BOTH))
            continue
        keep = {32: 615, 40: 800}.get(hw[1], N)
        kept = tuple((keep,) * 3 if 3 <= b < 28 else (N,) * 3 for b in range(32))
        expected.append(ScaleRecord(si, hw, skipped=False, guidance=GuidanceMode.BOTH, kept_tokens=kept))
    assert [(r.scale_index, r.skipped, r.kept_tokens) for r in records] == [
        (r.scale_index, r.skipped, tuple(r.kept_tokens)) for r in expected]
    dense = count_record_flops(arch, dense_records(arch.scale_hw), 1).total
    by_hand = count_record_flops(arch, expected, 1).total
    speedup, planned, dense_total = ideal_speedup(get_preset("fastvar"), arch)
    assert (planned, dense_total) == (by_hand, dense)
    assert speedup == pytest.approx(4.22, abs=0.005)
    generic = dataclasses.replace(get_preset("fastvar"), per_model="")
    assert ideal_speedup(generic, arch)[0] == pytest.approx(1.54, abs=0.005)
    with pytest.raises(ValueError, match="adaptive"):
        planned_records(get_preset("nova"), arch)
