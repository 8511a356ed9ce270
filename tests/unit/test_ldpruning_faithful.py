"""Paper-faithful LD-Pruning, StageVAR and SkipVAR (issue 12): where each acts, hand-worked.

SATS's window on a 13- and a 10-scale schedule, LHEP's native-grid energy on a hand-made residual map, SATS's
temperature option, the ``sparse_residual`` restorer (no new residual at pruned positions), and the scales at which
the presets prune, drop a CFG half or stop.
"""

from __future__ import annotations

import math

import pytest
import torch

from var_core.accel import build_policy, component_config
from var_core.accel.base import Signals
from var_core.accel.presets import get_preset
from var_core.accel.registry import GUIDANCES, SCORERS
from var_core.engine import GenerationInfo, GuidanceMode, SamplingConfig, ScaleContext, generate
from var_core.engine.context import ScaleRecord
from var_core.engine.tracing import NULL_TRACER

BOTH, COND, UNCOND = GuidanceMode.BOTH, GuidanceMode.COND_ONLY, GuidanceMode.UNCOND_ONLY
INFINITY_1024 = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)  # 13 scales: 9..12 = 32, 40, 48, 64
VAR_256 = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)  # 10 scales
SAMPLING = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)


def info_for(sides, batch_size=1, family="var", branches=("attn", "ffn"), sampling=None):
    hw = tuple((s, s) for s in sides)
    return GenerationInfo(batch_size, len(hw), 2, branches, hw, family, BOTH, NULL_TRACER, sampling)


def ctx_for(info, si, guidance=BOTH, history=()):
    return ScaleContext(si, info.num_scales, info.scale_hw[si], 0, info.batch_size, guidance, info.num_blocks,
                        info.branches, info.family, tuple(history))


def logits_with_gamma(gamma, N=3, V=4):
    """[2, N, V] raw logits (one sample) whose 'logits'-space discrepancy ‖c − u‖/‖c‖ is exactly gamma."""
    cond = torch.ones(1, N, V)
    return torch.cat((cond, cond * (1 - gamma)))


# ------------------------------------------------------------------------------------------------ SATS window
def sats_stop_when_gamma_is_low_only_at(sides, low_scale, **params):
    """Drive SATS over a schedule where γ is 0 at ``low_scale`` only (1 elsewhere); return the stop scale."""
    info = info_for(sides)
    sats = GUIDANCES.get("sats")(component_config("guidance", "sats", space="logits", **params))
    signals = Signals(info)
    sats.start(info, signals)
    for si in range(info.num_scales):
        assert sats.decide(ctx_for(info, si), signals).mode is None or si > low_scale
        sats.observe_logits(ctx_for(info, si), logits_with_gamma(0.0 if si == low_scale else 1.0), signals)
    return int(signals.extras["sats_stop_scale"][0])


@pytest.mark.parametrize("sides, scales, stops", [
    # 13 scales, 'dropped' (default): the uncond branch may be absent at 9..12 -> γ tested at 8..11 (12's test
    # would stop it from 13 = never)
    (INFINITY_1024, "dropped", {8: 9, 9: 10, 10: 11, 11: 12}),
    # 13 scales, 'tested': γ tested at 9..12 -> the branch stops from 10 at the earliest
    (INFINITY_1024, "tested", {9: 10, 10: 11, 11: 12}),
    # 10 scales: -4 = scale 6; 'dropped' -> tested at 5..8, absent at 6..9; 'tested' -> tested at 6..9
    (VAR_256, "dropped", {5: 6, 6: 7, 7: 8, 8: 9}),
    (VAR_256, "tested", {6: 7, 7: 8, 8: 9}),
])
def test_sats_acts_only_on_the_last_four_scales(sides, scales, stops):
    K = len(sides)
    for low in range(K):
        stop = sats_stop_when_gamma_is_low_only_at(sides, low, scales=scales)
        assert stop == stops.get(low, K), (low, stop)  # K = never stopped


