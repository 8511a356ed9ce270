"""The per-scale kept fraction of a record counts each sample's own kept tokens (issue 25: at batch 16 NOVA's
records said 0.667 of the tokens were kept at scales 6-8, the padded width of the batch's widest row, while its
samples kept about 0.35; at batch 1 the same samples said 0.343).

A hand-made ragged plan: at the last scale every block and branch of a sample's rows keeps its first
``1 + t mod 4`` tokens, ``t`` the sample's first-scale token (its own draw: a sample keeps the same count alone
and inside any batch). The expected fraction is counted here from the run's tokens."""

from __future__ import annotations

import pytest
import torch

from var_core.engine import Policy, ScalePlan
from var_core.engine.policy import pad_ragged_selection


class FirstTokenCounts(Policy):
    """Keeps the first ``1 + t mod 4`` tokens of the last scale in every block and branch, ``t`` = the sample's
    first-scale token (both CFG rows of a sample alike)."""

    name = "first_token_counts"

    def plan_scale(self, ctx):
        return ScalePlan(prune=ctx.is_last)

    def plan_block(self, ctx, block, branch, x_RNC):
        first_B = ctx.history[0].tokens_BN[:, 0]
        rows = x_RNC.shape[0]
        counts = [1 + int(first_B[r % ctx.batch_size]) % 4 for r in range(rows)]
        return pad_ragged_selection([torch.arange(k, device=x_RNC.device) for k in counts])


def _run(adapter, batch_size: int, samples: int = 18):
    from var_core.engine import SamplingConfig
    from var_core.eval.lightning import ConditionSet, run_generation

    conditions = ConditionSet(tuple(i % adapter.cfg.num_classes for i in range(samples)), base_seed=5)
    return run_generation(adapter, conditions, policy_factory=FirstTokenCounts, batch_size=batch_size, warmup=0,
                          progress=False, threads=1, sampling=SamplingConfig(cfg=1.5, top_k=100, top_p=0.95))


def test_kept_fraction_counts_each_samples_own_tokens_at_batch_1_and_16(tiny_adapter):
    from ablations.runner import _kept_fraction

    adapter = tiny_adapter
    h, w = adapter.scale_hw[-1]
    one, wide = _run(adapter, 1), _run(adapter, 16)  # batch 16: batches of 16 and 2 samples
    kept = [1 + int(t[0][0]) % 4 for t in one.tokens]  # the hand count, per sample
    assert kept == [1 + int(t[0][0]) % 4 for t in wide.tokens]  # the same draws inside a batch
    assert len(set(kept[:16])) > 1  # the batch of 16 is ragged
    expected = sum(kept) / (len(kept) * h * w)
    for run in (one, wide):
        fractions = _kept_fraction(run, adapter)
        assert fractions[:-1] == [1.0] * (adapter.num_scales - 1)
        assert fractions[-1] == pytest.approx(expected, abs=1e-12)
    # what the padded widths would have said at batch 16: the widest row of each batch, weighted by its samples
    padded = (16 * max(kept[:16]) + 2 * max(kept[16:])) / (18 * h * w)
    assert padded > expected + 0.01
    # each batch's own mean weighs the batch of 2 like the batch of 16: not the mean over samples either
    by_batch = (sum(kept[:16]) / 16 + sum(kept[16:]) / 2) / (2 * h * w)
    if abs(by_batch - expected) > 1e-9:
        assert _kept_fraction(wide, adapter)[-1] != pytest.approx(by_batch, abs=1e-9)
    # the batch record keeps both: the padded width every row ran and the rows' own mean
    first = wide.batches[0]
    assert first["kept_tokens"][-1][0][0] == max(kept[:16])
    assert first["valid_tokens"][-1][0][0] == pytest.approx(sum(kept[:16]) / 16)
