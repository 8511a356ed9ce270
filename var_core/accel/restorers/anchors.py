"""SparseVAR's anchors: a regular grid of tokens is always computed; excluded tokens are recovered from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import Restorer, Signals
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import RESTORERS
from .nearest import gather_slots, grid_coordinates, nearest_source_slots

GRIDS = ("multiples", "with_last")


def anchor_lines(size: int, stride: int, grid: str = "multiples") -> list[int]:
    """Anchor rows (or columns) of a ``size``-long axis: the multiples of ``stride``; ``grid='with_last'`` also
    appends ``size - 1`` whenever ``stride % size != 0`` — the third-party SparseVAR code's condition
    (``generate_anchors_from_flat``), which lists the last line twice when it is already a multiple of ``stride``
    (e.g. 8 on a 9-wide grid). The list order is the candidates' order (it breaks distance ties)."""
    lines = list(range(0, size, stride))
    if grid == "with_last" and stride % size != 0:
        lines.append(size - 1)
    return lines


def anchor_candidates(hw: tuple[int, int], stride: int, grid: str = "multiples", device=None) -> torch.Tensor:
    """int64 ``[A]``: flat positions of the anchors, rows × columns of :func:`anchor_lines` in row-major order
    (duplicates kept, as the candidate list of the third-party code keeps them). Built on the device (no host list
    copied over: issue 27)."""
    rows = _lines_on(hw[0], stride, grid, device)
    cols = _lines_on(hw[1], stride, grid, device)
    return (rows.view(-1, 1) * hw[1] + cols.view(1, -1)).flatten()


def _lines_on(size: int, stride: int, grid: str, device) -> torch.Tensor:
    """:func:`anchor_lines` as an int64 tensor made on ``device``: ``j·stride`` for the ``j``-th line, clamped to
    ``size − 1`` (only the appended last line, the one index past the multiples, reaches the clamp)."""
    count = len(anchor_lines(size, stride, grid))
    return (torch.arange(count, dtype=torch.long, device=device) * stride).clamp_(max=size - 1)


def anchor_mask(hw: tuple[int, int], stride: int, device=None, grid: str = "multiples") -> torch.Tensor:
    """bool ``[N]``: the anchor positions (:func:`anchor_candidates`; always includes (0, 0))."""
    mask = torch.zeros(hw[0] * hw[1], dtype=torch.bool, device=device)
    mask[anchor_candidates(hw, stride, grid, device)] = True
    return mask


def nearest_anchors(hw: tuple[int, int], candidates_A: torch.Tensor, count: int) -> torch.Tensor:
    """int64 ``[N, k]`` (``k = min(count, A)``): for every position, the flat positions of its ``k`` nearest
    anchor candidates by squared grid distance, nearest first, ties in candidate order (a stable sort)."""
    rows_N, cols_N = grid_coordinates(hw, candidates_A.device)
    ar, ac = candidates_A // hw[1], candidates_A % hw[1]
    d2_NA = (rows_N.view(-1, 1) - ar.view(1, -1)).square() + (cols_N.view(-1, 1) - ac.view(1, -1)).square()
    order_NA = d2_NA.sort(dim=1, stable=True).indices[:, :min(count, candidates_A.numel())]
    return candidates_A[order_NA]


SIMILARITY_BITS = 16


