"""ToProVAR's attention entropy without materialising the probabilities (var_core/engine/attention.py).

``H_i = log Z_i − E_α[s_i]``, computed blockwise (online log-sum-exp over key chunks) or by the fused CPU flash
kernel with the keys as values, must equal ``−Σ α log α`` of the materialised softmax to float error, with masks
and ragged rows; hand-worked distributions pin the values themselves.
"""

from __future__ import annotations

import math

import pytest
import torch

from var_core.engine import GenerationOptions, Policy, SamplingConfig, ScalePlan, generate
from var_core.engine.attention import (AttentionProbe, CachedKV, attention_entropy, entropy_chunked, entropy_fused,
                                       fused_available)

# the hand-worked values below were derived from generations with the multinomial random stream
SAMPLED = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9, draw="multinomial")


def _reference(q, k, scale, bias):
    """Materialised probabilities in float64, the textbook formula."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    p = s.softmax(-1)
    return -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(-1)


def _ragged_bias(R, L, lengths, holes=()):
    """[R, 1, 1, L] additive mask: row r sees keys [0, lengths[r]) minus the (row, key) holes."""
    valid = torch.arange(L).view(1, L) < torch.tensor(lengths).view(R, 1)
    for r, j in holes:
        valid[r, j] = False
    return torch.zeros(R, L).masked_fill(~valid, float("-inf"))[:, None, None, :]


@pytest.mark.parametrize("scale", [0.6, 25.0])  # 25: peaked rows, the online max must rescale correctly
def test_chunked_and_fused_equal_the_materialised_entropy(scale):
    torch.manual_seed(1)
    R, H, n, L, d = 3, 2, 7, 19, 8
    q, k = torch.randn(R, H, n, d), torch.randn(R, H, L, d)
    bias = _ragged_bias(R, L, lengths=(19, 13, 19), holes=((2, 3), (2, 4), (2, 11)))
    reference = _reference(q, k, scale, bias)
    chunked = entropy_chunked(q, k, scale, bias, query_chunk=3, key_chunk=5)  # several query and key chunks
    assert chunked.shape == (R, H, n) and chunked.dtype == torch.float32
    assert torch.allclose(chunked.double(), reference, atol=2e-5, rtol=1e-5)
    assert torch.allclose(entropy_chunked(q, k, scale, None, 4, 6).double(), _reference(q, k, scale, None),
                          atol=2e-5, rtol=1e-5)
    if fused_available(q):
        fused = entropy_fused(q, k, scale, bias)
        assert torch.allclose(fused.double(), reference, atol=5e-5, rtol=1e-5)
    materialised = attention_entropy(q, k, scale, bias, method="materialised")
    assert torch.allclose(materialised.double(), reference, atol=2e-5)


def test_hand_worked_entropies():
    """Uniform over 8 visible keys: ln 8; two equal logits among masked ones: ln 2; one dominant key: ~0."""
    d = 4
    q = torch.zeros(1, 1, 3, d)
    q[0, 0, 2, 0] = 1.0
    k = torch.zeros(1, 1, 8, d)
    k[0, 0, 5, 0] = 1.0
    bias = torch.zeros(1, 1, 3, 8)
    bias[0, 0, 1, 2:] = float("-inf")  # query 1 sees keys 0 and 1 only, equal logits
    for method in ("chunked", "fused", "materialised"):
        if method == "fused" and not fused_available(q):
            continue
        # query 2: logit 100 on key 5, 0 elsewhere -> entropy = 7e^-100·(100 + ...) ~ 0
        h = attention_entropy(q, k, 100.0, bias, method=method)[0, 0]
        assert h[0].item() == pytest.approx(math.log(8), abs=1e-5)
        assert h[1].item() == pytest.approx(math.log(2), abs=1e-5)
        assert abs(h[2].item()) < 1e-4


def test_lse_returned_with_the_entropy():
    torch.manual_seed(2)
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 9, 4)
    bias = _ragged_bias(2, 9, lengths=(9, 6))
    logits = (q @ k.transpose(-1, -2)) * 0.5 + bias
    for method in ("chunked", "fused"):
        if method == "fused" and not fused_available(q):
            continue
        _, lse = attention_entropy(q, k, 0.5, bias, method=method, return_lse=True)
        assert torch.allclose(lse, torch.logsumexp(logits, -1), atol=1e-5)


def test_probe_received_mass_equals_the_probability_sums():
    """Packed-layout probe: row 1 holds 6 keys (its 2 current keys at cache positions 4, 5), row 0 holds 9."""
    torch.manual_seed(3)
    R, H, n, L, d = 2, 2, 3, 9, 4
    q, keys = torch.randn(R, H, n, d), torch.randn(R, H, L, d)
    bias = _ragged_bias(R, L, lengths=(9, 6))
    current = torch.tensor([[6, 7, 8], [4, 5, 4]])  # row 1: slot 2 is padding
    current_valid = torch.tensor([[True, True, True], [True, True, False]])
    kv = CachedKV(keys, keys.clone(), bias, (9, 6), current, current_valid, packed=True)
    probe = AttentionProbe(q, kv, 0.8, method="chunked")
    p = probe.probs()  # [R, H, n, L]
    weights = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # padding queries do not count
    expected = torch.zeros(R, n)
    for r in range(R):
        for j in range(n):
            if current_valid[r, j]:
                expected[r, j] = (p[r, :, :, current[r, j]].mean(0) * weights[r]).sum()
    assert torch.allclose(probe.received_mass(weights), expected, atol=1e-5)
    assert torch.allclose(probe.query_entropy(), _reference(q, keys, 0.8, bias).mean(1).float(), atol=2e-5)


class _ObserveRagged(Policy):
    """Ragged last two scales (sample 0 keeps a quarter, sample 1 everything) with attention observed on every
    block there; stores the probe statistics, and the materialised ones for comparison."""

    def __init__(self):
        self.seen = {}

    def plan_scale(self, ctx):
        late = ctx.scale_index >= ctx.num_scales - 2
        return ScalePlan(prune=late, attention_blocks=frozenset(range(ctx.num_blocks)) if late else frozenset())

    def plan_block(self, ctx, block, branch, x):
        from var_core.accel.policy import top_tokens

        R, N, B = x.shape[0], ctx.num_tokens, ctx.batch_size
        scores = torch.arange(N, dtype=torch.float32).flip(0).expand(R, N)
        counts = torch.tensor([N // 4, N] * (R // B))
        return top_tokens(scores, counts, int(counts.max()))

    def observe_attention(self, ctx, block, probe, keep):
        assert isinstance(probe, AttentionProbe)
        fast = probe.query_entropy()
        p = probe.probs()
        slow = -torch.special.xlogy(p, p).sum(-1).mean(1)
        self.seen[(ctx.scale_index, block)] = (fast, slow, keep)


@pytest.mark.parametrize("layout", ["varlen", "padded"])
def test_probe_entropy_during_a_ragged_generation(tiny_adapter, layout):
    policy = _ObserveRagged()
    generate(tiny_adapter, torch.tensor([3, 7]), seeds=[1, 2], sampling=SAMPLED, policy=policy,
             options=GenerationOptions(decode=False, ragged_attention=layout))
    K, L = tiny_adapter.num_scales, tiny_adapter.num_blocks
    assert set(policy.seen) == {(si, b) for si in (K - 2, K - 1) for b in range(L)}
    for fast, slow, keep in policy.seen.values():
        assert fast.shape == slow.shape == keep.shape
        assert torch.allclose(fast, slow, atol=2e-5)


class _ReadStatistics(_ObserveRagged):
    """Reads what ToProVAR reads (entropy and received mass), never the probabilities."""

    def observe_attention(self, ctx, block, probe, keep):
        from var_core.accel.attention_stats import first_occurrence_Rn

        probe.query_entropy()
        probe.received_mass(first_occurrence_Rn(keep, ctx.num_tokens).float())


@pytest.mark.parametrize("layout", ["varlen", "padded"])
def test_statistics_flops_are_counted(tiny_adapter, layout):
    """The statistics pass is charged to ``attn_stats`` and the analytic total equals FlopCounterMode's."""
    from profilers.flops import count_flops, flop_counter_mode

    with flop_counter_mode() as counter:
        result = generate(tiny_adapter, torch.tensor([3, 7]), seeds=[1, 2], sampling=SAMPLED,
                          policy=_ReadStatistics(), options=GenerationOptions(decode=False, ragged_attention=layout))
    report = count_flops(tiny_adapter, result)
    assert report.total == counter.get_total_flops()
    K = tiny_adapter.num_scales
    stats = report.frame().query("component == 'attn_stats'")
    assert set(stats["scale"]) == {K - 2, K - 1} and (stats["flops"] > 0).all()
    # last scale (8x8): fused (QK^T and P·K) or chunked (QK^T) over the 4 rows' 64 query slots and 155 key slots
    # (sample 1's 91 + 64 keys; padded: 91 padded + 64), plus the received mass's QK^T over the 64 current keys
    last = result.records[-1]
    R, H, n, L = 4, tiny_adapter.var.cfg.num_heads, 64, 91 + 64
    d = tiny_adapter.var.cfg.embed_dim // H
    factor = 2 if fused_available(torch.zeros(1)) else 1
    assert last.attention_stats_flops[0] == factor * 2 * R * H * n * L * d + 2 * R * H * n * n * d


