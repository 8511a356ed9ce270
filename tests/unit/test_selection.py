"""Which tokens a selection keeps: hand-worked examples for ``top_tokens`` and ``rank_grid`` (issue 11).

Every expected index list below is worked out by hand from the scores in the test, not by another helper.
"""

from __future__ import annotations

import torch

from var_core.accel.policy import rank_grid, top_tokens
from var_core.engine.policy import TokenSelection


def _rows(selection):
    """Per row, the kept positions (padding removed)."""
    if isinstance(selection, TokenSelection):
        return [row[valid].tolist() for row, valid in zip(selection.index_Rn, selection.valid_Rn)]
    return [row.tolist() for row in selection]


def test_keeps_the_highest_scores_sorted_by_position():
    scores = torch.tensor([[0.1, 0.9, 0.3, 0.7, 0.5, 0.2]])
    # the three largest are 0.9 (pos 1), 0.7 (pos 3), 0.5 (pos 4)
    assert _rows(top_tokens(scores, torch.tensor([3]), 3)) == [[1, 3, 4]]


def test_ties_go_to_the_lower_position_whatever_the_batch_maximum():
    # a Haar-like row: positions 0-3 tie at 5.0, 4-7 tie at 2.0
    row = torch.tensor([5.0, 5.0, 5.0, 5.0, 2.0, 2.0, 2.0, 2.0])
    wide = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 1.0])  # a neighbour that keeps 6
    alone = top_tokens(row.view(1, -1), torch.tensor([2]), 2)
    assert _rows(alone) == [[0, 1]]
    for neighbour_count in (2, 3, 6, 7):  # the batch's largest keep count changes topk's k, not the answer
        batch = top_tokens(torch.stack([row, wide]), torch.tensor([2, neighbour_count]), max(2, neighbour_count))
        assert _rows(batch)[0] == [0, 1], neighbour_count
    # keeping 5 of the row: all four 5.0s, then the first 2.0
    assert _rows(top_tokens(row.view(1, -1), torch.tensor([5]), 5)) == [[0, 1, 2, 3, 4]]


def test_ragged_rows_are_padded_with_a_repeated_kept_index():
    scores = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 3.0, 2.0, 1.0]])
    sel = top_tokens(scores, torch.tensor([1, 3]), 3)
    assert isinstance(sel, TokenSelection)
    assert _rows(sel) == [[1], [0, 1, 2]]
    assert sel.index_Rn[0].tolist() == [1, 1, 1] and sel.valid_Rn[0].tolist() == [True, False, False]


def test_forced_keeps_and_nan_scores():
    # +inf (a restorer's anchor) is always kept; NaN ranks last
    scores = torch.tensor([[float("nan"), 1.0, float("inf"), 2.0]])
    assert _rows(top_tokens(scores, torch.tensor([2]), 2)) == [[2, 3]]
    assert _rows(top_tokens(scores, torch.tensor([3]), 3)) == [[1, 2, 3]]


def test_rank_grid_rounds_relative_to_the_rows_largest_score():
    # row max 1.0, 2 bits: steps of 0.25 -> 0.30 -> 0.25, 0.40 -> 0.5, 0.12 -> 0.0 (12/25 rounds down)
    scores = torch.tensor([[1.0, 0.30, 0.40, 0.12], [8.0, 2.9, 3.1, float("inf")]])
    out = rank_grid(scores, 2)
    assert out[0].tolist() == [1.0, 0.25, 0.5, 0.0]
    # second row: max finite 8.0, step 2.0 -> 2.9 -> 2.0, 3.1 -> 4.0, inf stays
    assert out[1].tolist() == [8.0, 2.0, 4.0, float("inf")]
    assert torch.equal(rank_grid(scores, 0), scores)


def test_rank_grid_makes_noise_level_differences_ties():
    # two tokens whose scores differ only by float noise tie after the grid, so position decides
    base = torch.tensor([[1.0, 0.5, 0.5 + 3e-9, 0.2]])
    noisy = torch.tensor([[1.0, 0.5 + 3e-9, 0.5, 0.2]])
    for scores in (base, noisy):
        kept = _rows(top_tokens(rank_grid(scores.double(), 16), torch.tensor([2]), 2))
        assert kept == [[0, 1]]


def test_haar_cells_tie_break_is_independent_of_the_neighbours_count():
    # Haar energies are constant inside 2x2 cells: a 16x16 map of 64 distinct cell values, each on 4 tokens
    gen = torch.Generator().manual_seed(0)
    cells = torch.rand(1, 8, 8, generator=gen)
    row = cells.repeat_interleave(2, 1).repeat_interleave(2, 2).flatten()
    expected = sorted(sorted(range(256), key=lambda p: (-float(row[p]), p))[:10])
    for neighbour_keeps in (10, 50, 100, 200, 256):
        other = torch.rand(256, generator=gen)
        sel = top_tokens(torch.stack([row, other]), torch.tensor([10, neighbour_keeps]), neighbour_keeps)
        assert _rows(sel)[0] == expected, neighbour_keeps