def most_similar_anchor(features_BNF: torch.Tensor, neighbours_Nk: torch.Tensor, bits: int = SIMILARITY_BITS
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """For every position, the neighbour (``[N, k]`` flat positions) whose feature vector is most cosine-similar
    to its own (``F.cosine_similarity``): ``(anchor_BN, similarity_BN)``. Similarities are rounded to steps of
    ``2^-bits`` first (0: raw) and ties go to the earlier neighbour, so float noise from batch-size-dependent
    kernels (~1e-6) cannot pick another anchor among near-equal ones: a sample recovers alike alone and in a
    batch (the policy's ``rank_bits`` does the same for scores)."""
    best_sim = best = None
    for j in range(neighbours_Nk.shape[1]):  # k columns (4): bounds memory to one [B, N, F] gather at a time
        pos_N = neighbours_Nk[:, j]
        sim_BN = F.cosine_similarity(features_BNF, features_BNF[:, pos_N], dim=-1)
        if bits > 0:
            sim_BN = torch.round(sim_BN * 2.0 ** bits) / 2.0 ** bits
        if best is None:
            best_sim, best = sim_BN, pos_N.view(1, -1).expand_as(sim_BN).clone()
        else:
            better = sim_BN > best_sim
            best_sim = torch.where(better, sim_BN, best_sim)
            best = torch.where(better, pos_N.view(1, -1).expand_as(best), best)
    return best, best_sim


def tent_interpolate(values_RNC: torch.Tensor, mask_RN: torch.Tensor, hw: tuple[int, int], radius: int
                     ) -> torch.Tensor:
    """Normalised convolution with a separable tent (bilinear) kernel of half-width ``radius`` over the masked
    tokens: ``Σ_q w(p,q)·y_q / Σ_q w(p,q)``, ``w = (1−|Δrow|/radius)₊·(1−|Δcol|/radius)₊``.

    On a regular grid of sources with spacing ``radius`` this is exactly bilinear interpolation between them
    (constant beyond the last source row/column). Positions with no source in reach get zero.
    """
    R, N, C = values_RNC.shape
    h, w = hw
    dtype = values_RNC.dtype
    work_dtype = torch.float32 if values_RNC.device.type == "cpu" else dtype
    taps = 1.0 - (torch.arange(2 * radius - 1, device=values_RNC.device) - (radius - 1)).abs() / radius
    taps = taps.to(work_dtype)
    m_R1hw = mask_RN.to(work_dtype).view(R, 1, h, w)
    y_RChw = (values_RNC.to(work_dtype) * mask_RN.to(work_dtype).unsqueeze(-1)).transpose(1, 2).reshape(R, C, h, w)

    def separable(x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        kh = taps.view(1, 1, -1, 1).expand(channels, 1, -1, 1)
        kw = taps.view(1, 1, 1, -1).expand(channels, 1, 1, -1)
        x = F.conv2d(x, kh, padding=(radius - 1, 0), groups=channels)
        return F.conv2d(x, kw, padding=(0, radius - 1), groups=channels)

    num_RChw = separable(y_RChw)
    den_R1hw = separable(m_R1hw)
    out = num_RChw / den_R1hw.clamp_min(1e-6)
    out = torch.where(den_R1hw > 1e-6, out, torch.zeros_like(out))
    return out.flatten(2).transpose(1, 2).to(dtype)  # [R, N, C]


@RESTORERS.register("anchors")
class Anchors(Restorer):
    """SparseVAR §6: a stride grid of anchor tokens is always computed; excluded tokens are recovered from them.

    Knob that matters: ``stride`` (RECONSTRUCTED, specs §11 item 4: the anchor spacing is not published; default
    4, i.e. 1/16 of the tokens). Anchors are the positions whose row and column are multiples of ``stride``
    (option ``grid``; ``with_last`` adds the last row and column, :func:`anchor_lines`), always selected by the
    policy (``forced_keep``) unless ``forced=False``. Recovery (RECONSTRUCTED, option ``recovery``): ``nearest``
    (the value of the nearest source token, ties to the lowest position), ``bilinear`` (normalised tent
    interpolation of half-width ``stride`` over the source tokens: exactly bilinear between anchors when only the
    anchors are sources) or ``most_similar`` (see below). Option ``source`` (RECONSTRUCTED, ``nearest`` and
    ``bilinear``): recover from every ``computed`` token (default: anchors plus whatever the scorer kept) or from
    the ``anchors`` alone. Option ``target`` (RECONSTRUCTED): recover every pruned residual-branch ``branch``
    output (default, the granularity the restore slot offers), or the ``final`` hidden state: pruned tokens pass
    every branch unchanged and, at the last branch of the last block, take their recovered final state (the
    policy must prune the last block: no ``exempt_last_blocks`` / ``pruned_blocks_end``).

    ``most_similar`` (the third-party SparseVAR code, ``Weepingchestnut/Lvar`` ``models/sparsevar/
    sparsevar_model.py``, ``lf_anchor`` / ``map_to_best_corner``): each pruned token looks at its ``neighbours``
    nearest anchor candidates (squared grid distance, ties in the grid's row-major order) and takes the value of
    the one whose **previous scale's guided logits** (resized to this grid with ``'nearest'``) are most
    cosine-similar to its own, if that similarity exceeds ``similarity``; otherwise it keeps its own value (its
    input, or a zero branch output) and its sampled residual is left out of the latent (the code zeroes its codes).
    The anchor's value is whatever it holds: its computed output, or — when anchors are not forced and the scorer
    dropped it — its own input. A pruned anchor is its own nearest candidate (similarity 1).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        stride: int = knob(4, "RECONSTRUCTED: anchor grid spacing in tokens (rows and columns)", low=1,
                           reconstructed=True, search=SearchSpace("int", low=2, high=8))
        recovery: str = knob("nearest", "RECONSTRUCTED: how excluded tokens are recovered from the sources",
                             choices=("nearest", "bilinear", "most_similar"), reconstructed=True)
        source: str = knob("computed", "RECONSTRUCTED: recover from every computed token or from the anchors only",
                           choices=("computed", "anchors"), reconstructed=True)
        grid: str = knob("multiples", "RECONSTRUCTED: anchors on the multiples of stride, or also on the last row "
                         "and column (the third-party code's grid)", choices=GRIDS, reconstructed=True)
        forced: bool = knob(True, "RECONSTRUCTED: anchors are always computed (False: only where the scorer keeps "
                            "them, as the third-party code at batch 1)", choices=(True, False), reconstructed=True)
        target: str = knob("branch", "RECONSTRUCTED: recover each pruned residual-branch output, or the final "
                           "hidden state once at the last block", choices=("branch", "final"), reconstructed=True)
        neighbours: int = knob(4, "most_similar: nearest anchor candidates compared", low=1)
        similarity: float = knob(0.8, "most_similar: cosine similarity of the previous scale's guided logits above "
                                 "which a pruned token takes its anchor's value", low=-1.0, high=1.0)

        def __post_init__(self) -> None:
            super().__post_init__()
            if not self.forced and self.source == "anchors" and self.recovery != "most_similar":
                raise ValueError("restorer 'anchors': source='anchors' recovers from computed anchors only, but "
                                 "forced=False may leave none computed: set forced=True or source='computed'")

    def start(self, info, signals: Signals) -> None:
        self._masks: dict[tuple, torch.Tensor] = {}
        self._neighbours: dict[tuple, torch.Tensor] = {}
        self._last: tuple[torch.Tensor, tuple[int, int], torch.Tensor] | None = None
        self._match: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (si, anchor_BN, recoverable_BN)
        self._dropped: tuple[int, torch.Tensor] | None = None  # (si, bool [B, N] residuals left out)
        self._pending: int | None = None  # a scale pruned with target='final' whose final recovery is due

    def _mask(self, hw: tuple[int, int], device) -> torch.Tensor:
        key = (tuple(hw), str(device))
        if key not in self._masks:
            self._masks[key] = anchor_mask(hw, self.config.stride, device, self.config.grid)
        return self._masks[key]

    def forced_keep(self, ctx, signals) -> torch.Tensor | None:
        if not self.config.forced:
            return None
        # The slot carries no device: take it from the last computed scale (CPU before the first one).
        previous = ctx.last_computed()
        device = previous.tokens_BN.device if previous is not None and previous.tokens_BN is not None else "cpu"
        return self._mask(ctx.hw, device)

    def _sources(self, keep_Rn: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        """bool ``[R, n]``: which kept slots are recovery sources."""
        if self.config.source == "computed":
            return torch.ones_like(keep_Rn, dtype=torch.bool)
        return self._mask(hw, keep_Rn.device)[keep_Rn]

    def _recover_from_kept(self, hw, values_kept_RnC, keep_Rn, R, N, C) -> torch.Tensor:
        """``nearest`` / ``bilinear``: ``[R, N, C]`` recovered from the kept slots' values."""
        if self.config.recovery == "nearest":
            if self._last is not None and self._last[0] is keep_Rn and self._last[1] == tuple(hw):
                slots = self._last[2]
            else:
                sources = None if self.config.source == "computed" else self._sources(keep_Rn, hw)
                slots = nearest_source_slots(keep_Rn, hw, "euclidean", sources)
                self._last = (keep_Rn, tuple(hw), slots)
            return gather_slots(values_kept_RnC, slots)
        idx_RnC = keep_Rn.unsqueeze(-1).expand(-1, -1, C)
        sources_Rn = self._sources(keep_Rn, hw)
        mask_RN = torch.zeros(R, N, dtype=torch.bool, device=keep_Rn.device).scatter_(1, keep_Rn, sources_Rn)
        values_RNC = values_kept_RnC.new_zeros(R, N, C).scatter_(1, idx_RnC, values_kept_RnC)
        return tent_interpolate(values_RNC, mask_RN, hw, self.config.stride)

    def _similar_anchor(self, ctx, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(anchor_BN, recoverable_BN)`` of this scale (cached): the most similar of each token's nearest anchor
        candidates, and whether the similarity exceeds the threshold (never, without a previous scale's logits)."""
        si, B, N = ctx.scale_index, ctx.batch_size, ctx.num_tokens
        if self._match is not None and self._match[0] == si:
            return self._match[1], self._match[2]
        previous = ctx.last_computed()
        logits = None if previous is None else previous.guided_logits_BNV
        if logits is None:
            anchor = torch.arange(N, device=device).expand(B, N)
            recoverable = torch.zeros(B, N, dtype=torch.bool, device=device)
        else:
            key = (tuple(ctx.hw), str(device))
            if key not in self._neighbours:
                candidates = anchor_candidates(ctx.hw, self.config.stride, self.config.grid, device)
                self._neighbours[key] = nearest_anchors(ctx.hw, candidates, self.config.neighbours)
            (hp, wp), h, w = previous.hw, *ctx.hw
            maps = logits.float().reshape(B, hp, wp, -1).permute(0, 3, 1, 2)  # [B, V, hp, wp]
            maps = F.interpolate(maps, size=(h, w), mode="nearest")
            features_BNV = maps.flatten(2).transpose(1, 2).to(device)
            anchor, similarity = most_similar_anchor(features_BNV, self._neighbours[key])
            recoverable = similarity > self.config.similarity
        self._match = (si, anchor, recoverable)
        return anchor, recoverable

    def _recover_most_similar(self, ctx, values_RNC, keep_Rn) -> torch.Tensor:
        R, N, C = values_RNC.shape
        B = ctx.batch_size
        anchor_BN, recoverable_BN = self._similar_anchor(ctx, values_RNC.device)
        pruned_RN = torch.ones(R, N, dtype=torch.bool, device=keep_Rn.device).scatter_(1, keep_Rn, False)
        take_RN = pruned_RN & recoverable_BN.repeat(R // B, 1)
        moved_RNC = torch.gather(values_RNC, 1, anchor_BN.repeat(R // B, 1).unsqueeze(-1).expand(-1, -1, C))
        self._dropped = (ctx.scale_index, pruned_RN[:B] & ~recoverable_BN)
        return torch.where(take_RN.unsqueeze(-1), moved_RNC, values_RNC)

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC, signals):
        R, N, C = x_RNC.shape
        hw = ctx.hw
        idx_RnC = keep_Rn.unsqueeze(-1).expand(-1, -1, C)
        final = self.config.target == "final"
        if final:
            self._pending = ctx.scale_index
            if block != ctx.num_blocks - 1 or branch != ctx.branches[-1]:  # pruned tokens pass unchanged
                return out_kept_RnC.new_zeros(R, N, C).scatter_(1, idx_RnC, out_kept_RnC)
            self._pending = None
            # the final hidden state: computed tokens' x + out; pruned tokens never moved from their input
            values_kept_RnC = torch.gather(x_RNC, 1, idx_RnC).to(out_kept_RnC.dtype) + out_kept_RnC
        else:
            values_kept_RnC = out_kept_RnC
        if self.config.recovery == "most_similar":
            base_RNC = x_RNC.to(values_kept_RnC.dtype) if final else values_kept_RnC.new_zeros(R, N, C)
            values_RNC = base_RNC.clone().scatter_(1, idx_RnC, values_kept_RnC)
            recovered = self._recover_most_similar(ctx, values_RNC, keep_Rn)
        else:
            recovered = self._recover_from_kept(hw, values_kept_RnC, keep_Rn, R, N, C)
        if final:
            recovered = recovered - x_RNC.to(recovered.dtype)
        return recovered.scatter_(1, idx_RnC, out_kept_RnC)

    def latent_mask(self, ctx, signals) -> torch.Tensor | None:
        if self._pending == ctx.scale_index:
            raise ValueError(f"restorer 'anchors' with target='final' recovers at the last branch of the last "
                             f"block, but scale {ctx.scale_index} left it dense: prune the last block (no "
                             f"exempt_last_blocks / pruned_blocks_end) or use target='branch'")
        if self._dropped is not None and self._dropped[0] == ctx.scale_index:
            return ~self._dropped[1]
        return None
