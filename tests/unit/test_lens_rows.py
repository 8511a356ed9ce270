"""NOVA's logit lens runs only on the rows of samples accelerated at the scale (var_core/accel/lens.py), counted by
the scale record's ``lens_rows``, and a sample's lens entropy does not depend on its batch neighbours."""

from __future__ import annotations

import math

import torch

from var_core.accel import build_policy
from var_core.accel.activation.fixed import FixedActivation
from var_core.accel.presets import get_preset
from var_core.engine import GenerationOptions, LensProbe, SamplingConfig, generate

SAMPLED = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)


class PerSampleStart(FixedActivation):
    """Sample b is accelerated from scale ``starts[b]`` on (the test sets ``starts`` before generating)."""

    starts: tuple[int, ...] = ()

    def start(self, info, signals) -> None:
        signals.activation_scale_B = torch.tensor(self.starts, dtype=torch.long)

    def active_B(self, ctx, signals) -> torch.Tensor:
        return signals.activation_scale_B <= ctx.scale_index


def _nova(starts):
    """The nova preset (dual linkage reads the lens after blocks 0..L-2) with per-sample activation scales."""
    policy = build_policy(get_preset("nova"))
    activation = PerSampleStart(FixedActivation.Config())
    activation.starts = tuple(starts)
    policy.activation = policy.parts["activation"] = activation
    return policy


def test_lens_projects_only_accelerated_rows(tiny_adapter):
    K = tiny_adapter.num_scales  # official-tiny: 7 scales, 2 blocks -> the lens after block 0 only
    labels, seeds = torch.tensor([3, 7]), [11, 12]
    policy = _nova((4, K))  # sample 0 accelerated from scale 4, sample 1 never
    result = generate(tiny_adapter, labels, seeds, SAMPLED, policy=policy, options=GenerationOptions(decode=False))
    lens_rows = {r.scale_index: r.lens_rows for r in result.records}
    assert all(lens_rows[si] == () for si in range(4))  # nobody accelerated: no lens at all
    # one projected row per block: sample 0's guided mixture (B = 2 would be 2 rows; both CFG halves 4)
    assert all(lens_rows[si] == ((0, 1),) for si in range(4, K))
    for si in range(4, K):
        entropy = policy.signals.lens_entropy[(si, 0)]
        assert entropy.shape == (2, result.records[si].hw[0] ** 2)
        assert torch.isfinite(entropy[0]).all() and torch.isnan(entropy[1]).all()
        assert (0 <= entropy[0]).all() and (entropy[0] <= math.log(tiny_adapter.vocab_size) + 1e-5).all()

    alone_policy = _nova((4,))  # batch = single: the same sample alone has the same lens entropy and tokens
    alone = generate(tiny_adapter, labels[:1], seeds[:1], SAMPLED, policy=alone_policy,
                     options=GenerationOptions(decode=False))
    for si in range(4, K):
        assert torch.allclose(alone_policy.signals.lens_entropy[(si, 0)][0], policy.signals.lens_entropy[(si, 0)][0],
                              atol=1e-4)
    assert all(torch.equal(a, b[:1]) for a, b in zip(alone.tokens, result.tokens))

    both = _nova((4, 5))
    result = generate(tiny_adapter, labels, seeds, SAMPLED, policy=both, options=GenerationOptions(decode=False))
    assert [r.lens_rows for r in result.records[4:]] == [((0, 1),)] + [((0, 2),)] * (K - 5)


def test_probe_sample_subsets_equal_the_full_rows():
    """Hand-made head: rows of a subset equal the same rows of the full projection, and are counted."""
    torch.manual_seed(0)
    B, N, C, V = 3, 2, 4, 5
    features = torch.randn(2 * B, N, C)
    head = torch.nn.Linear(C, V)
    full = head(features)
    asked = []

    def head_parts(rows=None):  # the head's input of the rows asked for (all rows when None)
        asked.append(None if rows is None else rows.tolist())
        return (features if rows is None else features[rows]), head

    probe = LensProbe(lambda: head(features), B, 2 * B, head_parts=head_parts)
    wc, wu = torch.tensor([2.0, 1.5, 1.0]), torch.tensor([-1.0, -0.5, 0.0])
    only = torch.tensor([False, True, True])
    mixed = probe.mixed_logits(wc, wu, only)
    expected = (wc.view(B, 1, 1) * full[:B] + wu.view(B, 1, 1) * full[B:])[1:]
    assert mixed.shape == (2, N, V) and torch.allclose(mixed, expected, atol=1e-5)
    assert probe.projected_rows == 2
    assert torch.allclose(probe.cond_logits(only), full[1:B], atol=1e-6) and probe.projected_rows == 4
    assert torch.allclose(probe.logits(torch.tensor([0])), full[[0, B]], atol=1e-6) and probe.projected_rows == 6
    assert probe.mixed_logits(wc, wu, only) is mixed and probe.projected_rows == 6  # memoised
    assert asked == [[1, 2, 4, 5], [1, 2], [0, 3]]  # features of the samples' rows only, never of every row
