"""Scorers and their shared signal helpers: hand-computed values, then a short generation per scorer arm."""

from __future__ import annotations

import math

import pytest
import torch

from var_core.accel import PolicyConfig, build_policy, component_config
from var_core.accel.attention_stats import (align_rows, fill_missing, first_occurrence_Rn, query_attention_entropy,
                                            received_attention_mass, record_attention_entropy, scatter_to_map)
from var_core.accel.base import Signals
from var_core.accel.entropy import predictive_entropy
from var_core.accel.frequency import (fft_energy, haar_energy, haar_subbands, high_frequency_energy,
                                      laplacian_energy, local_average, resize_map, sobel_energy)
from var_core.accel.lens import guidance_weights, lens_entropy, lens_entropy_map, record_lens_entropy
from var_core.engine import GenerationOptions, GuidanceMode, SamplingConfig, generate
from var_core.engine.context import GenerationInfo, ScaleContext, ScaleRecord

SAMPLED = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)
NO_DECODE = GenerationOptions(decode=False)


def _ctx(hw=(2, 2), si=1, B=1, guidance=GuidanceMode.BOTH, family="var", history=(), num_scales=4, blocks=2):
    return ScaleContext(si, num_scales, hw, 0, B, guidance, blocks, ("attn", "ffn"), family, tuple(history))


def _signals(B=1, family="var", num_scales=4):
    return Signals(GenerationInfo(B, num_scales, 2, ("attn", "ffn"), ((1, 1),) * num_scales, family,
                                  GuidanceMode.BOTH, None))


# ------------------------------------------------------------------------------------------- predictive entropy
def test_entropy_of_known_distributions():
    V = 16
    uniform = torch.zeros(1, 1, V)
    one_hot = torch.full((1, 1, V), -1e4)
    one_hot[..., 3] = 0.0
    masked = torch.full((1, 1, V), float("-inf"))  # top-k'd entries: two equal survivors = ln 2
    masked[..., :2] = 0.0
    logits = torch.cat((uniform, one_hot, masked), dim=1)
    ent = predictive_entropy(logits, "var")
    assert torch.allclose(ent, torch.tensor([[math.log(V), 0.0, math.log(2)]]), atol=1e-6)
    d = 5  # bitwise head: d bits, each at p = 0.5 -> d ln 2; certain bits -> 0
    bits_half = torch.zeros(1, 1, 2 * d)
    bits_sure = torch.tensor([[[30.0, -30.0] * d]])
    ent_bits = predictive_entropy(torch.cat((bits_half, bits_sure), dim=1), "infinity")
    assert torch.allclose(ent_bits, torch.tensor([[d * math.log(2), 0.0]]), atol=1e-6)


def test_lens_entropy_cfg_combinations():
    B, V = 1, 8
    cond = torch.zeros(B, 2, V)  # uniform: ln 8
    uncond = torch.full((B, 2, V), -1e4)
    uncond[..., 0] = 0.0  # one-hot: 0
    rows = torch.cat((cond, uncond))
    ctx = _ctx(si=0, B=B)
    sig = _signals(B)
    assert torch.allclose(lens_entropy(ctx, sig, rows, "cond"), torch.full((B, 2), math.log(V)))
    assert torch.allclose(lens_entropy(ctx, sig, rows, "mean"), torch.full((B, 2), math.log(V) / 2))
    assert lens_entropy(ctx, sig, rows, "per_row").shape == (2 * B, 2)
    # VAR's first scale: t = 0 -> guided = cond, with or without an explicit guidance scale
    assert torch.allclose(lens_entropy(ctx, sig, rows, "guided"), torch.full((B, 2), math.log(V)))
    assert torch.allclose(lens_entropy(ctx, sig, rows, "guided", guidance_scale=3.0), torch.full((B, 2), math.log(V)))


