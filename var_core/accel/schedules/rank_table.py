"""StageVAR's per-(width, block chunk) token counts from the released offline rank tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base import BLOCK_CHUNKS, Schedule, block_chunk
from ..knobs import ComponentConfig, SearchSpace, knob
from ..registry import SCHEDULES
from .stagevar_rank_ratio import RANK_RATIO, SOURCE

ALPHAS = tuple(RANK_RATIO)


def rank_count(alpha: str, width: int, chunk: int, num_tokens: int) -> int:
    """``int(ratio · N) + 1``: the number of random projections block chunk ``chunk`` runs on at a scale of
    width ``width`` with ``num_tokens`` tokens (StageVAR's released rule; the table: :data:`RANK_RATIO`)."""
    return int(RANK_RATIO[alpha][width][chunk] * num_tokens) + 1


@SCHEDULES.register("rank_table")
class RankTable(Schedule):
    """StageVAR (arXiv 2512.16483) low-rank features: at a scale whose token map is ``w`` tokens wide, block
    chunk ``b`` runs on ``r_b = int(ratio[alpha][w][b] · N) + 1`` tokens (FOUND(code): sen-mao/FasterVAR
    ``Infinity/infinity/models/infinity.py``; the numbers are the released offline tables, ``SOURCE``).

    Knob that matters: ``alpha`` (the energy ratio the table was measured at; the demo uses ``'0.96'``: at 40×40
    on Infinity-2B, r = 27, 219, 337, 401, 410, 317, 252, 306 of 1,600). ``widths``: the widths that run low rank
    (the released code: 40, 48, 64; other widths are dense). The chunk is the model's own block chunk
    (``GenerationInfo.block_chunks``; a model without its own uses ``L/8``); the table has 8 entries per width,
    so a model with more than 8 chunks is refused. Counts are keyed on the width, as the released code keys them
    on ``pn[-1]`` (the tables were measured on Infinity-2B at 1024 px: on other models they are the authors'
    numbers carried over, not a measurement).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        alpha: str = knob("0.96", "energy ratio of the released rank table (the demo: '0.96')", choices=ALPHAS,
                          search=SearchSpace("categorical", choices=ALPHAS))
        widths: tuple[int, ...] = knob((40, 48, 64), "token-map widths whose chunks run on r random projections "
                                       "(the released code: 40, 48, 64); other widths are dense", low=1)

        def __post_init__(self) -> None:
            super().__post_init__()
            missing = [w for w in self.widths if w not in RANK_RATIO[self.alpha]]
            if missing:
                raise ValueError(f"schedule 'rank_table': no released rank table for width(s) {missing}; the "
                                 f"tables ({SOURCE}) cover widths {sorted(RANK_RATIO[self.alpha])}")

    def check_model(self, info) -> None:
        chunks = info.block_chunks if info.block_chunks is not None else min(BLOCK_CHUNKS, info.num_blocks)
        if chunks > 8:
            raise ValueError(f"schedule 'rank_table': the released tables hold 8 block chunks, the model has "
                             f"{chunks}; use a schedule with your own counts (e.g. fixed_table)")

    def prunes_scale(self, ctx, signals) -> bool:
        return ctx.hw[1] in self.config.widths

    def keep_counts(self, ctx, block, branch, scores_RN, signals):
        width = ctx.hw[1]
        if width not in self.config.widths:
            return None
        chunks = signals.info.block_chunks if signals is not None else None
        chunk = block_chunk(block, ctx.num_blocks, chunks)
        count = rank_count(self.config.alpha, width, chunk, ctx.num_tokens)
        return torch.full((scores_RN.shape[0],), count, dtype=torch.long)  # host data: no synchronisation
