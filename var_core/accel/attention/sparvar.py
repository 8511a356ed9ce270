"""SparVAR (arXiv 2602.04361): cross-scale sparse attention predicted from a decision scale (CS4A) plus cross-scale
local windows (CSLA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...engine.adapters.base import row_slice_after_drop
from ...engine.attention import SPARSE_KERNELS, AttentionPattern, ScaleWindows, read_pattern_counts
from ..base import AttentionSparsity, Needs, NO_NEEDS
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import ATTENTION_PATTERNS

KERNEL_DOC = ("how the pattern runs (same outputs to float error): 'gather' = per query group, SDPA on the union "
              "of its keys (the CPU path that saves time), 'sdpa' = SDPA with a boolean mask, 'flex' = "
              "FlexAttention block masks (compiled on a GPU), 'reference' = materialised masked softmax")


def resolve_scale(index: int, num_scales: int) -> int:
    return index if index >= 0 else num_scales + index


def window_for(windows: tuple[int, ...], si: int, num_scales: int) -> int:
    """The self-window size of scale ``si``: ``windows`` is aligned with the END of the schedule (the last entry is
    the last scale's); scales before the entries take the first entry."""
    i = len(windows) - (num_scales - si)
    return windows[max(i, 0)]


def check_image_only_cache(info) -> None:
    """The patterns index the cache by image-token position from 0. HART's self-attention cache begins with its text
    context tokens (a prefix the patterns do not cover yet), so a sparse pattern is refused there before any
    generation, not at the first sparse scale."""
    if info.family == "hart":
        raise ValueError("sparse attention patterns index the KV cache by image-token position, but HART's cache "
                         "begins with its text-context tokens: run the attention family on VAR or Infinity models")


def check_windows(windows: tuple[int, ...], cross_window: int) -> None:
    if not windows or any(w < 1 or w % 2 == 0 for w in windows):
        raise ValueError(f"windows={windows}: give odd window sizes >= 1 (one per sparse scale, from the end)")
    if cross_window < 0 or (cross_window and cross_window % 2 == 0):
        raise ValueError(f"cross_window={cross_window}: give an odd window size, or 0 for none")


def scale_windows(scale_hw, si: int, self_window: int, cross_window: int, cross_from: int) -> ScaleWindows:
    """Windows for the queries of scale ``si``: ``self_window`` on ``si`` itself, ``cross_window`` on the scales
    ``cross_from .. si−1`` (0: none), nothing on the others."""
    radius = [-1] * (si + 1)
    radius[si] = (self_window - 1) // 2
    if cross_window:
        for s in range(max(cross_from, 0), si):
            radius[s] = (cross_window - 1) // 2
    return ScaleWindows(tuple(tuple(hw) for hw in scale_hw[:si + 1]), tuple(radius))


def top_key_mask(mass_RHGL: torch.Tensor, count: int) -> torch.Tensor:
    """bool ``[R, H, G, L]``: the ``count`` keys with the largest mass per (row, head, group); ties (and float noise
    below 2⁻¹⁶ of the row's largest mass, so a sample selects alike alone and in a batch) go to the lower
    position."""
    from ..policy import rank_grid

    R, H, G, L = mass_RHGL.shape
    flat = rank_grid(mass_RHGL.reshape(-1, L), 16)
    top = flat.sort(dim=1, descending=True, stable=True).indices[:, :count]
    mask = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, top, True)
    return mask.view(R, H, G, L)


