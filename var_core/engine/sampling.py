"""Sampling settings and token draws: top-k / top-p filtering and one generator per sample.

Unlike the official samplers these functions never modify the logits they are given, so observers can keep
references to the guided logits without a defensive copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UserError

DRAWS = ("inverse_cdf", "multinomial")


@dataclass(frozen=True)
class SamplingConfig:
    """User-facing sampling knobs.

    ``cfg`` is the guidance strength in the model family's own convention (VAR: a linear ramp from 0 at the
    first scale to ``cfg`` at the last, applied as ``(1+t)·cond − t·uncond``; Infinity: constant
    ``cfg·cond + (1−cfg)·uncond``). ``top_k=0`` / ``top_p=0`` disable the filters; ``top_k=1`` is greedy.

    ``draw`` is how a sample's own generator draws a token from the filtered distribution (the distribution is
    the same either way; the random stream and its coupling differ): ``multinomial`` (default) is
    ``torch.multinomial`` over the whole filtered vocabulary, as the official samplers draw; ``inverse_cdf`` takes
    one uniform per token over the top-k survivors (no full-vocabulary pass: cheaper where sampling is a large
    share of a step). The coupling matters for fidelity-to-baseline metrics (PSNR, SSIM, token agreement of a
    pruned run against the baseline on the same seed): with ``multinomial`` a small change of the logits leaves
    more tokens unchanged (testbed, 16 samples: NOVA 0.52 token agreement vs 0.42 with ``inverse_cdf``, FastVAR
    0.73 vs 0.67), so ``inverse_cdf`` makes every accelerated arm look less faithful than it is. The engine's
    shared-generator mode (official goldens) always draws as the official samplers do.
    """

    cfg: float = 1.5
    top_k: int = 900
    top_p: float = 0.96
    temperature: float = 1.0  # Infinity's tau; VAR's official loop has none (1.0)
    draw: str = "multinomial"

    def __post_init__(self) -> None:
        if self.draw not in DRAWS:
            raise ValueError(f"draw must be one of {DRAWS}, got {self.draw!r}")
        if not (math.isfinite(self.cfg) and self.cfg >= 0):
            raise ValueError(f"cfg must be a finite number >= 0, got {self.cfg}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (0 disables it), got {self.top_p}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def filter_top_k_top_p(logits_BNV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Official VAR semantics, out of place: keep the ``top_k`` largest; then drop the tokens whose ascending
    cumulative probability is ≤ ``1 − top_p`` (the largest token always survives).

    With both filters active the full-vocabulary sort is not needed (:func:`_filter_top_k_then_top_p`, the same
    bits); the rows where a tie makes the result depend on the official sort's order of equal values are
    recomputed by :func:`_official_filter` (every step works on each row alone, so a row's bits do not depend on
    which other rows are computed with it).
    """
    V = logits_BNV.shape[-1]
    if not (0 < top_k < V and 0.0 < top_p < 1.0):
        return _official_filter(logits_BNV, top_k, top_p)
    out, tied_BN = _filter_top_k_then_top_p(logits_BNV, top_k, top_p)
    if bool(tied_BN.any()):
        out[tied_BN] = _official_filter(logits_BNV[tied_BN].unsqueeze(0), top_k, top_p).squeeze(0)
    return out


