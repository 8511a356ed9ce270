"""Eviction frees memory (issue 29): after an eviction the KV cache re-allocates a block's buffers at the capacity
it still needs (kept keys + tokens still to come), the allocated bytes are measured from the buffers' storages,
and the outputs are bitwise those of the full-length buffers (engine.kvcache)."""

from __future__ import annotations

import pytest
import torch

from var_core.engine.kvcache import KVCache, KVKeep


def _keys(R: int, H: int, n: int, d: int, offset: int = 0) -> torch.Tensor:
    """k[r, h, j, :] = 1000·r + 100·h + (offset + j): every entry names its row, head and position."""
    r = torch.arange(R).view(R, 1, 1, 1) * 1000.0
    h = torch.arange(H).view(1, H, 1, 1) * 100.0
    j = torch.arange(n).view(1, 1, n, 1) + float(offset)
    return (r + h + j).expand(R, H, n, d).clone()


def test_eviction_at_10_percent_allocates_the_hand_computed_capacity():
    R, H, d, max_len = 2, 2, 4, 100
    with KVCache(num_blocks=1, max_len=max_len) as cache:
        cache.append(0, _keys(R, H, 30, d), -_keys(R, H, 30, d))  # 30 of 100 tokens consumed
        # full buffers: K and V, 2 rows x 2 heads x 100 slots x 4 dims x 4 bytes
        assert cache.allocated_nbytes() == 2 * R * H * 100 * d * 4 == 12800
        cache.evict(0, KVKeep(torch.tensor([[3, 17, 29]] * R)))  # 10 % of the 30 cached keys
        # capacity by hand: 3 kept + 70 tokens still to come = 73 <= 0.75 x 100 -> re-allocated at 73
        assert cache.allocated_nbytes() == 2 * R * H * 73 * d * 4 == 9344
        assert cache.slots() == (R * 73,)
        kv = cache.append(0, _keys(R, H, 70, d, offset=30), -_keys(R, H, 70, d, offset=30))  # the rest fits
        expected = torch.cat([torch.tensor([3.0, 17, 29]), torch.arange(30, 100.0)])
        for r in range(R):
            for h in range(H):
                assert torch.equal(kv.keys[r, h, :, 0], expected + 1000 * r + 100 * h)
                assert torch.equal(kv.values[r, h, :, 0], -(expected + 1000 * r + 100 * h))


def test_eviction_that_would_free_little_keeps_the_buffers():
    R, H, d = 1, 1, 2
    with KVCache(num_blocks=1, max_len=100) as cache:
        cache.append(0, _keys(R, H, 20, d), _keys(R, H, 20, d))
        cache.evict(0, KVKeep(torch.arange(10).view(1, 10)))  # 10 + 80 = 90 > 75: not worth a re-allocation
        assert cache.allocated_nbytes() == 2 * 100 * d * 4
    with KVCache(num_blocks=1, max_len=100, shrink=False) as cache:  # the full-length reference path
        cache.append(0, _keys(R, H, 30, d), _keys(R, H, 30, d))
        cache.evict(0, KVKeep(torch.tensor([[3, 17, 29]])))
        assert cache.allocated_nbytes() == 2 * 100 * d * 4


@pytest.fixture(scope="module")
def testbed():
    from var_core.zoo import load_model

    torch.set_num_threads(1)
    return load_model("testbed")


@pytest.mark.parametrize("kv", ["scalekv", "hack", "keep_recent"])
def test_shrunk_buffers_give_bitwise_the_outputs_of_full_buffers(testbed, kv, monkeypatch):
    """batch 1 and 8: the same tokens and latent with re-allocated and with full-length buffers, and the shrunk
    path holds less during the last scale."""
    from var_core.accel.policy import build_policy
    from var_core.accel.presets import get_preset
    from var_core.engine import GenerationOptions, generate

    # 10 % budget (scalekv's and hack's default; keep_recent's default is 50 %)
    config = get_preset("baseline").replace_component("kv", kv, **({"budget": 0.1} if kv == "keep_recent" else {}))
    options = GenerationOptions(decode=False)

    def run(labels, seeds, shrink):
        monkeypatch.setattr(type(testbed), "kv_cache",
                            lambda self: KVCache(self.num_blocks, self.total_tokens, shrink=shrink))
        return generate(testbed, labels, seeds=seeds, policy=build_policy(config), options=options)

    for labels, seeds in ((torch.tensor([3]), [11]), (torch.arange(8), list(range(40, 48)))):
        full, shrunk = run(labels, seeds, False), run(labels, seeds, True)
        for a, b in zip(full.tokens, shrunk.tokens):
            assert torch.equal(a, b)
        assert torch.equal(full.latent, shrunk.latent)
        assert full.records[-1].kv_bytes_allocated_peak == full.records[0].kv_bytes_allocated_peak
        assert shrunk.records[-1].kv_bytes_allocated_peak < 0.75 * full.records[-1].kv_bytes_allocated_peak
        assert [r.kv_bytes for r in full.records] == [r.kv_bytes for r in shrunk.records]


def test_analytic_memory_counts_the_re_allocated_buffers(testbed):
    """profilers.memory's KV term follows the buffers an eviction re-allocated: during the last scale it equals
    the storages measured on the cache (fp32, so the analytic element size is the cache's), below the dense
    ``2·R·L_max·C·e`` per block."""
    from profilers.memory import analytic_memory
    from var_core.accel.policy import build_policy
    from var_core.accel.presets import get_preset
    from var_core.engine import GenerationOptions, generate

    config = get_preset("baseline").replace_component("kv", "scalekv")
    result = generate(testbed, torch.tensor([1, 4]), seeds=[7, 8], policy=build_policy(config),
                      options=GenerationOptions(decode=False))
    report = analytic_memory(testbed, result.records, batch_size=2)
    dense = testbed.num_blocks * 2 * 4 * testbed.total_tokens * testbed.cfg.embed_dim * 4  # 4 CFG rows, fp32
    assert report.scales[0].kv_reserved_bytes == dense
    assert report.scales[-1].kv_reserved_bytes == result.records[-1].kv_bytes_allocated_peak < 0.75 * dense
