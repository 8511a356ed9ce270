"""The hook-slot protocol between the generation loop and an acceleration policy.

A policy returns decisions; the loop applies them. Slots (DESIGN.md, "Hook slots"):

=====================  ==========================================  =========================================
slot                   when                                        returns
=====================  ==========================================  =========================================
``start`` / ``end``    once per generation                         nothing (reset per-generation state)
``plan_scale``         before scale k                              :class:`ScalePlan`
``plan_block``         before each branch of block l (if pruning)  kept indices ``[R, n]`` (int64) or None
``observe_attention``  inside block l, if declared in the plan     nothing
``plan_attention``     before the attention branch of block l      an ``AttentionPattern`` or None (dense)
``restore``            after a branch ran on kept tokens           the full ``[R, N, C]`` branch output
``restore_projected``  after the last block of a projected run     the full ``[R, N, C]`` hidden state
``observe_branch``     after each branch, if declared              nothing
``observe_block``      after each block, if declared               nothing
``observe_lens``       after each declared block (logit lens)      nothing
``observe_logits``     after scale k's head output                 nothing
``latent_mask``        after sampling, before the latent update    bool ``[B, N]`` (tokens whose residual enters
                                                                   the latent) or None (all)
``end_scale``          after sampling and latent update            nothing
``plan_kv``            after a scale, before ``end_scale``         per block: cached positions that stay
                                                                   (``KVKeep``) or None (all)
=====================  ==========================================  =========================================

``R`` is the number of network rows at the scale (``2B`` with both CFG halves: conditional rows first).
Kept indices must be sorted per row and may differ between rows, but every row keeps the same count ``n``.

``plan_block`` may instead return :class:`ProjectedTokens`: the blocks up to ``last_block`` then run on a token
set the policy built (e.g. random projections of the tokens), not on a subset of the tokens, and after
``last_block`` the loop takes the full hidden state from ``restore_projected``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .context import DENSE_PLAN, GenerationInfo, GuidanceMode, ScaleContext, ScalePlan, ScaleRecord
from .lens_probe import LensProbe
from .packing import attach_host_counts, host_counts


class TokenSelection(NamedTuple):
    """A ragged kept-token plan: rows keeping fewer tokens are padded to the common count ``n``.

    Padding entries must repeat a kept index of their row (so gathers and scatters stay exact) and are marked
    False in ``valid_Rn``; the loop masks them out of attention (and the KV cache), so a sample's result does
    not depend on what the other rows of its batch keep.

    :attr:`counts_R`: each row's valid count on the host, when the policy knows it (it read the counts to size
    the selection) and every row's valid slots are a prefix (padding at the end). Build such a selection with
    :func:`ragged_selection`: the mask carries the counts (:func:`host_counts`; the adapters pass the mask on
    unchanged), so packing, attention row groups and the KV-cache lengths take them without reading the mask back
    (issue 27: host synchronisations). Still a pair: ``index, valid = selection`` unpacks as before.
    """

    index_Rn: torch.Tensor
    valid_Rn: torch.Tensor | None

    @property
    def counts_R(self) -> tuple[int, ...] | None:
        return host_counts(self.valid_Rn)


def ragged_selection(index_Rn: torch.Tensor, valid_Rn: torch.Tensor, counts_R) -> TokenSelection:
    """A :class:`TokenSelection` whose rows' valid slots are the prefixes of lengths ``counts_R`` (host integers);
    the counts ride on the mask itself, so the engine's consumers of ``valid_Rn`` (adapters pass it on unchanged)
    find them with :func:`host_counts`."""
    attach_host_counts(valid_Rn, counts_R)
    return TokenSelection(index_Rn, valid_Rn)


class ProjectedTokens(NamedTuple):
    """A run of consecutive blocks on ``r`` tokens the policy built from the ``N`` tokens of the scale.

    ``tokens_RrC``: the run's input (e.g. ``Qᵀx``, random projections of the token map). ``positions_Rr``: the
    positions (within the scale) whose positional encoding each of them takes; their keys and values enter the KV
    cache as tokens of the scale. ``index_Rr``: the policy's own bookkeeping for the restoration (e.g. where each
    output lands), handed back to ``restore_projected``. The blocks ``first .. last_block`` (``first`` = the block
    whose ``plan_block`` returned this) run on the ``r`` tokens; ``plan_block`` is not called again inside the run.
    """

    tokens_RrC: torch.Tensor
    positions_Rr: torch.Tensor
    index_Rr: torch.Tensor
    last_block: int


def pad_ragged_selection(keep_lists: list[torch.Tensor]) -> TokenSelection | torch.Tensor:
    """Stack per-row sorted index tensors of different lengths into a :class:`TokenSelection`."""
    n_max = max(k.numel() for k in keep_lists)
    if all(k.numel() == n_max for k in keep_lists):
        return torch.stack(keep_lists)
    index = torch.stack([torch.cat((k, k[-1:].expand(n_max - k.numel()))) for k in keep_lists])
    valid = torch.stack([torch.arange(n_max, device=k.device) < k.numel() for k in keep_lists])
    return ragged_selection(index, valid, [k.numel() for k in keep_lists])


class Policy:
    """Base class: every slot does nothing, so the loop runs dense, bit-identical to the plain algorithm."""

    name = "baseline"

    def initial_guidance(self, mode: GuidanceMode) -> GuidanceMode:
        """The rows the generation starts with, given ``mode``, what the sampling settings need (the adapter's
        choice). A policy that needs rows later that the settings alone would not compute (e.g. unconditional rows
        for late null-condition scales at cfg 1) asks for them here. Called before ``start``."""
        return mode

    def start(self, info: GenerationInfo) -> None:
        """Reset all per-generation state here."""

    def end(self) -> None:
        """Release per-generation state."""

    def plan_scale(self, ctx: ScaleContext) -> ScalePlan:
        return DENSE_PLAN

    def plan_block(self, ctx: ScaleContext, block: int, branch: str, x_RNC: torch.Tensor
                   ) -> torch.Tensor | TokenSelection | ProjectedTokens | None:
        """Kept token indices ``[R, n]`` (sorted per row) for this branch, a ragged TokenSelection, a
        :class:`ProjectedTokens` run, or None."""
        return None

    def observe_attention(self, ctx: ScaleContext, block: int, probs_RHnL, keep_Rn: torch.Tensor | None) -> None:
        """``probs_RHnL`` is an :class:`~var_core.engine.attention.AttentionProbe` of the computed queries over all
        cached keys: ``query_entropy()`` and ``received_mass()`` without materialising the probabilities,
        ``probs()`` materialised (``[R, H, n, L]``). Valid during the call only."""

    def plan_attention(self, ctx: ScaleContext, block: int):
        """A sparse :class:`~var_core.engine.attention.AttentionPattern` over the cache for the self-attention of
        ``block`` at this scale, or None (dense attention, the default). Patterns run on dense scales only (no
        token pruning in the same block)."""
        return None

    def restore(
        self,
        ctx: ScaleContext,
        block: int,
        branch: str,
        out_kept_RnC: torch.Tensor,
        keep_Rn: torch.Tensor,
        x_RNC: torch.Tensor,
    ) -> torch.Tensor:
        """Fill the pruned slots of a branch output. Default: zero (pruned tokens pass through unchanged)."""
        return scatter_into_zeros(out_kept_RnC, keep_Rn, x_RNC.shape[1])

    def restore_projected(self, ctx: ScaleContext, block: int, state_RrC: torch.Tensor, run: ProjectedTokens,
                          x_RNC: torch.Tensor) -> torch.Tensor:
        """The full ``[R, N, C]`` hidden state after a :class:`ProjectedTokens` run ended at ``block``:
        ``state_RrC`` is the run's output, ``x_RNC`` the token map that entered the run."""
        raise NotImplementedError(f"policy {self.name!r} returned ProjectedTokens but does not restore them")

    def observe_branch(self, ctx: ScaleContext, block: int, branch: str, out_RNC: torch.Tensor) -> None:
        pass

    def observe_block(self, ctx: ScaleContext, block: int, x_in_RNC: torch.Tensor, x_out_RNC: torch.Tensor) -> None:
        pass

    def observe_lens(self, ctx: ScaleContext, block: int, lens: LensProbe) -> None:
        """The head on ``block``'s output, computed lazily: ``lens.logits()`` (every row), ``lens.cond_logits()``,
        ``lens.mixed_logits(w_cond, w_uncond)`` (guided mixtures at half the head cost)."""
        pass

    def observe_logits(self, ctx: ScaleContext, raw_logits_RNV: torch.Tensor) -> None:
        pass

    def latent_mask(self, ctx: ScaleContext) -> torch.Tensor | None:
        """bool ``[B, N]``: the tokens whose sampled residual enters the latent at this scale; the others add a zero
        residual there (LD-Pruning's sparse residual tokens). Default None: every token's residual is accumulated."""
        return None

    def plan_kv(self, ctx: ScaleContext, cache) -> dict | None:
        """The KV-cache policy (issue 29): after scale ``ctx``, ``{block: KVKeep}`` of the cached positions that
        stay for later scales (``cache.view(block)`` reads a block's live keys; see ``engine.kvcache``). A block
        left out (or None) keeps everything. Default: None, every key stays."""
        return None

    def end_scale(self, ctx: ScaleContext, record: ScaleRecord) -> None:
        pass


