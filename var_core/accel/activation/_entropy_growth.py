"""Scale-entropy curves and NOVA's inflection test, as pure tensor functions (shared helper, not a component).

NOVA §2.1–2.2 (specs/methods.md). Index convention: the paper numbers scales ``t = 1..K`` (1-indexed); arrays here
are indexed by ``si = t − 1``. So ``H[:, si]`` is the paper's ``H_{si+1}``, ``g[:, si] = H[:, si] − H[:, si−1]`` is
``g_{si+1}`` (defined for ``si ≥ 1``, NaN at ``si = 0``), and the paper's reference window ``g_2 … g_{t_est}`` is
``g[:, 1 : t_est]``.

Used by the ``entropy_inflection`` activation and by the linkage schedules (which recompute the growth from
``Signals.token_entropy`` so that they work with any activation).
"""

from __future__ import annotations

import math

import torch

from ..base import Signals
from ..entropy import max_token_entropy, scale_entropy

SMOOTHINGS = ("backward", "none")
REFERENCES = ("mean", "max")
GROWTH_TESTS = ("signed", "magnitude")
SCOPES = ("sample", "batch", "pooled")
FIRST_ACCELERATED = ("after", "at")


def scale_entropy_curve(signals: Signals, upto: int, definition: str) -> torch.Tensor | None:
    """float64 ``[B, upto + 1]``: per-sample scale entropy ``H`` of scales ``0..upto`` (NaN where a scale was
    skipped or has not run). None when no scale has a record yet."""
    columns = []
    device = None
    B = signals.info.batch_size
    for si in range(upto + 1):
        ent_BN = signals.token_entropy(si)
        if ent_BN is None:
            columns.append(None)
            continue
        device = ent_BN.device
        max_entropy = 1.0
        if definition == "normalized":
            max_entropy = max_token_entropy(signals.records[si].guided_logits_BNV, signals.info.family)
        columns.append(scale_entropy(ent_BN.double(), definition, max_entropy))
    if device is None:
        return None
    nan = torch.full((B,), float("nan"), dtype=torch.float64, device=device)
    return torch.stack([nan if c is None else c.to(device) for c in columns], dim=1)


def growth(H_BK: torch.Tensor) -> torch.Tensor:
    """``g[:, si] = H[:, si] − H[:, si−1]`` (NaN at ``si = 0``), same shape as ``H``."""
    g = torch.full_like(H_BK, float("nan"))
    if H_BK.shape[1] > 1:
        g[:, 1:] = H_BK[:, 1:] - H_BK[:, :-1]
    return g


def smoothed_growth(g_BK: torch.Tensor, u: int, smoothing: str) -> torch.Tensor:
    """``δ`` at (0-indexed) scale ``u``: ``backward`` = (g_{u−1} + g_u)/2 (online form of the write-up's forward
    pair), ``none`` = g_u. NaN where undefined."""
    if smoothing == "none":
        return g_BK[:, u]
    if smoothing == "backward":
        if u < 1:
            return torch.full_like(g_BK[:, 0], float("nan"))
        return 0.5 * (g_BK[:, u - 1] + g_BK[:, u])
    raise ValueError(f"unknown smoothing {smoothing!r}; choose one of {SMOOTHINGS}")


def growth_reference(g_BK: torch.Tensor, t_est: int, reference: str, test: str) -> torch.Tensor:
    """Early-growth reference over the paper's ``g_2 … g_{t_est}`` (``g[:, 1:t_est]``), ``[B]``.

    ``signed``: mean or max of the signed growths; ``magnitude``: |mean| or max |g| (the size of the early change,
    whatever its sign)."""
    window = g_BK[:, 1:t_est]
    if test == "magnitude":
        return window.mean(1).abs() if reference == "mean" else window.abs().amax(1)
    return window.mean(1) if reference == "mean" else window.amax(1)


def first_test_scale(t_est: int, first_accelerated: str) -> int:
    """Earliest 0-indexed scale whose end may fire the test.

    ``after``: t* = min{t > t_est : δ_t < α·ḡ}, tested at the end of scale t → 0-indexed u = t − 1 ≥ t_est.
    ``at``: t* = min{t > t_est : δ_{t−1} < α·ḡ} (scale t* itself is accelerated, so its test can only use growth
    up to t* − 1) → tested at the end of u = t* − 2 ≥ t_est − 1.
    Either way the scale after the one whose end fired the test is the first accelerated one.
    """
    return t_est if first_accelerated == "after" else t_est - 1


def fires_at(H_BK: torch.Tensor, u: int, *, t_est: int, alpha: float, reference: str, smoothing: str, test: str
             ) -> torch.Tensor:
    """bool ``[B]``: does the inflection test fire at the end of 0-indexed scale ``u``? (``H`` needs columns
    ``0..u``; the t_est/first-accelerated window is the caller's business, see :func:`first_accelerated_scale`.)"""
    g = growth(H_BK[:, : u + 1])
    ref = growth_reference(g, t_est, reference, test)
    delta = smoothed_growth(g, u, smoothing)
    if test == "magnitude":
        return delta.abs() < alpha * ref  # NaN compares False: never fires on undefined values
    if test != "signed":
        raise ValueError(f"unknown growth test {test!r}; choose one of {GROWTH_TESTS}")
    return delta < alpha * ref


def first_accelerated_scale(H_BK: torch.Tensor, *, t_est: int, alpha: float, reference: str = "mean",
                            smoothing: str = "backward", test: str = "signed", first_accelerated: str = "after"
                            ) -> torch.Tensor:
    """Offline form of the online rule: int64 ``[B]`` first accelerated 0-indexed scale (``K`` = never) for a
    whole curve ``H [B, K]``. The activation component runs :func:`fires_at` scale by scale with the same result."""
    B, K = H_BK.shape
    first = torch.full((B,), K, dtype=torch.long)
    for u in range(first_test_scale(t_est, first_accelerated), K):
        fired = fires_at(H_BK, u, t_est=t_est, alpha=alpha, reference=reference, smoothing=smoothing,
                         test=test).cpu()
        first = torch.where((first == K) & fired, torch.full_like(first, u + 1), first)
    return first


def quorum_size(batch_size: int, share: float) -> int:
    """Samples that must have fired before a batch-level activation switches the whole batch on:
    ``ceil(share · B)``, at least 1 (so a batch of one behaves like the per-sample rule)."""
    return max(1, min(batch_size, math.ceil(share * batch_size - 1e-9)))


def batch_first_scale(first_B: torch.Tensor, share: float, num_scales: int) -> int:
    """Offline form of the ``batch`` scope: the batch's first accelerated 0-indexed scale given each sample's own
    (``num_scales`` = never) — the ``quorum_size``-th smallest of them, i.e. the first scale by which that many
    samples have fired. Every sample of the batch is accelerated from there on."""
    need = quorum_size(first_B.numel(), share)
    value = int(first_B.sort().values[need - 1])
    return min(value, num_scales)
