"""Restorers (static_cache, residual_reuse, nearest, anchors), guidance (stop_at, sats, null_late), skip_last."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from var_core.accel import PolicyConfig, build_policy, component_config
from var_core.accel.base import Signals
from var_core.accel.guidance.sats import guidance_discrepancy
from var_core.accel.registry import GUIDANCES, RESTORERS
from var_core.engine import GenerationInfo, GuidanceMode, SamplingConfig, ScaleContext, generate

BOTH, COND, UNCOND = GuidanceMode.BOTH, GuidanceMode.COND_ONLY, GuidanceMode.UNCOND_ONLY
BRANCHES = ("attn", "ffn")


# ---------------------------------------------------------------------------------------------- helpers
def make_info(scale_hw, batch_size=1, family="var", guidance=BOTH, num_blocks=1):
    return GenerationInfo(batch_size, len(scale_hw), num_blocks, BRANCHES, tuple(scale_hw), family, guidance, None)


def make_ctx(info, si, guidance=BOTH):
    return ScaleContext(si, info.num_scales, info.scale_hw[si], 0, info.batch_size, guidance, info.num_blocks,
                        BRANCHES, info.family, ())


def build(kind, name, **params):
    registry = RESTORERS if kind == "restorer" else GUIDANCES
    return registry.get(name)(component_config(kind, name, **params))


def padded_selection(rows, n):
    """Kept lists padded (repeating the last kept index) to ``n``: the TokenSelection layout."""
    return torch.stack([torch.tensor(r + [r[-1]] * (n - len(r))) for r in rows])


def fresh_outputs(keep_Rn, C, seed=0):
    """Branch outputs of the kept slots; padding duplicates carry their position's value (as the loop's do)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(keep_Rn.shape[0], 64, C, generator=gen)  # one value per (row, position)
    return torch.gather(table, 1, keep_Rn.unsqueeze(-1).expand(-1, -1, C))


def grid_up(y_RNC, src_hw, dst_hw, mode):
    R, N, C = y_RNC.shape
    g = y_RNC.transpose(1, 2).reshape(R, C, *src_hw)
    kw = dict(align_corners=False) if mode == "bilinear" else {}
    return F.interpolate(g, size=dst_hw, mode=mode, **kw).flatten(2).transpose(1, 2)


