"""``python -m studies.latency`` end to end on two tiny models (tiny repeats): every output is written and parses —
the JSON loads, the CSVs read with the expected columns (speedups included), the PNGs are PNGs — and, with
``--profile``, a Chrome trace and the op table exist. The speedups and FLOPs ratios of the report are recomputed
from the recorded per-round times (``repeats.csv``) and, for FastVAR on official-tiny, from FlopCounterMode; a
hand-worked example pins :func:`profilers.latency_report.summary_rows`."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from profilers.latency_report import MethodRun, spread, summary_rows
from studies.latency import main

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
    _check_speedups_against_recorded_times(out, summary, report, methods, batches)
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


def _check_speedups_against_recorded_times(out: Path, summary, report: dict, methods: set[str], batches: set[int]):
    """speedup = median baseline time / median method time of the timed rounds in repeats.csv (transformer and
    end to end), its spread = quartiles of the per-round ratios, FLOPs ratio = method FLOPs / baseline FLOPs."""
    repeats = pd.read_csv(out / "repeats.csv")
    md = (out / "report.md").read_text()
    json_rows = {(r["method"], r["batch"]): r for r in report["summary"]}
    for batch in batches:
        base = repeats[(repeats["method"] == "baseline") & (repeats["batch"] == batch)].sort_values("round")
        base_row = summary[(summary["method"] == "baseline") & (summary["batch"] == batch)].iloc[0]
        for method in methods - {"baseline"}:
            arm = repeats[(repeats["method"] == method) & (repeats["batch"] == batch)].sort_values("round")
            assert list(arm["round"]) == list(base["round"]) == [0, 1]
            row = summary[(summary["method"] == method) & (summary["batch"] == batch)].iloc[0]
            for col, key in (("transformer_ms", "speedup_transformer"), ("total_ms", "speedup_total")):
                expected = statistics.median(base[col]) / statistics.median(arm[col])
                assert expected != pytest.approx(1 / expected, rel=1e-9)  # the inverted ratio would fail
                assert row[key] == pytest.approx(expected, rel=1e-9), (method, batch, key)
                assert json_rows[(method, batch)][key] == pytest.approx(expected, rel=1e-9)
            per_round = base["transformer_ms"].to_numpy() / arm["transformer_ms"].to_numpy()
            assert row["speedup_transformer_q1"] == pytest.approx(np.percentile(per_round, 25), rel=1e-9)
            assert row["speedup_transformer_q3"] == pytest.approx(np.percentile(per_round, 75), rel=1e-9)
            ratio = row["gflops_transformer"] / base_row["gflops_transformer"]
            assert row["flops_ratio"] == pytest.approx(ratio, rel=1e-9)
            assert row["ideal_speedup"] == pytest.approx(1 / ratio, rel=1e-9)
            assert row["speedup_vs_ideal"] == pytest.approx(row["speedup_transformer"] * ratio, rel=1e-9)
            if batch == min(batches):  # the report's side-by-side shows the latency batch
                assert f"{row['speedup_transformer']:.2f}×" in md
        assert base_row["speedup_transformer"] == 1.0 and base_row["flops_ratio"] == 1.0


class _Flops:
    """A FlopReport stand-in: transformer FLOPs (everything but the decoder) and decoder FLOPs."""

    def __init__(self, transformer: float, decode: float):
        self.transformer, self.decode = transformer, decode

    def total_for(self, exclude=(), components=None):
        if components is not None:
            return self.decode if tuple(components) == ("vq_decode",) else 0.0
        return self.transformer if tuple(exclude) == ("vq_decode",) else self.transformer + self.decode


def _method_run(name: str, transformer_ms, decode_ms, flops: float) -> MethodRun:
    run = MethodRun(name, 2)
    for r, (tf, dec) in enumerate(zip(transformer_ms, decode_ms)):
        run.repeats.append({"method": name, "batch": 2, "round": r, "total_ms": tf + dec, "transformer_ms": tf,
                            "text_encode_ms": 0.0, "vq_decode_ms": dec, "entropy_ms": 0.0})
    run.flops = _Flops(flops, 1e8)
    memory = SimpleNamespace(peak_bytes=2 ** 20, source="analytic", scales=[SimpleNamespace(kv_cache_bytes=2 ** 19)])
    run.memory = run.memory_analytic = memory
    run.computed_tokens = [1, 4]
    return run


def test_summary_rows_hand_worked():
    """Three rounds, batch 2, worked by hand:

    baseline transformer ms 100, 300, 200 (median 200), + decode 10, 20, 30 → total 110, 320, 230 (median 230);
    method   transformer ms  50, 100, 400 (median 100), + decode 10, 10, 40 → total  60, 110, 440 (median 110).
    speedup (transformer) = 200 / 100 = 2; end to end = 230 / 110 = 2.0909; per-round ratios 2, 3, 0.5 → sorted
    0.5, 2, 3 → inclusive quartiles 1.25 and 2.5. FLOPs 2e9 vs 8e9 → ratio 0.25, ideal 4×, achieved 2 · 0.25 = 0.5
    of the ideal. Throughput 2 images / 0.110 s = 18.18 images/s, 55 ms per image.
    """
    runs = {"baseline": _method_run("baseline", [100, 300, 200], [10, 20, 30], 8e9),
            "fast": _method_run("fast", [50, 100, 400], [10, 10, 40], 2e9)}
    rows = {r["method"]: r for r in summary_rows(runs, "baseline")}
    fast = rows["fast"]
    assert fast["speedup_transformer"] == pytest.approx(2.0)
    assert fast["speedup_total"] == pytest.approx(230 / 110)
    assert (fast["speedup_transformer_q1"], fast["speedup_transformer_q3"]) == pytest.approx((1.25, 2.5))
    assert fast["flops_ratio"] == pytest.approx(0.25) and fast["ideal_speedup"] == pytest.approx(4.0)
    assert fast["speedup_vs_ideal"] == pytest.approx(0.5)
    assert fast["images_per_s"] == pytest.approx(2 / 0.110) and fast["ms_per_image"] == pytest.approx(55.0)
    assert fast["transformer_ms"] == 100 and fast["total_ms"] == 110
    base = rows["baseline"]
    assert base["speedup_transformer"] == 1.0 and base["speedup_total"] == 1.0 and base["flops_ratio"] == 1.0


def _flop_counter_ratio(method: str, batch: int) -> float:
    """FlopCounterMode FLOPs of ``method`` / the baseline's on official-tiny, one generation without the decoder
    (the report's FLOPs ratio excludes vq_decode). The MATH attention backend runs attention as matmuls, which
    FlopCounterMode counts by itself."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from var_core.accel import build_policy
    from var_core.accel.presets import get_preset
    from var_core.engine import GenerationOptions, generate
    from var_core.zoo import load_model

    adapter = load_model("official-tiny")
    flops = {}
    for name in ("baseline", method):
        with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
            generate(adapter, torch.arange(batch), seeds=list(range(batch)), policy=build_policy(get_preset(name)),
                     options=GenerationOptions(decode=False, check_finite=False))
        flops[name] = counter.get_total_flops()
    return flops[method] / flops["baseline"]


def test_latency_report_official_tiny(tmp_path, fixture_dir):
    threads = torch.get_num_threads()
    out = tmp_path / "vartiny"
    assert main(["--model", "official-tiny", "--weights", str(fixture_dir), "--method", "nova",
                 "--compare", "fastvar", "--repeats", "2", "--warmup", "0", "--throughput-batch", "2",
                 "--threads", "1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # --threads is restored
    report = _check_report(out, {"nova", "fastvar", "baseline"}, {1, 2}, "var")
    assert "`baseline` added as the speedup reference" in report["notes"]
    summary = pd.read_csv(out / "summary.csv")
    for batch in (1, 2):  # FastVAR's fixed table (the last two scales keep 22/36 and 32/64): measured FLOPs
        row = summary[(summary["method"] == "fastvar") & (summary["batch"] == batch)].iloc[0]
        expected = _flop_counter_ratio("fastvar", batch)
        assert expected < 0.8
        assert row["flops_ratio"] == pytest.approx(expected, rel=1e-6)


def test_latency_report_infinity_tiny_with_profile(tmp_path):
    # sparsevar, not fastvar: FastVAR's released Infinity setting prunes the 32- and 40-wide scales only, and this
    # 128 px model's widest is 8 (fastvar runs it unpruned, as the released code would)
    out = tmp_path / "inftiny"
    assert main(["--model", "random:infinity-tiny", "--method", "sparsevar", "--compare", "baseline",
                 "--repeats", "2", "--warmup", "1", "--throughput-batch", "2", "--profile", "--threads", "1",
                 "--out", str(out)]) == 0
    report = _check_report(out, {"sparsevar", "baseline"}, {1, 2}, "infinity")
    sparsevar = next(r for r in report["summary"] if r["method"] == "sparsevar" and r["batch"] == 1)
    assert sparsevar["flops_ratio"] < 1  # pruned: the FLOP report follows the kept tokens
    traces = sorted((out / "profile").glob("*_cycle0.json"))
    assert {t.name for t in traces} == {"sparsevar_b1_cycle0.json", "baseline_b1_cycle0.json"}
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


def test_unknown_method_fails_before_running(tmp_path, capsys):
    from studies._cli import run_cli

    argv = ["--model", "random:infinity-tiny", "--method", "novaa", "--out", str(tmp_path / "x")]
    assert run_cli(main, argv) == 2  # what `python -m studies.latency` exits with
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "unknown preset 'novaa'" in err and "Did you mean 'nova'" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_arch_flops_cli_infinity_2b(tmp_path, capsys):
    assert main(["--arch-flops", "--model", "infinity-2b", "--text-len", "64", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "60.8 % of tokens" in printed
    table = pd.read_csv(tmp_path / "arch_flops_infinity-2b.csv", index_col="scale")
    assert table.loc[table.index >= 0, "tokens"].sum() == 10521
    assert table["flop_share"].sum() == pytest.approx(1.0)
    assert table.loc[[11, 12], "flop_share"].sum() > table.loc[[11, 12], "token_share"].sum()
    assert (tmp_path / "arch_flops_infinity-2b.png").read_bytes()[:8] == PNG
