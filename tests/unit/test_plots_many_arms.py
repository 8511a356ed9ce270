"""The report's plots stay readable with 20 arms (issue 25): every arm is drawn (no facet cut off), the legend sits
outside every axes and title, colour encodes the series and marker the level of ``<series>@<level>`` arms.

Checked on the matplotlib objects after ``fig.canvas.draw()`` (window extents), no pixel comparison. Expected
groupings are parsed here from the arm names, independently of ``ablations.report.arm_styles``."""

from __future__ import annotations

import numpy as np
import pytest

from ablations import report

SERIES = ("entropy", "random", "mse", "lhep", "freq")
LEVELS = ("tau=0.2", "tau=0.4", "tau=0.6", "tau=0.8")
ARMS = [f"{s}@{lv}" for s in SERIES for lv in LEVELS]  # 20 arms: 5 series x 4 levels
SCALES = 6


def _summ(mean, half=0.0, n=8):
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def _records(arms=ARMS, samples=8):
    rng = np.random.default_rng(0)
    out = []
    for i, name in enumerate(["baseline"] + list(arms)):
        base = name == "baseline"
        per_scale = {"entropy": rng.random((samples, SCALES)).tolist()}
        if not base:
            per_scale["token_agreement"] = rng.random((samples, SCALES)).tolist()
        out.append({
            "arm": name, "role": "baseline" if base else "arm", "family": "scorer",
            "model": {"name": "testbed", "num_scales": SCALES}, "samples": {"n": samples},
            "summary": {"speedup": _summ(1 + i / 10, 0.05), "flops_ratio": _summ(1 - i / 50),
                        "psnr_mean_mse": _summ(20 + i, 1), "ssim": _summ(0.9 - i / 100, 0.02),
                        "token_agreement": _summ(0.9 - i / 100, 0.02), "class_correct": _summ(0.5, 0.1),
                        "fid_proxy": _summ(i / 10, 0.05)},
            "metrics": {"per_scale": per_scale, "label": [j % 10 for j in range(samples)], "per_sample": {},
                        "activation_scale": None if base else rng.integers(2, SCALES + 1, samples).tolist()},
            "timing": {"breakdown_ms_per_image": {"attention": 1.0 + i, "mlp": 2.0, "head": 0.5}},
        })
    return out


def _parse(name):
    series, _, level = name.partition("@")
    return series, level


