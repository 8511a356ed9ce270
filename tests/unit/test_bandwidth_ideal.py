"""The bytes-moved model and the bandwidth-aware ideal (profilers/memory.py) on a hand-worked tiny VAR."""

from __future__ import annotations

import pytest

from profilers.flops import ArchSpec, count_record_flops
from profilers.memory import Roofline, bandwidth_aware_ideal, bytes_moved, op_bytes, roofline_seconds
from var_core.engine.context import GuidanceMode, ScaleRecord

# depth 1, C = 4, one head, MLP 8, V = 6, C_vae = 2; scales 1x1 and 2x2; no Phi conv; fp32; one row (no CFG)
ARCH = ArchSpec(family="var", depth=1, embed_dim=4, num_heads=1, mlp_hidden=8, head_out=6, latent_channels=2,
                scale_hw=((1, 1), (2, 2)), latent_hw=(2, 2), phi_conv=(False, False), param_bytes=4)
DENSE = [ScaleRecord(0, (1, 1), False, GuidanceMode.COND_ONLY), ScaleRecord(1, (2, 2), False, GuidanceMode.COND_ONLY)]
PRUNED = [DENSE[0], ScaleRecord(1, (2, 2), False, GuidanceMode.COND_ONLY, kept_tokens=((2, 2),))]


def test_bytes_of_every_op_by_hand():
    report = count_record_flops(ARCH, DENSE, 1)
    # FLOPs: condition 2·4·24 = 192; scale 0: qkv 96, scores 8, pv 8, proj 32, fc1 64, fc2 64, adaln 64,
    # logits 48 (= 384); scale 1: embed 64, qkv 384, scores/pv 160 each (5 keys), proj 128, fc1/fc2 256 each,
    # adaln 64, logits 192 (= 1664)
    assert report.total == 192 + 384 + 1664
    got = {(r.scale, r.component, r.op): op_bytes(ARCH, r) for r in report.rows}
    # weight = K·N·4 bytes; activations = M·(K + N)·4 with M the rows computed
    assert got[(-1, "condition", "adaln_modulation")] == (4 * 24 * 4, 1 * 28 * 4)
    assert got[(0, "attn", "qkv")] == (4 * 12 * 4, 1 * 16 * 4)
    assert got[(1, "attn", "qkv")] == (4 * 12 * 4, 4 * 16 * 4)
    assert got[(1, "embed", "word_embed")] == (2 * 4 * 4, 4 * 6 * 4)
    assert got[(1, "ffn", "fc2")] == (8 * 4 * 4, 4 * 12 * 4)
    assert got[(1, "head", "logits")] == (4 * 6 * 4, 4 * 10 * 4)
    # attention streams the keys (values) it attends to and its queries: C·e·rows·(kv_len + tokens)
    assert got[(0, "attn", "scores")] == (0, 4 * 4 * (1 + 1))
    assert got[(1, "attn", "pv")] == (0, 4 * 4 * (5 + 4))
    # condition 496, scale 0 1080, scale 1 2128
    assert bytes_moved(report) == 496 + 1080 + 2128


def test_bandwidth_aware_ideal_by_hand():
    dense, pruned = count_record_flops(ARCH, DENSE, 1), count_record_flops(ARCH, PRUNED, 1)
    # pruned scale 1 (2 of 4 tokens in both branches, 3 keys): FLOPs 928 instead of 1664; bytes 1616 instead of 2128
    assert pruned.total == 192 + 384 + 928 and bytes_moved(pruned) == 496 + 1080 + 1616
    unit = Roofline(peak_flops=1.0, bandwidth=1.0)  # 1 FLOP/s, 1 byte/s: time = FLOPs + bytes
    assert roofline_seconds(dense, unit) == pytest.approx(2240 + 3704)
    assert roofline_seconds(pruned, unit) == pytest.approx(1504 + 3192)
    flops_ideal = dense.total / pruned.total
    assert flops_ideal == pytest.approx(2240 / 1504)  # 1.489
    assert bandwidth_aware_ideal(dense, pruned, unit) == pytest.approx(5944 / 4696)  # 1.266: weights still stream
    # the classic roofline (max per op): every scale-0 op and most of scale 1 are memory-bound here
    assert roofline_seconds(dense, Roofline(1.0, 1.0, rule="max")) == pytest.approx(496 + 1080 + 2160)
    compute_bound = Roofline(peak_flops=1.0, bandwidth=1e12)  # infinite bandwidth: the FLOPs ideal again
    assert bandwidth_aware_ideal(dense, pruned, compute_bound) == pytest.approx(flops_ideal, rel=1e-6)


def test_roofline_rejects_bad_settings():
    with pytest.raises(ValueError, match="rule"):
        Roofline(1.0, 1.0, rule="min")
    with pytest.raises(ValueError, match="positive"):
        Roofline(0.0, 1.0)
