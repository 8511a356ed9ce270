"""The claims ledger's published side (var_core/data/claims/headlines.json) against specs/methods.md §10, and how
the measured side is labelled (bounds vs measurements, direct vs proxy)."""

from __future__ import annotations

import pytest

from sweeps.frontier_claims import claims_markdown, comparison_kind, load_headlines

FIELDS = ("preset", "method", "speedup", "model", "resolution", "batch", "gpu", "baseline_kernel", "quality", "source")
# (speedup, model, GPU) as specs/methods.md §10 prints them
PUBLISHED = {"nova": (2.89, "Infinity-2B", "NVIDIA RTX 3090"), "fastvar": (2.7, "Infinity-2B", "NVIDIA RTX 3090"),
             "ldpruning": (2.35, "Infinity-8B", "unknown"), "toprovar": (3.4, "Infinity-2B", "NVIDIA L40"),
             "sparsevar": (2.0, "Infinity-2B", "unknown"), "skipvar": (1.81, "Infinity-2B", "unknown"),
             "stagevar": (3.4, "Infinity-2B", "unknown")}


def test_headlines_as_published():
    heads = load_headlines()
    assert set(heads) == set(PUBLISHED)
    for preset, (speedup, model, gpu) in PUBLISHED.items():
        h = heads[preset]
        assert all(f in h for f in FIELDS), preset
        assert (h["speedup"], h["model"], h["gpu"]) == (speedup, model, gpu)
        assert h["source"] and h["source"] != "unknown"
    # nothing invented: no source states a batch or the baseline's attention kernel
    assert {h["batch"] for h in heads.values()} == {"unknown"}
    assert {h["baseline_kernel"] for h in heads.values()} == {"unknown"}
    assert heads["fastvar"]["latency_s"] == {"baseline": 2.61, "method": 0.95}


def test_comparison_kind():
    assert comparison_kind("cpu", "testbed", "Infinity-2B") == "bound+proxy"
    assert comparison_kind("cpu", "infinity-2b", "Infinity-2B") == "bound+proxy"
    assert comparison_kind("cuda:0", "testbed", "Infinity-2B") == "bound+proxy"
    assert comparison_kind("cuda:0", "infinity-2b", "Infinity-2B") == "direct"


def test_markdown_labels_bounds_and_measurements():
    h = load_headlines()["nova"]
    row = {"preset": "nova", "published": h, "comparison": "bound+proxy",
           "measured": {"flops_ideal": 2.0, "bw_ideal": 1.5, "measured_speedup": {"mean": 1.2, "low": 1.1, "high": 1.3},
                        "ssim": {"mean": 0.8, "low": 0.75, "high": 0.85}, "class_acc_delta": None}}
    md = claims_markdown({"model": "testbed", "device": "cpu", "roofline": "roofline(x)", "rows": [row]})
    line = next(x for x in md.splitlines() if x.startswith("| nova"))
    assert "2.89×" in line and "| 2.00 | 1.50 | 1.20 [1.10, 1.30] | 0.800 [0.750, 0.850] | — | bound+proxy |" in line
    assert "FLOPs-ideal × (bound)" in md and "measured × [95 % CI]" in md