def test_guidance_weights_inferred_from_previous_scale():
    torch.manual_seed(0)
    B, N, V, K = 2, 4, 16, 5
    c, u = torch.randn(B, N, V), torch.randn(B, N, V)
    t_prev = 0.75  # VAR ramp: t = cfg * si / (K-1) with cfg = 1.5 at si = 2
    guided = (1 + t_prev) * c - t_prev * u
    guided[1] = c[1]  # sample 1's guidance was stopped (cond logits only)
    rec = ScaleRecord(2, (2, 2), False, GuidanceMode.BOTH, raw_logits_RNV=torch.cat((c, u)), guided_logits_BNV=guided)
    ctx = _ctx(si=3, B=B, history=(rec,), num_scales=K)
    alpha, beta = guidance_weights(ctx, _signals(B, num_scales=K))
    assert torch.allclose(alpha, torch.ones(B), atol=1e-4)
    assert torch.allclose(beta, torch.tensor([1 + t_prev * 3 / 2, 1.0]), atol=1e-4)  # ramp moved to si = 3
    # Infinity: constant cfg and temperature, recovered exactly
    cfg, tau = 3.0, 0.5
    rec_inf = ScaleRecord(2, (2, 2), False, GuidanceMode.BOTH, raw_logits_RNV=torch.cat((c, u)),
                          guided_logits_BNV=(u + cfg * (c - u)) / tau)
    ctx_inf = _ctx(si=3, B=B, history=(rec_inf,), family="infinity", num_scales=K)
    alpha, beta = guidance_weights(ctx_inf, _signals(B, "infinity", K))
    assert torch.allclose(alpha, torch.full((B,), 1 / tau), atol=1e-4)
    assert torch.allclose(beta, torch.full((B,), cfg / tau), atol=1e-4)
    alpha, beta = guidance_weights(ctx_inf, _signals(B, "infinity", K), guidance_scale=cfg, temperature=tau)
    assert torch.allclose(beta, torch.full((B,), cfg / tau))


def test_record_lens_entropy_idempotent_and_variants():
    sig, ctx = _signals(), _ctx(si=0)
    logits = torch.randn(2, 4, 8)
    first = record_lens_entropy(sig, ctx, 0, logits)
    again = record_lens_entropy(sig, ctx, 0, torch.randn(2, 4, 8))
    assert again is first and sig.lens_entropy[(0, 0)] is first
    variant = record_lens_entropy(sig, ctx, 0, logits, "cond")  # another component's setting: stored apart
    assert sig.lens_entropy[(0, 0)] is first and lens_entropy_map(sig, 0, 0, "cond") is variant
    assert torch.allclose(variant, predictive_entropy(logits[:1], "var"))
    assert lens_entropy_map(sig, 0, 1) is None


# -------------------------------------------------------------------------------------------- frequency maps
def test_haar_subbands_and_energy_of_a_2x2_map():
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    ll, lh, hl, hh = (s.item() for s in haar_subbands(x))
    assert (ll, lh, hl, hh) == (5.0, -1.0, -2.0, 0.0)
    assert torch.equal(haar_energy(x, window=3), torch.full((1, 2, 2), 5.0))  # LH^2 + HL^2 + HH^2


def test_haar_energy_of_odd_map_with_replicate_padding_and_channels():
    x = torch.arange(1.0, 10.0).view(1, 1, 3, 3)
    # padded rows [1 2 3 3] [4 5 6 6] [7 8 9 9] [7 8 9 9]; cells (LH, HL, HH): (-1,-3,0) (0,-3,0) (-1,0,0) (0,0,0)
    expected = torch.tensor([[[10.0, 10.0, 9.0], [10.0, 10.0, 9.0], [1.0, 1.0, 0.0]]])
    assert torch.equal(haar_energy(x, window=1), expected)
    two_channels = torch.cat((x, 2 * x), dim=1)  # energy adds over channels: 1 + 4 = 5x
    assert torch.equal(haar_energy(two_channels, window=1), 5 * expected)
    # window 3 on the 2x2 cell grid: every cell's neighbourhood is the whole grid -> (10 + 9 + 1 + 0) / 4
    assert torch.allclose(haar_energy(x, window=3), torch.full((1, 3, 3), 5.0))


def test_haar_energy_locality_and_aggregation_window():
    x = torch.zeros(1, 1, 4, 4)
    x[0, 0, :2, :2] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    no_window = haar_energy(x, window=1)
    assert torch.equal(no_window[0, :2, :2], torch.full((2, 2), 5.0))
    assert no_window.sum() == 20.0  # only the top-left cell has detail
    assert torch.allclose(haar_energy(x, window=3), torch.full((1, 4, 4), 1.25))  # 5 / 4 cells
    with pytest.raises(ValueError, match="odd"):
        local_average(torch.zeros(1, 3, 3), 2)


def test_laplacian_sobel_fft_energies():
    delta = torch.zeros(1, 1, 3, 3)
    delta[0, 0, 1, 1] = 1.0
    lap = laplacian_energy(delta)
    assert torch.equal(lap, torch.tensor([[[0.0, 1.0, 0.0], [1.0, 16.0, 1.0], [0.0, 1.0, 0.0]]]))
    ramp = torch.arange(4.0).view(1, 1, 1, 4).expand(1, 1, 4, 4)  # d/dx = 1 in the interior
    sob = sobel_energy(ramp)
    assert torch.allclose(sob[0, :, 1:3], torch.full((4, 2), 64.0))  # G_x = (1 + 2 + 1) * (x[j+1] - x[j-1]) = 8
    constant = torch.ones(2, 3, 4, 4)
    for extractor in ("haar", "fft", "laplacian", "sobel"):
        assert torch.allclose(high_frequency_energy(constant, extractor), torch.zeros(2, 4, 4), atol=1e-10)
    checker = (torch.arange(4).view(-1, 1) + torch.arange(4).view(1, -1)).remainder(2).float().mul(2).sub(1)
    energy = fft_energy(checker.view(1, 1, 4, 4), radius=0.4)  # Nyquist component: all of it is high-pass
    assert torch.allclose(energy, torch.ones(1, 4, 4), atol=1e-6)
    smooth = torch.cos(torch.arange(8.0) * 2 * math.pi / 8).view(1, 1, 1, 8).expand(1, 1, 8, 8)
    assert fft_energy(smooth, radius=0.4).abs().max() < 1e-10  # frequency 1 < 0.4 * 4: removed


