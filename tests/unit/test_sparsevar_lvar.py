"""SparseVAR as the third-party code ``Weepingchestnut/Lvar`` (models/sparsevar/) runs it: preset
``sparsevar_lvar`` and its generic pieces (issue 28).

Every expected value below is worked by hand from the rules read in that code (``lf_anchor``,
``map_to_best_corner``, ``generate_anchors_from_flat``, the ``compress_ratio`` share), or computed by a second
implementation written here (the end-to-end kept set on the tiny Infinity).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from var_core.accel import build_policy, component_config
from var_core.accel.base import Signals
from var_core.accel.policy import AccelPolicy, top_tokens
from var_core.accel.presets import ModelKey, get_preset, preset_summary, resolve_config
from var_core.accel.registry import RESTORERS, SCHEDULES, SCORERS
from var_core.accel.restorers.anchors import anchor_candidates, anchor_lines, anchor_mask, nearest_anchors
from var_core.accel.schedules.score_threshold import first_positions
from var_core.engine import GenerationInfo, GuidanceMode, SamplingConfig, ScaleContext, generate
from var_core.engine.context import ScaleRecord
from var_core.engine.policy import Policy

BOTH = GuidanceMode.BOTH
BRANCHES = ("sa", "ca", "ffn")


def ctx_at(si, hw, history=(), batch_size=1, num_blocks=1):
    return ScaleContext(si, si + 1, hw, 0, batch_size, BOTH, num_blocks, BRANCHES, "infinity", tuple(history))


def record(si, hw, logits=None):
    return ScaleRecord(si, hw, skipped=False, guidance=BOTH, guided_logits_BNV=logits)


def build(registry, kind, name, **params):
    return registry.get(name)(component_config(kind, name, **params))


# ------------------------------------------------------------------------------------------- threshold share
def test_threshold_keep_count_and_set_on_a_hand_made_score_map():
    sched = build(SCHEDULES, "schedule", "score_threshold")  # threshold 0.6, share over the scale's tokens
    sched.start(None, None)
    scores = torch.tensor([
        [0.1, 0.7, 0.65, 1.0, 0.2, 0.61, 0.6, 0.0],  # /1.0 > 0.6: 0.7, 0.65, 1.0, 0.61 (0.6 is not above) -> 4
        [2.0, 1.0, 1.3, 0.2, 1.1, 1.21, 0.0, 0.0],  # /2.0 > 0.6: 2.0, 1.3, 1.21 (1.1/2 = 0.55 no) -> 3
        [0.0] * 8,  # no positive maximum: 0/0, the code's sort()[-0:] keeps every token
    ])
    ctx = ctx_at(1, (2, 4))
    counts = sched.keep_counts(ctx, 0, "sa", scores, None)
    assert counts.tolist() == [4, 3, 8]
    kept = top_tokens(scores[:2], counts[:2], 4)  # the policy keeps the k best (ties to the lower position)
    assert kept.index_Rn[0].tolist() == [1, 2, 3, 5]
    assert kept.index_Rn[1][kept.valid_Rn[1]].tolist() == [0, 2, 5]
    # forced keeps (+inf) are not scores: finite 1.0, 0.5, 0.7 -> 2 of 3 above -> floor(4 * 2/3) = 2
    forced = torch.tensor([[math.inf, 1.0, 0.5, 0.7]])
    assert sched.keep_counts(ctx_at(1, (2, 2)), 0, "sa", forced, None).tolist() == [2]
    strict = build(SCHEDULES, "schedule", "score_threshold", threshold=0.62)
    strict.start(None, None)
    assert strict.keep_counts(ctx, 0, "sa", scores, None).tolist()[:2] == [3, 2]  # 0.61 and 0.605 drop


def test_threshold_share_on_the_previous_grid_of_a_nearest_upsampled_map():
    # a 2x2 map [[1.0, 0.5], [0.7, 0.2]] resized to 3x3 with 'nearest' (source = floor(dst * 2/3)):
    #   1.0 1.0 0.5 / 1.0 1.0 0.5 / 0.7 0.7 0.2
    assert first_positions((2, 2), (3, 3)).tolist() == [0, 2, 6, 8]  # where each source cell first appears
    grid = torch.tensor([[1.0, 0.5], [0.7, 0.2]])
    up = F.interpolate(grid.view(1, 1, 2, 2), size=(3, 3), mode="nearest").view(1, 9)
    assert torch.equal(up, torch.tensor([[1.0, 1.0, 0.5, 1.0, 1.0, 0.5, 0.7, 0.7, 0.2]]))
    ctx = ctx_at(1, (3, 3), history=[record(0, (2, 2))])
    previous = build(SCHEDULES, "schedule", "score_threshold", share_grid="previous")
    tokens = build(SCHEDULES, "schedule", "score_threshold", share_grid="tokens")
    for s in (previous, tokens):
        s.start(None, None)
    # previous grid: 2 of 4 cells above 0.6 -> floor(9 * 0.5) = 4; tokens: 6 of 9 above -> 6
    assert previous.keep_counts(ctx, 0, "sa", up, None).tolist() == [4]
    assert tokens.keep_counts(ctx, 0, "sa", up, None).tolist() == [6]


# ------------------------------------------------------------------------------------------------ anchor grid
def test_anchor_grid_with_the_last_row_and_column():
    # generate_anchors_from_flat: arange(0, N, 4), then N-1 appended whenever 4 % N != 0 (even if already there)
    assert anchor_lines(9, 4, "multiples") == [0, 4, 8]
    assert anchor_lines(9, 4, "with_last") == [0, 4, 8, 8]
    assert anchor_lines(10, 4, "with_last") == [0, 4, 8, 9]
    assert anchor_lines(4, 4, "with_last") == [0] and anchor_lines(3, 4, "with_last") == [0, 2]
    assert anchor_lines(40, 4, "with_last")[-2:] == [36, 39] and len(anchor_lines(64, 4, "with_last")) == 17
    assert anchor_mask((9, 9), 4, grid="with_last").nonzero().flatten().tolist() == [0, 4, 8, 36, 40, 44, 72, 76, 80]
    assert anchor_mask((10, 10), 4, grid="with_last").nonzero().flatten().tolist() == [
        0, 4, 8, 9, 40, 44, 48, 49, 80, 84, 88, 89, 90, 94, 98, 99]
    # the candidate list keeps the duplicated last line (rows x columns, row-major)
    assert anchor_candidates((9, 9), 4, "with_last").tolist() == [0, 4, 8, 8, 36, 40, 44, 44, 72, 76, 80, 80,
                                                                   72, 76, 80, 80]


def test_four_nearest_anchors_by_hand():
    cand = anchor_candidates((9, 9), 4, "with_last")
    near = nearest_anchors((9, 9), cand, 4)
    assert near.shape == (81, 4)
    # (2, 2): the four corners of its cell, all at squared distance 8, in candidate order
    assert near[2 * 9 + 2].tolist() == [0, 4, 36, 40]
    # (6, 6): (4,4), (4,8), (8,4), (8,8) are all at 8; the duplicated (4, 8) takes two of the four places
    assert near[6 * 9 + 6].tolist() == [40, 44, 44, 76]
    # (0, 1): (0,0) at 1, (0,4) at 9, (4,0) at 17, (4,4) at 25
    assert near[1].tolist() == [0, 4, 36, 40]
    # an anchor is its own nearest candidate
    assert near[80, 0].item() == 80
    # fewer candidates than asked: all of them (the 4-wide grid has the single anchor (0, 0))
    assert nearest_anchors((4, 4), anchor_candidates((4, 4), 4, "with_last"), 4).tolist() == [[0]] * 16


# ----------------------------------------------------------------------------- cosine-nearest-anchor recovery
# A 3x3 grid, stride 2: anchors 0, 2, 6, 8. The previous scale's guided logits (3x3 too: the resize is the
# identity) give each position a 2-vector; cosines worked by hand:
#   pos 1 [1, 0]:   nearest [0, 2, 6, 8]; cos 0, 0.707, 0.981 ([1, .2]), -1      -> anchor 6 (0.981 > 0.8)
#   pos 3 [-1, .5]: nearest [0, 6, 2, 8]; cos 0.447, -0.789, -0.316, 0.894       -> anchor 8 (0.894 > 0.8)
#   pos 5 [1, -1]:  nearest [2, 8, 0, 6]; cos 0, -0.707, -0.707, 0.555           -> none (0.555): keeps its input
#   pos 7 [1, 1]:   nearest [6, 8, 0, 2]; cos 0.832, -0.707, 0.707, 1.0          -> anchor 2 (1.0)
FEATURES = torch.tensor([[0, 1], [1, 0], [1, 1], [-1, .5], [0, 1], [1, -1], [1, .2], [1, 1], [-1, 0]],
                        dtype=torch.float)


def _recovery_case(similarity=0.8):
    restorer = build(RESTORERS, "restorer", "anchors", stride=2, grid="multiples", forced=False,
                     recovery="most_similar", target="final", similarity=similarity)
    restorer.start(None, None)
    ctx = ctx_at(1, (3, 3), history=[record(0, (3, 3), FEATURES.view(1, 9, 2))])
    keep = torch.tensor([[0, 2, 4, 6, 8]] * 2)  # anchors and the centre; both CFG rows alike
    x = torch.arange(2 * 9 * 2, dtype=torch.float).view(2, 9, 2)  # the hidden state entering the last branch
    out_kept = torch.tensor([[[100.0, 0.0]] * 5, [[0.0, 100.0]] * 5]) + torch.arange(5.0).view(1, 5, 1)
    return restorer, ctx, keep, x, out_kept


def test_final_hidden_state_taken_from_the_most_cosine_similar_anchor():
    restorer, ctx, keep, x, out_kept = _recovery_case()
    # before the last branch of the last block, pruned slots receive zeros (they pass through unchanged)
    early = restorer.restore(ctx, 0, "sa", out_kept, keep, x, None)
    assert torch.equal(early[:, [1, 3, 5, 7]], torch.zeros(2, 4, 2))
    assert torch.equal(early[:, [0, 2, 4, 6, 8]], out_kept)
    full = restorer.restore(ctx, 0, "ffn", out_kept, keep, x, None)
    final = x + full
    expected = x.clone()
    for slot, pos in enumerate([0, 2, 4, 6, 8]):
        expected[:, pos] = x[:, pos] + out_kept[:, slot]
    for pos, anchor in ((1, 6), (3, 8), (7, 2)):  # recovered: the anchor's final hidden state, in each CFG row
        expected[:, pos] = expected[:, anchor]
    # position 5 (no anchor above 0.8) keeps its input: expected[:, 5] == x[:, 5]
    torch.testing.assert_close(final, expected)
    assert torch.equal(full[:, [0, 2, 4, 6, 8]], out_kept)  # computed tokens keep their fresh outputs
    # its sampled residual is left out of the latent (the code zeroes its codes); everything else enters
    assert restorer.latent_mask(ctx, None).tolist() == [[True, True, True, True, True, False, True, True, True]]


def test_similarity_threshold_decides_recovery():
    restorer, ctx, keep, x, out_kept = _recovery_case(similarity=0.9)  # 0.894 of position 3 is no longer enough
    final = x + restorer.restore(ctx, 0, "ffn", out_kept, keep, x, None)
    torch.testing.assert_close(final[:, 3], x[:, 3])
    torch.testing.assert_close(final[:, 1], x[:, 6] + out_kept[:, 3])  # 0.981 still recovers from anchor 6
    assert restorer.latent_mask(ctx, None)[0].tolist() == [True, True, True, False, True, False, True, True, True]


def test_a_pruned_anchor_lends_its_input_and_recovers_itself():
    restorer, ctx, _, x, _ = _recovery_case()
    keep = torch.tensor([[0, 2, 4, 8]] * 2)  # anchor 6 dropped by the scorer (anchors not forced)
    out_kept = torch.ones(2, 4, 2)
    final = x + restorer.restore(ctx, 0, "ffn", out_kept, keep, x, None)
    torch.testing.assert_close(final[:, 1], x[:, 6])  # position 1's best anchor (6) holds only its input
    torch.testing.assert_close(final[:, 6], x[:, 6])  # 6 is its own nearest anchor (similarity 1): recovered
    assert restorer.latent_mask(ctx, None)[0, 6].item() is True


def test_similarity_reads_the_previous_logits_resized_with_nearest():
    # previous scale 2x2: c0 [1, 0], c1 [0, 1], c2 [-1, 0], c3 [0, -1]; 'nearest' to 3x3 (source = floor(dst * 2/3)):
    #   c0 c0 c1 / c0 c0 c1 / c2 c2 c3  -> pos 1 and 3 copy anchor 0's features, pos 5 anchor 2's, pos 7 anchor 6's
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]]).view(1, 4, 2)
    restorer = build(RESTORERS, "restorer", "anchors", stride=2, forced=False, recovery="most_similar",
                     target="final")
    restorer.start(None, None)
    ctx = ctx_at(1, (3, 3), history=[record(0, (2, 2), logits)])
    keep = torch.tensor([[0, 2, 4, 6, 8]])
    x = torch.zeros(1, 9, 1)
    out_kept = torch.tensor([[[10.0], [20.0], [40.0], [60.0], [80.0]]])  # final states of 0, 2, 4, 6, 8
    final = x + restorer.restore(ctx, 0, "ffn", out_kept, keep, x, None)
    assert final[0, :, 0].tolist() == [10, 10, 20, 10, 40, 20, 60, 60, 80]
    assert bool(restorer.latent_mask(ctx, None).all())


def test_final_target_needs_the_last_block_pruned(tiny_infinity):
    config = get_preset("sparsevar_lvar")
    config = dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, threshold=0.95),
                                 exempt_last_blocks=1)
    with pytest.raises(ValueError, match="target='final'"):
        generate(tiny_infinity, torch.tensor([3]), seeds=[0], sampling=SAMPLING, policy=build_policy(config))


# ------------------------------------------------------------------------------------------- chunk MSE scorer
def test_chunk_mse_averaged_over_the_cfg_halves():
    info = GenerationInfo(1, 2, 4, BRANCHES, ((2, 2), (4, 4)), "infinity", BOTH, None, block_chunks=2)
    scorers = {span: build(SCORERS, "scorer", "mse", mode="block_change", block=1, span=span, cfg_halves="mean",
                           upsample="nearest") for span in ("chunk", "block")}
    for s in scorers.values():
        s.start(info, Signals(info))
    ctx0 = ScaleContext(0, 2, (2, 2), 0, 1, BOTH, 4, BRANCHES, "infinity", ())
    a = torch.zeros(2, 4, 2)  # chunk 0 = blocks 0-1 (block_chunks=2 of 4 blocks): input of block 0 ...
    b = torch.ones(2, 4, 2)
    c = torch.tensor([[[1, 1], [2, 0], [0, 0], [3, 1]],  # ... to output of block 1: cond row, mean_c sq: 1, 2, 0, 5
                      [[1, -1], [0, 0], [2, 2], [1, 1]]], dtype=torch.float)  # uncond row: 1, 0, 4, 1
    for s in scorers.values():
        s.observe_block(ctx0, 0, a, b, None)
        s.observe_block(ctx0, 1, b, c, None)
    ctx1 = ctx_at(1, (4, 4), history=[record(0, (2, 2))], num_blocks=4)
    x = torch.zeros(2, 16, 2)
    got = scorers["chunk"].score(ctx1, 0, "sa", x, None)
    # per sample mean of the halves: 1, 1, 2, 3 on the 2x2 grid, nearest to 4x4
    assert got.tolist() == [[1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]]
    # span='block': block 1 alone, (c - b)^2: cond 0, 1, 1, 2; uncond 2, 1, 1, 0 -> 1, 1, 1, 1
    assert scorers["block"].score(ctx1, 0, "sa", x, None).tolist() == [[1.0] * 16]


# ---------------------------------------------------------------------------------------------------- preset
SAMPLING = SamplingConfig(cfg=3.0, top_k=20, top_p=0.9)


@pytest.fixture(scope="module")
def tiny_infinity():
    from var_core.zoo import load_model

    return load_model("random:infinity-tiny")


def test_preset_settings_per_model():
    config = get_preset("sparsevar_lvar")
    assert (config.scorer.mode, config.scorer.span, config.scorer.cfg_halves, config.scorer.upsample) == (
        "block_change", "chunk", "mean", "nearest")
    assert config.activation.start_scale == -3 and config.schedule.threshold == 0.6
    assert (config.restorer.stride, config.restorer.grid, config.restorer.forced, config.restorer.recovery,
            config.restorer.target, config.restorer.neighbours, config.restorer.similarity) == (
        4, "with_last", False, "most_similar", "final", 4, 0.8)
    # the chunk holding block floor(3L/8): chunk 3 of Infinity-2B's 8 (blocks 12-15), of the 8B's (15-19)
    for blocks, block in ((32, 12), (40, 15), (4, 1), (8, 3), (16, 6), (24, 9)):
        key = ModelKey("infinity", blocks, ((1, 1),))
        assert resolve_config(config, key).scorer.block == block
    summary = preset_summary("sparsevar_lvar")
    assert "third-party" in summary and "Weepingchestnut/Lvar" in summary


class _BlockSpy(Policy):
    """The plain loop, observing every block's input/output (what a dense run hands the MSE scorer)."""

    def __init__(self):
        self.io = {}

    def plan_scale(self, ctx):
        from var_core.engine.context import ScalePlan

        return ScalePlan(observe_blocks=True)

    def observe_block(self, ctx, block, x_in, x_out):
        self.io[(ctx.scale_index, block)] = (x_in.clone(), x_out.clone())