def test_sats_defaults_are_the_papers_window_and_the_guard_can_be_removed():
    cfg = component_config("guidance", "sats")
    assert (cfg.min_scale, cfg.scales, cfg.temperature, cfg.delta) == (-4, "dropped", "raw", 0.15)
    assert get_preset("ldpruning").guidance == cfg
    # min_scale = 0: no guard, γ tested from scale 0 on
    assert sats_stop_when_gamma_is_low_only_at(VAR_256, 0, min_scale=0) == 1
    assert sats_stop_when_gamma_is_low_only_at(VAR_256, 2, min_scale=0, scales="tested") == 3
    sats = GUIDANCES.get("sats")(component_config("guidance", "sats", min_scale=-11))
    with pytest.raises(ValueError, match="min_scale=-11 is outside the 10 scales"):
        sats.check_model(info_for(VAR_256))


def test_sats_gamma_with_the_sampling_temperature():
    """One token, two classes: cond logits (0, ln 3), uncond (0, 0); γ in 'probabilities' space (÷ ‖p_c‖)."""
    raw = torch.tensor([[[0.0, math.log(3.0)]], [[0.0, 0.0]]])
    got = {}
    for temperature in ("raw", "sampling"):
        info = info_for((1,), sampling=SamplingConfig(temperature=0.5))
        sats = GUIDANCES.get("sats")(component_config("guidance", "sats", space="probabilities", min_scale=0,
                                                      temperature=temperature))
        signals = Signals(info)
        sats.start(info, signals)
        sats.observe_logits(ctx_for(info, 0), raw, signals)
        got[temperature] = float(signals.extras["sats_gamma"][0][0])
    # raw: p_c = (1/4, 3/4), p_u = (1/2, 1/2) -> ‖(−1/4, 1/4)‖ / ‖(1/4, 3/4)‖ = (√2/4) / (√10/4) = 1/√5
    assert got["raw"] == pytest.approx(1 / math.sqrt(5), rel=1e-6)
    # τ = 0.5: cond logits (0, 2 ln 3) -> p_c = (1/10, 9/10) -> ‖(−2/5, 2/5)‖ / ‖(1/10, 9/10)‖ = 4√2/√82
    assert got["sampling"] == pytest.approx(4 * math.sqrt(2) / math.sqrt(82), rel=1e-6)


# ---------------------------------------------------------------------------------------- LHEP's native grid
def lhep_scores(residual_BChw, hw, **params):
    scorer = SCORERS.get("lhep")(component_config("scorer", "lhep", **params))
    info = info_for((residual_BChw.shape[-1], hw[0]))
    signals = Signals(info)
    scorer.start(info, signals)
    prev = ScaleRecord(0, tuple(residual_BChw.shape[-2:]), skipped=False, guidance=BOTH, residual_BChw=residual_BChw)
    ctx = ctx_for(info, 1, history=(prev,))
    x = torch.zeros(2, hw[0] * hw[1], 4)
    return scorer.score(ctx, 0, "attn", x, signals).view(1, *hw)


