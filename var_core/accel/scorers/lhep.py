"""LD-Pruning's LHEP score: high-frequency energy of the previous scale's quantised residual map."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import Scorer, Signals
from ..frequency import EXTRACTORS, RESIZE_MODES, high_frequency_energy, resize_map
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCORERS


@SCORERS.register("lhep")
class LHEPScorer(Scorer):
    """LD-Pruning (arXiv 2606.00310) Latent High-frequency Energy: high energy = keep. Knob: ``extractor``.

    Reads the last computed scale's quantised residual map ``R_{k−1}`` (``ScaleRecord.residual_BChw``: VAR's
    embedded codes, Infinity's ±1/√d codes, ``[B, C, h', w']``) — decoding-free — and measures its local
    high-frequency energy. Where it is measured (``grid``):

    * ``grid='native'`` (default; FOUND(paper §5.1): ``R_{k−1} ∈ R^{C×h_{k−1}×w_{k−1}}``, errata 2): the energy is
      taken on the residual's own grid, then the energy map is brought to the current grid with ``interpolation``
      (RECONSTRUCTED: default ``trilinear``, Infinity's latent resize; the paper does not say how);
    * ``grid='current'`` (the alternative, specs §3.1's first reading): the residual is resized to the current grid
      with ``interpolation`` first, then the energy is taken there.

    ``extractor`` (see :mod:`var_core.accel.frequency`): ``haar`` (default, FOUND(paper §5.1, §6.3): one-level Haar
    DWT, ``LH²+HL²+HH²`` summed over channels; RECONSTRUCTED: the local ``window × window`` average and the
    nearest upsampling of the cells), ``fft`` (energy beyond ``fft_radius · min(h, w)/2``), ``laplacian``,
    ``sobel`` (the paper's §6.3 comparison); every extractor averages over ``window``. The score is computed once
    per scale (same for all blocks and both CFG rows): ``[B, N]``; 0 at the first scale. With the
    ``sparse_residual`` restorer, ``R_{k−1}`` is the sparse residual (zero where scale k−1 was pruned). The
    selection rule (energy-preservation ratio ρ) is the schedule's job.
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        extractor: str = knob("haar", "high-frequency energy extractor", choices=EXTRACTORS,
                              search=SearchSpace("categorical", choices=EXTRACTORS))
        window: int = knob(3, "local energy aggregation window (odd; 1 = none)", low=1, reconstructed=True,
                           search=SearchSpace("categorical", choices=(1, 3, 5)))
        interpolation: str = knob("trilinear", "resize of the residual map (grid='current') or of the energy map "
                                  "(grid='native') to the current grid", choices=RESIZE_MODES, reconstructed=True,
                                  search=SearchSpace("categorical", choices=("trilinear", "bicubic", "area",
                                                                             "nearest")))
        grid: str = knob("native", "where the energy is measured: on the residual's own grid, the energy map then "
                         "resized ('native', the paper's R_{k-1}), or on the residual resized to the current grid "
                         "('current')", choices=("native", "current"), reconstructed=True)
        fft_radius: float = knob(0.4, "extractor='fft': high-pass cut-off as a fraction of min(h, w)/2", low=0.0,
                                 high=1.0, low_open=True)

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.window % 2 == 0:
                raise ValueError(f"scorer 'lhep': window={self.window} must be odd (a centred neighbourhood)")

    def start(self, info, signals) -> None:
        self._scores: dict[int, torch.Tensor] = {}

    def energy(self, residual_BChw: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        """``[B, h, w]`` LHEP energy on the grid ``hw`` of a residual map."""
        cfg = self.config
        if cfg.grid == "current":
            resized = resize_map(residual_BChw, hw, cfg.interpolation)
            return high_frequency_energy(resized, cfg.extractor, cfg.window, cfg.fft_radius)
        native = high_frequency_energy(residual_BChw, cfg.extractor, cfg.window, cfg.fft_radius)
        return resize_map(native, hw, cfg.interpolation)

    def scores_per_scale(self) -> bool:
        return True  # the previous residual map's energy: the same for every block of the scale

    def score(self, ctx, block, branch, x_RNC, signals: Signals) -> torch.Tensor:
        si = ctx.scale_index
        if si not in self._scores:
            record = ctx.last_computed()
            if record is None or record.residual_BChw is None:
                scores = torch.zeros(ctx.batch_size, ctx.num_tokens, device=x_RNC.device)
            else:
                scores = self.energy(record.residual_BChw, ctx.hw).flatten(1)
            self._scores = {si: scores}
        return self._scores[si]