def check_restored(full_RNC, keep_Rn, out_kept_RnC, expected_pruned_RNC):
    """Kept slots hold the fresh outputs; every other slot equals the expected fill."""
    R, N, C = full_RNC.shape
    kept = torch.zeros(R, N, dtype=torch.bool).scatter_(1, keep_Rn, True)
    expected = expected_pruned_RNC.clone().scatter_(1, keep_Rn.unsqueeze(-1).expand(-1, -1, C), out_kept_RnC)
    assert torch.equal(full_RNC[kept], expected[kept])
    torch.testing.assert_close(full_RNC[~kept], expected[~kept], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------- restorers
@pytest.mark.parametrize("mode", ["area", "bilinear", "nearest"])
def test_static_cache_fills_pruned_slots_with_interpolated_cache(mode):
    info = make_info([(2, 2), (3, 3), (4, 4)])
    r = build("restorer", "static_cache", cache_scale=0, interpolation=mode)
    signals = Signals(info)
    r.start(info, signals)
    C = 3
    assert r.needs(make_ctx(info, 0), signals).branch_outputs
    assert not r.needs(make_ctx(info, 2), signals).branch_outputs  # 'fixed': recorded once
    cached = {b: torch.randn(2, 4, C) for b in BRANCHES}
    for b in BRANCHES:
        r.observe_branch(make_ctx(info, 0), 0, b, cached[b], signals)
    ctx = make_ctx(info, 2)
    keep = torch.cat([padded_selection([[1, 5, 6]], 16), torch.arange(16).view(1, 16)])  # row 1 keeps all
    out = fresh_outputs(keep, C)
    x = torch.randn(2, 16, C)
    for b in BRANCHES:
        full = r.restore(ctx, 0, b, out, keep, x, signals)
        check_restored(full, keep, out, grid_up(cached[b], (2, 2), (4, 4), mode))
        assert torch.equal(full[1], out[1])  # full coverage: exactly as computed
    assert signals.extras["static_cache_misses"] == 0


def test_static_cache_refresh_rows_and_misses():
    info = make_info([(2, 2), (3, 3), (4, 4)])
    signals = Signals(info)
    fixed = build("restorer", "static_cache", cache_scale=-3)
    latest = build("restorer", "static_cache", cache_scale=-3, refresh="latest")
    for r in (fixed, latest):
        r.start(info, signals)
    keep = torch.tensor([[0, 3]])
    out = torch.ones(1, 2, 2)
    # before any cache: an error naming the scales, never a silent identity (issue 12)
    from var_core.accel.restorers.static_cache import CacheMissError

    with pytest.raises(CacheMissError, match="scale 0 block 0 .* no cache"):
        fixed.restore(make_ctx(info, 0, COND), 0, "attn", out, keep, torch.zeros(1, 4, 2), signals)
    y0, y1 = torch.randn(2, 4, 2), torch.randn(2, 9, 2)
    for r in (fixed, latest):
        r.observe_branch(make_ctx(info, 0), 0, "attn", y0, signals)
        r.observe_branch(make_ctx(info, 1), 0, "attn", y1, signals)
    assert latest.needs(make_ctx(info, 2), signals).branch_outputs
    # guidance dropped to the cond half after recording: the cached rows are sliced to [:B]
    ctx = make_ctx(info, 2, COND)
    keep = torch.tensor([[0, 15]])
    x = torch.zeros(1, 16, 2)
    check_restored(fixed.restore(ctx, 0, "attn", out, keep, x, signals), keep, out,
                   grid_up(y0[:1], (2, 2), (4, 4), "area"))
    check_restored(latest.restore(ctx, 0, "attn", out, keep, x, signals), keep, out,
                   grid_up(y1[:1], (3, 3), (4, 4), "area"))
    # null-only late scales keep the uncond half [B:]
    check_restored(latest.restore(make_ctx(info, 2, UNCOND), 0, "attn", out, keep, x, signals), keep, out,
                   grid_up(y1[1:], (3, 3), (4, 4), "area"))
    with pytest.raises(ValueError, match="outside"):
        build("restorer", "static_cache", cache_scale=5).start(info, signals)


@pytest.mark.parametrize("granularity", ["block", "branch"])
def test_residual_reuse_uses_previous_scale_residual(granularity):
    info = make_info([(2, 2), (4, 4)])
    r = build("restorer", "residual_reuse", granularity=granularity, interpolation="bilinear")
    signals = Signals(info)
    r.start(info, signals)
    needs = r.needs(make_ctx(info, 0), signals)
    assert needs.block_io == (granularity == "block") and needs.branch_outputs == (granularity == "branch")
    C = 4
    x_in, x_out = torch.randn(2, 4, C), torch.randn(2, 4, C)
    branch_out = {b: torch.randn(2, 4, C) for b in BRANCHES}
    ctx0 = make_ctx(info, 0)
    for b in BRANCHES:
        r.observe_branch(ctx0, 0, b, branch_out[b], signals)
    r.observe_block(ctx0, 0, x_in, x_out, signals)
    ctx1 = make_ctx(info, 1)
    keep = torch.cat([padded_selection([[2, 9, 10, 11]], 16), torch.arange(16).view(1, 16)])
    out = fresh_outputs(keep, C)
    x = torch.randn(2, 16, C)
    for b in BRANCHES:
        full = r.restore(ctx1, 0, b, out, keep, x, signals)
        if granularity == "block":
            fill = grid_up(x_out - x_in, (2, 2), (4, 4), "bilinear") if b == "attn" else torch.zeros(2, 16, C)
        else:
            fill = grid_up(branch_out[b], (2, 2), (4, 4), "bilinear")
        check_restored(full, keep, out, fill)
        assert torch.equal(full[1], out[1])
    # the observation of the current scale replaces the cache only for later scales
    stored = torch.ones(2, 16, C)
    r.observe_block(ctx1, 0, torch.zeros(2, 16, C), stored, signals)
    r.observe_branch(ctx1, 0, "attn", stored, signals)
    later = r.restore(make_ctx(make_info([(2, 2), (4, 4), (4, 4)]), 2), 0, "attn", out, keep, x, signals)
    check_restored(later, keep, out, torch.ones(2, 16, C))
    assert torch.equal(stored, torch.ones(2, 16, C))  # same grid: the stored map is not written into


def brute_nearest(keep_row, hw, metric):
    h, w = hw
    kept = sorted(set(keep_row))
    src = []
    for p in range(h * w):
        pr, pc = divmod(p, w)

        def dist(q):
            dr, dc = abs(pr - q // w), abs(pc - q % w)
            return {"euclidean": dr * dr + dc * dc, "manhattan": dr + dc, "chebyshev": max(dr, dc)}[metric]

        src.append(min(kept, key=lambda q: (dist(q), q)))
    return src


@pytest.mark.parametrize("metric", ["euclidean", "manhattan", "chebyshev"])
def test_nearest_takes_nearest_kept_output(metric):
    info = make_info([(3, 3), (5, 4)])
    r = build("restorer", "nearest", metric=metric)
    signals = Signals(info)
    r.start(info, signals)
    ctx = make_ctx(info, 1)
    N, C = 20, 3
    keep = torch.cat([padded_selection([[0, 7, 13, 19], [5, 6]], N), torch.arange(N).view(1, N)])
    out = fresh_outputs(keep, C, seed=3)
    x = torch.randn(3, N, C)
    full = r.restore(ctx, 0, "attn", out, keep, x, signals)
    for row in range(3):
        for p, q in enumerate(brute_nearest(keep[row].tolist(), (5, 4), metric)):
            slot = keep[row].tolist().index(q)
            assert torch.equal(full[row, p], out[row, slot]), (row, p, q)
    assert torch.equal(full[2], out[2])
    # same selection tensor in the next branch: same answer (map reused)
    assert torch.equal(r.restore(ctx, 0, "ffn", out, keep, x, signals), full)


def test_nearest_ties_go_to_lowest_position():
    info = make_info([(3, 3)])
    r = build("restorer", "nearest")
    signals = Signals(info)
    r.start(info, signals)
    keep = torch.tensor([[0, 8]])
    out = torch.tensor([[[10.0], [80.0]]])
    full = r.restore(make_ctx(info, 0), 0, "attn", out, keep, torch.zeros(1, 9, 1), signals)
    # centre (4) and the anti-diagonal corners (2, 6) are equidistant: they take position 0
    assert full[0, :, 0].tolist() == [10, 10, 10, 10, 10, 80, 10, 80, 80]


def test_anchors_forced_grid_and_recovery():
    info = make_info([(5, 5), (6, 6)])
    signals = Signals(info)
    bil = build("restorer", "anchors", stride=2, recovery="bilinear", source="anchors")
    near = build("restorer", "anchors", stride=2, recovery="nearest", source="anchors")
    comp = build("restorer", "anchors", stride=2, recovery="bilinear", source="computed")
    for r in (bil, near, comp):
        r.start(info, signals)
    forced = bil.forced_keep(make_ctx(info, 0), signals)
    assert forced.dtype == torch.bool and forced.shape == (25,)
    assert forced.nonzero().flatten().tolist() == [0, 2, 4, 10, 12, 14, 20, 22, 24]
    # bilinear from anchors reproduces a linear field exactly inside the anchor hull
    ctx = make_ctx(info, 0)
    keep = torch.tensor([[0, 2, 4, 10, 12, 14, 20, 22, 24, 7]])  # anchors + one extra kept token (position 7)
    keep = keep.sort(dim=1).values
    rows, cols = keep // 5, keep % 5
    out = torch.stack([rows.float(), cols.float(), torch.ones_like(rows, dtype=torch.float)], -1)
    out[0, (keep[0] == 7).nonzero().item()] = torch.tensor([100.0, 100.0, 1.0])  # not an anchor: ignored
    full = bil.restore(ctx, 0, "attn", out, keep, torch.zeros(1, 25, 3), signals)
    r_all, c_all = torch.arange(25) // 5, torch.arange(25) % 5
    expected = torch.stack([r_all.float(), c_all.float(), torch.ones(25)], -1)
    expected[7] = torch.tensor([100.0, 100.0, 1.0])
    torch.testing.assert_close(full[0], expected)
    # 'computed' sources also use the extra token: its neighbour (1, 1) mixes it in
    full_c = comp.restore(ctx, 0, "attn", out, keep, torch.zeros(1, 25, 3), signals)
    assert full_c[0, 6, 0] > 1.0 and torch.equal(full_c[0, keep[0]], out[0])
    # nearest anchor (ties to the lowest position); the extra kept token keeps its own output
    full_n = near.restore(ctx, 0, "attn", out, keep, torch.zeros(1, 25, 3), signals)
    anchors = forced.nonzero().flatten().tolist()
    for p, q in enumerate(brute_nearest(anchors, (5, 5), "euclidean")):
        want = out[0, keep[0].tolist().index(p if p == 7 else q)]
        assert torch.equal(full_n[0, p], want), p
    # beyond the last anchor row/column: constant extrapolation
    ctx6 = make_ctx(info, 1)
    keep6 = bil.forced_keep(ctx6, signals).nonzero().flatten().view(1, -1)
    vals = torch.randn(1, keep6.shape[1], 2)
    full6 = bil.restore(ctx6, 0, "ffn", vals, keep6, torch.zeros(1, 36, 2), signals).view(6, 6, 2)
    torch.testing.assert_close(full6[5], full6[4])
    torch.testing.assert_close(full6[:, 5], full6[:, 4])
    with pytest.raises(ValueError):
        component_config("restorer", "anchors", stride=0)


# ---------------------------------------------------------------------------------------------- guidance
def fake_logits(gamma_B, N=4, V=6):
    """Raw [2B, N, V] logits whose cond/uncond discrepancy in 'logits' space is exactly gamma per sample."""
    cond = torch.ones(len(gamma_B), N, V)
    uncond = cond * (1 - torch.tensor(gamma_B)).view(-1, 1, 1)
    return torch.cat([cond, uncond])


def run_sats(gammas, **params):
    """Drive SATS through the slots over a fake γ sequence; returns (modes, cond_only_B per scale, stop scales)."""
    K, B = len(gammas), len(gammas[0])
    info = make_info([(2, 2)] * K, batch_size=B)
    sats = build("guidance", "sats", space="logits", **params)
    signals = Signals(info)
    sats.start(info, signals)
    mode, modes, per_sample = BOTH, [], []
    for si in range(K):
        decision = sats.decide(make_ctx(info, si, mode), signals)
        if decision.mode is not None:
            assert not (mode is not BOTH and decision.mode is BOTH)
            mode = decision.mode
        modes.append(mode)
        per_sample.append(None if decision.cond_only_B is None else decision.cond_only_B.tolist())
        if mode is BOTH:
            sats.observe_logits(make_ctx(info, si, mode), fake_logits(gammas[si]), signals)
    return modes, per_sample, signals.extras["sats_stop_scale"].tolist()


def test_sats_stop_scale_per_sample_and_physical_drop_when_all_stopped():
    gammas = [[0.9, 0.8], [0.3, 0.5], [0.1, 0.2], [0.05, 0.12], [0.2, 0.01], [0.3, 0.3], [0.3, 0.3]]
    modes, per_sample, stop = run_sats(gammas, delta=0.15, min_scale=0)  # no guard
    # sample 0: γ_2 = 0.1 < δ → cond-only from scale 3; sample 1: γ_3 = 0.12 → from scale 4
    assert stop == [3, 4]
    assert per_sample[3] == [True, False]
    assert modes == [BOTH, BOTH, BOTH, BOTH, COND, COND, COND]
    # one-way: sample 0's later γ rising above δ does not restart it (its stop is sticky)
    # min_scale guard: no test before scale 3 ('tested'), i.e. no drop before scale 4 ('dropped', the default)
    _, _, stop = run_sats(gammas, delta=0.15, min_scale=3, scales="tested")
    assert stop == [4, 4]
    _, _, stop = run_sats(gammas, delta=0.15, min_scale=4)
    assert stop == [4, 4]
    # δ = 0 never fires; a sample that never falls below δ keeps guidance (stop = num_scales)
    modes, per_sample, stop = run_sats(gammas, delta=0.0)
    assert stop == [7, 7] and modes == [BOTH] * 7 and per_sample == [None] * 7
    modes, _, stop = run_sats([[0.9, 0.1]] * 7, delta=0.15, min_scale=0)
    assert stop == [7, 1] and modes == [BOTH] * 7


def test_sats_spaces_and_validation():
    torch.manual_seed(0)
    c, u = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    # Infinity expected code s(2p−1) per bit, bit b's classes at (2b, 2b+1)
    p_c = torch.softmax(c.view(2, 5, 4, 2), -1)[..., 1]
    p_u = torch.softmax(u.view(2, 5, 4, 2), -1)[..., 1]
    ec, eu = (2 * p_c - 1) / 2, (2 * p_u - 1) / 2
    want = (ec - eu).flatten(1).norm(dim=1) / ec.flatten(1).norm(dim=1)
    torch.testing.assert_close(guidance_discrepancy(c, u, "infinity", "expected_code"), want)
    pv_c, pv_u = torch.softmax(c, -1), torch.softmax(u, -1)
    want = (pv_c - pv_u).flatten(1).norm(dim=1) / (0.5 * (pv_c.flatten(1).norm(dim=1) + pv_u.flatten(1).norm(dim=1)))
    torch.testing.assert_close(guidance_discrepancy(c, u, "var", "probabilities", "symmetric"), want)
    with pytest.raises(ValueError, match="not available"):
        build("guidance", "sats", space="expected_code").start(make_info([(1, 1)]), Signals(make_info([(1, 1)])))
    for bad in (dict(delta=-0.1), dict(space="latent"), dict(normalization="max")):
        with pytest.raises(ValueError):
            component_config("guidance", "sats", **bad)


# ------------------------------------------------------------------------------ generations on official-tiny
SAMPLING = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)
LABELS, SEEDS = torch.tensor([3, 7]), [1, 2]


def gen(adapter, labels=LABELS, seeds=SEEDS, **components):
    policy = build_policy(PolicyConfig(name="t", **components))
    return generate(adapter, labels, seeds=seeds, sampling=SAMPLING, policy=policy), policy


def test_stop_at_and_null_late_modes(tiny_adapter):
    K = tiny_adapter.num_scales
    result, _ = gen(tiny_adapter, guidance=component_config("guidance", "stop_at", start_scale=-2))
    assert [r.guidance for r in result.records] == [BOTH] * (K - 2) + [COND] * 2
    assert result.records[-1].raw_logits_RNV.shape[0] == 2 and torch.isfinite(result.images).all()
    result, policy = gen(tiny_adapter, guidance=component_config("guidance", "null_late", count=3))
    assert [r.guidance for r in result.records] == [BOTH] * (K - 3) + [UNCOND] * 3
    assert [h["guidance"] for h in policy.history][-3:] == ["uncond_only"] * 3
    with pytest.raises(ValueError, match="unconditional"):
        gen(tiny_adapter, guidance=component_config("guidance", "null_late", count=K))


def test_skip_last_stop_and_skip(tiny_adapter):
    K = tiny_adapter.num_scales
    stopped, _ = gen(tiny_adapter, skip=component_config("skip", "skip_last", count=2, mode="stop"))
    skipped, _ = gen(tiny_adapter, skip=component_config("skip", "skip_last", count=2, mode="skip"))
    assert stopped.stopped_at == K - 2 and len(stopped.records) == K - 2
    assert skipped.stopped_at is None and [r.skipped for r in skipped.records] == [False] * (K - 2) + [True] * 2
    torch.testing.assert_close(stopped.images, skipped.images, rtol=0, atol=0)
    none, _ = gen(tiny_adapter, skip=component_config("skip", "skip_last", count=0))
    assert none.stopped_at is None and len(none.records) == K


def test_sats_generation_per_sample_and_batch_equals_single(tiny_adapter):
    K = tiny_adapter.num_scales
    probe, policy = gen(tiny_adapter, guidance=component_config("guidance", "sats", delta=0.0))
    gammas = policy.signals.extras["sats_gamma"]
    assert sorted(gammas) == list(range(K)) and all(g.shape == (2,) for g in gammas.values())
    # pick the scale where the two samples differ most and a δ between them: only one sample stops there
    s = max(range(1, K - 2), key=lambda k: float((gammas[k][0] - gammas[k][1]).abs()))
    first = int(gammas[s].argmin())
    delta = float(gammas[s].mean())
    result, policy = gen(tiny_adapter, guidance=component_config("guidance", "sats", delta=delta, min_scale=s,
                                                                 scales="tested"))
    stop = policy.signals.extras["sats_stop_scale"].tolist()
    assert stop[first] == s + 1 and stop[1 - first] > s + 1
    assert result.records[s + 1].guidance is BOTH  # the other sample still needs its uncond rows
    cond_from = max(stop)
    assert all((r.guidance is COND) == (r.scale_index >= cond_from) for r in result.records)
    # the stopped sample alone (physical drop at s+1) equals the same sample in the batch (logical drop)
    alone, policy1 = gen(tiny_adapter, labels=LABELS[first:first + 1], seeds=SEEDS[first:first + 1],
                         guidance=component_config("guidance", "sats", delta=delta, min_scale=s, scales="tested"))
    assert policy1.signals.extras["sats_stop_scale"].tolist() == [s + 1]
    assert alone.records[s + 1].guidance is COND
    for a, b in zip(alone.records, result.records):
        assert torch.equal(a.tokens_BN[0], b.tokens_BN[first])


RESTORER_ARMS = [
    ("static_cache", {}),
    ("static_cache", dict(refresh="latest", interpolation="bilinear")),
    ("residual_reuse", {}),
    ("residual_reuse", dict(granularity="branch", interpolation="nearest")),
    ("nearest", {}),
    ("anchors", {}),
    ("anchors", dict(stride=2, recovery="bilinear")),
]


@pytest.mark.parametrize("name,params", RESTORER_ARMS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(RESTORER_ARMS)])
def test_restorer_in_generation_finite_and_deterministic(tiny_adapter, name, params):
    components = dict(activation=component_config("activation", "fixed", start_scale=-2),
                      schedule=component_config("schedule", "fixed_table", ratios=(0.4, 0.5)),
                      restorer=component_config("restorer", name, **params))
    policy = build_policy(PolicyConfig(name="t", **components))  # reused: state must reset at every start
    first = generate(tiny_adapter, LABELS, seeds=SEEDS, sampling=SAMPLING, policy=policy)
    second = generate(tiny_adapter, LABELS, seeds=SEEDS, sampling=SAMPLING, policy=policy)
    assert torch.isfinite(first.images).all() and torch.isfinite(first.latent).all()
    assert torch.equal(first.images, second.images)
    assert all(torch.equal(a.tokens_BN, b.tokens_BN) for a, b in zip(first.records, second.records))
    K = tiny_adapter.num_scales
    dense = [4 * h * w for h, w in tiny_adapter.scale_hw]  # 2 blocks x 2 branches
    computed = first.computed_tokens_per_scale()
    assert computed[:K - 2] == dense[:K - 2] and all(c < d for c, d in zip(computed[K - 2:], dense[K - 2:]))
    if name == "static_cache":
        assert policy.signals.extras["static_cache_misses"] == 0


