"""FastVAR's Cached Token Restoration: branch outputs cached at one scale, interpolated to later grids."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...engine.adapters.base import row_slice_after_drop
from ...errors import UserError
from ...engine.context import GuidanceMode, ScaleContext
from ...engine.policy import scatter_into, scatter_tokens_
from ..base import NO_NEEDS, Needs, Restorer, Signals
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import RESTORERS

INTERPOLATIONS = ("area", "bilinear", "nearest")


def interpolate_tokens(y_RNC: torch.Tensor, src_hw: tuple[int, int], dst_hw: tuple[int, int], mode: str
                       ) -> torch.Tensor:
    """Resample a token map ``[R, h·w, C]`` from ``src_hw`` to ``dst_hw`` (``[R, h'·w', C]``, same dtype).

    ``area`` is FastVAR's ``F.interpolate(mode='area')`` (for upsampling: each output cell averages the input
    cells it overlaps); ``bilinear`` uses ``align_corners=False``; ``nearest`` is PyTorch's nearest.
    """
    if tuple(src_hw) == tuple(dst_hw):
        return y_RNC
    R, N, C = y_RNC.shape
    h, w = src_hw
    if N != h * w:
        raise ValueError(f"token map has {N} tokens, expected {h}x{w}={h * w}")
    dtype = y_RNC.dtype
    # CPU half-precision interpolation kernels are incomplete: compute in fp32 there.
    work = y_RNC.float() if (y_RNC.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)) else y_RNC
    # A token map IS a channels-last image: view it as one (no copy) and keep the output channels-last, so the
    # result reshapes back to tokens without a copy. The NCHW-transposed form took PyTorch's generic strided
    # kernels (25x slower at R = 1, e.g. a sample whose guidance was dropped).
    grid_RChw = work.reshape(R, h, w, C).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    kwargs = dict(align_corners=False) if mode == "bilinear" else {}
    out = F.interpolate(grid_RChw, size=tuple(dst_hw), mode=mode, **kwargs)
    out = out.contiguous(memory_format=torch.channels_last)
    return out.permute(0, 2, 3, 1).reshape(R, dst_hw[0] * dst_hw[1], C).to(dtype)  # [R, h'·w', C]


def rows_for_now(y_RNC: torch.Tensor, recorded: GuidanceMode, now: GuidanceMode, batch_size: int) -> torch.Tensor:
    """The rows of a tensor recorded under guidance layout ``recorded`` that exist in layout ``now``."""
    if recorded is now:
        return y_RNC
    return y_RNC[row_slice_after_drop(recorded, now, batch_size)]


def fill_pruned(base_RNC: torch.Tensor, out_kept_RnC: torch.Tensor, keep_Rn: torch.Tensor, owned: bool
                ) -> torch.Tensor:
    """``base`` with the kept slots replaced by the fresh outputs; ``owned``: base is a temporary (filled in place).

    Padding duplicates of a ragged selection write identical values, so the scatter stays exact.
    """
    if not owned or base_RNC.dtype != out_kept_RnC.dtype or not base_RNC.is_contiguous():
        return scatter_into(base_RNC.to(out_kept_RnC.dtype), out_kept_RnC, keep_Rn)
    return scatter_tokens_(base_RNC, out_kept_RnC, keep_Rn)


def resolve_scale(index: int, num_scales: int) -> int:
    return index if index >= 0 else num_scales + index


class CacheMissError(UserError, RuntimeError):
    """A static-cache restore found no cached output: the configuration prunes before its cache scale."""


@RESTORERS.register("static_cache")
class StaticCache(Restorer):
    """FastVAR §5 CTR: pruned slots get the same (block, branch) output cached at scale ``cache_scale``, resampled.

    Knob that matters: ``cache_scale`` (0-indexed, negative counts from the end; FastVAR caches scale K−N, the
    last scale before the pruned ones: with ``fixed_table``'s default two pruned scales that is ``-3``, the
    default here). ``interpolation``: FastVAR uses ``area``. ``refresh``: ``fixed`` (FastVAR: the cache is taken
    once, at ``cache_scale``) or ``latest`` (RECONSTRUCTED LD-Pruning "token selection update", specs §3.1 item
    5: from ``cache_scale`` on, the cache is refreshed after every scale with that scale's full (restored)
    branch outputs, so scale k restores from the most recent earlier scale). The cache holds references to
    the outputs the loop computed anyway (no copies); rows follow guidance drops (the dropped half is sliced
    off). A restore that finds no cache (pruning at or before the cache scale, or the cache scale was skipped or
    is not in the schedule) raises :class:`CacheMissError` naming the scales and the fix — it never silently acts
    as identity (the ``identity`` restorer is that arm); ``signals.extras["static_cache_misses"]`` counts it first.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        cache_scale: int = knob(-3, "scale whose branch outputs are cached (0-indexed; -k = k-th from the end); "
                                "FastVAR: K-N, the last scale before the pruned ones",
                                search=SearchSpace("int", low=-5, high=-2), unit="scale")
        interpolation: str = knob("area", "how the cached map is resampled to the current grid (FastVAR: area)",
                                  choices=INTERPOLATIONS, search=SearchSpace("categorical", choices=INTERPOLATIONS))
        refresh: str = knob("fixed", "RECONSTRUCTED (LD-Pruning token-selection update): 'fixed' = cache taken "
                            "once at cache_scale (FastVAR); 'latest' = refreshed after every scale from "
                            "cache_scale on with its full restored outputs", choices=("fixed", "latest"),
                            reconstructed=True)

    def check_model(self, info) -> None:
        if not 0 <= resolve_scale(self.config.cache_scale, info.num_scales) < info.num_scales:
            raise ValueError(f"restorer 'static_cache': cache_scale={self.config.cache_scale} is outside the "
                             f"{info.num_scales} scales of this model")

    def start(self, info, signals: Signals) -> None:
        self.check_model(info)
        self._num_scales = info.num_scales
        self._first = resolve_scale(self.config.cache_scale, info.num_scales)
        # (block, branch) -> (scale index, hw, guidance layout, output [R, N, C])
        self._cache: dict[tuple[int, str], tuple[int, tuple[int, int], GuidanceMode, torch.Tensor]] = {}
        signals.extras["static_cache_misses"] = 0

    def _records_at(self, si: int) -> bool:
        return si == self._first if self.config.refresh == "fixed" else si >= self._first

    def needs(self, ctx, signals) -> Needs:
        return Needs(branch_outputs=True) if self._records_at(ctx.scale_index) else NO_NEEDS

    def observe_branch(self, ctx: ScaleContext, block, branch, out_RNC, signals) -> None:
        if self._records_at(ctx.scale_index):
            self._cache[(block, branch)] = (ctx.scale_index, ctx.hw, ctx.guidance, out_RNC)

    def cached(self, ctx: ScaleContext, block: int, branch: str) -> torch.Tensor | None:
        """The cache entry for (block, branch) resampled to this scale and row layout, ``[R, N, C]``, or None."""
        entry = self._cache.get((block, branch))
        if entry is None or entry[0] >= ctx.scale_index:
            return None
        _, hw, mode, y_RNC = entry
        y_RNC = rows_for_now(y_RNC, mode, ctx.guidance, ctx.batch_size)
        return interpolate_tokens(y_RNC, hw, ctx.hw, self.config.interpolation)

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC, signals):
        base_RNC = self.cached(ctx, block, branch)
        if base_RNC is None:
            signals.extras["static_cache_misses"] = int(signals.extras.get("static_cache_misses", 0)) + 1
            first = getattr(self, "_first", None)
            where = "at no scale of this schedule" if first is None else f"at scale {first}"
            raise CacheMissError(
                f"restorer 'static_cache': scale {ctx.scale_index} block {block} ({branch}) is pruned but no cache "
                f"exists yet: it is taken {where} (cache_scale={self.config.cache_scale}), which is not before this "
                f"scale or was not generated. Set "
                f"restorer.cache_scale to a scale before the first accelerated one (FastVAR: the last scale before "
                f"the pruned ones), start acceleration later, or use the 'identity' restorer for no update")
        entry_hw = self._cache[(block, branch)][1]
        return fill_pruned(base_RNC, out_kept_RnC, keep_Rn, owned=tuple(entry_hw) != tuple(ctx.hw))