def test_lhep_native_grid_energy_of_a_hand_made_residual():
    """A 4x4 residual with detail in its top-left 2x2 cell only, scored for an 8x8 scale.

    Haar on the native grid: cell (0,0) = [[1, 2], [3, 4]] -> LH = −1, HL = −2, HH = 0 -> energy 5; the other
    cells are 0. Tokens of the 4x4 grid take their cell's value: profile (5, 5, 0, 0) per axis. Bilinear
    (align_corners=False) to 8: output i samples (i + 0.5)/2 − 0.5 = −0.25, 0.25, 0.75, 1.25, 1.75, 2.25, …
    -> weights (1, 1, 1, 0.75, 0.25, 0, 0, 0) of the value 5, separably in both axes.
    """
    residual = torch.zeros(1, 1, 4, 4)
    residual[0, 0, :2, :2] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    q = torch.tensor([1.0, 1.0, 1.0, 0.75, 0.25, 0.0, 0.0, 0.0])
    expected = 5 * q.view(8, 1) * q.view(1, 8)
    got = lhep_scores(residual, (8, 8), window=1)  # grid='native', interpolation='trilinear': the defaults
    torch.testing.assert_close(got[0], expected, rtol=0, atol=1e-6)
    nearest = lhep_scores(residual, (8, 8), window=1, interpolation="nearest")
    assert torch.equal(nearest[0], torch.kron(torch.tensor([[5.0, 0.0], [0.0, 0.0]]), torch.ones(4, 4)))
    # default window 3 on the 2x2 cell grid: every neighbourhood is the whole grid -> 5 / 4 everywhere
    torch.testing.assert_close(lhep_scores(residual, (8, 8))[0], torch.full((8, 8), 1.25), rtol=0, atol=1e-6)
    # the 'current' reading resizes the residual first: a different map (smoothed detail, lower energy)
    current = lhep_scores(residual, (8, 8), window=1, grid="current")
    assert float(current.max()) < 5 * 0.5 and not torch.allclose(current, got)
    assert component_config("scorer", "lhep").grid == "native"


# ----------------------------------------------------------------------------------------- sparse_residual
def latent_spy(adapter, monkeypatch):
    """Record (scale, latent before, latent after, keep mask) at every latent update of ``adapter``."""
    calls = []
    original = adapter.update_latent

    def spy(state, si, tokens, keep_BN=None):
        before = adapter.latent(state).clone()
        out = original(state, si, tokens) if keep_BN is None else original(state, si, tokens, keep_BN)
        calls.append((si, before, adapter.latent(state).clone(), keep_BN))
        return out

    monkeypatch.setattr(adapter, "update_latent", spy)
    return calls


def kept_spy(policy):
    """Record the kept indices the loop hands to ``restore`` at each scale: {scale: [keep_Rn, ...]}."""
    seen = {}
    original = policy.restore

    def restore(ctx, block, branch, out, keep_Rn, x):
        seen.setdefault(ctx.scale_index, []).append(keep_Rn.clone())
        return original(ctx, block, branch, out, keep_Rn, x)

    policy.restore = restore
    return seen


def sparse_policy(last_scales=1):
    from var_core.accel import PolicyConfig

    return build_policy(PolicyConfig(
        name="sparse", scorer=component_config("scorer", "random"),
        activation=component_config("activation", "fixed", start_scale=-last_scales),
        schedule=component_config("schedule", "fixed_table", ratios=(0.5,) * last_scales),
        restorer=component_config("restorer", "sparse_residual")))


@pytest.fixture(scope="module")
def infinity_tiny():
    from var_core.zoo import load_model

    return load_model("random:infinity-tiny")


def test_sparse_residual_leaves_the_latent_unchanged_at_pruned_positions(infinity_tiny, monkeypatch):
    """Infinity's last scale is at full latent resolution and has no Phi: pruned positions keep their latent."""
    calls = latent_spy(infinity_tiny, monkeypatch)
    policy = sparse_policy()
    seen = kept_spy(policy)
    result = generate(infinity_tiny, ["a cat", "a dog"], seeds=[1, 2], sampling=SamplingConfig(cfg=3.0),
                      policy=policy)
    K = infinity_tiny.num_scales
    h, w = infinity_tiny.scale_hw[-1]
    N, B = h * w, 2
    assert [c[3] is None for c in calls] == [True] * (K - 1) + [False]
    # expected kept positions, from the indices the loop computed (random scores: every row its own choice)
    expected_BN = torch.zeros(B, N, dtype=torch.bool)
    for keep_Rn in seen[K - 1]:
        for r in range(keep_Rn.shape[0]):
            expected_BN[r % B, keep_Rn[r]] = True
    assert 0 < int(expected_BN.sum()) < B * N
    si, before, after, keep_BN = calls[-1]
    assert si == K - 1 and torch.equal(keep_BN.cpu(), expected_BN)
    delta = (after - before).view(B, -1, N).transpose(1, 2)  # [B, d, 1, h, w] -> [B, N, d]
    d = delta.shape[-1]
    assert torch.equal(delta[~expected_BN], torch.zeros(int((~expected_BN).sum()), d))
    kept_delta = delta[expected_BN]  # [kept, d]: ±1/√d codes of the sampled bits
    torch.testing.assert_close(kept_delta.abs(), torch.full_like(kept_delta, 1 / math.sqrt(d)))
    # the recorded residual (what LHEP reads next) is sparse too; the sampled tokens are all still recorded
    residual = result.records[-1].residual_BChw.view(B, d, N)
    assert torch.equal(residual.transpose(1, 2)[~expected_BN], torch.zeros(int((~expected_BN).sum()), d))
    assert result.records[-1].tokens_BN.shape[:2] == (B, N)
    assert policy.signals.extras["sparse_residual_kept"][K - 1].tolist() == expected_BN.sum(1).tolist()


