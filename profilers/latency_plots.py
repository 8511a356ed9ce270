"""The comparison figures of the latency report (:mod:`profilers.latency_report`): seaborn on a bare matplotlib
``Figure`` (no pyplot state), one PNG each — time per generation by part, time per scale, peak memory per scale.

Readable with many methods (issue 25): one colour per method (distinct up to 20, evenly spaced hues beyond), the
legend right of every axes in room the constrained layout reserves (it covers no data and no title). Each
``plot_*`` saves the figure its ``*_figure`` builds."""

from __future__ import annotations

import math
from pathlib import Path

LEGEND_ROWS = 26  # legend entries per column before a second column starts


def _figure(width, height, ncols=1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def _palette(names) -> dict:
    """A distinct colour per name in order: tab10 up to 10, tab20 (dark shades, then light) up to 20, husl beyond."""
    import seaborn as sns

    names = list(dict.fromkeys(names))
    if len(names) <= 10:
        colors = sns.color_palette("tab10", max(len(names), 1))
    elif len(names) <= 20:
        tab20 = sns.color_palette("tab20", 20)
        colors = tab20[0::2] + tab20[1::2]
    else:
        colors = sns.color_palette("husl", len(names))
    return dict(zip(names, colors))


def _legend_outside(fig, axes, title: str):
    """Move the axes' seaborn legends into one figure legend right of every axes (``outside right upper``)."""
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=7, frameon=False, title=title,
                   title_fontsize=8, ncols=max(1, math.ceil(len(handles) / LEGEND_ROWS)))


def _height(entries: int, base: float = 4.0) -> float:
    return max(base, 0.17 * min(entries, LEGEND_ROWS) + 0.6)


def methods_latency_figure(repeats):
    """Median time per generation (IQR error bars): one bar per method and part, one panel per batch."""
    import seaborn as sns

    long = repeats.melt(id_vars=["method", "batch", "round"], value_vars=["text_encode_ms", "transformer_ms",
                                                                          "vq_decode_ms"],
                        var_name="part", value_name="ms")
    long["part"] = long["part"].map({"text_encode_ms": "text encoding", "transformer_ms": "transformer",
                                     "vq_decode_ms": "VQ decode"})
    long = long[long.groupby(["part"])["ms"].transform("max") > 0]
    batches = sorted(long["batch"].unique())
    methods = list(dict.fromkeys(long["method"]))
    fig, axes = _figure((0.35 * len(methods) + 2.8) * len(batches) + 1.6, 4.4, len(batches))
    for ax, b in zip(axes, batches):
        sns.barplot(data=long[long["batch"] == b], x="method", y="ms", hue="part", estimator="median",
                    errorbar=("pi", 50), capsize=0.15, ax=ax, order=methods)
        ax.set_title(f"batch {b}: median per generation (bars: IQR)")
        ax.set_ylabel("ms per generation")
        ax.set_xlabel("")
        ax.tick_params(axis="x", labelrotation=90 if len(methods) > 6 else 0)
    _legend_outside(fig, axes, "part")
    return fig


def plot_methods_latency(repeats, path) -> Path:
    methods_latency_figure(repeats).savefig(path, dpi=120, bbox_inches="tight")
    return Path(path)


def methods_per_scale_figure(scale_long, batch: int):
    """Median time per scale (IQR band), one line per method."""
    import seaborn as sns

    data = scale_long[scale_long["batch"] == batch]
    palette = _palette(data["method"])
    fig, (ax,) = _figure(8.6, _height(len(palette)))
    sns.lineplot(data=data, x="scale", y="ms", hue="method", estimator="median", errorbar=("pi", 50),
                 marker="o", ax=ax, palette=palette, hue_order=list(palette))
    ax.set_yscale("log")
    ax.set_xlabel("scale index")
    ax.set_ylabel("scale window, ms (median, band: IQR)")
    ax.set_title(f"time per scale, batch {batch}")
    _legend_outside(fig, [ax], "method")
    return fig


def plot_methods_per_scale(scale_long, path, batch: int) -> Path:
    methods_per_scale_figure(scale_long, batch).savefig(path, dpi=120, bbox_inches="tight")
    return Path(path)


def methods_memory_figure(per_scale, weight_mib: float):
    """Peak memory per scale, one bar per method, one panel per batch; says whether it is measured or estimated."""
    import seaborn as sns

    data = per_scale.copy()
    source = data["memory_source"].iloc[0]
    if source == "cuda-measured":
        data["value"] = data["peak_mib"]
        ylabel, what = "MiB (torch.cuda.max_memory_allocated)", "CUDA measured peak"
    else:
        data["value"] = data["peak_mib"] - weight_mib
        ylabel, what = "MiB, excluding weights", f"analytic estimate (weights {weight_mib:.1f} MiB not shown)"
    batches = sorted(data["batch"].unique())
    palette = _palette(data["method"])
    fig, axes = _figure(4.5 * len(batches) + 2.0, _height(len(palette)), len(batches))
    for ax, b in zip(axes, batches):
        sns.barplot(data=data[data["batch"] == b], x="scale", y="value", hue="method", ax=ax, palette=palette,
                    hue_order=list(palette))
        ax.set_ylabel(ylabel)
        ax.set_xlabel("scale index")
        ax.set_title(f"peak memory per scale, batch {b}\n{what}", fontsize=9)
    _legend_outside(fig, axes, "method")
    return fig


def plot_methods_memory(per_scale, path, weight_mib: float) -> Path:
    methods_memory_figure(per_scale, weight_mib).savefig(path, dpi=120, bbox_inches="tight")
    return Path(path)
