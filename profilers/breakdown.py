"""Tables and plots from timer, FLOP and memory data (used by ``studies/latency.py``).

Inputs are the objects of the other profiler modules: a finalized :class:`~profilers.timers.ComponentTimer`,
a :class:`~profilers.flops.FlopReport`, a :class:`~profilers.memory.MemoryReport`. Every function returns a
pandas DataFrame (long or pivoted, documented per function); the ``plot_*`` functions write a PNG with seaborn
on a matplotlib ``Figure`` object (no pyplot global state, headless) and return its path.

Times are the timer's **self** milliseconds per generation (so components add up without double counting;
nested ``accel/*`` spans appear on their own), FLOPs are GFLOPs per generation, memory is MiB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

import pandas as pd

__all__ = [
    "COMPONENT_LABELS", "layer_heatmap_frame", "per_scale_summary", "plot_gflops_vs_resolution",
    "plot_layer_heatmap", "plot_peak_memory", "plot_scale_stack", "scale_breakdown", "scale_component_frame",
    "write_breakdown",
]

MIB = 1024 ** 2

COMPONENT_LABELS: dict[str, str] = {
    "attn": "self-attention",
    "cross": "cross-attention",
    "ffn": "FFN",
    "head": "head (logits)",
    "lens": "logit lens",
    "sampling": "sampling (CFG, top-k/p, draw)",
    "latent_update": "latent update (VQ)",
    "embed": "input embedding",
    "plan": "token selection (plan)",
    "restore": "pruned-token restore (cache)",
    "vq_decode": "VQ decode",
    "text_encode": "text encoder",
}


def _label(component: str) -> str:
    if component.startswith("accel/"):
        return f"accel: {component.removeprefix('accel/')}"
    return COMPONENT_LABELS.get(component, component)


def scale_component_frame(timer=None, flops=None) -> pd.DataFrame:
    """Long table, one row per (scale, component): ``ms`` (self time per generation) and ``gflops``.

    Either source may be omitted (its column is then NaN). Scale ``-1`` holds once-per-generation work
    (``vq_decode``, ``condition``).
    """
    frames = []
    if timer is not None:
        t = timer.frame().groupby(["scale", "component"], as_index=False)["self_ms"].sum()
        frames.append(t.rename(columns={"self_ms": "ms"}))
    if flops is not None:
        f = flops.frame().groupby(["scale", "component"], as_index=False)["flops"].sum()
        f["gflops"] = f.pop("flops") / 1e9
        frames.append(f)
    if not frames:
        raise ValueError("give a timer, a FLOP report, or both")
    out = frames[0]
    for other in frames[1:]:
        out = out.merge(other, on=["scale", "component"], how="outer")
    for col in ("ms", "gflops"):
        if col not in out:
            out[col] = float("nan")
    out["label"] = out["component"].map(_label)
    return out.sort_values(["scale", "component"]).reset_index(drop=True)[
        ["scale", "component", "label", "ms", "gflops"]]


def per_scale_summary(timer=None, flops=None, memory=None) -> pd.DataFrame:
    """One row per scale: ``ms`` (Σ self times of spans), ``scale_ms`` (scale window), ``gflops``,
    ``tokens_computed`` (per row, summed over blocks and branches), ``peak_mib`` / ``kv_cache_mib`` /
    ``largest_activation`` (memory source in ``memory_source``). Missing sources leave NaN."""
    parts = []
    if timer is not None:
        spans = timer.per_scale()
        parts.append(pd.DataFrame({"ms": spans["total"], "scale_ms": spans["scale_ms"]}))
    if flops is not None:
        frame = flops.frame()
        gflops = frame.groupby("scale")["flops"].sum() / 1e9
        blocks = frame[(frame["block"] >= 0) & frame["op"].isin(["qkv", "fc1", "fc1_gate", "q"])]
        tokens = blocks.groupby("scale")["tokens"].sum()
        parts.append(pd.DataFrame({"gflops": gflops, "tokens_computed": tokens}))
    if memory is not None:
        m = memory.frame().set_index("scale")
        parts.append(pd.DataFrame({
            "peak_mib": m["peak_bytes"] / MIB, "kv_cache_mib": m["kv_cache_bytes"] / MIB,
            "largest_activation": m["largest_activation"], "memory_source": m["source"],
        }))
    if not parts:
        raise ValueError("give at least one of timer, flops, memory")
    out = pd.concat(parts, axis=1)
    out.index.name = "scale"
    return out[out.index >= 0].sort_index()


def layer_heatmap_frame(source, components: Iterable[str] | None = None) -> pd.DataFrame:
    """Block (layer) × scale matrix: self ms per generation (a timer) or GFLOPs (a FLOP report)."""
    if hasattr(source, "per_scale_block") and hasattr(source, "spans"):
        return source.per_scale_block(tuple(components) if components is not None else None)
    frame = source.frame()
    frame = frame[frame["block"] >= 0]
    if components is not None:
        frame = frame[frame["component"].isin(list(components))]
    return frame.pivot_table(index="block", columns="scale", values="flops", aggfunc="sum", fill_value=0) / 1e9


def scale_breakdown(timer, scale: int | None = None, flops=None) -> pd.DataFrame:
    """Latency breakdown of one representative scale (NOVA's Table 8 layout).

    ``scale``: default the last scale the timer saw (the highest resolution). Rows: every component with its
    self time (``accel/*`` rows, e.g. the entropy or scorer computation, are listed separately so their share
    is visible), plus ``loop (outside spans)`` = the scale window minus the spans (gathers, residual additions,
    hook calls without a span). Columns: ``ms``, ``share`` (of the scale window, in %), ``gflops``.
    """
    frame = timer.frame()
    if scale is None:
        scale = int(frame.loc[frame["scale"] >= 0, "scale"].max())
    rows = frame[frame["scale"] == scale].groupby("component")["self_ms"].sum()
    window = float(timer.scale_windows().get(scale, rows.sum()))
    table = pd.DataFrame({"ms": rows})
    outside = window - rows.sum()
    table.loc["loop (outside spans)", "ms"] = max(outside, 0.0)
    if flops is not None:
        f = flops.frame()
        g = f[f["scale"] == scale].groupby("component")["flops"].sum() / 1e9
        table["gflops"] = g.reindex(table.index)
    table["share"] = 100 * table["ms"] / max(window, table["ms"].sum())
    table.index = [_label(c) if c in COMPONENT_LABELS or c.startswith("accel/") else c for c in table.index]
    table.index.name = f"scale {scale}"
    table = table.sort_values("ms", ascending=False)
    table.loc["total (scale window)"] = [window] + ([table["gflops"].sum()] if flops is not None else []) + [100.0]
    return table


# ----- plots ------------------------------------------------------------------------------------------------
def _figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


def _legend_outside(fig) -> None:
    """Each axes legend becomes a figure legend right of the axes (``outside right upper``: the constrained layout
    makes room), where it covers no bar and no title (issue 25)."""
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            fig.legend(legend.legend_handles, [t.get_text() for t in legend.get_texts()], loc="outside right upper",
                       title=legend.get_title().get_text() or None, fontsize=7, title_fontsize=8, frameon=False)
            legend.remove()


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _legend_outside(fig)
    fig.savefig(path, dpi=120)
    return path


def plot_scale_stack(frame: pd.DataFrame, path, value: str = "ms", title: str | None = None) -> Path:
    """Stacked bars per scale by component from :func:`scale_component_frame` (``value``: ``ms`` or ``gflops``)."""
    import seaborn as sns

    data = frame[(frame["scale"] >= 0) & frame[value].notna() & (frame[value] > 0)]
    fig, ax = _figure()
    sns.histplot(data=data, x="scale", weights=value, hue="label", multiple="stack", discrete=True, shrink=0.8,
                 palette="tab20", ax=ax)
    ax.set_xlabel("scale index")
    ax.set_ylabel({"ms": "self time per generation (ms)", "gflops": "GFLOPs per generation"}.get(value, value))
    ax.set_title(title or f"per-scale breakdown ({value})")
    legend = ax.get_legend()
    if legend is not None:
        legend.set_title("component")
    return _save(fig, path)


def plot_layer_heatmap(matrix: pd.DataFrame, path, title: str = "per-layer cost", unit: str = "ms") -> Path:
    """Heat map of a block × scale matrix from :func:`layer_heatmap_frame`."""
    import seaborn as sns

    fig, ax = _figure(1.2 + 0.55 * max(4, matrix.shape[1]), 1.5 + 0.3 * max(4, matrix.shape[0]))
    sns.heatmap(matrix, ax=ax, cmap="viridis", cbar_kws={"label": unit},
                annot=matrix.size <= 120, fmt=".2g", annot_kws={"fontsize": 7})
    ax.set_xlabel("scale index")
    ax.set_ylabel("block (layer)")
    ax.set_title(title)
    return _save(fig, path)


def plot_peak_memory(memory, path, title: str | None = None) -> Path:
    """Per-scale memory bars. CUDA reports: the measured peak and the peak above the scale's starting
    allocation. Analytic reports: the estimate *excluding weights* (weights are constant across scales and
    would dwarf the rest; their size goes in the title) and its parts."""
    import seaborn as sns

    frame = memory.frame()
    if memory.source == "cuda-measured":
        cols = {"peak_bytes": "peak (measured)", "delta_peak_bytes": "peak above scale start"}
    else:
        cols = {"delta_peak_bytes": "estimate excl. weights", "kv_cache_bytes": "KV cache (held)",
                "kv_reserved_bytes": "KV cache (reserved)", "largest_activation_bytes": "largest activation"}
    long = frame.melt(id_vars=["scale"], value_vars=list(cols), var_name="quantity", value_name="bytes")
    long["MiB"] = long["bytes"] / MIB
    long["quantity"] = long["quantity"].map(cols)
    fig, ax = _figure()
    sns.barplot(data=long, x="scale", y="MiB", hue="quantity", ax=ax)
    ax.set_xlabel("scale index")
    ax.set_ylabel("MiB")
    weights = f", weights {memory.weight_bytes / MIB:.1f} MiB" if memory.weight_bytes else ""
    ax.set_title(title or f"memory per scale ({memory.source}{weights})")
    return _save(fig, path)


def plot_gflops_vs_resolution(frame: pd.DataFrame, path, title: str | None = None) -> Path:
    """Figure 2b: GFLOPs vs resolution for next-scale and next-token, from
    :func:`profilers.flops.gflops_vs_resolution` (log scale)."""
    import seaborn as sns

    fig, ax = _figure(6.0, 4.0)
    sns.lineplot(data=frame, x="resolution", y="gflops", hue="method", marker="o", ax=ax)
    ax.set_yscale("log")
    ax.set_xticks(sorted(frame["resolution"].unique()))
    ax.set_xlabel("image resolution (px, square)")
    ax.set_ylabel("theoretical GFLOPs per image")
    ax.set_title(title or "next-scale vs next-token generation cost")
    return _save(fig, path)


def write_breakdown(out_dir, timer=None, flops=None, memory=None, prefix: str = "") -> Mapping[str, Path]:
    """Write every table (CSV) and plot (PNG) the given sources allow into ``out_dir``; returns name → path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    def csv(name: str, frame: pd.DataFrame, index: bool = True) -> None:
        path = out / f"{prefix}{name}.csv"
        frame.to_csv(path, index=index)
        paths[name] = path

    if timer is not None or flops is not None:
        frame = scale_component_frame(timer, flops)
        csv("scale_component", frame, index=False)
        if timer is not None:
            paths["scale_stack_ms"] = plot_scale_stack(frame, out / f"{prefix}scale_stack_ms.png", "ms")
        if flops is not None:
            paths["scale_stack_gflops"] = plot_scale_stack(frame, out / f"{prefix}scale_stack_gflops.png",
                                                           "gflops")
    if timer is not None:
        heat = layer_heatmap_frame(timer)
        csv("layer_heatmap_ms", heat)
        paths["layer_heatmap_ms_png"] = plot_layer_heatmap(heat, out / f"{prefix}layer_heatmap_ms.png",
                                                           "self time per block and scale", "ms")
        csv("scale_breakdown", scale_breakdown(timer, flops=flops))
    if flops is not None:
        heat = layer_heatmap_frame(flops)
        csv("layer_heatmap_gflops", heat)
        paths["layer_heatmap_gflops_png"] = plot_layer_heatmap(heat, out / f"{prefix}layer_heatmap_gflops.png",
                                                               "GFLOPs per block and scale", "GFLOPs")
    if memory is not None:
        csv("memory", memory.frame(), index=False)
        paths["memory_png"] = plot_peak_memory(memory, out / f"{prefix}memory.png")
    if any(s is not None for s in (timer, flops, memory)):
        csv("per_scale", per_scale_summary(timer, flops, memory))
    return paths
