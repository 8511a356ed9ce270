"""StageVAR = its released code on Infinity: ``get_preset("stagevar")`` against the goldens of the official code
(issue 28), and the released plan's pieces checked by hand.

Fixture: ``shared/fixtures/official_stagevar_tiny`` (goldens of sen-mao/FasterVAR ``Infinity/`` on the tiny random
model of ``official_infinity_tiny``, read its README). Every golden file of the folder that records a StageVAR call
(an ``args`` dict with an ``alpha``) is a setting here, whatever its name: the call's own ``cfg_list``, ``tau_list``,
``alpha``, sampling, ``g_seed``, text and seed are read from the file, the global generator is seeded with
``torch_manual_seed_before_call`` right before ``generate`` (as the goldens were made) and the bit sampler gets
its own generator seeded with ``g_seed`` (shared-generator mode, the official sampler's draws). Other folders:
``VARSCOPE_STAGEVAR_FIXTURE`` (and ``VARSCOPE_INFINITY_FIXTURE`` for the model; default: the sibling
``official_infinity_tiny``). The golden tests skip when the fixtures are absent; the others need no model.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from var_core.accel import build_policy, component_config
from var_core.accel.presets import REFERENCE_MODELS, ModelKey, get_preset, resolve_config, resolved_settings
from var_core.engine import GenerationOptions, GuidanceMode, SamplingConfig, ScaleContext, generate

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "fixtures"
STAGEVAR_DIR = Path(os.environ.get("VARSCOPE_STAGEVAR_FIXTURE", SHARED / "official_stagevar_tiny"))
INFINITY_DIR = Path(os.environ.get("VARSCOPE_INFINITY_FIXTURE", STAGEVAR_DIR.parent / "official_infinity_tiny"))
INFINITY = REFERENCE_MODELS["infinity"][1]
GAP_EXCEPTION = 1e-4  # README: bits of the last computed scale with a golden gap below this may differ


def _load(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _golden_files() -> list[Path]:
    """Every ``.pt`` of the fixture folder that records a StageVAR call (tensors and plain data only)."""
    if not STAGEVAR_DIR.is_dir() or not (INFINITY_DIR / "infinity.pth").exists():
        return []
    found = []
    for path in sorted(STAGEVAR_DIR.glob("*.pt")):
        data = _load(path)
        if isinstance(data, dict) and isinstance(data.get("args"), dict) and data["args"].get("alpha") is not None:
            found.append(path)
    return found


GOLDENS = _golden_files()
needs_fixture = pytest.mark.skipif(not GOLDENS, reason=f"no StageVAR goldens at {STAGEVAR_DIR} (or no model at "
                                                       f"{INFINITY_DIR})")


@pytest.fixture(scope="module")
def tiny():
    from var_core.verify.infinity import load_fixture_models

    model, vae, _ = load_fixture_models(INFINITY_DIR)
    return model, vae


def _call_settings(args: dict, num_scales: int):
    """``(cfg, tau, null-condition scale count)`` of the official call; refuses what the preset cannot express."""
    cfg_list = [float(c) for c in args["cfg_list"]][:num_scales]
    tau_list = [float(t) for t in args["tau_list"]][:num_scales]
    null = 0
    while null < num_scales and cfg_list[num_scales - 1 - null] == 0:
        null += 1
    head = cfg_list[:num_scales - null]
    assert head and len(set(head)) == 1, f"cfg_list {cfg_list}: one cfg, then zeros on the last scales"
    assert len(set(tau_list)) == 1, f"tau_list {tau_list}: one tau for every scale"
    assert list(args.get("cfg_insertion_layer", [0])) == [0] and not args.get("negative_label_B_or_BLT")
    assert int(args.get("B", 1)) == 1 and int(args.get("gt_leak", 0)) == 0
    assert int(args.get("trunk_scale", 1000)) >= num_scales
    return head[0], tau_list[0], null


class _Recorder:
    """Wraps the restorer's projection (the run each chunk gets, with its input) without changing anything."""

    def __init__(self, policy):
        self.runs: list[dict] = []
        project = policy.restorer.project

        def recording(ctx, block, weights_RN, count, x_RNC, signals):
            run = project(ctx, block, weights_RN, count, x_RNC, signals)
            self.runs.append(dict(scale=ctx.scale_index, block=block, x=x_RNC.clone(), run=run))
            return run

        policy.restorer.project = recording


