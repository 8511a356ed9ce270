"""The ablation table says where its numbers come from (issue 25): the peak-memory columns name their source
(analytic estimate on the CPU, measured with CUDA), and a FID interval is shown only from more samples than the
features have dimensions (below that the cell reads ``[CI n/a: n=… ≤ d=…]``), while per-sample metrics keep theirs."""

from __future__ import annotations

import pytest

from ablations.report import write_table


def _summ(mean, low, high, n, **extra):
    return {"mean": mean, "low": low, "high": high, "n": n, "level": 0.95, "method": "BCa", **extra}


def _record(arm, role, *, n=4, device="cpu", memory_source="analytic", summary=None, peak_bytes=3 * 2 ** 20):
    timing = {"batch_size": n, "warmup_generations": 1, "batches": [{"size": n}]}
    if peak_bytes is not None:
        timing["peak_memory_bytes"] = peak_bytes
        if memory_source is not None:
            timing["memory_source"] = memory_source
    extra = dict(summary or {})
    if peak_bytes is not None:  # as ablations.runner._absolute_costs writes it: the method is the source
        mib = peak_bytes / 2 ** 20
        extra["peak_memory_mb"] = _summ(mib, mib, mib, n, method=memory_source or "")
    return {
        "arm": arm, "role": role, "changes": "", "description": arm, "config_hash": f"h{arm}", "family": "scorer",
        "model": {"name": "testbed"}, "sampling": {"cfg": 1.5, "top_k": 100, "top_p": 0.95},
        "environment": {"device_name": device, "device": device, "threads": 1, "dtype": "float32", "git": {}},
        "samples": {"n": n, "base_seed": 0, "hash": "abc"}, "timing": timing,
        "summary": {"ms_per_image": _summ(10.0, 9.0, 11.0, 1), **extra},
        "metrics": {"per_sample": {}, "wilcoxon_vs_baseline": {}, "unavailable": {}},
    }


def _table(tmp_path, records):
    write_table(tmp_path, records, [])
    md = (tmp_path / "table.md").read_text()
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| arm | n |"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    rows = {c[0]: c for c in ([x.strip() for x in line.strip("|").split("|")] for line in lines
                              if line.startswith("|") and line.count("|") == header.count("|"))}
    return md, cols, rows


@pytest.mark.parametrize("device,source,label,note", [
    ("cpu", "analytic", "peak MiB (analytic estimate)", "analytic estimate, not a measurement"),
    ("cuda:0", "cuda-measured", "peak MiB (CUDA measured)", "**measured**: `torch.cuda.max_memory_allocated`"),
    ("cpu", None, "peak MiB (analytic estimate)", "analytic estimate, not a measurement"),  # old CPU record
    ("cuda:0", None, "peak MiB (source not recorded)", "source not recorded"),  # old GPU record: unknown
])
def test_peak_memory_column_names_its_source(tmp_path, device, source, label, note):
    records = [_record("baseline", "baseline", device=device, memory_source=source),
               _record("a", "arm", device=device, memory_source=source, peak_bytes=2 * 2 ** 20)]
    md, cols, rows = _table(tmp_path, records)
    assert label in cols and "peak MiB" not in cols
    assert rows["a"][cols.index(label)] == "2.0"
    assert note in md
    other = "analytic estimate" if source == "cuda-measured" else "CUDA measured"
    assert other not in " ".join(cols)
    import pandas as pd

    frame = pd.read_csv(tmp_path / "table.csv").set_index("arm")
    expected = source or ("analytic" if device == "cpu" else None)  # table.csv: the source, old CPU records too
    value = frame.loc["a", "memory_source"]
    assert value == expected if expected else pd.isna(value)


def test_mixed_memory_sources_are_named_per_arm(tmp_path):
    records = [_record("baseline", "baseline", device="cuda:0", memory_source="cuda-measured"),
               _record("old", "arm", device="cpu", memory_source=None)]
    md, cols, _ = _table(tmp_path, records)
    assert "peak MiB (sources differ, see below)" in cols
    assert "`baseline`: **measured**" in md and "`old`: **analytic estimate" in md


# the FID interval: rendered below and above the sample count that supports it (d + 1 for d-dim features)
def _fid(n, mean=0.42, low=0.0, high=14.94):
    return {"fid_proxy": _summ(mean, low, high, n, method="bootstrap percentile, bias-shifted"),
            "ssim": _summ(0.9, 0.85, 0.95, n), "kid_proxy": _summ(0.01, 0.001, 0.02, n)}


@pytest.mark.parametrize("n,cell", [
    (32, "0.42 [CI n/a: n=32 ≤ d=128]"),
    (128, "0.42 [CI n/a: n=128 ≤ d=128]"),  # n = d: the covariance still has rank d - 1
    (129, "0.42 [0.00, 14.94]"),
])
def test_fid_interval_only_from_more_samples_than_feature_dimensions(tmp_path, n, cell):
    records = [_record("baseline", "baseline", n=n), _record("a", "arm", n=n, summary=_fid(n))]
    md, cols, rows = _table(tmp_path, records)
    assert rows["a"][cols.index("FID-proxy")] == cell
    assert rows["a"][cols.index("SSIM")] == "0.900 [0.850, 0.950]"  # a per-sample metric keeps its interval
    assert ("`[CI n/a: n ≤ d]`" in md) == (n <= 128)
    assert ("FID-proxy from n = 129" in md) == (n <= 128)
    # the "CI width this sample count buys" line leaves the FID out where no interval is shown
    width = next(line for line in md.splitlines() if line.startswith("CI width"))
    assert ("FID-proxy ±" in width) == (n > 128) and "SSIM ±0.05" in width


def test_fid_inception_threshold_is_its_2048_features(tmp_path):
    summary = {"fid_inception": _summ(3.5, 2.0, 5.0, 2048)}
    records = [_record("baseline", "baseline", n=2048), _record("a", "arm", n=2048, summary=summary)]
    _, cols, rows = _table(tmp_path, records)
    assert rows["a"][cols.index("FID (Inception)")] == "3.50 [CI n/a: n=2048 ≤ d=2048]"
    summary = {"fid_inception": _summ(3.5, 2.0, 5.0, 2049)}
    records = [_record("baseline", "baseline", n=2049), _record("a", "arm", n=2049, summary=summary)]
    _, cols, rows = _table(tmp_path, records)
    assert rows["a"][cols.index("FID (Inception)")] == "3.50 [2.00, 5.00]"
