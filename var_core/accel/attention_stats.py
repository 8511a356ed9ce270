"""Attention statistics shared by components (ToProVAR §4.1 / §4.2 / §4.3), plus small helpers for score maps.

Attention arrives from the loop as an :class:`~var_core.engine.attention.AttentionProbe` (``probs_RHnL`` below):
``R`` network rows, ``H`` heads, the ``n`` computed queries of this scale (at positions ``keep_Rn`` within the
scale, or all ``N`` in order when ``keep_Rn`` is None) over the ``L`` keys cached so far. The probe computes the
per-query entropy as ``log Z − E_α[s]`` blockwise and the received mass from ``log Z`` and the current keys' logits,
so no ``[R, H, n, L]`` probability tensor is ever materialised (ToProVAR's FlashAttention-Entropy point, §4.1; cost
and exactness in ``var_core/engine/attention.py``). A probability tensor ``[R, H, n, L]`` is accepted too (tests,
offline analysis); there the current scale's keys are the LAST ``n`` of the ``L``.

Stored maps (per generation, in :class:`~var_core.accel.base.Signals`):

* ``signals.attention_entropy[(si, block)]`` — float32 ``[R, N]`` head-averaged per-query entropy of the scale's
  queries on the scale's full token grid (``R`` = rows computed at that scale). Positions whose query was not
  computed (pruned at that block) are **NaN**: no value is invented at recording time; readers fill them with
  :func:`fill_missing` (their own, documented choice).
* ``signals.extras["attention.received_mass"][(si, block)]`` — float32 ``[R, N]`` attention mass each current-scale
  token received as a key, NaN where the token was not computed (it was no key).

Both recorders are idempotent: when several components observe the same block, the first call stores the map and
later calls leave it untouched, so the result does not depend on the order the components are called in.

Ragged selections: the loop passes only the padded index ``keep_Rn`` to ``observe_attention`` (not the validity
mask). Padding repeats an index already kept in the row, so here a query / key counts only at its FIRST occurrence
in its row (:func:`first_occurrence_Rn`); padded keys are masked to probability 0 by the loop anyway.
"""

from __future__ import annotations

import torch

from ..engine.attention import AttentionProbe
from ..engine.context import GuidanceMode, ScaleContext
from .base import Signals

RECEIVED_MASS_KEY = "attention.received_mass"
FIRST_PRUNABLE_KEY = "schedule.first_prunable_scale"
MISSING_FILLS = ("lowest", "row_mean")


def query_attention_entropy(probs_RHnL) -> torch.Tensor:
    """``[R, n]`` per-query entropy ``H(q_i) = −Σ_j α_ij ln α_ij`` (nats), averaged over heads (ToProVAR Eq. 2).

    The mean is of the per-head entropies (not the entropy of the head-averaged distribution). Zero probabilities
    (masked keys) contribute 0. ``probs_RHnL``: an ``AttentionProbe`` (blockwise, nothing materialised) or the
    probabilities themselves.
    """
    if isinstance(probs_RHnL, AttentionProbe):
        return probs_RHnL.query_entropy()
    p = probs_RHnL.float()
    return -torch.special.xlogy(p, p).sum(-1).mean(1)


def first_occurrence_Rn(keep_Rn: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """bool ``[R, n]``: True where ``keep_Rn[r, j]`` is the first occurrence of that position in row ``r``."""
    R, n = keep_Rn.shape
    order = torch.arange(n, device=keep_Rn.device).expand(R, n)
    first = torch.full((R, num_tokens), n, dtype=torch.long, device=keep_Rn.device)
    first = first.scatter_reduce(1, keep_Rn, order, reduce="amin", include_self=True)
    return first.gather(1, keep_Rn) == order


def scatter_to_map(values_Rn: torch.Tensor, keep_Rn: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
    """Place per-computed-token values ``[R, n]`` on the scale grid ``[R, N]``; NaN where nothing was computed."""
    values = values_Rn.float()
    if keep_Rn is None:
        return values
    valid = first_occurrence_Rn(keep_Rn, num_tokens)
    R = values.shape[0]
    total = values.new_zeros(R, num_tokens).scatter_add(1, keep_Rn, torch.where(valid, values, 0.0))
    count = values.new_zeros(R, num_tokens).scatter_add(1, keep_Rn, valid.float())
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))