def _run(tiny, path: Path, decode: bool = False):
    """Our run of the golden's call: the ``stagevar`` preset resolved for the model, with the call's alpha and
    null-condition count; the global generator seeded right before ``generate``, as the goldens were made."""
    from var_core.engine.adapters.infinity_adapter import InfinityAdapter
    from var_core.models.text_encoder import TextTokens

    g = _load(path)
    model, vae = tiny
    schedule = [tuple(int(v) for v in s) for s in g["scale_schedule"]]
    adapter = InfinityAdapter(model, vae, schedule=schedule)
    cfg, tau, null = _call_settings(g["args"], len(schedule))
    args = g["args"]
    sampling = SamplingConfig(cfg=cfg, top_k=int(args.get("top_k", 0)), top_p=float(args.get("top_p", 0.0)),
                              temperature=tau)
    key = ModelKey("infinity", adapter.num_blocks, adapter.scale_hw)
    config = resolve_config(get_preset("stagevar"), key)
    config = dataclasses.replace(
        config, schedule=dataclasses.replace(config.schedule, alpha=str(args["alpha"])),
        guidance=dataclasses.replace(config.guidance, count=null))
    policy = build_policy(config)
    recorder = _Recorder(policy)
    text = TextTokens.from_official(g["label_B_or_BLT"])
    # g_seed None: the official sampler draws from the global generator too (our shared mode without a generator)
    g_seed = args.get("g_seed")
    bit_generator = None if g_seed is None else torch.Generator().manual_seed(int(g_seed))
    torch.manual_seed(int(g["torch_manual_seed_before_call"]))
    result = generate(adapter, text, seeds=None, sampling=sampling, policy=policy, shared_generator=bit_generator,
                      options=GenerationOptions(decode=decode))
    return g, result, recorder, adapter