@ATTENTION_PATTERNS.register("sparvar")
class SparVAR(AttentionSparsity):
    """SparVAR: the top keys per query group at a decision scale, carried to the later scales, plus local windows.

    Paper: SparVAR, arXiv 2602.04361 (authors' repository CAS-CLab/SparVAR holds only a README). How it runs here,
    read from the paper's abstract and the third-party port in Weepingchestnut/Lvar (``models/sparvar/``,
    ``kernels/sparse_attn/``; read for understanding, nothing copied):

    * CS4A (cross-scale sparse attention from a decision scale) — FOUND: at ``decision_scale`` (Lvar:
      ``decision_scale: 10`` of Infinity's 13 → −3 here) every block attends densely and, per head and per group of
      ``query_block`` consecutive queries (Lvar: ``bm = 192``), the keys' attention mass summed over the group's
      queries (block column sums) ranks the cached keys; the ``top_keys`` fraction of them (Lvar's config file:
      ``top_keys: 0.2``) is kept. At each later scale, a query group takes the kept keys of the decision-scale group
      at the same relative position (nearest group centre, as the port maps groups). The keys keep their cache
      positions: the kept tokens of scales 0..decision.
    * CSLA (cross-scale local windows) — window on the query's own scale FOUND (Lvar: ``win_size`` 7 and 9 on the
      last two scales: ``windows``, aligned with the end of the schedule), exact 2-D windows cut at the border;
      RECONSTRUCTED: the scales between the decision scale and the current one (which the decision scale never
      saw) get a ``cross_window`` × ``cross_window`` window at the query's cell (the port instead carries the
      previous sparse scale's own window indices, as a contiguous index range per query group).
    * ``sink_scales`` (RECONSTRUCTED, the paper's attention sinks): every key of the first scales, attended by all
      queries; 0 by default (Lvar's ``attn_sink: 5`` reaches no code path that runs).
    * ``dense_blocks``: the first blocks stay dense (Lvar's ``first_n_dense_layers: 2`` is commented out in the
      attention it runs, so 0 here).
    * Not reproduced: the port's output cache (``O = O_cache + ΔO``, Chipmunk's delta over the unselected keys) and
      its scale skipping (the paper's 2.28× setting composes with a skip component instead).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        decision_scale: int = knob(-3, "scale whose dense attention decides the pattern of every later scale (Lvar: "
                                   "10 of 13)", unit="scale", search=SearchSpace("int", low=-5, high=-2))
        top_keys: float = knob(0.2, "fraction of the decision scale's cached keys each query group keeps (CS4A)",
                               low=0.0, high=1.0, low_open=True, search=SearchSpace("float", low=0.05, high=0.5))
        query_block: int = knob(192, "queries per group sharing one key set (Lvar's kernel block, bm)", low=1)
        windows: tuple[int, ...] = knob((7, 9), "CSLA window size on the query's own scale, one per sparse scale "
                                        "from the END of the schedule (earlier sparse scales take the first)")
        cross_window: int = knob(3, "window size on each scale between the decision scale and the query's scale "
                                 "(0 = none)", low=0, reconstructed=True)
        sink_scales: int = knob(0, "every key of the first this many scales is attended by all queries", low=0,
                                reconstructed=True)
        dense_blocks: int = knob(0, "the first this many blocks attend densely", low=0)
        kernel: str = knob("gather", KERNEL_DOC, choices=SPARSE_KERNELS)

    def check_model(self, info) -> None:
        cfg = self.config
        check_image_only_cache(info)
        check_windows(cfg.windows, cfg.cross_window)
        S = resolve_scale(cfg.decision_scale, info.num_scales)
        if not 0 <= S < info.num_scales - 1:
            raise ValueError(f"decision_scale={cfg.decision_scale} is scale {S} of {info.num_scales}: choose a scale "
                             f"before the last (e.g. -3)")
        if cfg.sink_scales > S:
            raise ValueError(f"sink_scales={cfg.sink_scales} reaches past the decision scale {S}")

    def start(self, info, signals) -> None:
        self.check_model(info)
        self._info = info
        self._decision = resolve_scale(self.config.decision_scale, info.num_scales)
        self._key_blocks: dict[int, torch.Tensor] = {}  # block -> bool [R, H, G_S, L_S] at the decision scale
        self._decision_guidance = None
        self._windows: dict[int, ScaleWindows] = {}
        self._patterns_key, self._patterns = None, {}

    def needs(self, ctx, signals) -> Needs:
        if ctx.scale_index != self._decision:
            return NO_NEEDS
        return Needs(attention_blocks=frozenset(range(self.config.dense_blocks, ctx.num_blocks)))

    def observe_attention(self, ctx, block, probe, keep_Rn, signals) -> None:
        if ctx.scale_index != self._decision or keep_Rn is not None or block < self.config.dense_blocks:
            return
        with self._info.tracer.span("accel/attention", ctx.scale_index, block):
            mass = probe.key_mass(self.config.query_block)
            count = max(1, round(self.config.top_keys * mass.shape[-1]))
            self._key_blocks[block] = top_key_mask(mass, count)
        self._decision_guidance = ctx.guidance

    def _rows(self, ctx, kb: torch.Tensor) -> torch.Tensor:
        if self._decision_guidance is None or ctx.guidance is self._decision_guidance:
            return kb
        return kb[row_slice_after_drop(self._decision_guidance, ctx.guidance, ctx.batch_size)]

    def _scale_windows(self, ctx) -> ScaleWindows:
        si = ctx.scale_index
        if si not in self._windows:
            cfg, K = self.config, self._info.num_scales
            self._windows[si] = scale_windows(self._info.scale_hw, si, window_for(cfg.windows, si, K),
                                              cfg.cross_window, self._decision + 1)
        return self._windows[si]

    def pattern(self, ctx, block, signals):
        if ctx.scale_index <= self._decision or block not in self._key_blocks:
            return None
        key = (ctx.scale_index, ctx.num_tokens, id(ctx.guidance), ctx.batch_size)
        if self._patterns_key != key:  # the scale's first block: every block's pattern, their counts read once
            self._patterns_key, self._patterns = key, self._scale_patterns(ctx)
        return self._patterns[block]

    def _scale_patterns(self, ctx) -> dict[int, AttentionPattern]:
        """Every observed block's pattern at this scale, with their key counts and pairs read in one device→host
        transfer (issue 27: one host sync per sparse scale, not one per block and query group)."""
        cfg = self.config
        n = ctx.num_tokens
        windows = self._scale_windows(ctx)
        sink = sum(h * w for h, w in self._info.scale_hw[:cfg.sink_scales])
        patterns, nearest = {}, None
        for block, kb in self._key_blocks.items():
            if nearest is None:  # the decision-scale group nearest each group's centre, computed on the device
                groups, decision_groups = -(-n // cfg.query_block), kb.shape[2]
                centres = (torch.arange(groups, dtype=torch.float64, device=kb.device) + 0.5) / groups \
                    * decision_groups - 0.5
                nearest = centres.round().long().clamp_(0, decision_groups - 1)
            patterns[block] = AttentionPattern(n, windows.num_keys,
                                               key_blocks_RHGL=self._rows(ctx, kb).index_select(2, nearest),
                                               query_block=cfg.query_block, windows=windows, dense_keys=sink,
                                               kernel=cfg.kernel)
        if patterns:
            read_pattern_counts(list(patterns.values()), next(iter(self._key_blocks.values())).device)
        return patterns
