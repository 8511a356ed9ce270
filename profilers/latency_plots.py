"""The comparison figures of the latency report (:mod:`profilers.latency_report`): seaborn on a bare matplotlib
``Figure`` (no pyplot state), one PNG each — time per generation by part, time per scale, peak memory per scale."""

from __future__ import annotations

from pathlib import Path


def _figure(width, height, ncols=1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def plot_methods_latency(repeats, path) -> Path:
    """Median time per generation (IQR error bars): one bar per method and part, one panel per batch."""
    import seaborn as sns

    long = repeats.melt(id_vars=["method", "batch", "round"], value_vars=["text_encode_ms", "transformer_ms",
                                                                          "vq_decode_ms"],
                        var_name="part", value_name="ms")
    long["part"] = long["part"].map({"text_encode_ms": "text encoding", "transformer_ms": "transformer",
                                     "vq_decode_ms": "VQ decode"})
    long = long[long.groupby(["part"])["ms"].transform("max") > 0]
    batches = sorted(long["batch"].unique())
    fig, axes = _figure(4.2 * len(batches) + 0.5, 4.0, len(batches))
    for ax, b in zip(axes, batches):
        sns.barplot(data=long[long["batch"] == b], x="method", y="ms", hue="part", estimator="median",
                    errorbar=("pi", 50), capsize=0.15, ax=ax)
        ax.set_title(f"batch {b}: median per generation (bars: IQR)")
        ax.set_ylabel("ms per generation")
        ax.set_xlabel("")
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_methods_per_scale(scale_long, path, batch: int) -> Path:
    import seaborn as sns

    data = scale_long[scale_long["batch"] == batch]
    fig, (ax,) = _figure(7.0, 4.0)
    sns.lineplot(data=data, x="scale", y="ms", hue="method", estimator="median", errorbar=("pi", 50),
                 marker="o", ax=ax)
    ax.set_yscale("log")
    ax.set_xlabel("scale index")
    ax.set_ylabel("scale window, ms (median, band: IQR)")
    ax.set_title(f"time per scale, batch {batch}")
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_methods_memory(per_scale, path, weight_mib: float) -> Path:
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
    fig, axes = _figure(4.5 * len(batches) + 0.5, 4.0, len(batches))
    for ax, b in zip(axes, batches):
        sns.barplot(data=data[data["batch"] == b], x="scale", y="value", hue="method", ax=ax)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("scale index")
        ax.set_title(f"peak memory per scale, batch {b}\n{what}", fontsize=9)
    fig.savefig(path, dpi=120)
    return Path(path)