@needs_fixture
@pytest.mark.parametrize("path", GOLDENS, ids=[p.stem for p in GOLDENS])
def test_stagevar_preset_reproduces_the_released_code(tiny, path):
    g, result, recorder, adapter = _run(tiny, path)
    computed = [r for r in result.records if not r.skipped]
    # the scales computed and those not generated (widths 48 and 64)
    assert len(computed) == len(g["bits"])
    if "computed_scales" in g:
        assert [r.scale_index for r in computed] == [int(s) for s in g["computed_scales"]]
    if "skipped_scales" in g:
        assert [r.scale_index for r in result.records if r.skipped] == [int(s) for s in g["skipped_scales"]]
    # network rows given to the head at each computed scale: 2B while cfg != 0 (the code computes both rows as
    # soon as a cfg_list entry differs from 1), B (the unconditional rows) where cfg == 0
    cfg_list = [float(c) for c in g["args"]["cfg_list"]]
    rows = [int(r.raw_logits_RNV.shape[0]) for r in computed]
    assert rows == [1 if cfg_list[r.scale_index] == 0 else 2 for r in computed]
    if "rows_per_scale" in g:
        assert rows == [int(n) for n in g["rows_per_scale"]]
    for si in g.get("null_condition_scale_indices", []):
        assert result.records[int(si)].guidance is GuidanceMode.UNCOND_ONLY
    # every bit; the last computed scale may differ only where the golden gap |l(1) - l(0)| < 1e-4
    assert len(g["bits"]) == len(computed)
    for i, (r, bits, logits) in enumerate(zip(computed, g["bits"], g["cfg_logits"], strict=True)):
        differ = r.tokens_BN.to(torch.uint8) != bits
        if i == len(computed) - 1:
            gap = (logits[..., 1] - logits[..., 0]).abs().view_as(differ)
            differ &= gap >= GAP_EXCEPTION
        assert not bool(differ.any()), f"scale {r.scale_index}: {int(differ.sum())} bits differ"
        assert float((r.guided_logits_BNV.reshape(logits.shape) - logits).abs().max()) <= 3e-4
    golden_latent = g["summed_codes_last"]
    assert float((result.latent.reshape(golden_latent.shape) - golden_latent).abs().max()) <= 1e-5
    # the representative-index sets (and the draw order, the rank, the chunk input and its projection)
    chunks = adapter.block_chunks
    per_chunk = adapter.num_blocks // chunks
    runs = {(run["scale"], run["block"] // per_chunk): run for run in recorder.runs}
    selections = g["selections"]
    low_rank = [int(s) for s in g.get("low_rank_scale_indices", [])]
    assert sorted({scale for scale, _ in runs}) == sorted(low_rank or {int(s["scale"]) for s in selections})
    assert len(runs) == len(selections)
    for sel in selections:
        ours = runs[(int(sel["scale"]), int(sel["chunk"]))]
        index = ours["run"].index_Rr
        assert index.shape[1] == int(sel["rank"]) == ours["run"].tokens_RrC.shape[1]
        assert torch.equal(index.sort(dim=1).values, sel["indices_sorted"].long())
        assert torch.equal(index, sel["indices_draw_order"].long())
        x = ours["x"]
        torch.testing.assert_close(x.float().square().sum(-1), sel["row_norm2"], rtol=1e-5, atol=0)
        expected = torch.bmm(sel["Q"].transpose(1, 2), x.float())  # the golden projection of our chunk input
        assert torch.equal(ours["run"].tokens_RrC, expected)
        assert torch.equal(ours["run"].positions_Rr, torch.arange(index.shape[1]).expand_as(index))


@pytest.mark.slow
@needs_fixture
def test_stagevar_official_image(tiny):
    """The decoded image of the goldens that store one (official return value: truncated BGR uint8) within one
    level on a small fraction (README: the random decoder amplifies 1e-6)."""
    with_image = [p for p in GOLDENS if "img_uint8_bgr" in _load(p)]
    if not with_image:
        pytest.skip("no golden stores an image")
    g, result, _, _ = _run(tiny, with_image[0], decode=True)
    ours = result.images.permute(0, 2, 3, 1).mul(255).to(torch.uint8).flip(dims=(3,))
    diff = (ours.int() - g["img_uint8_bgr"].int()).abs()
    assert diff.shape == g["img_uint8_bgr"].shape and int(diff.max()) <= 1
    assert (diff > 0).float().mean() < 0.02


@needs_fixture
def test_seeded_draws_leave_the_global_generator_alone(tiny):
    """With per-sample seeds (``draws='auto'`` -> seeded) the projection draws from its own generators: the global
    generator is untouched, two runs agree, and the result differs from the global-generator run."""
    from var_core.engine.adapters.infinity_adapter import InfinityAdapter
    from var_core.models.text_encoder import TextTokens

    g = _load(GOLDENS[0])
    model, vae = tiny
    adapter = InfinityAdapter(model, vae, schedule=[tuple(int(v) for v in s) for s in g["scale_schedule"]])
    text = TextTokens.from_official(g["label_B_or_BLT"])
    sampling = SamplingConfig(cfg=3.0, top_k=1, top_p=0.0, temperature=1.0)
    config = resolve_config(get_preset("stagevar"), ModelKey("infinity", adapter.num_blocks, adapter.scale_hw))
    torch.manual_seed(5)
    before = torch.get_rng_state()
    runs = [generate(adapter, text, seeds=[0], sampling=sampling, policy=build_policy(config),
                     options=GenerationOptions(decode=False)) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(runs[0].latent, runs[1].latent)
    torch.manual_seed(5)
    shared = generate(adapter, text, sampling=sampling, policy=build_policy(config),
                      shared_generator=torch.Generator().manual_seed(0), options=GenerationOptions(decode=False))
    assert not torch.equal(torch.get_rng_state(), before)
    assert not torch.equal(shared.latent, runs[0].latent)


# ------------------------------------------------------------------------------------- the plan's pieces
def _ctx(hw, si=10, K=13, blocks=32):
    return ScaleContext(si, K, hw, 0, 1, GuidanceMode.UNCOND_ONLY, blocks, ("attn", "cross", "ffn"), "infinity",
                        ())


def test_rank_table_counts_by_hand():
    """r_b = int(ratio * N) + 1 per chunk of the model's own chunks: the issue's 40x40 counts at alpha 0.96 on the
    2B's 8 chunks of 4 blocks, the fixture README's ranks on the tiny's 2 chunks of 1 block."""
    from var_core.accel.base import Signals
    from var_core.accel.registry import SCHEDULES
    from var_core.engine import GenerationInfo

    def counts(alpha, blocks, chunks, hw=(40, 40)):
        table = SCHEDULES.get("rank_table")(component_config("schedule", "rank_table", alpha=alpha))
        info = GenerationInfo(1, 13, blocks, ("attn",), INFINITY.scale_hw, "infinity", GuidanceMode.BOTH, None,
                              block_chunks=chunks)
        out = [table.keep_counts(_ctx(hw, blocks=blocks), b, "attn", torch.zeros(1, 1), Signals(info))
               for b in range(blocks)]
        return [None if c is None else int(c[0]) for c in out]

    assert counts("0.96", 32, 8) == [c for c in (27, 219, 337, 401, 410, 317, 252, 306) for _ in range(4)]
    assert counts("0.97", 2, 2) == [29, 265] and counts("0.95", 2, 2) == [26, 186]
    assert counts("0.92", 2, 2) == [24, 122]
    # the model's own chunks, not L/8: 8 blocks in 2 chunks of 4 read table entries 0 and 1
    assert counts("0.96", 8, 2) == [27] * 4 + [219] * 4 and counts("0.96", 8, None) == [27, 219, 337, 401, 410,
                                                                                         317, 252, 306]
    assert counts("0.96", 32, 8, hw=(32, 32)) == [None] * 32  # dense at widths outside 40/48/64
    # at 48 x 48 (2304 tokens), alpha 0.96: int(0.01340312164472197 * 2304) + 1 = 31
    assert counts("0.96", 8, 8, hw=(48, 48))[0] == 31
    with pytest.raises(ValueError, match="out of|choose|one of"):
        component_config("schedule", "rank_table", alpha="0.5")


def test_skip_widths_and_the_null_rows():
    from var_core.accel.registry import SKIPS

    skip = SKIPS.get("skip_widths")(component_config("skip", "skip_widths"))
    assert [skip.decide(_ctx(hw, si), None).skip for si, hw in enumerate(INFINITY.scale_hw)] == [False] * 11 + [
        True, True]
    released = resolve_config(get_preset("stagevar"), INFINITY)
    # null_late keeps the unconditional rows at cfg 1 too (the released code computes 2B rows: cfg_list has zeros)
    policy = build_policy(released)
    assert policy.initial_guidance(GuidanceMode.NONE) is GuidanceMode.BOTH
    assert policy.initial_guidance(GuidanceMode.BOTH) is GuidanceMode.BOTH
    assert build_policy(get_preset("baseline")).initial_guidance(GuidanceMode.NONE) is GuidanceMode.NONE


def test_stagevar_resolves_to_the_released_code_on_infinity_only():
    inf = resolve_config(get_preset("stagevar"), INFINITY)
    assert inf.skip.component_name == "skip_widths" and inf.skip.widths == (48, 64)
    assert inf.schedule.component_name == "rank_table" and inf.schedule.alpha == "0.96"
    assert inf.schedule.widths == (40, 48, 64) and inf.activation.start_scale == 0
    assert (inf.restorer.component_name, inf.restorer.inputs, inf.restorer.interpolation) == (
        "previous_output", "projection", "area")
    assert (inf.scorer.component_name, inf.scorer.mode) == ("norm", "probability")
    assert (inf.guidance.component_name, inf.guidance.count, inf.granularity) == ("null_late", 3, "chunk")
    sampled = dataclasses.replace(get_preset("stagevar_sampled"), name="stagevar")
    for family in ("var", "hart"):  # no released code there: the earlier reading, by position
        assert resolve_config(get_preset("stagevar"), REFERENCE_MODELS[family][1]) == sampled
    text = resolved_settings("stagevar")
    assert "rank_table(alpha=0.96" in text["infinity"] and "inputs=projection" in text["infinity"]
    assert "fixed_table(ratios=(0.5, 0.5, 0.5)" in text["var"] and "inputs=tokens" in text["hart"]


def test_ls_presets_says_what_is_released_code():
    from ablations.listing import presets_lines

    lines = "\n".join(presets_lines())
    block = lines.split("\n  stagevar\n", 1)[1].split("\n  stagevar_sampled\n", 1)[0]
    assert "Infinity — the released code" in block and "Not the released code:" in block
    assert "VAR, HART — ours" in block
    assert "not the released code" in lines.split("\n  stagevar_sampled\n", 1)[1].split("\n\n", 1)[0]


def test_flops_ideal_of_the_released_plan_and_the_old_reading():
    """Issue 28's figures on Infinity-2B: the released plan 5.13x, the earlier reading 2.76x; the released plan's
    40x40 chunks run on exactly the table's counts, 48 and 64 are left out, and the others are dense."""
    from profilers.flops import infinity_arch
    from profilers.plan_flops import ideal_speedup, planned_records
    from var_core.models.infinity import INFINITY_2B

    arch = infinity_arch(INFINITY_2B, INFINITY.scale_hw, text_len=64)
    records = planned_records(get_preset("stagevar"), arch)
    assert [r.scale_index for r in records if r.skipped] == [11, 12]
    ranks = (27, 219, 337, 401, 410, 317, 252, 306)
    assert records[10].kept_tokens == tuple((ranks[b // 4],) * 3 for b in range(32))
    assert records[10].guidance is GuidanceMode.UNCOND_ONLY
    assert all(r.kept_tokens == tuple((r.hw[0] * r.hw[1],) * 3 for _ in range(32)) for r in records[:10])
    assert ideal_speedup(get_preset("stagevar"), arch)[0] == pytest.approx(5.13, abs=0.005)
    assert ideal_speedup(get_preset("stagevar_sampled"), arch)[0] == pytest.approx(2.76, abs=0.005)


def test_rtr_after_a_projected_chunk_by_hand():
    """The hidden state after a projected chunk = the previous scale's chunk output, area-resampled, with the
    run's outputs written at the drawn indices (pseudo-token j at index j of the draw): a second implementation."""
    from var_core.accel.base import Signals
    from var_core.accel.registry import RESTORERS
    from var_core.engine import GenerationInfo
    from var_core.engine.policy import ProjectedTokens

    restorer = RESTORERS.get("previous_output")(component_config("restorer", "previous_output", inputs="projection"))
    info = GenerationInfo(1, 3, 2, ("attn",), ((2, 2), (3, 3), (4, 4)), "infinity", GuidanceMode.BOTH, None,
                          block_chunks=1)
    signals = Signals(info, chunked_selection=True)
    restorer.start(info, signals)
    prev_ctx = ScaleContext(1, 3, (3, 3), 0, 1, GuidanceMode.BOTH, 2, ("attn",), "infinity", ())
    y = torch.arange(2 * 9 * 2, dtype=torch.float32).view(2, 9, 2)  # both rows at the 3x3 scale
    restorer.observe_block(prev_ctx, 1, y, y, signals)
    ctx = ScaleContext(2, 3, (4, 4), 0, 1, GuidanceMode.UNCOND_ONLY, 2, ("attn",), "infinity", ())
    weights = torch.rand(1, 16)
    run = restorer.project(ctx, 0, weights, 3, torch.randn(1, 16, 2), signals)
    assert isinstance(run, ProjectedTokens) and run.last_block == 1 and run.tokens_RrC.shape == (1, 3, 2)
    state = torch.tensor([[[100.0, 101.0], [200.0, 201.0], [300.0, 301.0]]])
    out = restorer.restore_projected(ctx, 1, state, run, torch.zeros(1, 16, 2), signals)
    grid = y[1:].view(1, 3, 3, 2).permute(0, 3, 1, 2)  # the unconditional row
    expected = F.interpolate(grid, size=(4, 4), mode="area").permute(0, 2, 3, 1).reshape(1, 16, 2).clone()
    for j, i in enumerate(run.index_Rr[0].tolist()):
        expected[0, i] = state[0, j]
    assert torch.equal(out, expected)
    assert len(set(run.index_Rr[0].tolist())) == 3  # drawn without replacement


@needs_fixture
def test_seeded_draws_are_batch_invariant(tiny):
    """With per-sample seeds each row draws its representatives and projection from a generator of its own state:
    a sample generated alone equals the same sample inside a batch of two (every bit, the latent exactly)."""
    from var_core.engine.adapters.infinity_adapter import InfinityAdapter
    from var_core.models.text_encoder import TextTokens

    g = _load(GOLDENS[0])
    model, vae = tiny
    adapter = InfinityAdapter(model, vae, schedule=[tuple(int(v) for v in s) for s in g["scale_schedule"]])
    text = TextTokens.from_official(_load(INFINITY_DIR / "inputs.pt")["label_B_or_BLT"])
    assert text.rows == 2
    sampling = SamplingConfig(cfg=3.0, top_k=1, top_p=0.0, temperature=1.0)
    config = resolve_config(get_preset("stagevar"), ModelKey("infinity", adapter.num_blocks, adapter.scale_hw))
    batch = generate(adapter, text, seeds=[0, 1], sampling=sampling, policy=build_policy(config),
                     options=GenerationOptions(decode=False))
    assert any(r.guidance is GuidanceMode.UNCOND_ONLY and not r.skipped for r in batch.records)
    for i in range(2):
        alone = generate(adapter, text.select([i]), seeds=[i], sampling=sampling, policy=build_policy(config),
                         options=GenerationOptions(decode=False))
        for a, b in zip(batch.records, alone.records, strict=True):
            assert a.skipped == b.skipped
            if not a.skipped:
                assert torch.equal(a.tokens_BN[i:i + 1], b.tokens_BN), f"sample {i}, scale {a.scale_index}"
        assert torch.equal(batch.latent[i:i + 1], alone.latent)
