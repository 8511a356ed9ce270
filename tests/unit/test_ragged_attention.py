"""Ragged selections: attention on each row's valid tokens (packed KV cache, var_core/engine/attention.py) equals the
padded-and-masked path — outputs and cache contents — and the FLOPs counter charges the pairs it computed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from var_core.engine import GenerationOptions, Policy, SamplingConfig, ScalePlan, generate
from var_core.engine.attention import CachedAttention, row_groups
from var_core.engine.kvcache import KVCache

SAMPLED = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)


def test_row_groups_are_strided_views_of_equal_counts():
    # cond rows 0, 1 and uncond rows 2, 3 of two samples: each sample's pair is one strided slice
    assert row_groups([9, 36, 9, 36], [64, 91, 64, 91]) == [(slice(0, 3, 2), 9, 64), (slice(1, 4, 2), 36, 91)]
    rows = row_groups([5] * 11, [7, 7, 7, 0, 0, 0, 0, 0, 7, 7, 7])
    assert (slice(0, 3, 1), 5, 7) in rows and (slice(8, 11, 1), 5, 7) in rows
    assert row_groups([2, 2, 2, 0], [3, 3, 3, 3])[0] == (slice(0, 3, 1), 2, 3)  # a row without queries: left out
    assert row_groups([1, 1, 1], [4, 9, 4]) == [(slice(0, 3, 2), 1, 4), (slice(1, 2), 1, 9)]


def test_packed_cache_and_varlen_core_against_per_row_attention():
    """Two ragged appends: each row's keys are stored contiguously, and every valid query attends to exactly its
    row's keys (float64 per-row SDPA reference); the pairs are Σ_r n_r·len_r."""
    torch.manual_seed(0)
    R, H, d = 3, 2, 4
    cache = KVCache(num_blocks=1, max_len=20, layout="packed").__enter__()
    k1, v1 = torch.randn(R, H, 4, d), torch.randn(R, H, 4, d)
    valid1 = torch.tensor([[True] * 4, [True, True, False, False], [True, True, True, False]])
    cache.append(0, k1, v1, valid1)
    for buffer in (cache.keys[0], cache.values[0]):  # what uninitialised memory may hold beyond the rows' ends
        buffer[:, :, 4:] = float("nan")
    k2, v2, q2 = torch.randn(R, H, 3, d), torch.randn(R, H, 3, d), torch.randn(R, H, 3, d)
    valid2 = torch.tensor([[True, False, False], [True] * 3, [True, True, False]])
    kv = cache.append(0, k2, v2, valid2)
    assert kv.lengths is None  # 4+1, 2+3, 3+2: the rows agree again, so no mask
    assert cache.row_lengths[0] == [5, 5, 5] and kv.bias is None
    for r in range(R):  # row r's keys: its valid slots of append 1, then of append 2, in order
        expected = torch.cat((k1[r][:, valid1[r]], k2[r][:, valid2[r]]), dim=1)
        assert torch.equal(kv.keys[r], expected)
    core = CachedAttention(kv, valid2)
    out = core(q2, kv.keys, kv.values, kv.bias, 0.5)
    for r in range(R):
        n = int(valid2[r].sum())
        ref = F.scaled_dot_product_attention(q2[r:r + 1, :, :n].double(), kv.keys[r:r + 1].double(),
                                             kv.values[r:r + 1].double(), scale=0.5)
        assert torch.allclose(out[r:r + 1, :, :n].double(), ref, atol=1e-6)
        assert not out[r, :, n:].any()  # padding query slots: zeros (the caller drops them)
    assert core.pairs == 1 * 5 + 3 * 5 + 2 * 5
    k3 = torch.randn(R, H, 2, d)
    kv3 = cache.append(0, k3, k3, torch.tensor([[True, True], [True, False], [True, True]]))
    assert kv3.lengths == (7, 6, 7) and kv3.bias is not None
    assert torch.isfinite(kv3.keys).all() and torch.isfinite(kv3.values).all()  # masked slots hold zeros, not NaN
    assert torch.isinf(kv3.bias[1, 0, 0, 6]) and not kv3.bias[0].any()
    assert kv3.current_Rn[1].tolist()[0] == 5 and kv3.current_valid_Rn[1].tolist() == [True, False]
    k4 = torch.randn(R, H, 3, d)  # padding in the middle of a row: stored in slot order all the same
    kv4 = cache.append(0, k4, k4, torch.tensor([[True, False, True], [False, True, True], [True, True, True]]))
    assert kv4.lengths == (9, 8, 10)
    assert torch.equal(kv4.keys[0, :, 7:9], k4[0][:, [0, 2]]) and torch.equal(kv4.keys[1, :, 6:8], k4[1][:, [1, 2]])
    assert kv4.current_Rn[0].tolist()[::2] == [7, 8] and kv4.current_Rn[1].tolist()[1:] == [6, 7]