def received_attention_mass(probs_RHnL, keep_Rn: torch.Tensor | None, ctx: ScaleContext
                            ) -> torch.Tensor:
    """``[R, N]`` attention mass each current-scale token receives as a key: the sum over this scale's (distinct)
    queries of the head-averaged probability on that key. NaN where the token was not computed."""
    N = ctx.num_tokens
    query_valid = None if keep_Rn is None else first_occurrence_Rn(keep_Rn, N)
    if isinstance(probs_RHnL, AttentionProbe):
        return scatter_to_map(probs_RHnL.received_mass(query_valid), keep_Rn, N)
    n = probs_RHnL.shape[2]
    to_current_Rnn = probs_RHnL[..., -n:].float().mean(1)  # [R, queries, current keys]
    if query_valid is not None:
        to_current_Rnn = to_current_Rnn * query_valid.unsqueeze(-1)
    return scatter_to_map(to_current_Rnn.sum(1), keep_Rn, N)


def record_attention_entropy(signals: Signals, ctx: ScaleContext, block: int, probs_RHnL,
                             keep_Rn: torch.Tensor | None) -> torch.Tensor:
    """Store (once) and return ``signals.attention_entropy[(si, block)]``: ``[R, N]``, NaN at uncomputed queries."""
    key = (ctx.scale_index, block)
    if key not in signals.attention_entropy:
        signals.attention_entropy[key] = scatter_to_map(query_attention_entropy(probs_RHnL), keep_Rn,
                                                        ctx.num_tokens)
    return signals.attention_entropy[key]


def record_received_mass(signals: Signals, ctx: ScaleContext, block: int, probs_RHnL,
                         keep_Rn: torch.Tensor | None) -> torch.Tensor:
    """Store (once) and return ``signals.extras["attention.received_mass"][(si, block)]`` (``[R, N]``)."""
    store = signals.extras.setdefault(RECEIVED_MASS_KEY, {})
    key = (ctx.scale_index, block)
    if key not in store:
        store[key] = received_attention_mass(probs_RHnL, keep_Rn, ctx)
    return store[key]


# ---------------------------------------------------------------------------------------------------- map helpers
def fill_missing(map_RN: torch.Tensor, how: str = "lowest") -> torch.Tensor:
    """Replace NaN (uncomputed) entries per row: ``lowest`` = the row's smallest computed value (they rank last,
    ties broken by position), ``row_mean`` = the row's mean computed value. An all-NaN row becomes 0."""
    missing = torch.isnan(map_RN)  # no "anything missing?" shortcut: it is a host synchronisation on a GPU
    present = ~missing
    any_present = present.any(-1, keepdim=True)
    if how == "lowest":
        fill = torch.where(present, map_RN, torch.full_like(map_RN, float("inf"))).amin(-1, keepdim=True)
    elif how == "row_mean":
        fill = torch.where(present, map_RN, 0.0).sum(-1, keepdim=True) / present.sum(-1, keepdim=True).clamp(min=1)
    else:
        raise ValueError(f"unknown fill {how!r}; choose one of {MISSING_FILLS}")
    fill = torch.where(any_present, fill, torch.zeros_like(fill))
    return torch.where(missing, fill, map_RN)


# ---------------------------------------------------------------------------------------------------- regions
def region_ids(hw: tuple[int, int], regions: int) -> torch.Tensor:
    """int64 ``[N]``: the cell of a ``regions × regions`` grid each token of an ``h × w`` map falls in (row-major
    cells; cell boundaries at ``floor(i·h/regions)``; on a map smaller than the grid some cells are empty)."""
    h, w = hw
    rows = torch.arange(h) * regions // h
    cols = torch.arange(w) * regions // w
    return (rows.view(h, 1) * regions + cols.view(1, w)).flatten()


def region_quotas(hw: tuple[int, int], regions: int, min_keep: float) -> torch.Tensor:
    """int64 ``[regions²]``: tokens each cell must keep, ``ceil(min_keep · n_cell)`` (0 for an empty cell)."""
    sizes = torch.bincount(region_ids(hw, regions), minlength=regions * regions)
    return torch.ceil(sizes.double() * min_keep - 1e-9).clamp(min=0).long()


def region_floor(hw: tuple[int, int], regions: int, min_keep: float) -> int:
    """Smallest keep count that lets every cell keep its quota: ``Σ_cells ceil(min_keep · n_cell)``."""
    return int(region_quotas(hw, regions, min_keep).sum()) if min_keep > 0 else 0