def flat_token_index(keep_Rn: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 ``[R·n]``: ``r·N + keep[r, j]``, the rows' token indices into a ``[R·N, C]`` view of a token map.

    The token gathers and scatters below go through ``index_select`` / ``index_copy_`` on that flat view: the same
    data movement as ``gather`` / ``scatter_`` with an index expanded over the channels, about 3× faster on CPU."""
    rows = torch.arange(keep_Rn.shape[0], device=keep_Rn.device).unsqueeze(1)
    return (keep_Rn + rows * num_tokens).reshape(-1)


def gather_tokens(x_RNC: torch.Tensor, keep_Rn: torch.Tensor) -> torch.Tensor:
    """``x[r, keep[r]]`` for every row: ``[R, n, C]``."""
    R, N, C = x_RNC.shape
    return x_RNC.reshape(R * N, C).index_select(0, flat_token_index(keep_Rn, N)).view(R, keep_Rn.shape[1], C)


def scatter_tokens_(base_RNC: torch.Tensor, out_kept_RnC: torch.Tensor, keep_Rn: torch.Tensor) -> torch.Tensor:
    """``base[r, keep[r]] = out[r]`` in place (``base`` contiguous); returns ``base``. Ragged padding slots repeat a
    kept index with an identical value (the engine copies their outputs), so duplicates write the same bits."""
    R, N, C = base_RNC.shape
    if not base_RNC.is_contiguous():
        raise ValueError("scatter_tokens_ needs a contiguous token map (it writes through a flat view)")
    base_RNC.view(R * N, C).index_copy_(0, flat_token_index(keep_Rn, N),
                                       out_kept_RnC.reshape(-1, C).to(base_RNC.dtype))
    return base_RNC


def scatter_into_zeros(out_kept_RnC: torch.Tensor, keep_Rn: torch.Tensor, num_tokens: int) -> torch.Tensor:
    R, _, C = out_kept_RnC.shape
    return scatter_tokens_(out_kept_RnC.new_zeros(R, num_tokens, C), out_kept_RnC, keep_Rn)


def scatter_into(base_RNC: torch.Tensor, out_kept_RnC: torch.Tensor, keep_Rn: torch.Tensor) -> torch.Tensor:
    """A copy of ``base`` with the kept slots replaced by the freshly computed outputs."""
    return scatter_tokens_(base_RNC.clone(memory_format=torch.contiguous_format), out_kept_RnC, keep_Rn)