def _official_filter(logits_BNV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The official samplers' filter, step for step (``sample_with_top_k_top_p_`` without its in-place writes)."""
    V = logits_BNV.shape[-1]
    out = logits_BNV
    if 0 < top_k < V:
        kth = logits_BNV.topk(top_k, dim=-1, largest=True, sorted=False)[0].amin(dim=-1, keepdim=True)
        out = out.masked_fill(out < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = out.sort(dim=-1, descending=False)
        drop_sorted = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def _filter_top_k_then_top_p(logits_BNV: torch.Tensor, top_k: int, top_p: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The official top-k-then-top-p filter without sorting the whole vocabulary: ``(filtered [B, N, V], tied
    [B, N])``, where ``tied`` marks the rows whose official result depends on the sort's order of equal values
    (their filtered row is not the official one; the caller recomputes them).

    After the top-k mask the official ascending sort is ``[−inf × (V − k), the k survivors ascending]``: exactly
    the vector built here from the top-k values sorted among themselves, at the same positions, so its softmax and
    cumulative sum are the official ones bit for bit; only which vocabulary entry sits at each survivor position
    needs the sort's order, which is unique unless equal survivors fall on both sides of the top-p cut, or the
    k-th logit is tied (the official mask then keeps every tied token, ``topk`` only ``k`` of them). The full sort
    was the largest cost of a draw on a 4096-way codebook.
    """
    V = logits_BNV.shape[-1]
    values, index = logits_BNV.topk(top_k, dim=-1, largest=True, sorted=False)
    values, order = values.sort(dim=-1)  # the k survivors ascending (a sort of k, not of V, values)
    ascending = values.new_full(logits_BNV.shape, float("-inf"))
    ascending[..., V - top_k:] = values
    drop_survivor = ascending.softmax(dim=-1).cumsum(dim=-1)[..., V - top_k:] <= (1 - top_p)
    drop_survivor[..., -1:] = False  # the largest token always survives
    tied = _rows_tied_at_kth(logits_BNV, values[..., :1], top_k)
    tied |= ((values[..., 1:] == values[..., :-1]) & (drop_survivor[..., 1:] != drop_survivor[..., :-1])).any(-1)
    drop = torch.ones(logits_BNV.shape, dtype=torch.bool, device=logits_BNV.device)
    drop.scatter_(-1, index.gather(-1, order), drop_survivor)  # outside the top k: dropped
    return logits_BNV.masked_fill(drop, float("-inf")), tied


def _rows_tied_at_kth(logits_BNV: torch.Tensor, kth_BN1: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool ``[B, N]``: the rows with more than ``top_k`` logits ``≥`` their k-th largest (a tie at the boundary:
    the official filter keeps every tied token, ``topk`` only ``top_k`` of them)."""
    return (logits_BNV >= kth_BN1).sum(-1) > top_k


def _top_k_has_ties(logits_BNV: torch.Tensor, kth_BN1: torch.Tensor, top_k: int) -> bool:
    """Whether any row is tied at its k-th logit (:func:`_rows_tied_at_kth`)."""
    return bool(_rows_tied_at_kth(logits_BNV, kth_BN1, top_k).any())


def _draw_top_k_inverse_cdf(logits_BNV: torch.Tensor, top_k: int, top_p: float,
                            generators: list[torch.Generator]) -> torch.Tensor | None:
    """Per-sample draws from the top-k/top-p distribution by inverse CDF over the ``top_k`` survivors only.

    The distribution is the official one (same survivors as :func:`filter_top_k_top_p`, same renormalised
    probabilities); the random stream is another one: one float64 uniform per token from the sample's generator,
    located on the survivors' cumulative distribution in vocabulary order (its tokens are not those of
    ``torch.multinomial`` with the same generator). On VAR-d16 (V = 4096, k = 900) that removes the
    full-vocabulary sort and the per-vocabulary-entry work, the largest fixed cost outside the transformer.
    Returns None (the caller takes the official path) when a row has ties at the k-th logit.
    """
    B, N, _ = logits_BNV.shape
    values, index = logits_BNV.topk(top_k, dim=-1, largest=True, sorted=True)  # descending
    if _top_k_has_ties(logits_BNV, values[..., -1:], top_k):
        return None
    probs = values.float().softmax(dim=-1)
    if 0.0 < top_p < 1.0:  # official rule: drop the ascending prefix whose cumulative mass is <= 1 - top_p
        drop_ascending = probs.flip(-1).cumsum(dim=-1) <= (1 - top_p)
        drop_ascending[..., -1:] = False  # the largest token always survives
        probs = probs.masked_fill(drop_ascending.flip(-1), 0.0)
    # The CDF runs over the survivors in VOCABULARY order, as torch.multinomial's does over the whole filtered
    # vocabulary: a small change of the logits (a pruned run vs its baseline) then moves the CDF's steps a little
    # and the same uniform mostly picks the same token. In probability order two near-equal tokens swapping ranks
    # would move whole intervals and decouple the runs that fidelity metrics compare.
    order = index.argsort(dim=-1)
    index = index.gather(-1, order)
    cdf = probs.gather(-1, order).double().cumsum(dim=-1)
    uniform = torch.stack([torch.rand(N, generator=g, dtype=torch.float64, device=logits_BNV.device)
                           for g in generators])
    target = uniform.unsqueeze(-1) * cdf[..., -1:]  # [B, N, 1] in [0, total mass)
    pick = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).clamp_(max=top_k - 1)
    if not bool(torch.isfinite(cdf[..., -1]).all()):  # a nan CDF would pick the last survivor in silence
        return None  # the caller's multinomial path refuses it in one line
    return index.gather(-1, pick).view(B, N)


class NonFiniteLogitsError(UserError, RuntimeError):
    """The token distribution holds inf / nan: the guided logits overflowed (a guidance strength or a temperature
    far outside the official range, or a half-precision dtype). One ``error:`` line naming the knobs to change,
    instead of ``torch.multinomial``'s "probability tensor contains either inf, nan or element < 0"."""


def _non_finite(sampling: SamplingConfig) -> NonFiniteLogitsError:
    return NonFiniteLogitsError(
        f"the token probabilities hold inf or nan (the guided logits overflowed) with cfg={sampling.cfg:g}, "
        f"temperature={sampling.temperature:g}: lower --cfg (official 1.5-4.5), raise --temperature (official "
        f"0.5-1), or generate in float32 (--dtype float32)")


def draw_categorical(
    logits_BNV: torch.Tensor,
    sampling: SamplingConfig,
    generators: list[torch.Generator] | None = None,
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Token ids ``[B, N]``.

    ``generators``: one per sample (results independent of batch composition; the default in the engine):
    ``torch.multinomial`` over the filtered vocabulary (``sampling.draw == "multinomial"``, the default), or with
    ``draw == "inverse_cdf"`` and an active top-k filter (``0 < top_k < V``) an inverse-CDF draw over the top-k
    survivors (:func:`_draw_top_k_inverse_cdf`: the official distribution, a cheaper and less tightly coupled
    random stream, see :class:`SamplingConfig`).
    ``shared_generator``: one draw over the whole batch with a single generator, which is what the official
    code does (used to compare against RNG-dependent official goldens): ``torch.multinomial`` over the whole
    filtered vocabulary, bit-identical to the official samplers.
    """
    if sampling.greedy:
        return logits_BNV.argmax(dim=-1)
    B, N, V = logits_BNV.shape
    if generators is not None and len(generators) != B:
        raise ValueError(f"got {len(generators)} generators for a batch of {B} samples")
    if (shared_generator is None and generators is not None and sampling.draw == "inverse_cdf"
            and 0 < sampling.top_k < V):
        tokens = _draw_top_k_inverse_cdf(logits_BNV, sampling.top_k, sampling.top_p, generators)
        if tokens is not None:
            return tokens
    filtered = filter_top_k_top_p(logits_BNV, sampling.top_k, sampling.top_p)
    probs = filtered.softmax(dim=-1)
    try:  # torch.multinomial checks its input anyway: catching its refusal costs nothing per draw
        if shared_generator is not None or generators is None:
            flat = torch.multinomial(probs.view(-1, V), 1, replacement=True, generator=shared_generator)
            return flat.view(B, N)
        return torch.cat(
            [torch.multinomial(probs[b], 1, replacement=True, generator=generators[b]).view(1, N) for b in range(B)]
        )
    except RuntimeError as exc:
        if "probability tensor contains" in str(exc):
            raise _non_finite(sampling) from None
        raise
