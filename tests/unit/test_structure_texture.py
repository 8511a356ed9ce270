"""StepVAR's structure-texture scorer (arXiv 2603.01757): ``S = w_str·|X_c v| + Σ_c (X − AvgPool3×3(X))²``, pinned on a
hand-worked 2×2 map and against a second implementation (eigendecomposition of the covariance, neighbour loops)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from var_core.accel.policy import component_config
from var_core.accel.registry import SCORERS


def _scorer(**knobs):
    return SCORERS.get("structure_texture")(component_config("scorer", "structure_texture", **knobs))


def _score(scorer, x_RNC, hw):
    return scorer.score(SimpleNamespace(hw=hw), 0, "attn", x_RNC, None)


def test_hand_worked_one_channel_two_by_two():
    # one channel: the principal direction is ±1, so S_str = |x − mean|; on a 2×2 grid every 3×3 window holds all
    # four tokens. x = 1, 2, 3, 6 (mean 3): S_str = 2, 1, 0, 3.
    x = torch.tensor([1.0, 2.0, 3.0, 6.0]).view(1, 4, 1)
    # valid border: the local mean is the global mean 3 -> S_txt = 4, 1, 0, 9
    assert torch.allclose(_score(_scorer(), x, (2, 2)), torch.tensor([[6.0, 2.0, 0.0, 12.0]]))
    # zero padding: the local mean is 12/9 -> S_txt = (x − 4/3)² = 1/9, 4/9, 25/9, 196/9; with w_str = 2
    want = 2 * torch.tensor([2.0, 1.0, 0.0, 3.0]) + torch.tensor([1.0, 4.0, 25.0, 196.0]) / 9
    got = _score(_scorer(border="zero", structure_weight=2.0), x, (2, 2))
    assert torch.allclose(got, want.view(1, 4))
    # each term scaled to [0, 1] first: 2/3, 1/3, 0, 1 and 4/9, 1/9, 0, 1
    want = torch.tensor([2 / 3 + 4 / 9, 1 / 3 + 1 / 9, 0.0, 2.0]).view(1, 4)
    assert torch.allclose(_score(_scorer(normalize="max"), x, (2, 2)), want)


def _second_implementation(x_RNC, hw, weight, border):
    R, N, C = x_RNC.shape
    h, w = hw
    out = torch.empty(R, N, dtype=torch.float64)
    for r in range(R):
        X = x_RNC[r].double()
        Xc = X - X.mean(0)
        _, vectors = torch.linalg.eigh(Xc.T @ Xc)  # ascending eigenvalues: the last column is the top component
        structure = (Xc @ vectors[:, -1]).abs()
        grid = X.view(h, w, C)
        for i in range(h):
            for j in range(w):
                neigh = [grid[a, b] for a in range(i - 1, i + 2) for b in range(j - 1, j + 2) if 0 <= a < h and 0 <= b < w]
                mean = torch.stack(neigh).sum(0) / (len(neigh) if border == "valid" else 9)
                out[r, i * w + j] = weight * structure[i * w + j] + (grid[i, j] - mean).square().sum()
    return out


@pytest.mark.parametrize("border", ["valid", "zero"])
def test_matches_eigendecomposition_and_neighbour_loops(border):
    g = torch.Generator().manual_seed(0)
    hw = (3, 5)
    # one dominant direction (a well separated top eigenvalue, so the power iteration converges in its budget)
    direction = torch.tensor([3.0, -1.0, 2.0, 0.5])
    x = torch.randn(2, 15, 4, generator=g) * 0.3 + torch.randn(2, 15, 1, generator=g) * direction
    got = _score(_scorer(border=border, structure_weight=0.7, iterations=30), x, hw)
    want = _second_implementation(x, hw, 0.7, border)
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4)