def test_preset_on_the_tiny_infinity_matches_a_second_implementation(tiny_infinity):
    """5 scales (1, 2, 4, 6, 8 wide): the last 3 are pruned. At the released 0.6 the random tiny model's chunk MSE
    is nearly uniform, so every token is kept (the run equals the plain loop); at 0.95 it prunes, and the kept
    set of the first pruned scale equals the one worked out here from a dense run's block chunk 0 (blocks 0-1)."""
    labels, seeds = torch.tensor([3, 7]), [0, 1]
    plain = generate(tiny_infinity, labels, seeds=seeds, sampling=SAMPLING)
    lvar = generate(tiny_infinity, labels, seeds=seeds, sampling=SAMPLING,
                    policy=build_policy(get_preset("sparsevar_lvar")))
    assert all(torch.equal(a, b) for a, b in zip(plain.tokens, lvar.tokens))

    config = get_preset("sparsevar_lvar")
    config = dataclasses.replace(config, schedule=dataclasses.replace(config.schedule, threshold=0.95))
    policy = AccelPolicy(config)
    kept = {}
    original = policy.plan_block

    def spy(ctx, block, branch, x_RNC):
        selection = original(ctx, block, branch, x_RNC)
        kept.setdefault(ctx.scale_index, selection)
        return selection

    policy.plan_block = spy
    run = generate(tiny_infinity, labels, seeds=seeds, sampling=SAMPLING, policy=policy)
    dense = _BlockSpy()
    generate(tiny_infinity, labels, seeds=seeds, sampling=SAMPLING, policy=dense)
    assert sorted(kept) == [2, 3, 4]  # only the last three scales are planned
    # second implementation: MSE across blocks 0-1 at scale 1 (2x2), mean of the CFG halves, share > 0.95 of the
    # sample's maximum on the 2x2 grid, k = floor(16 * share) best of the 'nearest' 4x4 map
    x_in, _ = dense.io[(1, 0)]
    _, x_out = dense.io[(1, 1)]
    mse = (x_out - x_in).square().mean(-1)  # [2B, 4]
    mse = (mse[:2] + mse[2:]) / 2
    up = mse.view(2, 2, 2).repeat_interleave(2, 1).repeat_interleave(2, 2).reshape(2, 16)
    selection = kept[2]
    assert selection is not None and all(r.kept_tokens[0][0] < r.hw[0] * r.hw[1] for r in run.records[2:])
    index = selection if isinstance(selection, torch.Tensor) else selection.index_Rn
    valid = torch.ones_like(index, dtype=torch.bool) if isinstance(selection, torch.Tensor) else selection.valid_Rn
    for b in range(2):
        share = (mse[b] / mse[b].max() > 0.95).float().mean()
        k = int(16 * share)
        order = sorted(range(16), key=lambda p: (-float(up[b, p]), p))
        assert sorted(index[b][valid[b]].tolist()) == sorted(order[:k]), b
        assert torch.equal(index[b], index[b + 2])  # the CFG halves share the selection
    assert torch.isfinite(run.images).all()
    # a sample alone equals the same sample in the batch
    alone = generate(tiny_infinity, labels[1:], seeds=seeds[1:], sampling=SAMPLING, policy=policy)
    assert all(torch.equal(a[0], b[1]) for a, b in zip(alone.tokens, run.tokens))


def test_unforced_anchors_cannot_be_the_only_sources():
    with pytest.raises(ValueError, match="forced=False may leave none computed"):
        component_config("restorer", "anchors", forced=False, source="anchors", recovery="nearest")
    component_config("restorer", "anchors", forced=False, source="anchors", recovery="most_similar")  # unread there