def region_priority(scores_RN: torch.Tensor, hw: tuple[int, int], regions: int, min_keep: float) -> torch.Tensor:
    """Scores re-ranked so that any top-``k`` with ``k ≥ region_floor`` keeps every cell's quota.

    Per row, order the tokens by score (descending, ties to the lower position); the best ``ceil(min_keep · n)``
    tokens of each cell come first, then every other token, each group in that order. Returned as rank values in
    (0, 2] (quota tokens above 1), so the policy's top-k picks the quota first and the rest by score."""
    R, N = scores_RN.shape
    if min_keep <= 0:
        return scores_RN
    device = scores_RN.device
    cells = region_ids(hw, regions).to(device)
    quotas = region_quotas(hw, regions, min_keep).to(device)
    order = torch.nan_to_num(scores_RN.double(), nan=float("-inf")).sort(dim=1, descending=True, stable=True).indices
    sorted_cells = cells[order]  # [R, N]
    onehot = torch.nn.functional.one_hot(sorted_cells, regions * regions)
    within = onehot.cumsum(1).gather(2, sorted_cells.unsqueeze(-1)).squeeze(-1) - 1  # rank inside the cell
    first_sorted = within < quotas[sorted_cells]
    rank_value = (N - torch.arange(N, device=device, dtype=torch.float64)) / N  # 1 for the best, 1/N for the last
    value_sorted = rank_value.expand(R, N) + first_sorted.double()
    out = torch.empty(R, N, dtype=torch.float64, device=device)
    out.scatter_(1, order, value_sorted)
    return out.to(scores_RN.dtype if scores_RN.is_floating_point() else torch.float32)


def align_rows(map_R: torch.Tensor, from_guidance: GuidanceMode, ctx: ScaleContext) -> torch.Tensor:
    """Rows of a map recorded under ``from_guidance`` that correspond to the rows computed at ``ctx``.

    A map with one row per sample (``B`` rows) is returned unchanged. A 2B-row map recorded with both CFG halves
    keeps its conditional (or unconditional) half when ``ctx`` computes one half only.
    """
    B = ctx.batch_size
    if map_R.shape[0] == ctx.rows or map_R.shape[0] == B:
        return map_R
    if from_guidance is GuidanceMode.BOTH and map_R.shape[0] == 2 * B:
        return map_R[B:] if ctx.guidance is GuidanceMode.UNCOND_ONLY else map_R[:B]
    raise ValueError(f"cannot align a {map_R.shape[0]}-row map recorded under {from_guidance.value} to "
                     f"{ctx.rows} rows under {ctx.guidance.value}")


def publish_first_prunable(signals: Signals, scale: int) -> None:
    """A schedule that never prunes before 0-indexed ``scale`` says so (e.g. ToProVAR's gate: not before ``s_rep``),
    so that observations read only at pruned scales are not made earlier (:func:`may_prune_at` /
    :func:`may_prune_next`). Read back with :func:`first_prunable_scale`."""
    signals.extras[FIRST_PRUNABLE_KEY] = int(scale)


def first_prunable_scale(signals: Signals) -> int:
    """The earliest scale any schedule may prune (0 when none published one)."""
    extras = getattr(signals, "extras", None) or {}
    return int(extras.get(FIRST_PRUNABLE_KEY, 0))


def may_prune_at(si: int, signals: Signals) -> bool:
    """Whether some sample may be accelerated at scale ``si``, judged from ``signals.activation_scale_B`` (and the
    schedule's first prunable scale, when published).

    Used to keep costly same-scale observations (logit lens, attention statistics) off scales that certainly run
    dense. When the activation component does not publish its scale (None) the answer is True.
    """
    if si < first_prunable_scale(signals):
        return False
    first = signals.activation_scale_B
    return first is None or bool((first <= si).any())


def may_prune_next(si: int, num_scales: int, signals: Signals) -> bool:
    """Whether the scale after ``si`` may be accelerated (for observations made at ``si`` and read at ``si + 1``).

    True when the activation scale is unpublished (None), already reached (``<= si + 1``), or not decided yet
    (``num_scales``: an adaptive activation may still fire at the end of ``si``). False at the last scale and
    before the schedule's first prunable scale (:func:`publish_first_prunable`).
    """
    if si >= num_scales - 1 or si + 1 < first_prunable_scale(signals):
        return False
    first = signals.activation_scale_B
    return first is None or bool(((first <= si + 1) | (first >= num_scales)).any())


__all__ = ["FIRST_PRUNABLE_KEY", "MISSING_FILLS", "RECEIVED_MASS_KEY", "align_rows", "fill_missing",
           "first_occurrence_Rn", "first_prunable_scale", "may_prune_at", "may_prune_next", "publish_first_prunable",
           "query_attention_entropy", "received_attention_mass", "record_attention_entropy", "record_received_mass",
           "region_floor", "region_ids", "region_priority", "region_quotas", "scatter_to_map"]


def entropy_source_blocks(source: str, num_blocks: int) -> frozenset[int]:
    """The blocks whose attention ToProVAR's depth rule reads for ``entropy_source`` (shared by the
    ``low_entropy_ratio`` activation and the ``depth_exit`` skip): none for ``predictive``, block 0 for
    ``attention_block0``, every block otherwise."""
    if source == "predictive":
        return frozenset()
    return frozenset({0} if source == "attention_block0" else range(num_blocks))
