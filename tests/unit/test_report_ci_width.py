"""The table's "CI width this sample count buys" line: median half-widths over the arms, hand-worked."""

from __future__ import annotations

from ablations.report import ci_width_note


def _record(role, n, **summaries):
    return {"role": role, "samples": {"n": n},
            "summary": {k: {"mean": (lo + hi) / 2, "low": lo, "high": hi, "n": n} for k, (lo, hi) in summaries.items()}}


def test_median_half_width_over_the_arms_not_the_baseline():
    records = [
        _record("baseline", 32, token_agreement=(0.0, 1.0)),  # the reference: never counted
        _record("arm", 32, token_agreement=(0.90, 0.92), class_correct=(0.5, 0.9)),
        _record("arm", 32, token_agreement=(0.80, 0.86), class_correct=(0.6, 0.8)),
        _record("arm", 32, token_agreement=(0.70, 0.80)),
    ]
    note = ci_width_note(records)
    # token agreement half-widths 0.01, 0.03, 0.05 -> median 0.03; class acc 0.2, 0.1 -> median 0.15
    assert "n = 32 per arm" in note
    assert "token agree ±0.03" in note and "class acc ±0.15" in note
    assert "SSIM" not in note  # no arm has it


def test_no_confidence_intervals_no_line():
    assert ci_width_note([_record("baseline", 8, ssim=(0.1, 0.2))]) is None
    assert ci_width_note([{"role": "arm", "samples": {"n": 4}, "summary": {"ssim": {"mean": 0.5, "low": float("nan"),
                                                                                   "high": 0.6}}}]) is None


def test_default_samples_per_family_and_the_explicit_value_wins():
    from argparse import Namespace

    from studies.ablate import default_samples

    assert default_samples(Namespace(command="scorer", samples=None)) == 32
    assert default_samples(Namespace(command="method", samples=None)) == 64
    assert default_samples(Namespace(command="scorer", samples=7)) == 7
    assert default_samples(Namespace(command="scorr", samples=None)) == 64