def test_sparse_residual_on_var_zeroes_the_code_map_before_phi(tiny_adapter, monkeypatch):
    """VAR: the pruned tokens' embedding is zero at scale resolution, then the scale's Phi applies as usual."""
    calls = latent_spy(tiny_adapter, monkeypatch)
    policy = sparse_policy(last_scales=2)
    result = generate(tiny_adapter, torch.tensor([3, 7]), seeds=[1, 2], sampling=SAMPLING, policy=policy)
    quant = tiny_adapter.vae.quantize
    K = tiny_adapter.num_scales
    for si, before, after, keep_BN in calls[-2:]:
        assert keep_BN is not None and not bool(keep_BN.all())
        p = tiny_adapter.cfg.patch_nums[si]
        tokens = result.records[si].tokens_BN
        codes = quant.embedding(tokens.view(-1, p, p)).permute(0, 3, 1, 2) * keep_BN.view(-1, 1, p, p)
        full = quant.patch_nums[-1]
        up = codes if si == K - 1 else torch.nn.functional.interpolate(codes, size=(full, full), mode="bicubic")
        torch.testing.assert_close(after - before, quant.phi(si, up), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result.records[si].residual_BChw, codes, rtol=0, atol=0)


def test_sparse_residual_combines_selections_any_or_all():
    from var_core.accel.registry import RESTORERS

    info = info_for((1, 2))
    ctx = ctx_for(info, 1)  # 2x2 scale, one sample, both CFG rows
    out = {}
    for combine in ("any", "all"):
        r = RESTORERS.get("sparse_residual")(component_config("restorer", "sparse_residual", combine=combine))
        signals = Signals(info)
        r.start(info, signals)
        x = torch.randn(2, 4, 3)
        for keep in ([[0, 1], [0, 2]], [[0, 3], [0, 1]]):  # (cond row, uncond row) per branch
            keep_Rn = torch.tensor(keep)
            full = r.restore(ctx, 0, "attn", torch.ones(2, 2, 3), keep_Rn, x, signals)
            pruned = torch.ones(2, 4, dtype=torch.bool).scatter_(1, keep_Rn, False)
            assert torch.equal(full[pruned], torch.zeros(int(pruned.sum()), 3))  # no update where pruned
        out[combine] = r.latent_mask(ctx, signals)
        assert r.latent_mask(ctx, signals) is None  # consumed once per scale
    assert out["any"] is None  # positions 0..3 were each computed somewhere: nothing masked
    assert out["all"].tolist() == [[True, False, False, False]]  # only position 0 was computed by every row


# ------------------------------------------------------------------------------- where each preset acts
def plan_over(preset, sides):
    """(prune, guidance mode, stop, skip) per scale of a model-free walk through the preset's plan_scale."""
    policy = build_policy(get_preset(preset))
    info = info_for(sides, batch_size=2)
    policy.start(info)
    mode, out = BOTH, []
    for si in range(info.num_scales):
        plan = policy.plan_scale(ctx_for(info, si, mode))
        if plan.stop:
            out.append("stop")
            break
        mode = plan.guidance or mode
        out.append(("skip" if plan.skip else "prune" if plan.prune else "dense", mode))
    return out


