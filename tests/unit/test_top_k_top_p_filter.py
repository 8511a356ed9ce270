"""The top-k / top-p filter: hand-worked cases, and bit-equality of its sort-free path with the official
algorithm (written out here as VAR's ``sample_with_top_k_top_p_`` does it: mask below the k-th logit, sort the whole
vocabulary ascending, drop the prefix whose cumulative probability is ≤ 1 − top_p), ties included."""

from __future__ import annotations

import math

import pytest
import torch

from var_core.engine.sampling import _filter_top_k_then_top_p, filter_top_k_top_p

NEG = float("-inf")


def official_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    V = logits.shape[-1]
    out = logits.clone()
    if 0 < top_k < V:
        kth = logits.topk(top_k, dim=-1, largest=True, sorted=False)[0].amin(dim=-1, keepdim=True)
        out.masked_fill_(out < kth, NEG)
    if 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = out.sort(dim=-1, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum_(dim=-1) <= (1 - top_p)
        remove[..., -1:] = False
        out.masked_fill_(remove.scatter(sorted_idx.ndim - 1, sorted_idx, remove), NEG)
    return out


def test_hand_worked_cut():
    # top-4 of [3, 2, 1, 0, -1] → probabilities ∝ e^3, e^2, e^1, e^0 = .644, .237, .087, .032; ascending cumulative
    # .032, .119, .356, 1: with top_p = 0.5 every prefix ≤ 0.5 goes (tokens 3, 2, 1), with 0.9 only token 3 (0.032)
    logits = torch.tensor([[[0.0, 3.0, -1.0, 1.0, 2.0]]])
    assert torch.equal(filter_top_k_top_p(logits, 4, 0.5), torch.tensor([[[NEG, 3.0, NEG, NEG, NEG]]]))
    assert torch.equal(filter_top_k_top_p(logits, 4, 0.9), torch.tensor([[[NEG, 3.0, NEG, 1.0, 2.0]]]))
    weights = [math.exp(v) for v in (3, 2, 1, 0)]
    assert weights[-1] / sum(weights) == pytest.approx(0.032, abs=1e-3)  # the hand numbers above
    assert not _filter_top_k_then_top_p(logits, 4, 0.9)[1].any()  # no ties: the sort-free path answered


def test_the_largest_token_always_survives():
    logits = torch.tensor([[[5.0, 0.0, 0.0, -3.0]]])
    assert torch.equal(filter_top_k_top_p(logits, 2, 0.01), torch.tensor([[[5.0, NEG, NEG, NEG]]]))


@pytest.mark.parametrize("V, k, p", [(64, 10, 0.9), (512, 100, 0.95), (4096, 900, 0.96), (300, 299, 0.5)])
def test_equals_the_official_filter_bit_for_bit(V, k, p):
    g = torch.Generator().manual_seed(V + k)
    for scale in (0.3, 3.0, 20.0):
        logits = torch.randn(3, 17, V, generator=g) * scale
        assert torch.equal(filter_top_k_top_p(logits, k, p), official_filter(logits, k, p))
        assert not _filter_top_k_then_top_p(logits, k, p)[1].any()  # the sort-free path, not the fallback


def test_ties_take_the_official_path():
    # a tie at the k-th logit: the official mask keeps every tied token, topk only k of them
    at_kth = torch.tensor([[[4.0, 3.0, 1.0, 1.0, 0.0]]])
    assert _filter_top_k_then_top_p(at_kth, 3, 0.99)[1].tolist() == [[True]]
    assert torch.equal(filter_top_k_top_p(at_kth, 3, 0.99), official_filter(at_kth, 3, 0.99))
    # equal survivors on both sides of the top-p cut: which one survives is the official sort's tie order
    across_cut = torch.tensor([[[2.0, 0.0, 0.0, -9.0]]])  # ascending cumulative of the 3 survivors: .106, .212, 1
    assert _filter_top_k_then_top_p(across_cut, 3, 0.85)[1].tolist() == [[True]]  # cut at 0.15: between the zeros
    assert torch.equal(filter_top_k_top_p(across_cut, 3, 0.85), official_filter(across_cut, 3, 0.85))
    # equal survivors on the same side of the cut are unambiguous: the sort-free path answers
    same_side = torch.tensor([[[2.0, 0.0, 0.0, -9.0]]])
    fast, tied = _filter_top_k_then_top_p(same_side, 3, 0.5)
    assert not tied.any() and torch.equal(fast, official_filter(same_side, 3, 0.5))


def test_rounded_logits_with_many_ties():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 31, 512, generator=g) * 2
    logits[:2] = (logits[:2] * 2).round() / 2  # two samples' rows full of ties, the others with (almost) none
    for k, p in ((50, 0.9), (200, 0.6)):
        tied = _filter_top_k_then_top_p(logits, k, p)[1]
        assert tied.any() and not tied.all()  # some rows recomputed the official way, the others not
        assert torch.equal(filter_top_k_top_p(logits, k, p), official_filter(logits, k, p))
