"""The attention-pattern seam (issue 29, seam 2) and SparVAR / window-only on it.

Values are pinned against second implementations written here: a pair-by-pair mask from the definitions, a masked
softmax in float64, window key lists worked by hand on a tiny grid, and window pair counts summed in plain Python.
"""

from __future__ import annotations

import math

import pytest
import torch

from var_core.accel.policy import PolicyConfig, build_policy, component_config
from var_core.accel.presets import get_preset
from var_core.engine import SamplingConfig, generate
from var_core.engine.attention import SPARSE_KERNELS, AttentionPattern, ScaleWindows, sparse_attention
from var_core.engine.loop import GenerationOptions

SAMPLING = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)


def mask_by_definition(pattern: AttentionPattern, R: int, H: int) -> torch.Tensor:
    """bool [R, H, n, L], one pair at a time from the definitions (the union of group keys, windows, prefix)."""
    n, L = pattern.num_queries, pattern.num_keys
    out = torch.zeros(R, H, n, L, dtype=torch.bool)
    win = pattern.windows
    key_pos = []
    if win is not None:
        for s, (hs, ws) in enumerate(win.scale_hw):
            key_pos += [(s, y, x) for y in range(hs) for x in range(ws)]
        h, w = win.scale_hw[-1]
    kb = pattern.key_blocks_RHGL
    for r in range(R):
        for hd in range(H):
            for i in range(n):
                for j in range(L):
                    keep = j < pattern.dense_keys
                    if kb is not None and j < kb.shape[3]:
                        keep |= bool(kb[r % kb.shape[0], hd % kb.shape[1], i // pattern.query_block, j])
                    if win is not None:
                        s, ky, kx = key_pos[j]
                        hs, ws = win.scale_hw[s]
                        rad = win.radius[s]
                        qy, qx = divmod(i, w)
                        keep |= rad >= 0 and abs(ky - qy * hs // h) <= rad and abs(kx - qx * ws // w) <= rad
                    out[r, hd, i, j] = keep
    return out


def softmax_attention_float64(q, k, v, keep, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, float("-inf"))
    return s.softmax(-1) @ v.double()


def random_pattern(kernel: str, seed: int = 0) -> AttentionPattern:
    g = torch.Generator().manual_seed(seed)
    scale_hw = ((1, 1), (2, 2), (3, 3), (5, 5))
    windows = ScaleWindows(scale_hw, (-1, 0, -1, 1))
    L = windows.num_keys  # 39 keys, 25 queries
    key_blocks = torch.rand(2, 3, 4, 14, generator=g) < 0.3  # per row and head, groups of 7 queries, first 14 keys
    return AttentionPattern(25, L, key_blocks_RHGL=key_blocks, query_block=7, windows=windows, dense_keys=1,
                            kernel=kernel)


@pytest.mark.parametrize("kernel", SPARSE_KERNELS)
def test_every_kernel_equals_the_dense_reference_on_a_random_pattern(kernel):
    g = torch.Generator().manual_seed(1)
    R, H, n, L, d = 2, 3, 25, 39, 8
    q, k, v = (torch.randn(R, H, m, d, generator=g) for m in (n, L, L))
    pattern = random_pattern(kernel)
    keep = mask_by_definition(pattern, R, H)
    assert torch.equal(pattern.mask().expand(R, H, n, L), keep)  # the pattern's own mask is the definition's
    expected = softmax_attention_float64(q, k, v, keep, 0.3)
    out, pairs = sparse_attention(q, k, v, pattern, 0.3)
    assert torch.allclose(out.double(), expected, atol=1e-5), (out.double() - expected).abs().max()
    assert pairs == int(keep.sum()) // H and pattern.take_pairs() == pairs  # attended pairs, averaged over heads
    assert pairs < R * n * L  # the pattern is sparse: dense attention would differ


def test_masked_padding_keys_stay_out_of_every_kernel():
    """A ragged cache's additive bias (−inf on padding) combines with the pattern: masked keys get no weight."""
    g = torch.Generator().manual_seed(2)
    R, H, n, L, d = 2, 3, 25, 39, 8
    q, k, v = (torch.randn(R, H, m, d, generator=g) for m in (n, L, L))
    bias = torch.zeros(R, 1, 1, L)
    bias[1, ..., 20:30] = float("-inf")
    keep = mask_by_definition(random_pattern("sdpa"), R, H) & torch.isfinite(bias)
    expected = softmax_attention_float64(q, k, v, keep, 0.3)
    for kernel in SPARSE_KERNELS:
        out, pairs = sparse_attention(q, k, v, random_pattern(kernel), 0.3, bias)
        assert torch.allclose(out.double(), expected, atol=1e-5), kernel
        assert pairs == int(keep.sum()) // H, kernel


def test_window_mask_on_a_tiny_grid_by_hand():
    """Scales 1×1, 2×2, 4×4; queries on the 4×4 scale; a 3×3 window (radius 1) on their own scale, the cell under
    the query (radius 0) on the 2×2 scale, nothing on the 1×1 scale. Cache positions: 1×1 → 0, 2×2 → 1..4,
    4×4 → 5..20."""
    windows = ScaleWindows(((1, 1), (2, 2), (4, 4)), (-1, 0, 1))
    mask = windows.mask(0, 16, torch.device("cpu"))
    assert mask.shape == (16, 21)
    # query (0, 0): own (0,0) (0,1) (1,0) (1,1) -> 5 6 9 10; the 2x2 cell under it (0,0) -> 1
    assert mask[0].nonzero().flatten().tolist() == [1, 5, 6, 9, 10]
    # query (2, 3) = 11: rows 1..3 x cols 2..3 -> 5 + {6,7,10,11,14,15}; 2x2 cell (1,1) -> 4
    assert mask[11].nonzero().flatten().tolist() == [4, 11, 12, 15, 16, 19, 20]
    # query (1, 1) = 5: rows 0..2 x cols 0..2 -> 5 + {0,1,2,4,5,6,8,9,10}; 2x2 cell (0,0) -> 1
    assert mask[5].nonzero().flatten().tolist() == [1, 5, 6, 7, 9, 10, 11, 13, 14, 15]
    keys, local = windows.local(8, 12, torch.device("cpu"))  # rows 2 of the grid: its rectangles and their mask
    assert torch.equal(local, mask[8:12].index_select(1, keys)) and int(local.sum()) == int(mask[8:12].sum())


def window_pairs_by_hand(sides, si: int, self_window: int, cross_window: int, cross_from: int) -> int:
    """Σ over the queries of scale ``si`` of the keys their windows reach (plain Python, cut at the borders)."""
    h = sides[si]
    total = 0
    for y in range(h):
        for x in range(h):
            for s in range(si + 1):
                size = self_window if s == si else (cross_window if s >= cross_from else 0)
                if not size:
                    continue
                r, hs = (size - 1) // 2, sides[s]
                cy, cx = y * hs // h, x * hs // h
                total += (min(cy + r, hs - 1) - max(cy - r, 0) + 1) * (min(cx + r, hs - 1) - max(cx - r, 0) + 1)
    return total


@pytest.fixture(scope="module")
def testbed():
    from var_core.zoo import load_model

    return load_model("testbed")


def test_window_only_records_and_flops_charge_exactly_the_windowed_pairs(testbed):
    """window_only on the testbed (scales 13×13 and 16×16 windowed: 7×7 and 9×9 on their own scale, 3×3 at the
    cell of every earlier scale): each block's recorded pairs, and the FLOPs counter's score FLOPs, follow the
    window sizes counted here by hand (rows = 2 samples × 2 CFG halves)."""
    from profilers.flops import arch_from_adapter, count_record_flops

    config = PolicyConfig(name="w", attention=component_config("attention", "window_only"))
    result = generate(testbed, torch.tensor([1, 2]), seeds=[0, 1], sampling=SAMPLING, policy=build_policy(config),
                      options=GenerationOptions(decode=False))
    sides = [hw[0] for hw in testbed.scale_hw]
    K = len(sides)
    for si, window in ((K - 2, 7), (K - 1, 9)):
        expected = 4 * window_pairs_by_hand(sides, si, window, 3, 0)
        assert result.records[si].attention_pairs == (expected,) * testbed.num_blocks
    assert result.records[K - 3].attention_pairs == ()  # dense before start_scale
    arch = arch_from_adapter(testbed)
    report = count_record_flops(arch, result.records, 2)
    scores = sum(r.flops for r in report.rows if r.scale == K - 1 and r.component == "attn" and r.op == "scores")
    assert scores == testbed.num_blocks * 2 * 4 * window_pairs_by_hand(sides, K - 1, 9, 3, 0) * arch.embed_dim


@pytest.mark.parametrize("name", ["sparvar", "window_only"])
def test_sparse_attention_gives_a_sample_the_same_result_alone_and_in_a_batch(testbed, name):
    config = get_preset("sparvar") if name == "sparvar" else PolicyConfig(
        name=name, attention=component_config("attention", name))
    labels, seeds = torch.tensor([2, 7, 5]), [21, 22, 23]
    batch = generate(testbed, labels, seeds, SAMPLING, policy=build_policy(config))
    dense = generate(testbed, labels, seeds, SAMPLING)
    assert any(not torch.equal(a, b) for a, b in zip(batch.tokens, dense.tokens))  # the pattern acts
    for b in (0, 2):
        alone = generate(testbed, labels[b:b + 1], seeds[b:b + 1], SAMPLING, policy=build_policy(config))
        for a_tok, b_tok in zip(alone.tokens, batch.tokens):
            assert torch.equal(a_tok[0], b_tok[b]), (name, b)
        assert torch.allclose(alone.images[0], batch.images[b], atol=2e-4)


def test_sparvar_keeps_the_top_keys_of_its_decision_scale(testbed):
    """At the decision scale (−3) the pattern's group keys are, per row and head, the top 20 % of the keys by the
    attention mass the group's queries give them, recomputed here from the block's queries and keys."""
    from var_core.accel.attention.sparvar import SparVAR

    captured = {}
    original = SparVAR.observe_attention

    def spy(self, ctx, block, probe, keep_Rn, signals):
        if block == 3 and ctx.scale_index == self._decision:
            captured["q"], captured["k"], captured["scale"] = probe.q.clone(), probe.kv.keys.clone(), probe.scale
        original(self, ctx, block, probe, keep_Rn, signals)
        if "q" in captured and "mask" not in captured:
            captured["mask"] = self._key_blocks[3].clone()

    SparVAR.observe_attention = spy
    try:
        generate(testbed, torch.tensor([4]), [5], SAMPLING, policy=build_policy(get_preset("sparvar")),
                 options=GenerationOptions(decode=False))
    finally:
        SparVAR.observe_attention = original
    q, k = captured["q"].double(), captured["k"].double()
    p = ((q @ k.transpose(-1, -2)) * captured["scale"]).softmax(-1)  # [R, H, n, L]: n = 100 queries, one group
    mass = p.sum(2)  # [R, H, L]
    count = round(0.2 * k.shape[2])
    mask = captured["mask"]
    assert mask.shape == (2, q.shape[1], 1, k.shape[2]) and int(mask[0, 0, 0].sum()) == count
    for r in range(2):
        for hd in range(q.shape[1]):
            chosen = set(mask[r, hd, 0].nonzero().flatten().tolist())
            ranked = sorted(range(k.shape[2]), key=lambda j: -float(mass[r, hd, j]))
            assert chosen == set(ranked[:count]), (r, hd)


def test_sparvar_prunes_most_attention_pairs_on_the_last_scales_of_a_1m_tiny_infinity():
    """random:infinity-tiny on the whole 1M schedule (13 scales, 64×64 last), SparVAR at its default setting: at
    each of the two scales after the decision scale the attended pairs are at most half the dense pairs (rows ×
    queries × cached keys). About 5 s on the 2-core CPU (25 s under load; decode off)."""
    from var_core.zoo import load_model

    adapter = load_model("random:infinity-tiny", num_scales=13)
    assert adapter.scale_hw[-1] == (64, 64)
    result = generate(adapter, ["a red fox"], [3], SamplingConfig(cfg=3.0, top_k=20),
                      policy=build_policy(get_preset("sparvar")), options=GenerationOptions(decode=False))
    for record in result.records[-2:]:
        si = record.scale_index
        n = record.hw[0] * record.hw[1]
        dense = 2 * n * sum(h * w for h, w in adapter.scale_hw[:si + 1])
        assert len(record.attention_pairs) == adapter.num_blocks
        for pairs in record.attention_pairs:
            assert pairs <= 0.5 * dense, (si, pairs / dense)


def test_ls_lists_the_attention_components_and_the_sparvar_preset(capsys):
    from studies.ablate import cmd_ls

    cmd_ls("presets")
    assert "sparvar " in capsys.readouterr().out.replace("\n", " ")
    cmd_ls("components")
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "window_only" in line or "sparvar" in line.split()[:2]]
    assert any("window_only" in line for line in lines) and any("SparVAR" in line for line in lines), out


def test_attention_family_builds_and_validates_every_arm(testbed):
    """``ablate validate``'s check for the family: every arm builds, passes check_model on the testbed and on
    random:infinity-tiny (5 scales), and the arms differ in the attention component only."""
    from ablations.base import build_arms
    from var_core.accel.policy import AccelPolicy
    from var_core.engine.context import GuidanceMode
    from var_core.engine.loop import generation_info
    from var_core.zoo import load_model

    arms = build_arms("attention")
    assert [a.name for a in arms] == ["baseline", "sparvar", "window_only", "cs4a_only"]
    assert all(a.ok for a in arms), [(a.name, a.error) for a in arms if not a.ok]
    assert [a.config.attention.component_name for a in arms] == ["dense", "sparvar", "window_only", "sparvar"]
    for adapter in (testbed, load_model("random:infinity-tiny")):
        info = generation_info(adapter, 1, GuidanceMode.BOTH)
        for arm in arms:
            AccelPolicy(arm.config).check_model(info)
    # a decision scale beyond a short schedule is refused before anything runs
    short = generation_info(testbed, 1, GuidanceMode.BOTH)
    with pytest.raises(ValueError, match="decision_scale"):
        AccelPolicy(PolicyConfig(attention=component_config("attention", "sparvar", decision_scale=9))
                    ).check_model(short)


@pytest.mark.parametrize("edit", [{"kv": ("keep_recent", {"budget": 0.5})},
                                  {"activation": ("fixed", {"start_scale": -2})}])
def test_sparse_attention_with_kv_eviction_or_token_pruning_is_refused_before_generating(testbed, edit):
    """The pattern lies over the dense cache's positions; an evicted or pruned cache would misalign it (the engine
    raises mid-generation there): the policy refuses the combination at check_model, naming both components."""
    import dataclasses

    from var_core.accel.policy import AccelPolicy
    from var_core.engine.context import GuidanceMode
    from var_core.engine.loop import generation_info

    (kind, (name, params)), = edit.items()
    config = dataclasses.replace(get_preset("sparvar"), **{kind: component_config(kind, name, **params)})
    with pytest.raises(ValueError, match=f"attention=sparvar with .*{name}"):
        AccelPolicy(config).check_model(generation_info(testbed, 1, GuidanceMode.BOTH))
    AccelPolicy(get_preset("sparvar")).check_model(generation_info(testbed, 1, GuidanceMode.BOTH))  # alone: fine


def shared_keys_by_definition(pattern: AttentionPattern, q0: int, q1: int) -> set[int]:
    """The keys every row and head of the queries ``q0 .. q1−1`` may use (plain Python): the prefix, and per scale
    with a window the rows reached by some query's window × the columns reached by some query's window."""
    keys = set(range(pattern.dense_keys))
    win = pattern.windows
    h, w = win.scale_hw[-1]
    offset = 0
    for (hs, ws), r in zip(win.scale_hw, win.radius):
        if r >= 0:
            ys = {y for i in range(q0, q1) for y in range(hs) if abs(y - (i // w) * hs // h) <= r}
            xs = {x for i in range(q0, q1) for x in range(ws) if abs(x - (i % w) * ws // w) <= r}
            keys |= {offset + y * ws + x for y in ys for x in xs}
        offset += hs * ws
    return keys


@pytest.mark.parametrize("dense_keys", [0, 1, 3, 7])
def test_read_pattern_counts_reads_once_and_leaves_the_outputs_bit_identical(dense_keys):
    """Issue 27: the group key counts and the attended pairs of several patterns come back in ONE device→host read
    (the host-sync counter sees one event), equal to counts from the definitions (group keys outside the group's
    prefix and window rectangles, most over rows and heads; pairs of the pair-by-pair mask); then every kernel reads
    nothing and gives the same bits as the pattern that reads its own counts. ``dense_keys`` 3 and 7 end the prefix
    inside the 2×2 and 3×3 scales."""
    from profilers.host_syncs import HostSyncCounter

    from var_core.engine.attention import read_pattern_counts

    g = torch.Generator().manual_seed(3)
    R, H, n, L, d = 2, 3, 25, 39, 8
    q, k, v = (torch.randn(R, H, m, d, generator=g) for m in (n, L, L))

    def patterns(kernel):
        out = []
        for seed in (0, 1, 2):
            p = random_pattern(kernel, seed)
            out.append(AttentionPattern(25, L, key_blocks_RHGL=p.key_blocks_RHGL, query_block=7, windows=p.windows,
                                        dense_keys=dense_keys, kernel=kernel))
        return out

    for kernel in SPARSE_KERNELS:
        filled, plain = patterns(kernel), patterns(kernel)
        with HostSyncCounter() as counter:
            read_pattern_counts(filled, torch.device("cpu"))
        assert counter.total == 1, counter.by_site()
        for p_f, p_p in zip(filled, plain):
            keep = mask_by_definition(p_p, R, H)
            expected_counts = []
            for group, q0 in enumerate(range(0, n, 7)):
                shared = shared_keys_by_definition(p_p, q0, min(q0 + 7, n))
                kb = p_p.key_blocks_RHGL[:, :, group]
                expected_counts.append(max(sum(1 for j in range(kb.shape[-1]) if kb[r, hd, j] and j not in shared)
                                           for r in range(R) for hd in range(H)))
            assert p_f.group_counts == expected_counts
            with HostSyncCounter() as counter:
                out_f, pairs_f = sparse_attention(q, k, v, p_f, 0.3)
            if kernel != "flex":  # flex builds its mask_mod tables from host data (not the default kernel)
                assert counter.total == 0, (kernel, counter.by_site())
            out_p, pairs_p = sparse_attention(q, k, v, p_p, 0.3)
            assert pairs_f == pairs_p == int(keep.sum()) // H, kernel
            assert torch.equal(out_f, out_p), kernel


@pytest.mark.parametrize("dense_keys", [0, 1, 3, 6, 14])
def test_window_pairs_from_the_grid_sizes_equal_the_pair_by_pair_count(dense_keys):
    """``host_pairs`` (window_only's pairs, no device read) against the pair-by-pair mask, with the prefix ending
    before, at and inside a scale; and the windowed key lists of a query group whose columns are not contiguous
    (queries 8..11 of a 5×5 grid: (1, 3) (1, 4) (2, 0) (2, 1); radius 0 there), by hand."""
    windows = ScaleWindows(((1, 1), (2, 2), (3, 3), (5, 5)), (-1, 0, 1, 1))
    pattern = AttentionPattern(25, windows.num_keys, query_block=7, windows=windows, dense_keys=dense_keys)
    assert pattern.host_pairs() == int(mask_by_definition(pattern, 1, 1).sum())
    own = ScaleWindows(((1, 1), (5, 5)), (-1, 0))  # positions: 1x1 -> 0, 5x5 -> 1..25
    keys, local = own.local(8, 12, torch.device("cpu"))
    assert keys.tolist() == [1 + 5 + 0, 1 + 5 + 1, 1 + 5 + 3, 1 + 5 + 4, 1 + 10 + 0, 1 + 10 + 1, 1 + 10 + 3,
                             1 + 10 + 4]
    assert torch.equal(local, own.mask(8, 12, torch.device("cpu")).index_select(1, keys))