class _RaggedLateScales(Policy):
    """The last two scales ragged: sample 0 keeps a quarter, sample 1 keeps everything."""

    def plan_scale(self, ctx):
        return ScalePlan(prune=ctx.scale_index >= ctx.num_scales - 2)

    def plan_block(self, ctx, block, branch, x):
        from var_core.accel.policy import top_tokens

        R, N, B = x.shape[0], ctx.num_tokens, ctx.batch_size
        scores = torch.arange(N, dtype=torch.float32).flip(0).expand(R, N)
        counts = torch.tensor([N // 4, N] * (R // B))
        return top_tokens(scores, counts, int(counts.max()))


def _run(adapter, layout, monkeypatch):
    """Generate with ``layout`` and return (result, per-block per-row valid keys at the end, FlopCounterMode total)."""
    from profilers.flops import flop_counter_mode

    snapshot = {}
    exit_ = KVCache.__exit__

    def keep_contents(self, *exc):
        rows = []
        for block, keys in enumerate(self.keys):
            per_row = []
            for r in range(keys.shape[0]):
                if self.layout == "padded" and self.valid[block] is not None:
                    mask = self.valid[block][r, :self.lengths[block]]
                    per_row.append(keys[r, :, :self.lengths[block]][:, mask].clone())
                else:
                    length = (self.row_lengths[block] or [self.lengths[block]] * keys.shape[0])[r]
                    per_row.append(keys[r, :, :length].clone())
            rows.append(per_row)
        snapshot["keys"] = rows
        return exit_(self, *exc)

    monkeypatch.setattr(KVCache, "__exit__", keep_contents)
    with flop_counter_mode() as counter:
        result = generate(adapter, torch.tensor([3, 7]), seeds=[1, 2], sampling=SAMPLED, policy=_RaggedLateScales(),
                          options=GenerationOptions(decode=False, ragged_attention=layout))
    monkeypatch.setattr(KVCache, "__exit__", exit_)
    return result, snapshot["keys"], counter.get_total_flops()


def test_varlen_equals_padded_outputs_cache_and_counted_flops(tiny_adapter, monkeypatch):
    from profilers.flops import count_flops

    varlen, varlen_keys, varlen_measured = _run(tiny_adapter, "varlen", monkeypatch)
    padded, padded_keys, padded_measured = _run(tiny_adapter, "padded", monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(varlen.tokens, padded.tokens))
    assert torch.equal(varlen.latent, padded.latent)
    for a, b in zip(varlen.records, padded.records):
        assert torch.allclose(a.raw_logits_RNV, b.raw_logits_RNV, atol=1e-5)
    for block_v, block_p in zip(varlen_keys, padded_keys):  # same valid keys per row, in the same order
        for row_v, row_p in zip(block_v, block_p):
            assert row_v.shape == row_p.shape and torch.allclose(row_v, row_p, atol=1e-5)
    # hand-worked pairs (official-tiny: scales 1..8² , K-2 = 6x6 after 55 tokens, K-1 = 8x8); rows: s0c, s1c, s0u, s1u
    K = tiny_adapter.num_scales
    assert [r.attention_pairs for r in varlen.records[:K - 2]] == [()] * (K - 2)
    scale_a = 2 * 9 * (55 + 9) + 2 * 36 * (55 + 36)  # sample 0: 9 of 36 queries; sample 1: all 36
    scale_b = 2 * 16 * (64 + 16) + 2 * 64 * (91 + 64)  # row lengths 80 and 155
    assert varlen.records[K - 2].attention_pairs == (scale_a,) * tiny_adapter.num_blocks
    assert varlen.records[K - 1].attention_pairs == (scale_b,) * tiny_adapter.num_blocks
    assert padded.records[K - 2].attention_pairs == (4 * 36 * 91,) * tiny_adapter.num_blocks
    assert padded.records[K - 1].attention_pairs == (4 * 64 * 155,) * tiny_adapter.num_blocks
    assert count_flops(tiny_adapter, varlen).total == varlen_measured
    assert count_flops(tiny_adapter, padded).total == padded_measured
    assert varlen_measured < padded_measured


def test_bad_ragged_attention_option():
    with pytest.raises(ValueError, match="ragged_attention"):
        GenerationOptions(ragged_attention="nested")


def test_padding_sources_point_each_padding_slot_at_the_slot_of_its_token():
    from var_core.engine.packing import copy_padding_outputs, padding_sources

    # row 0: kept tokens 1, 4, 7 (no padding); row 1: kept 0, 5, padding repeats 5; row 2: kept 2, padding x2
    keep = torch.tensor([[1, 4, 7], [0, 5, 5], [2, 2, 2]])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    assert padding_sources(keep, valid).tolist() == [[0, 1, 2], [0, 1, 1], [0, 0, 0]]
    out = torch.arange(9.0).view(3, 3, 1)
    assert copy_padding_outputs(out, padding_sources(keep, valid)).view(3, 3).tolist() == [
        [0.0, 1.0, 2.0], [3.0, 4.0, 4.0], [6.0, 6.0, 6.0]]
