"""Evaluation: Lightning-wrapped generation over condition sets, metrics against the baseline, statistics with
confidence intervals, and self-describing result records.

* :mod:`.lightning` — ``run_generation`` (``Trainer.predict`` over class labels with per-sample seeds; any
  accelerator / devices / strategy; probes attach profilers from above), ``ConditionSet``, ``GenerationRun``;
* :mod:`.metrics` — PSNR / SSIM / MS-SSIM and token agreement vs the baseline, testbed-classifier accuracy,
  FID / KID / IS proxies in the classifier's feature space, standard FID / CLIP with local weights only;
* :mod:`.stats` — seeded bootstrap CIs, paired bootstrap ratios, paired Wilcoxon tests;
* :mod:`.records` — ``RunConfig``, one JSON record per arm (atomic writes, resume by key);
* :mod:`.images` — sample grids.

Submodules are imported lazily (``import var_core.eval`` does not import Lightning).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ConditionSet": "lightning", "GenerationRun": "lightning", "GenerationModule": "lightning",
    "GenerationDataModule": "lightning", "run_generation": "lightning", "sample_seed": "lightning",
    "MetricContext": "metrics", "compute_arm_metrics": "metrics", "fidelity_per_sample": "metrics",
    "token_agreement": "metrics", "bootstrap_ci": "stats", "paired_bootstrap_ratio": "stats",
    "paired_wilcoxon": "stats", "Summary": "stats", "RunConfig": "records", "write_json_atomic": "records",
    "find_reusable": "records", "validate_record": "records", "save_grid": "images",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
