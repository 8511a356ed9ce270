"""StepVAR's structure-texture token score: PCA structural importance plus high-pass texture energy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import Scorer, Signals
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCORERS


def first_principal_direction(xc_RNC: torch.Tensor, iterations: int) -> torch.Tensor:
    """``[R, C]`` unit vector per row: power iteration ``v <- X_cᵀ X_c v / ‖·‖`` from the all-ones direction
    (RECONSTRUCTED start: any start not orthogonal to the top component converges to it up to sign)."""
    R, _, C = xc_RNC.shape
    v = torch.full((R, C), C ** -0.5, dtype=xc_RNC.dtype, device=xc_RNC.device)
    for _ in range(iterations):
        w = torch.einsum("rnc,rn->rc", xc_RNC, torch.einsum("rnc,rc->rn", xc_RNC, v))
        v = w / w.norm(dim=1, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
    return v


@SCORERS.register("structure_texture")
class StructureTextureScorer(Scorer):
    """StepVAR (arXiv 2603.01757, specs/methods.md §9; FOUND(secondary write-up), no code): a token is kept for its
    global structure or its local texture, ``S = w_str · S_str + S_txt`` (high = keep). Knob: ``structure_weight``.

    * ``S_str = |X_c v|`` — the magnitude of the token's projection on the first principal component ``v`` of the
      centred features ``X_c = X − mean_tokens(X)`` of its row (power iteration, knob ``iterations``).
    * ``S_txt = Σ_c (X − AvgPool3×3(X))²`` — the energy a 3×3 box high-pass leaves on the scale's token grid.

    ``X`` is the hidden state handed to the scorer (the block input). RECONSTRUCTED: ``structure_weight`` (the
    write-up names ``w_str``, not its value), ``iterations``, ``border`` (how the 3×3 mean treats the grid's edge:
    ``valid`` averages the neighbours that exist, ``zero`` pads with zeros) and ``normalize`` (``none`` adds the
    terms as the write-up states; ``max`` scales each to [0, 1] per row first, so the weight is a true balance).
    Returns ``[R, N]``.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        structure_weight: float = knob(1.0, "w_str: weight of the PCA structure term against the texture term",
                                       low=0.0, reconstructed=True,
                                       search=SearchSpace("float", low=0.0, high=4.0))
        iterations: int = knob(8, "power-iteration steps for the first principal component", low=1, high=100,
                               reconstructed=True)
        border: str = knob("valid", "3x3 mean at the grid's edge: over the neighbours that exist, or zero-padded",
                           choices=("valid", "zero"), reconstructed=True)
        normalize: str = knob("none", "add the terms as they are, or each scaled to [0, 1] per row first",
                              choices=("none", "max"), reconstructed=True)

    def score(self, ctx, block, branch, x_RNC, signals: Signals) -> torch.Tensor:
        x = x_RNC.float()
        R, N, C = x.shape
        h, w = ctx.hw
        xc = x - x.mean(1, keepdim=True)
        v = first_principal_direction(xc, self.config.iterations)
        structure_RN = torch.einsum("rnc,rc->rn", xc, v).abs()
        grid = x.transpose(1, 2).reshape(R, C, h, w)
        local_mean = F.avg_pool2d(grid, 3, stride=1, padding=1, count_include_pad=self.config.border == "zero")
        texture_RN = (grid - local_mean).square().sum(1).reshape(R, N)
        if self.config.normalize == "max":
            tiny = torch.finfo(torch.float32).tiny
            structure_RN = structure_RN / structure_RN.amax(1, keepdim=True).clamp(min=tiny)
            texture_RN = texture_RN / texture_RN.amax(1, keepdim=True).clamp(min=tiny)
        return self.config.structure_weight * structure_RN + texture_RN