def _check_legend_outside(fig):
    """The figure has one legend, no axes has one, and it overlaps no axes, no axes title and no figure text
    (the suptitle), and lies inside the figure. Returns the legend's entries."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert len(fig.legends) == 1
    assert all(ax.get_legend() is None for ax in fig.axes)
    box = fig.legends[0].get_window_extent(renderer)
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
    others = [ax.get_window_extent(renderer) for ax in fig.axes]
    others += [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
    others += [t.get_window_extent(renderer) for t in fig.texts if t.get_text()]
    assert [t for t in fig.texts if t.get_text()] or [ax for ax in fig.axes if ax.get_title()], "no title"
    for other in others:
        assert not box.overlaps(other), f"legend {box} overlaps {other}"
    return fig.legends[0]


def _check_encoding(styles: dict[str, tuple]):
    """``styles``: arm -> (colour, marker). Same series, same colour; series differ, colours differ; the same for
    levels and markers."""
    by_series, by_level = {}, {}
    for name, (color, marker) in styles.items():
        series, level = _parse(name)
        by_series.setdefault(series, set()).add(tuple(np.round(color[:3], 4)))
        by_level.setdefault(level, set()).add(marker)
    assert all(len(c) == 1 for c in by_series.values()), by_series
    assert len({next(iter(c)) for c in by_series.values()}) == len(by_series)
    assert all(len(m) == 1 for m in by_level.values()), by_level
    assert len({next(iter(m)) for m in by_level.values()}) == len(by_level)


def _line_styles(fig, names):
    """arm -> (colour, marker) of the curves labelled with an arm name, over all axes."""
    import matplotlib.colors as mcolors

    out = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_label() in names:
                out[line.get_label()] = (mcolors.to_rgb(line.get_color()), line.get_marker())
    return out


def _errorbar_styles(fig, names):
    """arm -> (colour, marker) of the error-bar points labelled with an arm name, per axes."""
    import matplotlib.colors as mcolors

    per_axes = []
    for ax in fig.axes:
        seen = {}
        for container in ax.containers:
            if container.get_label() in names:
                line = container.lines[0]
                seen[container.get_label()] = (mcolors.to_rgb(line.get_color()), line.get_marker())
        per_axes.append(seen)
    return per_axes


@pytest.mark.parametrize("key,with_baseline", [("entropy", True), ("token_agreement", False)])
def test_per_scale_curves_show_every_arm_with_the_legend_outside(key, with_baseline):
    records = _records()
    if not with_baseline:
        records = records[1:]
    fig = report.per_scale_figure(records, key, "y", "a title over the panels")
    legend = _check_legend_outside(fig)
    expected = (["baseline"] if with_baseline else []) + ARMS
    assert [t.get_text() for t in legend.get_texts()] == expected
    styles = _line_styles(fig, set(ARMS))
    assert sorted(styles) == sorted(ARMS)  # every arm has a curve
    _check_encoding(styles)
    # panels of at most 6 curves (a series never split): 5 series of 4 arms -> 5 panels, one series each
    assert len(fig.axes) == len(SERIES)
    for ax in fig.axes:
        series = {_parse(line.get_label())[0] for line in ax.get_lines() if line.get_label() in ARMS}
        assert len(series) == 1 and ax.get_title() == next(iter(series))
        baseline_lines = [line for line in ax.get_lines() if line.get_label() == "baseline"]
        assert len(baseline_lines) == (1 if with_baseline else 0)  # the reference in every panel
    # the legend handles carry the same colour and marker as the curves
    import matplotlib.colors as mcolors

    handles = {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}
    for name in ARMS:
        assert handles[name].get_marker() == styles[name][1]
        assert np.allclose(mcolors.to_rgb(handles[name].get_color()), styles[name][0])


def test_activation_histogram_has_a_facet_for_every_arm():
    fig = report.activation_figure(_records())  # the report used to show the first 6 arms
    assert [ax.get_title() for ax in fig.axes] == ARMS
    legend = _check_legend_outside(fig)
    assert [t.get_text() for t in legend.get_texts()] == [str(c) for c in range(8)]  # classes of 8 samples
    # each facet counts that arm's samples: 8 per arm
    for ax in fig.axes:
        assert sum(p.get_height() for p in ax.patches) == 8


def test_activation_histogram_pools_classes_beyond_ten():
    records = _records(ARMS[:3], samples=24)
    for r in records:
        r["metrics"]["label"] = list(range(24))  # 24 classes: one bar per class would be unreadable
    fig = report.activation_figure(records)
    fig.canvas.draw()
    assert not fig.legends and all(ax.get_legend() is None for ax in fig.axes)
    assert "24 classes pooled" in fig.texts[0].get_text()
    for ax in fig.axes:
        assert sum(p.get_height() for p in ax.patches) == 24


def test_speed_quality_every_arm_in_every_panel():
    fig = report.speed_quality_figure(_records())
    legend = _check_legend_outside(fig)
    assert [t.get_text() for t in legend.get_texts()] == ["baseline"] + ARMS
    panels = _errorbar_styles(fig, set(ARMS))
    assert len(panels) == 3  # PSNR, FID-proxy, class accuracy
    for seen in panels:
        assert sorted(seen) == sorted(ARMS)
        _check_encoding(seen)


def test_quality_vs_flops_colour_is_series_marker_is_level():
    fig = report.quality_vs_flops_figure(_records())
    legend = _check_legend_outside(fig)
    assert [t.get_text() for t in legend.get_texts()] == ARMS
    panels = _errorbar_styles(fig, set(ARMS))
    assert len(panels) == 3  # SSIM, token agreement, class accuracy
    for seen in panels:
        assert sorted(seen) == sorted(ARMS)
        _check_encoding(seen)


def test_twenty_arms_without_levels_get_twenty_colours():
    names = [f"method{i}" for i in range(20)]  # e.g. presets: each arm a series of its own
    fig = report.speed_quality_figure(_records(names))
    _check_legend_outside(fig)
    seen = _errorbar_styles(fig, set(names))[0]
    assert sorted(seen) == sorted(names)
    assert len({tuple(np.round(c, 4)) for c, _ in seen.values()}) == 20  # tab10 alone would repeat colours


def test_latency_breakdown_has_a_bar_for_every_arm():
    fig = report.latency_breakdown_figure(_records())
    legend = _check_legend_outside(fig)
    assert sorted(t.get_text() for t in legend.get_texts()) == ["attention", "head", "mlp"]
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["baseline"] + ARMS


def test_write_plots_writes_every_plot(tmp_path):
    paths = report.write_plots(tmp_path, _records(ARMS[:8]))  # 20 arms: the figure tests above
    assert set(paths) == {"speed_quality", "entropy_per_scale", "activation_histogram", "token_agreement",
                          "latency_breakdown", "quality_vs_flops"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths.values())


def test_analysis_plots_keep_their_legends_outside(monkeypatch, tmp_path):
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or path)
    rows = [{"criterion": c, "rate": p, "mean": m, "low": m - 0.1, "high": m + 0.1}
            for c in ("lhep", "random", "entropy") for p, m in ((0.1, 0.8), (0.5, 0.6))]
    assert report.plot_criterion_iou({"summary": rows, "scales": [2]}, tmp_path / "a.png")
    assert report.plot_gamma({"gamma": [[None, 0.5, 0.2], [None, 0.4, 0.1]], "delta": 0.15}, tmp_path / "b.png")
    assert report.plot_rho_calibration({"table": {"rho": [[0.1, 0.3, 0.5], [0.2, 0.35, 0.45]], "source": "x"},
                                        "calibration": {"rho_star": [0.4, 0.5], "star_scale": [1, 2], "tau": 0.45}},
                                       tmp_path / "c.png")
    entries = [[t.get_text() for t in _check_legend_outside(fig).get_texts()] for fig in figures]
    assert entries[0] == ["lhep", "random", "entropy"]
    assert entries[1] == ["mean", "SATS delta = 0.15"]
    assert entries[2][0] == "mean" and "implied tau = 0.45" in entries[2] and "paper tau = 0.40" in entries[2]


def test_latency_report_figures_with_twenty_methods():
    """profilers.latency_plots: every method in the legend (outside), each in its own colour."""
    import matplotlib.colors as mcolors
    import pandas as pd

    from profilers import latency_plots

    methods = [f"method{i}" for i in range(20)]
    repeats = pd.DataFrame([(m, 1, k, 0.0, 10.0 + i + k, 2.0) for i, m in enumerate(methods) for k in range(3)],
                           columns=["method", "batch", "round", "text_encode_ms", "transformer_ms", "vq_decode_ms"])
    scale_long = pd.DataFrame([(m, 1, s, k, 1.0 + s + i) for i, m in enumerate(methods) for s in range(4)
                               for k in range(3)], columns=["method", "batch", "scale", "round", "ms"])
    per_scale = pd.DataFrame([(m, 1, s, 100.0 + s + i, "analytic") for i, m in enumerate(methods) for s in range(4)],
                             columns=["method", "batch", "scale", "peak_mib", "memory_source"])
    fig = latency_plots.methods_latency_figure(repeats)
    legend = _check_legend_outside(fig)
    assert [t.get_text() for t in legend.get_texts()] == ["transformer", "VQ decode"]  # text encoding is all 0
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == methods
    for fig in (latency_plots.methods_per_scale_figure(scale_long, 1), latency_plots.methods_memory_figure(per_scale,
                                                                                                           50.0)):
        legend = _check_legend_outside(fig)
        assert [t.get_text() for t in legend.get_texts()] == methods
        colours = [mcolors.to_rgb(h.get_color() if hasattr(h, "get_color") else h.get_facecolor())
                   for h in legend.legend_handles]
        assert len({tuple(np.round(c, 4)) for c in colours}) == 20


def test_breakdown_stack_legend_outside(monkeypatch, tmp_path):
    """profilers.breakdown: the per-scale stack's component legend sits right of the axes, covering no bar."""
    import pandas as pd
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from profilers import breakdown

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: saved.append(self))
    labels = [f"component {i}" for i in range(12)]
    frame = pd.DataFrame([(s, lab, 1.0 + i) for s in range(6) for i, lab in enumerate(labels)],
                         columns=["scale", "label", "ms"])
    breakdown.plot_scale_stack(frame, tmp_path / "stack.png")
    (fig,) = saved
    FigureCanvasAgg(fig)
    legend = _check_legend_outside(fig)
    assert sorted(t.get_text() for t in legend.get_texts()) == sorted(labels)
    assert legend.get_title().get_text() == "component"
