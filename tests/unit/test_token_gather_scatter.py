"""The engine's token gathers and scatters (flat ``index_select`` / ``index_copy_``), on hand-worked examples."""

from __future__ import annotations

import pytest
import torch

from var_core.engine.policy import gather_tokens, scatter_into, scatter_into_zeros, scatter_tokens_


def _map():
    return torch.arange(24, dtype=torch.float32).view(2, 4, 3)  # token t of row r = [12r+3t, 12r+3t+1, 12r+3t+2]


def test_gather_picks_each_rows_own_tokens():
    keep = torch.tensor([[3, 0], [1, 2]])
    assert gather_tokens(_map(), keep).tolist() == [[[9, 10, 11], [0, 1, 2]], [[15, 16, 17], [18, 19, 20]]]


def test_scatter_into_copies_and_writes_the_kept_slots_only():
    base = _map()
    out = -torch.ones(2, 2, 3)
    got = scatter_into(base, out, torch.tensor([[1, 3], [0, 0]]))  # row 1: a padding slot repeats token 0
    assert got[0, :, 0].tolist() == [0, -1, 6, -1] and got[1, :, 0].tolist() == [-1, 15, 18, 21]
    assert base[0, 1, 0].item() == 3  # the input is not modified


def test_scatter_into_zeros_and_non_contiguous_base():
    out = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    assert scatter_into_zeros(out, torch.tensor([[2], [0]]), 3).tolist() == [
        [[0, 0], [0, 0], [1, 2]], [[3, 4], [0, 0], [0, 0]]]
    strided = _map().transpose(0, 1).contiguous().transpose(0, 1)  # same values, not contiguous
    got = scatter_into(strided, -torch.ones(2, 1, 3), torch.tensor([[2], [1]]))
    assert got[0, 2].tolist() == [-1, -1, -1] and got[1, 1].tolist() == [-1, -1, -1] and got[1, 2, 0].item() == 18
    with pytest.raises(ValueError, match="contiguous"):
        scatter_tokens_(strided, -torch.ones(2, 1, 3), torch.tensor([[2], [1]]))
