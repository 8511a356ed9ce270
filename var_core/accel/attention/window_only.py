"""Cross-scale local windows alone (SparVAR's CSLA without the decision-scale keys)."""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.attention import SPARSE_KERNELS, AttentionPattern
from ..base import AttentionSparsity
from ..knobs import ComponentConfig, knob
from ..registry import ATTENTION_PATTERNS
from .sparvar import KERNEL_DOC, check_image_only_cache, check_windows, resolve_scale, scale_windows, window_for


@ATTENTION_PATTERNS.register("window_only")
class WindowOnly(AttentionSparsity):
    """Local windows only: each query of a late scale attends to a window on its own scale and on every earlier one.

    The ablation of SparVAR (arXiv 2602.04361) that removes CS4A: no decision scale, no observation. From
    ``start_scale`` on (default −2, the scales SparVAR makes sparse on a 13-scale Infinity), a query attends to a
    ``windows`` window on its own scale (as SparVAR's CSLA; sizes aligned with the end of the schedule) and a
    ``cross_window`` window at its cell on EVERY earlier scale (RECONSTRUCTED: without CS4A's keys the coarse scales
    would otherwise drop out of the context altogether; ``cross_window=0`` gives the own-scale window alone)."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        start_scale: int = knob(-2, "first scale with the windowed pattern (earlier scales attend densely)",
                                unit="scale")
        windows: tuple[int, ...] = knob((7, 9), "window size on the query's own scale, one per windowed scale from "
                                        "the END of the schedule (earlier windowed scales take the first)")
        cross_window: int = knob(3, "window size at the query's cell on every earlier scale (0 = none)", low=0,
                                 reconstructed=True)
        sink_scales: int = knob(0, "every key of the first this many scales is attended by all queries", low=0)
        query_block: int = knob(192, "queries per group (the 'gather' kernel's unit of work)", low=1)
        kernel: str = knob("gather", KERNEL_DOC, choices=SPARSE_KERNELS)

    def check_model(self, info) -> None:
        check_image_only_cache(info)
        check_windows(self.config.windows, self.config.cross_window)
        first = resolve_scale(self.config.start_scale, info.num_scales)
        if not 0 < first < info.num_scales:
            raise ValueError(f"start_scale={self.config.start_scale} is scale {first} of {info.num_scales}: choose "
                             "one after the first (e.g. -2)")

    def start(self, info, signals) -> None:
        self.check_model(info)
        self._info = info
        self._first = resolve_scale(self.config.start_scale, info.num_scales)
        self._scales: dict[int, tuple] = {}  # scale -> (windows, prefix keys, attended pairs per row)

    def pattern(self, ctx, block, signals):
        si = ctx.scale_index
        if si < self._first:
            return None
        cfg = self.config
        if si not in self._scales:  # the windows and their pairs (host geometry: no device read, issue 27)
            windows = scale_windows(self._info.scale_hw, si, window_for(cfg.windows, si, self._info.num_scales),
                                    cfg.cross_window, 0)
            sink = sum(h * w for h, w in self._info.scale_hw[:cfg.sink_scales])
            pairs = AttentionPattern(ctx.num_tokens, windows.num_keys, query_block=cfg.query_block, windows=windows,
                                     dense_keys=sink).host_pairs()
            self._scales[si] = windows, sink, pairs
        windows, sink, pairs = self._scales[si]
        pattern = AttentionPattern(ctx.num_tokens, windows.num_keys, query_block=cfg.query_block, windows=windows,
                                   dense_keys=sink, kernel=cfg.kernel)
        pattern.known_pairs = pairs
        return pattern