def test_resize_map_modes():
    m = torch.arange(4.0).view(1, 2, 2)
    assert torch.equal(resize_map(m, (4, 4), "nearest")[0, :2, :2], torch.zeros(2, 2))
    assert torch.allclose(resize_map(m, (3, 3), "trilinear"), resize_map(m, (3, 3), "bilinear"))
    assert resize_map(m, (2, 2), "bicubic") is not None and resize_map(m, (2, 2), "area").shape == (1, 2, 2)


# -------------------------------------------------------------------------------------------- attention stats
def _probs():
    p = torch.zeros(1, 2, 2, 4)  # R=1, H=2, n=2 queries, L=4 keys (the last 2 are this scale's)
    p[0, 0, 0] = 0.25  # uniform: ln 4
    p[0, 1, 0, 3] = 1.0  # one-hot: 0
    p[0, :, 1, :2] = 0.5  # both heads ln 2, no mass on current keys
    return p


def test_query_attention_entropy_of_known_rows():
    ent = query_attention_entropy(_probs())
    assert torch.allclose(ent, torch.tensor([[math.log(4) / 2, math.log(2)]]))


def test_received_mass_and_nan_positions():
    ctx = _ctx(hw=(2, 2), si=1, B=1, guidance=GuidanceMode.COND_ONLY)
    keep = torch.tensor([[1, 3]])
    mass = received_attention_mass(_probs(), keep, ctx)
    expected = torch.tensor([[float("nan"), 0.125, float("nan"), 0.625]])  # key 2: (.25+0)/2, key 3: (.25+1)/2
    assert torch.allclose(mass, expected, equal_nan=True)
    sig = _signals()
    stored = record_attention_entropy(sig, ctx, 0, _probs(), keep)
    assert torch.allclose(stored, torch.tensor([[float("nan"), math.log(4) / 2, float("nan"), math.log(2)]]),
                          equal_nan=True)
    assert record_attention_entropy(sig, ctx, 0, torch.full((1, 2, 2, 4), 0.25), keep) is stored  # idempotent


def test_ragged_padding_counts_once():
    keep = torch.tensor([[2, 0, 2, 2]])  # a ragged row padded by repeating index 2
    assert first_occurrence_Rn(keep, 4).tolist() == [[True, True, False, False]]
    mapped = scatter_to_map(torch.tensor([[1.0, 2.0, 9.0, 9.0]]), keep, 4)
    assert torch.allclose(mapped, torch.tensor([[2.0, float("nan"), 1.0, float("nan")]]), equal_nan=True)


def test_fill_missing_and_align_rows():
    m = torch.tensor([[1.0, float("nan"), 3.0], [float("nan")] * 3])
    assert torch.equal(fill_missing(m, "lowest"), torch.tensor([[1.0, 1.0, 3.0], [0.0, 0.0, 0.0]]))
    assert torch.equal(fill_missing(m, "row_mean"), torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]))
    both = torch.arange(4.0).view(4, 1)  # B = 2, both halves
    ctx = _ctx(B=2, guidance=GuidanceMode.COND_ONLY)
    assert torch.equal(align_rows(both, GuidanceMode.BOTH, ctx), both[:2])
    assert torch.equal(align_rows(both, GuidanceMode.BOTH, _ctx(B=2)), both)


# ---------------------------------------------------------------------------------------------- scorer units
def test_fastvar_mean_distance_on_a_known_map():
    scorer = build_policy(PolicyConfig(scorer=component_config("scorer", "mse"))).scorer
    x = torch.tensor([[[0.0, 0.0], [2.0, 0.0], [1.0, 3.0]], [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]])  # R=2, N=3
    ctx = _ctx(hw=(1, 3), B=1)
    scores = scorer.score(ctx, 0, "attn", x, _signals())
    assert torch.equal(scores, torch.tensor([[2.0, 2.0, 4.0], [0.0, 0.0, 0.0]]))  # mean (1, 1) per row


