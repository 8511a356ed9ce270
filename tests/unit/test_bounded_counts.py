"""Kept counts that stay on the device (``count_sync='bounded'``, issue 27) and selections shared by a scale.

NOVA's layer linkage sets each block's kept count from the logit lens after the block before, so exact shapes need
one host read per pruned block. The bounded mode runs a host-known upper bound of tokens, the slots past each row's
count masked out of attention and the KV cache. Pinned here: the bound by hand, the same kept tokens and sampled
tokens as reading the counts, the KV cache's device-count append against positions and a softmax written here, a
bound that lies is caught, and LD-Pruning / the third-party SparseVAR selecting once per scale gives the images of
selecting per block.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from var_core.accel.policy import AccelPolicy, build_policy
from var_core.accel.presets import get_preset
from var_core.accel.schedules._linkage_math import linkage_keep_bound
from var_core.engine.kvcache import KVCache
from var_core.engine.loop import GenerationOptions, generate
from var_core.engine.packing import mark_device_counts
from var_core.engine.sampling import SamplingConfig


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_linkage_keep_bound_by_hand():
    ctx = SimpleNamespace(num_tokens=256, scale_index=7, batch_size=2)
    started = SimpleNamespace(activation_scale_B=torch.tensor([6, 5]))
    centre = torch.tensor([0.6, 0.2], dtype=torch.float64)
    # removed fraction at its smallest: sigmoid(0.5) and sigmoid(0.1); kept ceil((1 - r) N), plus one
    by_hand = (math.ceil((1 - _sigmoid(0.5)) * 256) + 1, math.ceil((1 - _sigmoid(0.1)) * 256) + 1)
    assert by_hand == (98, 123)
    assert linkage_keep_bound(ctx, started, centre, 0.1, "removed") == by_hand
    assert linkage_keep_bound(ctx, started, centre, 0.1, "removed", rows=4) == by_hand * 2  # row r: sample r mod B
    # r read as the kept fraction: its largest, sigmoid(0.7) for the first sample
    assert linkage_keep_bound(ctx, started, centre, 0.1, "kept")[0] == math.ceil(_sigmoid(0.7) * 256) + 1
    # a sample that has not started runs dense: its rows' bound is every token
    not_started = SimpleNamespace(activation_scale_B=torch.tensor([6, 9]))
    assert linkage_keep_bound(ctx, not_started, centre, 0.1, "removed") == (98, 256)


@pytest.fixture(scope="module")
def testbed():
    from var_core.zoo import load_model

    return load_model("testbed")


def _run(model, config, batch_size=1, seed=1000):
    labels = torch.arange(batch_size) % model.cfg.num_classes
    with torch.inference_mode():
        return generate(model, labels, list(range(seed, seed + batch_size)), SamplingConfig(),
                        policy=build_policy(config), options=GenerationOptions(decode=True))


def _nova(mode: str):
    return dataclasses.replace(get_preset("nova"), count_sync=mode)


def _row_counts(record, block):
    """Per network row: the tokens block ``block`` kept (its valid slots where the selection was ragged)."""
    valid = record.valid_tokens_R[block][0] if record.valid_tokens_R else None
    width = record.kept_tokens[block][0]
    return [width] * record.tokens_BN.shape[0] * 2 if valid is None else valid.tolist()


@pytest.mark.parametrize("batch", [1, 8])
def test_bounded_keeps_the_tokens_per_block_reading_keeps(testbed, batch):
    """Every pruned block keeps, row by row, the count reading it keeps; the same tokens and images. At batch 8
    samples start at different scales, so rows have different bounds and the packed path runs (rows of samples
    not started yet are bounded by N)."""
    exact = _run(testbed, _nova("per_block"), batch_size=batch)
    bounded = _run(testbed, _nova("bounded"), batch_size=batch)
    padded_blocks = pruned_blocks = 0
    for a, b in zip(exact.records, bounded.records):
        if a.tokens_BN is None:
            continue
        assert torch.equal(a.tokens_BN, b.tokens_BN), a.scale_index
        N = a.hw[0] * a.hw[1]
        for block in range(len(a.kept_tokens)):
            kept, width = _row_counts(a, block), b.kept_tokens[block][0]
            if max(kept) == N and min(kept) == N:
                continue
            pruned_blocks += 1
            assert _row_counts(b, block) == kept, (a.scale_index, block)
            assert width >= max(kept)
            packed = b.packed_tokens[block][0] if b.packed_tokens else None
            ran = width * len(kept) if packed is None else packed  # tokens the block's per-token work ran on
            padded_blocks += ran > sum(kept)
    assert pruned_blocks >= 8 and padded_blocks == pruned_blocks  # the bounded path ran, with padding
    assert torch.equal(exact.images, bounded.images)
    if batch > 1:
        assert any(r.packed_tokens for r in bounded.records if r.valid_tokens_R), "no packed bounded block"


def test_bounded_reads_at_most_three_per_scale_at_batch_1_and_8(testbed):
    from profilers.host_syncs import count_generation

    for batch in (1, 8):
        bounded = count_generation(testbed, batch_size=batch, policy=build_policy(_nova("bounded"))).total
        per_block = count_generation(testbed, batch_size=batch, policy=build_policy(_nova("per_block"))).total
        assert bounded <= 3 * testbed.num_scales < per_block, (batch, bounded, per_block)
    assert get_preset("nova").count_sync == "bounded"


def test_a_bound_below_the_count_is_caught(testbed, monkeypatch):
    from var_core.accel.schedules.dual_linkage import DualLinkage

    monkeypatch.setattr(DualLinkage, "count_bound", lambda self, ctx, block, rows, signals: 2)
    with pytest.raises(RuntimeError, match="exceeded the bound"):
        _run(testbed, _nova("bounded"))


def test_device_count_append_places_keys_and_masks_the_rest():
    torch.manual_seed(0)
    R, H, d = 2, 1, 4
    k0, v0 = torch.randn(R, H, 3, d), torch.randn(R, H, 3, d)
    k1, v1 = torch.randn(R, H, 4, d), torch.randn(R, H, 4, d)
    valid = mark_device_counts(torch.tensor([[True, True, False, False], [True, True, True, False]]))
    with KVCache(num_blocks=1, max_len=12) as cache:
        cache.append(0, k0, v0)
        kv = cache.append(0, k1, v1, valid)
        assert kv.keys.shape[2] == 7  # 3 + the padded width: the host does not know the counts yet
        for r, count in enumerate((2, 3)):
            assert torch.equal(kv.keys[r, :, :3], k0[r]) and torch.equal(kv.keys[r, :, 3:3 + count], k1[r, :, :count])
            assert torch.equal(kv.values[r, :, 3:3 + count], v1[r, :, :count])
        # attention of the valid queries = a softmax over each row's own 3 + count keys, written out here
        q = torch.randn(R, H, 4, d)
        out = torch.nn.functional.scaled_dot_product_attention(q, kv.keys, kv.values, attn_mask=kv.bias)
        for r, count in enumerate((2, 3)):
            keys = torch.cat((k0[r], k1[r, :, :count]), 1)
            values = torch.cat((v0[r], v1[r, :, :count]), 1)
            weights = torch.softmax(q[r] @ keys.transpose(-1, -2) / math.sqrt(d), -1)
            assert torch.allclose(out[r, :, :count], (weights @ values)[:, :count], atol=1e-6)
        cache.resolve_lengths()
        assert cache.row_lengths[0] == [5, 6]
        k2, v2 = torch.randn(R, H, 1, d), torch.randn(R, H, 1, d)
        kv = cache.append(0, k2, v2)  # the next scale lands right after each row's own keys
        assert torch.equal(kv.keys[0, :, 5], k2[0, :, 0]) and torch.equal(kv.keys[1, :, 6], k2[1, :, 0])
        assert kv.bias is not None and bool(torch.isinf(kv.bias[0, 0, 0, 6])) and float(kv.bias[1, 0, 0, 6]) == 0


@pytest.mark.parametrize("preset", ["ldpruning", "sparsevar_lvar"])
def test_selecting_once_per_scale_gives_the_per_block_images(testbed, monkeypatch, preset):
    from profilers.host_syncs import count_generation

    config = get_preset(preset)
    shared = _run(testbed, config, batch_size=2)
    shared_syncs = count_generation(testbed, preset, 1).total
    monkeypatch.setattr(AccelPolicy, "_selection_per_scale", lambda self: False)
    per_block = _run(testbed, config, batch_size=2)
    per_block_syncs = count_generation(testbed, preset, 1).total
    assert torch.equal(shared.images, per_block.images)
    pruned_scales = sum(1 for r in per_block.records if r.valid_tokens_R or any(
        k[0] < r.hw[0] * r.hw[1] for k in r.kept_tokens))
    assert pruned_scales >= 1
    # one read per pruned block became one per pruned scale (the testbed's 8 blocks)
    assert per_block_syncs - shared_syncs >= 7 * pruned_scales - 2


def test_scorers_that_read_the_block_input_never_share_a_selection():
    assert not build_policy(get_preset("fastvar"))._selection_per_scale()  # distance to the current state's mean
    assert build_policy(get_preset("ldpruning"))._selection_per_scale()


@pytest.mark.parametrize("model_name", ["testbed", "random:infinity-tiny"])
def test_nova_sample_alone_equals_sample_in_batch(model_name):
    """Bounded counts alone (batch 1: a padded rectangle) and in a batch of 3 (rows of different bounds, packed):
    the middle sample draws the same tokens, and the same as reading every count in the batch."""
    from var_core.zoo import load_model

    model = load_model(model_name) if model_name == "testbed" else load_model(model_name, num_scales=10)
    if model_name == "testbed":
        conditions, seeds = torch.arange(3) % model.cfg.num_classes, [1000, 1001, 1002]
    else:
        conditions, seeds = ["a red cat on a sofa", "two dogs", "a lighthouse at dusk, oil painting"], [11, 12, 13]
    sampling = SamplingConfig() if model_name == "testbed" else SamplingConfig(cfg=3.0, top_k=900, top_p=0.97)

    def run(conds, sds, mode):
        with torch.inference_mode():
            return generate(model, conds, seeds=sds, sampling=sampling, policy=build_policy(_nova(mode)),
                            options=GenerationOptions(decode=False))
    batch = run(conditions, seeds, "bounded")
    alone = run(conditions[1:2], seeds[1:2], "bounded")
    assert any(r.valid_tokens_R for r in alone.records), "the bounded path did not run alone"
    assert all(torch.equal(a[0], b[1]) for a, b in zip(alone.tokens, batch.tokens))
    read = run(conditions, seeds, "per_block")
    assert all(torch.equal(a, b) for a, b in zip(read.tokens, batch.tokens))


@pytest.mark.parametrize("batch", [1, 8])
def test_bounded_flops_charge_the_padding_that_ran(testbed, batch):
    """The bounded mode's FLOPs are what ran: a pruned block's MLP is charged for the bound's tokens (every row's
    width at batch 1, the packed bounds at batch 8), not for the kept count — written out here from the testbed's
    width C and MLP width 4C (two matrices, 2 FLOPs per multiply-add), so a counter that charged the valid tokens
    (and hid the padding's cost) fails."""
    from profilers.flops import arch_from_adapter, count_record_flops

    result = _run(testbed, _nova("bounded"), batch_size=batch)
    report = count_record_flops(arch_from_adapter(testbed), result.records, batch)
    C = testbed.cfg.embed_dim
    hidden = int(C * testbed.cfg.mlp_ratio)
    checked = padded = 0
    for record in result.records:
        if not record.valid_tokens_R:
            continue
        for block, counts in enumerate(record.kept_tokens):
            valid = record.valid_tokens_R[block][0]
            if valid is None:
                continue
            packed = record.packed_tokens[block][0] if record.packed_tokens else None
            ran = counts[0] * valid.numel() if packed is None else packed  # token rows the MLP ran on
            ffn = sum(r.flops for r in report.rows
                      if (r.scale, r.block, r.component) == (record.scale_index, block, "ffn"))
            assert ffn == 2 * ran * C * hidden * 2, (record.scale_index, block)
            checked += 1
            padded += ran > int(valid.sum())
    assert checked >= 8 and padded == checked
