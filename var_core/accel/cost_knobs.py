"""Each method preset's main cost knob(s) and the candidate grid a speed–quality frontier sweeps (issue 30).

A frontier (``varscope frontier``, :mod:`sweeps.frontier`) compares methods at *matched cost*, so every method needs
the knob(s) that move its cost and a grid of settings wide enough to reach the same cost range as the others. A
grid point may set several knobs together (NOVA: activation window ``t_est`` and removal strength ``τ``; StageVAR:
how many late scales drop the conditional rows and the kept share) — ``fields`` names them, each grid entry gives
one value per field, ordered from the strongest reduction to the weakest. ``published`` is the paper's own operating
point on this (generic / VAR-family) config: it is always evaluated and highlighted on the plots.

Grids are declared for the generic config a preset returns before a model is known (the testbed, VAR). A per-model
preset whose knob has another shape on a family (FastVAR's width table on Infinity) declares that family's grid in
``families``; a family with no declared grid is refused with a message rather than swept with a wrong shape.
The frontier picks from the candidates the ones whose measured FLOPs ratios best cover the common cost range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError, did_you_mean

__all__ = ["CostKnobs", "COST_KNOBS", "cost_knobs", "point_label"]


@dataclass(frozen=True)
class CostKnobs:
    """The knob(s) (dotted paths, as ``--set`` names them) and the candidate settings of one preset."""

    fields: tuple[str, ...]
    grid: tuple[tuple, ...]  # one tuple of values (one per field) per candidate
    published: tuple
    doc: str
    families: dict = field(default_factory=dict)  # family -> CostKnobs for a per-model preset's other shapes

    def __post_init__(self):
        for values in (*self.grid, self.published):
            if len(values) != len(self.fields):
                raise ValueError(f"a grid point {values!r} needs one value per field {self.fields}")

    def for_family(self, family: str | None) -> "CostKnobs":
        return self.families.get(family, self) if family else self

    def candidates(self) -> list[tuple]:
        """The grid with the published point included (once)."""
        grid = list(self.grid)
        if self.published not in grid:
            grid.append(self.published)
        return grid


def _flat(*ratios: float, n: int = 3) -> tuple:
    return tuple((r,) * n for r in ratios)


COST_KNOBS: dict[str, CostKnobs] = {
    "nova": CostKnobs(
        ("activation.t_est", "schedule.tau"),
        ((3, 1.0), (5, 1.0), (5, 0.9), (5, 0.8), (5, 0.65), (5, 0.5), (5, 0.3), (6, 0.8), (6, 0.3), (7, 1.0),
         (7, 0.8), (7, 0.5), (7, 0.3)),
        (5, 0.8),
        "NOVA (arXiv 2602.01345): τ scales the dual-linkage removal ratio, t_est sets how late the entropy-"
        "inflection activation can fire (paper §4.1: t_est=5, τ=0.8)"),
    "fastvar": CostKnobs(
        ("schedule.ratios",),
        ((((0.9, 0.95)),), ((0.8, 0.9),), ((0.7, 0.8),), ((0.6, 0.7),), ((0.5, 0.6),), ((0.4, 0.5),), ((0.3, 0.4),),
         ((0.2, 0.3),), ((0.1, 0.2),)),
        ((0.4, 0.5),),
        "FastVAR (csguoh/FastVAR): the removal ratio of each pruned late scale (our VAR mapping: last two scales, "
        "0.4 / 0.5)",
        families={"infinity": CostKnobs(
            ("schedule.ratios",),
            (((0.8, 0.9, 1.0, 1.0),), ((0.6, 0.7, 1.0, 1.0),), ((0.4, 0.5, 1.0, 1.0),), ((0.2, 0.3, 1.0, 1.0),),
             ((0.0, 0.0, 1.0, 1.0),)),
            ((0.4, 0.5, 1.0, 1.0),),
            "FastVAR's released Infinity table (widths 32, 40, 48, 64; 1.0 = the scale is not generated)")}),
    "ldpruning": CostKnobs(
        ("schedule.rho",),
        ((0.2,), (0.3,), (0.4,), (0.5,), (0.6,), (0.7,), (0.8,), (0.9,)),
        (0.5,),
        "LD-Pruning (arXiv 2606.00310): ρ, the share of the LHEP high-frequency energy the kept tokens hold (0.5)"),
    "stagevar": CostKnobs(
        ("guidance.count", "schedule.ratios"),
        ((3, (0.9,) * 3), (3, (0.7,) * 3), (3, (0.5,) * 3), (3, (0.3,) * 3), (3, (0.1,) * 3), (2, (0.5,) * 3),
         (2, (0.0,) * 3), (1, (0.5,) * 3), (1, (0.0,) * 3)),
        (3, (0.5,) * 3),
        "StageVAR (arXiv 2512.16483), our VAR reading (stagevar_sampled): how many late scales run on the "
        "unconditional rows only (3) and the token share each block chunk drops there (0.5); on Infinity the "
        "released rank table's α is the knob (no grid declared here)"),
    "toprovar": CostKnobs(
        ("activation.tau",),
        ((0.6,), (0.5,), (0.45,), (0.4,), (0.35,), (0.3,), (0.2,)),
        (0.4,),
        "ToProVAR (arXiv 2602.22948): τ of the low-entropy-ratio depth D (0.4)"),
    "skipvar": CostKnobs(
        ("guidance.start_scale",),
        ((-4,), (-3,), (-2,), (-1,)),
        (-3,),
        "SkipVAR (arXiv 2506.08908) static reading: the scale from which the unconditional branch is dropped"),
    "sparsevar": CostKnobs(
        ("restorer.stride",),
        ((8,), (6,), (4,), (3,), (2,)),
        (4,),
        "SparseVAR: the anchor stride (denser anchors compute more tokens)"),
}


def cost_knobs(method: str, family: str | None = None) -> CostKnobs:
    """The declared cost knobs of ``method`` (for ``family`` when it declares another shape there)."""
    if method not in COST_KNOBS:
        raise UserError(f"no cost knob is declared for method {method!r}.{did_you_mean(method, COST_KNOBS)} "
                        f"Methods with a frontier grid: {', '.join(COST_KNOBS)} (var_core/accel/cost_knobs.py)")
    knobs = COST_KNOBS[method]
    if method == "stagevar" and family == "infinity":
        raise UserError("stagevar on Infinity runs the released rank table (knob schedule.alpha, a table key): no "
                        "frontier grid is declared for it; use a VAR-family model or the testbed")
    return knobs.for_family(family)


def point_label(fields: tuple[str, ...], values: tuple) -> str:
    """``tau=0.8,t_est=5``-style label of a grid point (last path component of each field)."""
    def fmt(v):
        if isinstance(v, tuple):
            return "(" + ",".join(fmt(x) for x in v) + ")" if len(set(v)) > 1 or len(v) < 2 else f"{fmt(v[0])}x{len(v)}"
        return f"{v:g}" if isinstance(v, float) else str(v)

    return ",".join(f"{f.rsplit('.', 1)[-1]}={fmt(v)}" for f, v in zip(fields, values))
