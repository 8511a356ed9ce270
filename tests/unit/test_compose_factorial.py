"""The compose family's factorial effects (ablations/factorial.py) on hand-worked 2^2 and 2^3 examples."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import stats

from ablations.base import build_arms
from ablations.factorial import factorial_effects


def test_two_factor_effects_by_hand():
    # y(0,0)=1, y(1,0)=3, y(0,1)=2, y(1,1)=6 (two samples, the second shifted by +1 where A is on)
    cells = {(0, 0): np.array([1.0, 1.0]), (1, 0): np.array([3.0, 4.0]), (0, 1): np.array([2.0, 2.0]),
             (1, 1): np.array([6.0, 7.0])}
    eff = {e["effect"]: e for e in factorial_effects(cells, ("A", "B"), n_boot=200)}
    # A: mean(A on) - mean(A off) = (3+6)/2 - (1+2)/2 = 3 on sample 0, (4+7)/2 - 1.5 = 4 on sample 1
    assert eff["A"]["value"] == pytest.approx(3.5)
    # B: (2+6)/2 - (1+3)/2 = 2; sample 1: (2+7)/2 - (1+4)/2 = 2
    assert eff["B"]["value"] == pytest.approx(2.0)
    # AB: half of (A's effect with B on - with B off) = ((6-2) - (3-1))/2 = 1; sample 1 ((7-2) - (4-1))/2 = 1
    assert eff["A×B"]["value"] == pytest.approx(1.0)
    assert eff["A×B"]["order"] == 2
    assert eff["A"]["p"] == pytest.approx(stats.ttest_1samp([3.0, 4.0], 0.0).pvalue)
    assert eff["A"]["low"] >= 3.0 and eff["A"]["high"] <= 4.0


def test_additive_three_factor_design_has_no_interactions():
    rng = np.random.default_rng(0)
    noise = rng.normal(size=6)
    cells = {bits: 0.5 * bits[0] - 0.2 * bits[1] + 0.1 * bits[2] + noise
             for bits in itertools.product((0, 1), repeat=3)}
    eff = {e["effect"]: e for e in factorial_effects(cells, ("p", "g", "e"), n_boot=100)}
    assert [eff[k]["value"] for k in ("p", "g", "e")] == pytest.approx([0.5, -0.2, 0.1])
    for k in ("p×g", "p×e", "g×e", "p×g×e"):
        assert eff[k]["value"] == pytest.approx(0.0, abs=1e-12)
    # a multiplicative (log-additive) saving stacks: log2 of 0.5 x 0.8 has no interaction either
    logs = {bits: np.full(2, np.log2((0.5 if bits[0] else 1) * (0.8 if bits[1] else 1)))
            for bits in itertools.product((0, 1), repeat=2)}
    assert {e["effect"]: e["value"] for e in factorial_effects(logs, ("a", "b"), n_boot=100)}["a×b"] == \
        pytest.approx(0.0, abs=1e-12)


def test_compose_family_is_the_full_2x2x2_factorial():
    arms = build_arms("compose")
    assert [a.name for a in arms][0] == "baseline" and len(arms) == 8
    assert all(a.ok for a in arms), [a.error for a in arms if not a.ok]
    by = {a.name: a.config for a in arms}
    full = by["prune+guidance+early"]
    assert full.guidance.component_name == "stop_at" and full.guidance.start_scale == -3
    assert full.skip.component_name == "skip_last" and full.skip.count == 1
    assert full.schedule.component_name == "fixed_table"  # FastVAR's pruning
    from var_core.accel.presets import get_preset

    assert by["prune"].config_hash() == get_preset("fastvar").config_hash()
    plain = get_preset("baseline")
    for kind in ("scorer", "activation", "schedule", "restorer"):  # no pruning where prune is off
        assert getattr(by["guidance+early"], kind) == getattr(plain, kind)