def test_toprovar_observes_only_where_its_maps_are_read(tiny_adapter):
    """ToProVAR on official-tiny (7 scales, s_rep = 6: classified at scale 5, prunable at scale 6, the last): block
    0's entropy feeds the depth test at every undecided scale; the other blocks' maps (Global/Detail classes, token
    scores read at scale 6) only at scale 5 — before issue 16 the scorer asked for every block at every undecided
    scale, and nothing reads a map of the last scale."""
    from var_core.accel import build_policy
    from var_core.accel.presets import get_preset

    policy = build_policy(get_preset("toprovar"))
    generate(tiny_adapter, torch.tensor([3]), seeds=[1], sampling=SAMPLED, policy=policy,
             options=GenerationOptions(decode=False))
    # block 0 from scale 3 (the depth test's min_test_tokens) until D is decided (end of scale 4: D = 5); both
    # blocks at scale 5, where the gate classifies the layers for scale 6
    assert policy.signals.activation_scale_B.tolist() == [5]
    assert set(policy.signals.attention_entropy) == {(3, 0), (4, 0), (5, 0), (5, 1)}


def test_entropy_benchmark_table(capsys):
    """``studies.bench entropy`` prints every method per shape with its deviation from the materialised entropy."""
    from profilers.benchmarks import bench_attention_entropy

    assert bench_attention_entropy(shapes=(("tiny", 1, 2, 5, 9, 8),), repeats=1) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = {line.split()[1]: line.split() for line in lines[2:-1]}
    assert set(rows) >= {"sdpa", "chunked", "materialised"}
    assert all(float(rows[m][4]) < 1e-5 for m in rows)  # max |dH| against the materialised reference
    assert float(rows["materialised"][5]) == pytest.approx(1 * 2 * 5 * 9 * 4 / 2**20, abs=0.05)
    assert lines[-1].startswith("entropy_fused_vs_sdpa=")
