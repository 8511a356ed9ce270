"""StageVAR's token-selection reading (``stagevar_sampled``, and ``stagevar`` on VAR / HART): one token selection
per block chunk (L/8 consecutive blocks) and Representative Token Restoration (pruned tokens take the chunk's output
at the previous scale, area-resampled). Checked against hand-worked chunk layouts and an independent area
interpolation of the captured block outputs. The released code's projected chunks: ``test_stagevar_official.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from var_core.accel import build_policy
from var_core.accel.base import block_chunk, ends_block_chunk
from var_core.accel.presets import get_preset
from var_core.engine import GenerationOptions, GuidanceMode, SamplingConfig, generate
from var_core.engine.adapters.var_adapter import VARAdapter
from var_core.models.var import VARConfig
from var_core.zoo import build_var_pair

SAMPLING = SamplingConfig(cfg=1.5, top_k=10, top_p=0.9)
DEPTH = 16


@pytest.fixture(scope="module")
def deep_adapter():
    patch_nums = (1, 2, 3, 4, 5)
    cfg = VARConfig(vocab_size=64, z_channels=8, num_classes=10, depth=DEPTH, embed_dim=32, num_heads=2,
                    patch_nums=patch_nums)
    vq = dict(vocab_size=64, z_channels=8, ch=32, ch_mult=(1, 2), num_res_blocks=1, patch_nums=patch_nums)
    var, vae = build_var_pair(cfg, vq, seed=0)
    return VARAdapter(var.requires_grad_(False), vae.requires_grad_(False))


def test_block_chunks_hand_worked():
    assert [block_chunk(b, 16) for b in range(16)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert [b for b in range(16) if ends_block_chunk(b, 16)] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert [block_chunk(b, 32) for b in range(0, 32, 4)] == list(range(8)) and block_chunk(3, 32) == 0
    assert [block_chunk(b, 8) for b in range(8)] == list(range(8))  # the depth-8 testbed: one block per chunk
    assert all(ends_block_chunk(b, 8) for b in range(8))
    # 30 blocks (VAR-d30): chunk c holds 30c/8 <= b < 30(c+1)/8: sizes 4, 4, 4, 3, 4, 4, 4, 3
    sizes = [sum(1 for b in range(30) if block_chunk(b, 30) == c) for c in range(8)]
    assert sizes == [4, 4, 4, 3, 4, 4, 4, 3]
    assert [block_chunk(b, 4) for b in range(4)] == [0, 2, 4, 6] and all(ends_block_chunk(b, 4) for b in range(4))


class _Capture:
    """Wraps a policy's slots: which blocks score, the selection each block gets, every block's input and output."""

    def __init__(self, policy):
        self.scored: list[tuple[int, int]] = []
        self.selections: dict[tuple[int, int], torch.Tensor] = {}
        self.block_io: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, GuidanceMode]] = {}
        scorer, plan_block, observe_block = policy.scorer.score, policy.plan_block, policy.observe_block

        def score(ctx, block, branch, x, signals):
            self.scored.append((ctx.scale_index, block))
            return scorer(ctx, block, branch, x, signals)

        def plan(ctx, block, branch, x):
            selection = plan_block(ctx, block, branch, x)
            if selection is not None:
                self.selections[(ctx.scale_index, block)] = getattr(selection, "index_Rn", selection)
            return selection

        def observe(ctx, block, x_in, x_out):
            self.block_io[(ctx.scale_index, block)] = (x_in.clone(), x_out.clone(), ctx.guidance)
            observe_block(ctx, block, x_in, x_out)

        policy.scorer.score, policy.plan_block, policy.observe_block = score, plan, observe


def _run(adapter, config):
    policy = build_policy(config)
    capture = _Capture(policy)
    generate(adapter, torch.tensor([3, 7]), seeds=[1, 2], sampling=SAMPLING, policy=policy,
             options=GenerationOptions(decode=False))
    return capture


def test_one_selection_per_chunk(deep_adapter):
    capture = _run(deep_adapter, get_preset("stagevar_sampled"))
    K = deep_adapter.num_scales
    pruned = list(range(K - 3, K))
    assert sorted(set(capture.scored)) == [(si, b) for si in pruned for b in range(0, DEPTH, 2)]
    for si in pruned:
        for b in range(0, DEPTH, 2):  # both blocks of a chunk run on the same tokens
            assert capture.selections[(si, b)] is capture.selections[(si, b + 1)]
        assert not torch.equal(capture.selections[(si, 0)], capture.selections[(si, 2)])  # chunks draw anew


def _area(y_RNC: torch.Tensor, src: tuple[int, int], dst: tuple[int, int]) -> torch.Tensor:
    R, _, C = y_RNC.shape
    grid = y_RNC.reshape(R, src[0], src[1], C).permute(0, 3, 1, 2)
    return F.interpolate(grid, size=dst, mode="area").permute(0, 2, 3, 1).reshape(R, dst[0] * dst[1], C)


def test_pruned_tokens_take_the_previous_scale_chunk_output(deep_adapter):
    capture = _run(deep_adapter, get_preset("stagevar_sampled"))
    K, B, hw = deep_adapter.num_scales, 2, deep_adapter.scale_hw
    checked = 0
    for si in range(K - 3, K):
        for first in range(0, DEPTH, 2):
            last = first + 1
            keep = capture.selections[(si, first)]  # [R, n] (no padding: every row keeps the same count)
            x_in, x_mid, mode = capture.block_io[(si, first)]
            _, x_out, _ = capture.block_io[(si, last)]
            _, prev_out, prev_mode = capture.block_io[(si - 1, last)]
            assert mode is GuidanceMode.UNCOND_ONLY
            prev_rows = prev_out[B:] if prev_mode is GuidanceMode.BOTH else prev_out  # the unconditional rows
            target = _area(prev_rows, hw[si - 1], hw[si])
            pruned = torch.ones(x_in.shape[:2], dtype=torch.bool)
            pruned.scatter_(1, keep, False)
            assert 0 < int(pruned.sum()) < pruned.numel()
            # inside the chunk a pruned token is left as it entered; at the chunk's end it is the target
            assert torch.equal(x_mid[pruned], x_in[pruned])
            torch.testing.assert_close(x_out[pruned], target[pruned], atol=1e-6, rtol=1e-6)
            assert not torch.allclose(x_out[~pruned], target[~pruned], atol=1e-3)  # kept tokens were computed
            checked += 1
    assert checked == 3 * DEPTH // 2


def test_block_granularity_restores_every_block(deep_adapter):
    capture = _run(deep_adapter, dataclasses.replace(get_preset("stagevar_sampled"), granularity="block"))
    K, B, hw = deep_adapter.num_scales, 2, deep_adapter.scale_hw
    si, block = K - 1, 4
    assert (si, 5) in set(capture.scored)  # every block selects
    keep = capture.selections[(si, block)]
    _, x_out, _ = capture.block_io[(si, block)]
    _, prev_out, _ = capture.block_io[(si - 1, block)]
    pruned = torch.ones(x_out.shape[:2], dtype=torch.bool).scatter_(1, keep, False)
    torch.testing.assert_close(x_out[pruned], _area(prev_out, hw[si - 1], hw[si])[pruned], atol=1e-6, rtol=1e-6)


def test_chunk_granularity_rejects_exemptions_that_cut_a_chunk(deep_adapter):
    from var_core.engine.loop import generation_info

    info = generation_info(deep_adapter, 2, GuidanceMode.BOTH)
    cut = build_policy(dataclasses.replace(get_preset("stagevar_sampled"), exempt_first_blocks=1))
    with pytest.raises(ValueError, match="cut a chunk"):
        cut.check_model(info)
    build_policy(dataclasses.replace(get_preset("stagevar_sampled"), exempt_first_blocks=2, exempt_last_blocks=4)
                 ).check_model(info)
