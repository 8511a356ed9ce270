"""``python -m studies.latency`` end to end on two tiny models (tiny repeats): every output is written and parses —
the JSON loads, the CSVs read with the expected columns (speedups included), the PNGs are PNGs — and, with
``--profile``, a Chrome trace and the op table exist."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from studies.latency import main, spread

PNG = b"\x89PNG\r\n\x1a\n"
SPEEDUP_COLUMNS = {"speedup_transformer", "speedup_total", "flops_ratio", "ideal_speedup", "speedup_vs_ideal",
                   "transformer_ms", "total_ms", "text_encode_ms", "vq_decode_ms", "peak_mib", "memory_source",
                   "images_per_s", "total_q1", "total_q3"}


def _check_report(out: Path, methods: set[str], batches: set[int], family: str) -> dict:
    report = json.loads((out / "report.json").read_text())
    assert set(report["methods"]) == methods and report["reference"] == "baseline"
    env = report["environment"]
    for key in ("device", "dtype", "attention_backend", "threads", "torch", "timer", "memory_source"):
        assert env[key] is not None, key
    assert env["memory_source"] == "analytic"  # CPU

    summary = pd.read_csv(out / "summary.csv")
    assert SPEEDUP_COLUMNS <= set(summary.columns)
    assert set(summary["method"]) == methods and set(summary["batch"]) == batches
    base = summary[summary["method"] == "baseline"]
    assert (base["speedup_transformer"] == 1.0).all() and (base["flops_ratio"] == 1.0).all()
    assert (summary["transformer_ms"] > 0).all() and (summary["vq_decode_ms"] > 0).all()
    assert (summary["total_ms"] >= summary["transformer_ms"]).all()
    if family == "infinity":
        assert (summary["text_encode_ms"] > 0).all()  # text encoding reported on its own
    else:
        assert (summary["text_encode_ms"] == 0).all()

    repeats = pd.read_csv(out / "repeats.csv")
    assert len(repeats) == len(methods) * len(batches) * 2
    per_scale = pd.read_csv(out / "per_scale.csv")
    assert {"scale", "ms", "ms_q1", "ms_q3", "gflops", "peak_mib", "computed_tokens"} <= set(per_scale.columns)

    for name in ("methods_latency", "methods_per_scale", "methods_memory"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG
    for method in methods:
        folder = out / "breakdown" / f"{method}_b1"  # figures of the latency batch
        for png in ("scale_stack_ms", "scale_stack_gflops", "layer_heatmap_ms", "layer_heatmap_gflops", "memory"):
            assert (folder / f"{png}.png").read_bytes()[:8] == PNG
        assert not (out / "breakdown" / f"{method}_b2").exists()
        for batch in batches:
            breakdown = pd.read_csv(out / f"scale_breakdown_{method}_b{batch}.csv", index_col=0)
            assert "total (Σ medians)" in breakdown.index and "share" in breakdown.columns
            assert breakdown.loc["total (Σ medians)", "share"] == pytest.approx(100.0)
    text = (out / "report.md").read_text()
    assert "speedup (transformer)" in text and "Breakdown of a representative" in text
    return report


def test_latency_report_official_tiny(tmp_path, fixture_dir):
    threads = torch.get_num_threads()
    out = tmp_path / "vartiny"
    assert main(["--model", "official-tiny", "--weights", str(fixture_dir), "--method", "nova",
                 "--compare", "fastvar", "--repeats", "2", "--warmup", "0", "--throughput-batch", "2",
                 "--threads", "1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # --threads is restored
    report = _check_report(out, {"nova", "fastvar", "baseline"}, {1, 2}, "var")
    assert "`baseline` added as the speedup reference" in report["notes"]


def test_latency_report_infinity_tiny_with_profile(tmp_path):
    out = tmp_path / "inftiny"
    assert main(["--model", "random:infinity-tiny", "--method", "fastvar", "--compare", "baseline",
                 "--repeats", "2", "--warmup", "1", "--throughput-batch", "2", "--profile", "--threads", "1",
                 "--out", str(out)]) == 0
    report = _check_report(out, {"fastvar", "baseline"}, {1, 2}, "infinity")
    fastvar = next(r for r in report["summary"] if r["method"] == "fastvar" and r["batch"] == 1)
    assert fastvar["flops_ratio"] < 1  # pruned: the FLOP report follows the kept tokens
    traces = sorted((out / "profile").glob("*_cycle0.json"))
    assert {t.name for t in traces} == {"fastvar_b1_cycle0.json", "baseline_b1_cycle0.json"}
    trace = json.loads(traces[0].read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "text_encode" in names and any(str(n).startswith("scale4/") for n in names)
    ops = pd.read_csv(out / "profile" / "ops_by_range.csv")
    assert {"method", "range", "op", "self_cpu_us"} <= set(ops.columns)
    assert "torch.profiler" in (out / "report.md").read_text()


def test_spread():
    s = spread([4.0, 1.0, 3.0, 2.0, 100.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 100.0 and s["q1"] == 2.0 and s["q3"] == 4.0
    assert spread([5.0])["q1"] == spread([5.0])["q3"] == 5.0


def test_unknown_method_fails_before_running(tmp_path):
    with pytest.raises(KeyError, match="unknown preset"):
        main(["--model", "random:infinity-tiny", "--method", "novaa", "--out", str(tmp_path / "x")])


def test_arch_flops_cli_infinity_2b(tmp_path, capsys):
    assert main(["--arch-flops", "--model", "infinity-2b", "--text-len", "64", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "60.8 % of tokens" in printed
    table = pd.read_csv(tmp_path / "arch_flops_infinity-2b.csv", index_col="scale")
    assert table.loc[table.index >= 0, "tokens"].sum() == 10521
    assert table["flop_share"].sum() == pytest.approx(1.0)
    assert table.loc[[11, 12], "flop_share"].sum() > table.loc[[11, 12], "token_share"].sum()
    assert (tmp_path / "arch_flops_infinity-2b.png").read_bytes()[:8] == PNG