@pytest.mark.parametrize("sides", [INFINITY_1024, VAR_256], ids=["13-scales", "10-scales"])
def test_presets_act_on_the_papers_scales(sides):
    K = len(sides)
    dense, prune = [("dense", BOTH)], [("prune", BOTH)]
    # StageVAR: the refinement stage = the last 3 scales, unconditional rows only (and token restoration)
    assert plan_over("stagevar", sides) == dense * (K - 3) + [("prune", UNCOND)] * 3
    # SkipVAR (c = 0): nothing skipped, the unconditional branch replaced on the last 3 scales -- never both
    assert plan_over("skipvar", sides) == dense * (K - 3) + [("dense", COND)] * 3
    # LD-Pruning: LHEP on the last 3 scales (SATS's drop is adaptive: with no γ observed it keeps guidance)
    assert plan_over("ldpruning", sides) == dense * (K - 3) + prune * 3
    # FastVAR-fair LD-Pruning: the last two scales are not generated, LHEP prunes the one before
    assert plan_over("ldpruning_skip", sides) == dense * (K - 3) + prune + ["stop"]


def test_stagevar_and_skipvar_generations(tiny_adapter):
    K = tiny_adapter.num_scales
    stage = generate(tiny_adapter, torch.tensor([3, 7]), seeds=[1, 2], sampling=SAMPLING,
                     policy=build_policy(get_preset("stagevar")))
    assert [r.guidance for r in stage.records] == [BOTH] * (K - 3) + [UNCOND] * 3
    dense = stage.computed_tokens_per_scale()  # per network row, 2 blocks x 2 branches
    assert all(c == 4 * h * w for c, (h, w) in zip(dense[:K - 3], tiny_adapter.scale_hw))
    assert all(c < 4 * h * w for c, (h, w) in zip(dense[K - 3:], tiny_adapter.scale_hw[K - 3:]))
    skip = generate(tiny_adapter, torch.tensor([3, 7]), seeds=[1, 2], sampling=SAMPLING,
                    policy=build_policy(get_preset("skipvar")))
    assert skip.stopped_at is None and not any(r.skipped for r in skip.records) and len(skip.records) == K
    assert [r.guidance for r in skip.records] == [BOTH] * (K - 3) + [COND] * 3


def test_sparse_residual_mask_on_infinitys_patchified_grid():
    """With the 8B's 2x2 patchify a token covers 2x2 VAE cells: a masked token zeroes exactly its four cells."""
    from types import SimpleNamespace

    from var_core.engine.adapters.infinity_adapter import InfinityAdapter

    d = 2  # VAE bits per cell; the transformer reads 4d bits per token
    stub = SimpleNamespace(_scale_hw=((2, 2),), patchify=True,
                           vae=SimpleNamespace(bits_to_codes=lambda b: ((2 * b.float() - 1) / math.sqrt(d))
                                               .movedim(-1, 1)))
    stub.bits_to_vae_grid = lambda bits, si: InfinityAdapter.bits_to_vae_grid(stub, bits, si)
    state = SimpleNamespace(summed_codes=torch.zeros(1, d, 1, 4, 4))
    bits = torch.ones(1, 4, 4 * d)  # every bit 1: code +1/√d in every cell
    keep = torch.tensor([[True, False, True, True]])  # token (0, 1) pruned
    residual = InfinityAdapter.update_latent(stub, state, 0, bits, keep)
    expected = torch.full((4, 4), 1 / math.sqrt(d))
    expected[0:2, 2:4] = 0.0  # the VAE cells of token (0, 1)
    for c in range(d):
        torch.testing.assert_close(state.summed_codes[0, c, 0], expected, rtol=0, atol=1e-7)
    assert residual.shape == (1, 4 * d, 2, 2)
    assert torch.equal(residual[0, :, 0, 1], torch.zeros(4 * d)) and bool((residual[0, :, 1, 1] > 0).all())