def test_norm_scorer_top_and_sample():
    x = torch.tensor([[[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]]])
    ctx = _ctx(hw=(1, 3), B=1, guidance=GuidanceMode.COND_ONLY)
    top = build_policy(PolicyConfig(scorer=component_config("scorer", "norm", mode="top"))).scorer
    assert torch.equal(top.score(ctx, 0, "attn", x, _signals()), torch.tensor([[25.0, 1.0, 0.0]]))
    sample = build_policy(PolicyConfig(scorer=component_config("scorer", "norm", seed=3))).scorer
    s1, s2 = (sample.score(ctx, 0, "attn", x, _signals()) for _ in range(2))
    assert torch.equal(s1, s2) and torch.isfinite(s1).all()
    assert s1[0, 2] < s1[0, 0]  # a zero-norm token is never drawn before a non-zero one


def test_config_validation():
    with pytest.raises(ValueError, match="odd"):
        component_config("scorer", "lhep", window=4)
    with pytest.raises(ValueError, match="not one of"):
        component_config("scorer", "entropy", source="attention")
    with pytest.raises(ValueError, match="out of range"):
        component_config("scorer", "lhep", fft_radius=0.0)
    with pytest.raises(ValueError, match="not one of"):
        component_config("scorer", "attention", source="next_block")


# ------------------------------------------------------------------------------------------ short generations
ARMS = [
    ("entropy", {}), ("entropy", {"source": "previous", "upsample": "nearest"}),
    ("entropy", {"source": "lens"}), ("entropy", {"source": "lens", "lens_rows": "per_row"}),
    ("attention", {}), ("attention", {"source": "previous_block"}), ("attention", {"signal": "received_mass"}),
    ("attention", {"min_region_keep": 0.25, "regions": 2}),
    ("mse", {}), ("mse", {"mode": "block_change", "block": -1}),
    ("lhep", {}), ("lhep", {"grid": "current", "extractor": "fft"}), ("lhep", {"extractor": "sobel", "window": 1}),
    ("norm", {}), ("random", {}),
]


@pytest.fixture(scope="module")
def tiny():
    from var_core.zoo import load_model

    return load_model("official-tiny")


@pytest.mark.parametrize("name,params", ARMS, ids=[f"{n}-{'-'.join(map(str, p.values())) or 'default'}"
                                                  for n, p in ARMS])
def test_short_generation_per_scorer(tiny, name, params):
    cfg = PolicyConfig(name=name, scorer=component_config("scorer", name, **params),
                       activation=component_config("activation", "fixed", start_scale=-2))
    policy = build_policy(cfg)
    seen = []
    original = policy.scorer.score

    def recording(ctx, block, branch, x_RNC, signals):
        scores = original(ctx, block, branch, x_RNC, signals)
        seen.append((ctx.scale_index, block, ctx.batch_size, ctx.rows, ctx.num_tokens, scores))
        return scores

    policy.scorer.score = recording
    result = generate(tiny, torch.tensor([3, 7]), seeds=[1, 2], sampling=SAMPLED, policy=policy, options=NO_DECODE)
    assert seen, "the scorer was never asked"
    for si, block, B, R, N, scores in seen:
        assert si >= tiny.num_scales - 2
        assert scores.shape in ((B, N), (R, N)), (si, block, scores.shape)
        assert torch.isfinite(scores).all(), (si, block)
    full = [h * w for h, w in tiny.scale_hw]
    computed = result.computed_tokens_per_scale()
    branches = len(tiny.branches) * tiny.num_blocks
    assert computed[-1] < full[-1] * branches and computed[0] == full[0] * branches
    # a sample generated alone equals the same sample generated in a batch
    alone = generate(tiny, torch.tensor([7]), seeds=[2], sampling=SAMPLED, policy=policy, options=NO_DECODE)
    for rec_batch, rec_alone in zip(result.records, alone.records):
        assert torch.equal(rec_batch.tokens_BN[1:], rec_alone.tokens_BN)


def test_observations_are_declared_only_where_needed(tiny):
    cfg = PolicyConfig(scorer=component_config("scorer", "attention"),
                       activation=component_config("activation", "fixed", start_scale=-2))
    policy = build_policy(cfg)
    generate(tiny, torch.tensor([1]), seeds=[0], sampling=SAMPLED, policy=policy, options=NO_DECODE)
    K = tiny.num_scales
    assert {si for si, _ in policy.signals.attention_entropy} == {K - 3, K - 2}  # read at K-2 and K-1
    lens_cfg = cfg.replace_component("scorer", "entropy", source="lens")
    policy = build_policy(lens_cfg)
    generate(tiny, torch.tensor([1]), seeds=[0], sampling=SAMPLED, policy=policy, options=NO_DECODE)
    assert {key for key in policy.signals.lens_entropy} == {(si, b) for si in (K - 2, K - 1)
                                                           for b in range(tiny.num_blocks - 1)}
