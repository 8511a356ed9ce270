"""The KV-cache policy seam (issue 29): eviction keeps exactly the planned keys, attention reads exactly them, the
FLOPs counter and the byte measurement see them (engine.kvcache)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from var_core.engine.attention import CachedAttention
from var_core.engine.kvcache import KVCache, KVKeep


def _keys(R: int, H: int, n: int, offset: int = 0) -> torch.Tensor:
    """k[r, h, j, :] = 1000·r + 100·h + (offset + j), so every cached entry names its row, head and position."""
    r = torch.arange(R).view(R, 1, 1, 1) * 1000.0
    h = torch.arange(H).view(1, H, 1, 1) * 100.0
    j = torch.arange(n).view(1, 1, n, 1) + float(offset)
    return (r + h + j).expand(R, H, n, 2).clone()


def test_eviction_keeps_the_hand_worked_positions_in_order():
    with KVCache(num_blocks=1, max_len=12) as cache:
        cache.append(0, _keys(2, 2, 5), -_keys(2, 2, 5))  # positions 0..4
        # row 0: head 0 keeps {0, 2, 4}, head 1 keeps {1, 3, 4}; row 1: both heads keep {0, 1, 3}
        index = torch.tensor([[[0, 2, 4], [1, 3, 4]], [[0, 1, 3], [0, 1, 3]]])
        cache.evict(0, KVKeep(index))
        kv = cache.append(0, _keys(2, 2, 2, offset=5), -_keys(2, 2, 2, offset=5))  # positions 5, 6 appended after
        got = kv.keys[..., 0]
    expected = torch.tensor([[[0, 2, 4, 5, 6], [101, 103, 104, 105, 106]],
                             [[1000, 1001, 1003, 1005, 1006], [1100, 1101, 1103, 1105, 1106]]], dtype=torch.float32)
    assert torch.equal(got, expected)
    assert torch.equal(kv.values[..., 0], -expected)
    assert kv.bias is None  # every head keeps the same count: no mask


def test_keep_recent_keeps_the_last_budget_share_by_hand():
    from var_core.accel.kv.keep_recent import KeepRecent

    policy = KeepRecent(KeepRecent.Config(budget=0.5))
    # after scale 1 (2x2 tokens at offset 1): dense length 5, ceil(0.5 * 5) = 3 -> positions 2, 3, 4
    ctx = SimpleNamespace(is_last=False, token_offset=1, num_tokens=4, num_blocks=1)
    with KVCache(num_blocks=1, max_len=12) as cache:
        cache.append(0, _keys(1, 2, 1), _keys(1, 2, 1))
        cache.append(0, _keys(1, 2, 4, offset=1), _keys(1, 2, 4, offset=1))
        keep = policy.plan_kv(ctx, cache, None)
        cache.evict(0, keep[0])
        assert cache.lengths[0] == 3
        assert torch.equal(cache.view(0).keys[0, :, :, 0], torch.tensor([[2.0, 3, 4], [102, 103, 104]]))


def test_attention_over_the_evicted_cache_is_dense_attention_over_the_kept_keys():
    """Per-head budgets of different sizes (padding + mask): every (row, head) attends to exactly its kept keys
    and this scale's keys; the reference is a softmax written here over just those keys."""
    torch.manual_seed(3)
    R, H, d, L0, n = 2, 3, 4, 7, 3
    k0, v0 = torch.randn(R, H, L0, d), torch.randn(R, H, L0, d)
    k1, v1 = torch.randn(R, H, n, d), torch.randn(R, H, n, d)
    q = torch.randn(R, H, n, d)
    kept = {(0, 0): [1, 4], (0, 1): [0, 2, 5, 6], (0, 2): [3],
            (1, 0): [0, 1, 2, 3], (1, 1): [6], (1, 2): [2, 5]}
    m = 4
    index = torch.zeros(R, H, m, dtype=torch.long)
    valid = torch.zeros(R, H, m, dtype=torch.bool)
    for (r, h), pos in kept.items():
        index[r, h, :len(pos)] = torch.tensor(pos)
        index[r, h, len(pos):] = pos[-1]
        valid[r, h, :len(pos)] = True
    with KVCache(num_blocks=1, max_len=16) as cache:
        cache.append(0, k0, v0)
        cache.evict(0, KVKeep(index, valid))
        kv = cache.append(0, k1, v1)
        core = CachedAttention(kv)
        out = core(q, kv.keys, kv.values, kv.bias, 1 / math.sqrt(d))
        pairs = cache.take_attention_pairs(0)
        lengths = cache.take_attention_lengths()
    for (r, h), pos in kept.items():
        keys = torch.cat([k0[r, h, pos], k1[r, h]])
        values = torch.cat([v0[r, h, pos], v1[r, h]])
        probs = (q[r, h] @ keys.T / math.sqrt(d)).softmax(-1)
        assert torch.allclose(out[r, h], probs @ values, atol=1e-6), (r, h)
    kept_keys = sum(len(p) + n for p in kept.values())  # summed over rows and heads
    assert pairs == round(n * kept_keys / H)  # each query's kept keys, averaged over heads
    assert lengths == (round(kept_keys / (R * H)),)


def test_kv_bytes_count_the_kept_entries_and_the_stored_padding():
    R, H, d = 2, 3, 4
    with KVCache(num_blocks=2, max_len=16) as cache:
        for block in range(2):
            cache.append(block, torch.randn(R, H, 6, d), torch.randn(R, H, 6, d))
        assert cache.nbytes() == 2 * (2 * R * H * 6 * d * 4)  # two blocks, K and V, fp32
        valid = torch.ones(R, H, 3, dtype=torch.bool)
        valid[0, 1, 2] = valid[1, 2, 1:] = False  # 3 padding entries
        cache.evict(1, KVKeep(torch.tensor([0, 2, 5]).expand(R, H, 3), valid))
        assert cache.nbytes() == 2 * R * H * 6 * d * 4 + 2 * (R * H * 3 - 3) * d * 4
        assert cache.nbytes(kept=False) == 2 * R * H * 6 * d * 4 + 2 * R * H * 3 * d * 4


def test_rows_keeping_different_counts_become_row_lengths_not_a_head_mask():
    """Every head of a row keeps the same count but rows differ (ScaleKV's per-row budgets): the packed layout
    stores each row's own length (varlen attention, as for ragged token selections), not a per-head mask."""
    R, H = 2, 2
    with KVCache(num_blocks=1, max_len=12) as cache:
        cache.append(0, _keys(R, H, 5), _keys(R, H, 5))
        index = torch.tensor([[1, 3, 3], [0, 2, 4]]).view(R, 1, 3).expand(R, H, 3)
        valid = torch.tensor([[True, True, False], [True, True, True]]).view(R, 1, 3).expand(R, H, 3)
        cache.evict(0, KVKeep(index, valid))
        assert cache.head_valid[0] is None and cache.row_lengths[0] == [2, 3]
        kv = cache.append(0, _keys(R, H, 2, offset=5), _keys(R, H, 2, offset=5))
        assert kv.lengths == (4, 5)
        assert torch.equal(kv.keys[0, 0, :4, 0], torch.tensor([1.0, 3, 5, 6]))
        assert torch.equal(kv.keys[1, 1, :5, 0], torch.tensor([1100.0, 1102, 1104, 1105, 1106]))
        assert cache.nbytes() == 2 * H * (4 + 5) * 2 * 4
