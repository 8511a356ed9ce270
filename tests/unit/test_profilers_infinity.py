"""Infinity FLOPs: the analytic count (``profilers.flops``, family ``"infinity"``) equals ``FlopCounterMode`` on
``random:infinity-tiny`` — dense, with half of the last scale pruned, and with guidance dropped to the
conditional rows — plus the arch builder, the text length rule, the decoder count and the arch-only report.

The prompts are encoded before the measured region (the text encoder is not part of the transformer count).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from var_core.engine import GenerationOptions, GuidanceMode, Policy, SamplingConfig, ScalePlan, generate
from var_core.models.infinity import INFINITY_2B, scale_schedule
from var_core.zoo import load_model

from profilers.flops import (
    INFINITY_SCHEDULE_1024, arch_from_adapter, count_flops, count_record_flops, decode_flops, dense_records,
    flop_counter_mode, infinity_arch, infinity_text_len, measure_flops,
)

GREEDY = SamplingConfig(cfg=3.0, top_k=1, top_p=0.0, temperature=1.0)
NO_DECODE = GenerationOptions(check_finite=False, decode=False)
PROMPTS = ["a red cat on a sofa", "two dogs"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:infinity-tiny")


class HalfLastScale(Policy):
    """Prunes half of the last scale in every branch (sorted ``[R, n]`` indices); optionally drops to the
    conditional rows from scale ``cond_only_from`` on."""

    name = "test-half-last"

    def __init__(self, cond_only_from: int | None = None):
        self.cond_only_from = cond_only_from

    def plan_scale(self, ctx):
        guidance = None
        if self.cond_only_from is not None and ctx.scale_index >= self.cond_only_from \
                and ctx.guidance is GuidanceMode.BOTH:
            guidance = GuidanceMode.COND_ONLY
        return ScalePlan(prune=ctx.is_last, guidance=guidance)

    def plan_block(self, ctx, block, branch, x_RNC):
        R, N, _ = x_RNC.shape
        n = N // 2
        return torch.arange(0, N, 2, device=x_RNC.device)[:n].expand(R, n).contiguous()


def _measured_and_analytic(adapter, policy=None):
    text = adapter.encode_prompts(PROMPTS)  # outside the measured region
    box = {}

    def run():
        box["result"] = generate(adapter, text, seeds=[0, 1], sampling=GREEDY, policy=policy, options=NO_DECODE)

    with torch.inference_mode():
        measured, per_op = measure_flops(run)
    T = infinity_text_len(adapter, text, GREEDY.cfg)
    assert T == text.features.shape[1]
    report = count_flops(adapter, box["result"], text_len=T)
    assert box["result"].context_length == T
    assert count_flops(adapter, box["result"]).total == report.total  # the recorded context length by default
    return measured, per_op, report, box["result"]


def test_arch_from_infinity_adapter(tiny):
    arch = arch_from_adapter(tiny)
    cfg = tiny.cfg
    assert arch.family == "infinity" and arch.branches == ("attn", "cross", "ffn")
    assert (arch.depth, arch.embed_dim, arch.num_heads) == (cfg.depth, cfg.embed_dim, cfg.num_heads)
    assert arch.mlp_hidden == cfg.ffn_hidden and arch.head_out == 2 * cfg.d_vae == cfg.vocab_size
    assert arch.latent_channels == cfg.d_vae and arch.text_channels == cfg.text_channels
    assert arch.scale_hw == tiny.scale_hw and arch.shared_aln
    assert arch.cross_kv_per_scale is False  # our model projects the text K/V once per generation
    assert arch_from_adapter(tiny, text_len=9).text_len == 9


def test_count_flops_requires_text_len(tiny):
    text = tiny.encode_prompts(PROMPTS[:1])
    result = generate(tiny, text, seeds=[0], sampling=GREEDY, options=NO_DECODE)
    result = dataclasses.replace(result, context_length=None)  # e.g. a result built by other code
    with pytest.raises(ValueError, match="text_len"):
        count_flops(tiny, result)


def test_infinity_flops_match_flop_counter_dense(tiny):
    measured, per_op, report, result = _measured_and_analytic(tiny)
    assert any("scaled_dot_product" in op for op in per_op), per_op
    assert report.total == measured, (report.per_op(), per_op)
    frame = report.frame()
    assert set(frame["component"]) == {"condition", "embed", "attn", "cross", "ffn", "head"}
    assert (frame.loc[frame["component"] == "cross", "rows"] == 4).all()  # 2 samples x (cond, uncond)
    assert (frame.loc[frame["op"] == "scores", "kv_len"] > 0).all()


@pytest.mark.parametrize("cond_only_from", [None, 3])
def test_infinity_flops_match_flop_counter_pruned(tiny, cond_only_from):
    _, _, dense, _ = _measured_and_analytic(tiny)
    measured, _, report, result = _measured_and_analytic(tiny, HalfLastScale(cond_only_from))
    assert report.total == measured
    last = result.records[-1]
    N = last.hw[0] * last.hw[1]
    assert all(counts == (N // 2,) * 3 for counts in last.kept_tokens)
    assert report.total < dense.total
    frame = report.frame()
    last_cross = frame[(frame["scale"] == last.scale_index) & (frame["component"] == "cross")]
    assert (last_cross["tokens"] == N // 2).all()
    if cond_only_from is not None:
        assert (frame.loc[(frame["scale"] >= cond_only_from) & (frame["block"] >= 0), "rows"] == 2).all()


def test_cross_kv_per_scale_counts_the_official_recompute(tiny):
    text = tiny.encode_prompts(PROMPTS)
    result = generate(tiny, text, seeds=[0, 1], sampling=GREEDY, options=NO_DECODE)
    T = text.features.shape[1]
    ours = count_flops(tiny, result, text_len=T)
    official = count_flops(arch_from_adapter(tiny, cross_kv_per_scale=True, text_len=T), result, batch_size=2)
    C, R, K, depth = tiny.cfg.embed_dim, 4, tiny.num_scales, tiny.num_blocks
    once = 2 * R * T * C * 2 * C * depth
    assert official.total - ours.total == once * (K - 1)


def test_infinity_decode_flops(tiny):
    _, H, W = tiny.vae_schedule[-1]
    with torch.inference_mode(), flop_counter_mode() as counter:
        tiny.vae.decode(torch.zeros(2, tiny.vae.codebook_dim, H, W))
    assert decode_flops(tiny, 2) == counter.get_total_flops() > 0


def test_infinity_2b_arch_only_report():
    schedule = scale_schedule("1M")
    assert schedule == tuple((p, p) for p in INFINITY_SCHEDULE_1024)
    arch = infinity_arch(INFINITY_2B, schedule, text_len=64)
    assert arch.total_tokens == 10521 and arch.head_out == 64 and arch.mlp_hidden == 8192
    report = count_record_flops(arch, dense_records(schedule), batch_size=1)
    per_scale = report.per_scale()["total"]
    assert per_scale.index.tolist() == [-1] + list(range(13))
    last_two = per_scale.loc[[11, 12]].sum() / per_scale.sum()
    token_share = (48 * 48 + 64 * 64) / 10521
    assert token_share == pytest.approx(0.608, abs=1e-3)
    assert last_two > token_share  # attention over the long cache makes the last scales dearer than their tokens


class RaggedLastScale(Policy):
    """Sample 0 keeps a quarter of the last scale, sample 1 all of it (ragged: padding repeats a kept index)."""

    def plan_scale(self, ctx):
        return ScalePlan(prune=ctx.is_last)

    def plan_block(self, ctx, block, branch, x_RNC):
        from var_core.accel.policy import top_tokens

        R, N = x_RNC.shape[0], ctx.num_tokens
        scores = torch.arange(N, dtype=torch.float32).expand(R, N)
        counts = torch.tensor([N // 4, N] * (R // 2))
        return top_tokens(scores, counts, N)


def test_infinity_ragged_rows_packed_exactly_and_counted(tiny, monkeypatch):
    """Packed per-token work (self-attn QKV/proj, cross-attn q/proj, MLP) on Infinity: the same bits as the padded
    path, and the analytic FLOPs equal FlopCounterMode's."""
    text = tiny.encode_prompts(PROMPTS)
    box = {}

    def run():
        box["result"] = generate(tiny, text, seeds=[0, 1], sampling=GREEDY, policy=RaggedLastScale(),
                                 options=NO_DECODE)

    with torch.inference_mode():
        measured, _ = measure_flops(run)
    packed = box["result"]
    last = packed.records[-1]
    N = last.hw[0] * last.hw[1]
    assert all(total == 2 * (N // 4 + N) for branches in last.packed_tokens for total in branches)
    assert count_flops(tiny, packed).total == measured
    monkeypatch.setattr(type(tiny), "row_packing", lambda self, keep, valid: None)
    padded = generate(tiny, text, seeds=[0, 1], sampling=GREEDY, policy=RaggedLastScale(), options=NO_DECODE)
    assert not padded.records[-1].packed_tokens
    assert all(torch.equal(a, b) for a, b in zip(packed.tokens, padded.tokens))
