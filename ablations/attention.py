"""``attention``: the attention pattern — dense vs SparVAR vs its two halves (issue 29, seam 2).

Base: ``sparvar`` (SparVAR, arXiv 2602.04361: CS4A's top 20 % keys per query group of the decision scale −3 carried
to the later scales, plus CSLA windows). Arms: ``dense`` is the baseline (every token, every key); ``window_only``
(CSLA without CS4A: windows on the query's own scale and at its cell on every earlier scale, from scale −2 on);
``cs4a_only`` (SparVAR with its windows shrunk to the query's own key: the decision-scale keys alone). Every arm
computes every token, so the table's FLOPs differ in the attention scores only (counted over the attended pairs);
on the CPU the sparse kernels gain little time (docs/benchmarks.md, "Sparse attention kernels"). Works on any VAR or
Infinity model with a dense cache (testbed, random:infinity-tiny).
"""

from __future__ import annotations

from .base import Arm, FamilyContext, baseline_arm, compose, family


@family("attention", "the attention pattern: dense vs SparVAR (CS4A + CSLA) vs window-only vs CS4A-only",
        table="SparVAR (arXiv 2602.04361) ablation of CS4A / CSLA")
def attention_family(ctx: FamilyContext) -> list[Arm]:
    return [
        baseline_arm(),
        compose("baseline", "sparvar", ("attention", "sparvar", {}), role="base",
                description="SparVAR: decision-scale top keys (CS4A) + cross-scale local windows (CSLA)"),
        compose("baseline", "window_only", ("attention", "window_only", {}),
                description="CSLA alone: local windows on the own scale and at the query's cell on every earlier "
                            "scale (no decision scale)"),
        compose("baseline", "cs4a_only", ("attention", "sparvar", {"windows": (1,), "cross_window": 0}),
                description="CS4A alone: the decision scale's top keys and each query's own key, no windows"),
    ]