def test_model_dependent_settings_fail_in_the_pre_flight(tiny_adapter):
    """Settings that cannot run on a model raise from ``check_model`` (what studies call before generating),
    with the component named, instead of failing mid-study."""
    from var_core.accel import PolicyConfig, build_policy
    from var_core.accel.policy import component_config
    from var_core.engine import GuidanceMode
    from var_core.engine.loop import generation_info

    info = generation_info(tiny_adapter, 1, GuidanceMode.BOTH)
    K = tiny_adapter.num_scales
    bad = [
        ("guidance", component_config("guidance", "sats", space="expected_code"), "not available for the 'var'"),
        ("guidance", component_config("guidance", "null_late", count=K), "every one of the"),
        ("guidance", component_config("guidance", "stop_at", start_scale=K), "outside the"),
        ("restorer", component_config("restorer", "static_cache", cache_scale=K + 2), "outside the"),
        ("skip", component_config("skip", "skip_last", count=K), "leaves none"),
        ("schedule", component_config("schedule", "toprovar_gate", s_rep=K), "--set schedule.s_rep="),
    ]
    for kind, component, message in bad:
        policy = build_policy(PolicyConfig(name="probe", **{kind: component}))
        with pytest.raises(ValueError, match=message):
            policy.check_model(info)
    build_policy(PolicyConfig(name="ok")).check_model(info)  # defaults fit
