"""StageVAR's Representative Token Restoration: pruned tokens take the previous scale's output of their chunk."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...engine.context import GuidanceMode, ScaleContext
from ...engine.policy import ProjectedTokens, scatter_into_zeros, scatter_tokens_
from ..base import Needs, Restorer, Signals, block_chunk, ends_block_chunk, last_block_of_chunk
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import RESTORERS
from .static_cache import INTERPOLATIONS, fill_pruned, interpolate_tokens, rows_for_now


@RESTORERS.register("previous_output")
class PreviousOutput(Restorer):
    """StageVAR (arXiv 2512.16483) RTR: a pruned token's hidden state after a block chunk is the chunk's OUTPUT at
    the previous computed scale, resampled to this grid: ``F^o_k = {F^o_r(i) : i ∈ I} ∪ {interp(F^o_{k−1})(i) :
    i ∉ I}`` (FOUND(code), sen-mao/FasterVAR ``Infinity/infinity/models/infinity.py``: the cached chunk outputs
    are area-interpolated and the kept outputs scattered over them). Knob: ``interpolation`` (the code: ``area``).

    A value, not an update: where FastVAR's cache restoration (``static_cache``) adds a cached branch OUTPUT to the
    token's current state, here the state itself is replaced. In the loop's additive form the first branch of the
    restoring block gives a pruned slot ``target − x`` and the later branches zero (``x + (target − x)`` equals
    the target to one rounding).

    Where it acts: with the policy's ``granularity='chunk'`` (StageVAR's unit, Infinity's 8 block chunks) at the
    LAST block of each chunk, with that block's previous-scale output, i.e. the chunk's output; the chunk's earlier
    blocks give pruned slots zero (their state is the chunk input, which no kept token reads: the KV cache of a
    pruned block holds its kept tokens only). With ``granularity='block'`` every pruned block restores its own
    previous output. Before any computed scale (nothing cached) pruned slots get zero. Rows follow guidance drops
    (StageVAR keeps the unconditional rows in its refinement stage).

    Option ``inputs`` — what a pruned chunk runs on (``granularity='chunk'``):

    * ``tokens`` (our earlier reading): the kept tokens at their own positions; pruned slots restored as above.
    * ``projection`` (the released code, FOUND(code): ``utils/low_rank_feature.py``): ``r`` representative indices
      ``I`` are drawn without replacement with ``torch.multinomial`` over the scorer's weights (``norm`` with
      ``mode='probability'``: ∝ ‖x_i‖² of the chunk input), then ``Q ~ N(0, 1/r)^{N×r}``; the chunk's blocks run
      on the ``r`` projections ``Qᵀx`` (not on tokens) with the positional encoding of the scale's first ``r``
      raster positions, and their keys / values enter the KV cache. After the chunk, the hidden state is the
      previous scale's chunk output, area-resampled, with projection ``j``'s output written at ``I[j]`` (the
      draw order). Before any computed scale the chunk input stands in for the previous output (ours; the code
      never projects the first scale).

    Option ``draws`` — where ``projection`` draws come from: ``global`` = torch's global generator, per chunk the
    ``multinomial`` then the ``randn``, as the released code draws them (it sets no seed: seed the global generator
    yourself before the call to get its result bit for bit); ``seeded`` = a generator seeded from ``(seed, scale,
    chunk)`` per row, so a sample draws the same alone and in a batch (every sample gets the same noise);
    ``auto`` = ``global`` when the generation runs in shared-generator mode (``generate(shared_generator=...)``
    or no seeds: the official codes' behaviour), ``seeded`` with per-sample seeds.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        interpolation: str = knob("area", "resampling of the previous scale's output map (StageVAR's code: area)",
                                  choices=INTERPOLATIONS, search=SearchSpace("categorical", choices=INTERPOLATIONS))
        inputs: str = knob("tokens", "what a pruned block chunk runs on: the kept tokens ('tokens') or r random "
                           "projections Q^T x with the outputs written at representative indices ('projection', "
                           "StageVAR's released code)", choices=("tokens", "projection"))
        draws: str = knob("auto", "source of the projection's draws: torch's global generator in the released "
                          "order ('global'), a generator seeded from (seed, scale, chunk) per row ('seeded'), or "
                          "global in shared-generator runs and seeded otherwise ('auto')",
                          choices=("auto", "global", "seeded"))
        seed: int = knob(0, "seed of the 'seeded' draws", low=0)

    def start(self, info, signals: Signals) -> None:
        self._first_branch = info.branches[0]
        # block -> (scale index, hw, guidance layout, block output [R, N, C]) of the latest computed scale
        self._prev: dict[int, tuple[int, tuple[int, int], GuidanceMode, torch.Tensor]] = {}

    def needs(self, ctx, signals) -> Needs:
        return Needs(block_io=True)  # references to outputs the loop computed anyway

    def observe_block(self, ctx: ScaleContext, block, x_in_RNC, x_out_RNC, signals) -> None:
        self._prev[block] = (ctx.scale_index, ctx.hw, ctx.guidance, x_out_RNC)

    def previous_output(self, ctx: ScaleContext, block: int) -> torch.Tensor | None:
        """Block ``block``'s output at the latest earlier computed scale, on this grid and rows, or None."""
        entry = self._prev.get(block)
        if entry is None or entry[0] >= ctx.scale_index:
            return None
        _, hw, mode, y_RNC = entry
        return interpolate_tokens(rows_for_now(y_RNC, mode, ctx.guidance, ctx.batch_size), hw, ctx.hw,
                                  self.config.interpolation)

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC, signals):
        restores_here = branch == self._first_branch and (
            not signals.chunked_selection or ends_block_chunk(block, ctx.num_blocks, signals.info.block_chunks))
        target_RNC = self.previous_output(ctx, block) if restores_here else None
        if target_RNC is None:
            return scatter_into_zeros(out_kept_RnC, keep_Rn, x_RNC.shape[1])
        return fill_pruned((target_RNC - x_RNC).to(out_kept_RnC.dtype), out_kept_RnC, keep_Rn, owned=True)

    # projected chunks -------------------------------------------------------------------------------------
    def projects_chunks(self) -> bool:
        return self.config.inputs == "projection"

    def _generator(self, ctx: ScaleContext, chunk: int, device: torch.device, signals: Signals):
        """None = torch's global generator; else a fresh generator for (seed, scale, chunk)."""
        mode = self.config.draws
        if mode == "global" or (mode == "auto" and signals.info.shared_generator):
            return None
        gen = torch.Generator(device=device if device.type == "cuda" else "cpu")
        return gen.manual_seed(self.config.seed * 1_000_003 + ctx.scale_index * 1009 + chunk)

    def project(self, ctx, block, weights_RN, count, x_RNC, signals) -> ProjectedTokens:
        R, N, _ = x_RNC.shape
        chunks = signals.info.block_chunks
        chunk = block_chunk(block, ctx.num_blocks, chunks)
        weights_RN = weights_RN.to(x_RNC.device)
        gen = self._generator(ctx, chunk, x_RNC.device, signals)
        if gen is None:  # the released order: the chunk's multinomial, then its randn, both from the global RNG
            index_Rr = torch.multinomial(weights_RN, count, replacement=False)
            q_RNr = torch.randn(R, N, count, device=x_RNC.device)
        else:  # one generator state per row: a row draws the same whatever its batch
            index_Rr = torch.empty(R, count, dtype=torch.long, device=x_RNC.device)
            q_RNr = torch.empty(R, N, count, device=x_RNC.device)
            start = gen.get_state()
            for r in range(R):
                gen.set_state(start)
                index_Rr[r] = torch.multinomial(weights_RN[r], count, replacement=False, generator=gen)
                q_RNr[r] = torch.randn(N, count, generator=gen, device=x_RNC.device)
        q_RNr = q_RNr * (1.0 / math.sqrt(count))
        tokens_RrC = torch.bmm(q_RNr.transpose(1, 2), x_RNC.float()).to(x_RNC.dtype)
        positions_Rr = torch.arange(count, device=x_RNC.device).expand(R, count)
        signals.extras.setdefault("previous_output", []).append(
            dict(scale=ctx.scale_index, chunk=chunk, rank=count, indices=index_Rr))  # draw order, per row
        return ProjectedTokens(tokens_RrC, positions_Rr, index_Rr, last_block_of_chunk(block, ctx.num_blocks, chunks))

    def restore_projected(self, ctx, block, state_RrC, run, x_RNC, signals) -> torch.Tensor:
        target_RNC = self.previous_output(ctx, block)
        base_RNC = (x_RNC if target_RNC is None else target_RNC).to(state_RrC.dtype)
        return scatter_tokens_(base_RNC.clone(memory_format=torch.contiguous_format), state_RrC, run.index_Rr)
