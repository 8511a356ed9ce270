"""``torch.profiler`` integration: named ranges for every loop span, scheduled profiling, per-range op tables.

* :class:`RecordFunctionTracer` — a :class:`~var_core.engine.tracing.Tracer` whose spans are
  ``torch.profiler.record_function`` ranges named ``scale{k}/block{l}/{component}`` (block spans),
  ``scale{k}/{component}`` (scale spans, e.g. ``scale9/head``) or ``{component}`` (no scale, e.g. ``vq_decode``;
  policy spans are ``accel/<name>``, prefixed the same way when they give a scale). Each generated scale is itself
  a range ``scale{k}`` (opened in ``scale_begin``, closed in ``scale_end``), so work the loop does between spans
  (token gathers, residual additions) is still attributed to its scale.
* :class:`CompositeTracer` — several tracers at once (e.g. a :class:`~profilers.timers.ComponentTimer` and a
  :class:`RecordFunctionTracer`); defined in the engine's tracing seam and re-exported here.
* :func:`profile_generations` — runs a callable under ``torch.profiler.profile`` with a wait/warmup/active
  schedule, exports one Chrome trace per active cycle, and returns operator tables grouped by enclosing range
  (:func:`ops_by_range`).

What is measured: the profiler's own clocks (CPU: host time of each op, ``self`` = excluding child ops; CUDA:
kernel time attributed to the op that launched it). Only the *active* steps of the schedule are recorded;
``wait`` steps run unprofiled and ``warmup`` steps run with the profiler on but discard their events. With the
profiler off, a ``record_function`` range costs about a microsecond.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

import torch

from var_core.engine.tracing import CompositeTracer, Tracer

from .device_sync import synchronize

__all__ = [
    "CompositeTracer", "ProfileRun", "ProfileSchedule", "RecordFunctionTracer", "ops_by_range", "profile_generate",
    "profile_generations", "range_name", "parse_range_name",
]


def range_name(component: str, scale: int | None = None, block: int | None = None) -> str:
    """``scale{k}/block{l}/{component}``, ``scale{k}/{component}`` or ``{component}``."""
    if scale is None:
        return component if block is None else f"block{block}/{component}"
    if block is None:
        return f"scale{scale}/{component}"
    return f"scale{scale}/block{block}/{component}"


_RANGE_RE = re.compile(r"^(?:scale(?P<scale>\d+))?(?:/?block(?P<block>\d+))?/?(?P<component>.*)$")


def parse_range_name(name: str) -> tuple[int | None, int | None, str]:
    """Inverse of :func:`range_name`: ``(scale, block, component)``; ``scale{k}`` alone gives component ``""``."""
    match = _RANGE_RE.match(name)
    scale = int(match["scale"]) if match["scale"] is not None else None
    block = int(match["block"]) if match["block"] is not None else None
    return scale, block, match["component"]


class RecordFunctionTracer(Tracer):
    """Opens a ``torch.profiler.record_function`` range per span (see the module docstring for the names).

    A span opened without a scale between ``scale_begin`` and ``scale_end`` (e.g. a policy's ``accel/scorer``)
    is named with the open scale (``scale3/accel/scorer``); the block is not inherited (the trace's nesting
    shows it). ``names`` collects every range name this tracer produced (used by :func:`ops_by_range` to tell the loop's
    ranges from PyTorch's own events).
    """

    enabled = True

    def __init__(self, scale_ranges: bool = True):
        self.scale_ranges = scale_ranges
        self.names: set[str] = set()
        self._open_scale: torch.profiler.record_function | None = None
        self._scale: int | None = None  # the scale between scale_begin and scale_end

    def span(self, component: str, scale: int | None = None, block: int | None = None) -> ContextManager:
        name = range_name(component, self._scale if scale is None else scale, block)
        self.names.add(name)
        return torch.profiler.record_function(name)

    def scale_begin(self, scale: int) -> None:
        self._scale = scale
        if not self.scale_ranges:
            return
        self._close_scale()
        name = f"scale{scale}"
        self.names.add(name)
        self._open_scale = torch.profiler.record_function(name)
        self._open_scale.__enter__()

    def scale_end(self, scale: int) -> None:
        self._scale = None
        self._close_scale()

    def _close_scale(self) -> None:
        if self._open_scale is not None:
            rf, self._open_scale = self._open_scale, None
            rf.__exit__(None, None, None)


# ----- scheduled profiling ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileSchedule:
    """``torch.profiler.schedule`` arguments: per cycle ``wait`` unprofiled steps, ``warmup`` profiled but
    discarded steps, ``active`` recorded steps; ``repeat`` cycles (each exported as one trace)."""

    wait: int = 1
    warmup: int = 1
    active: int = 2
    repeat: int = 1

    def __post_init__(self) -> None:
        if self.active < 1 or self.wait < 0 or self.warmup < 0 or self.repeat < 1:
            raise ValueError(f"need active >= 1, repeat >= 1, wait/warmup >= 0; got {self}")

    @property
    def steps(self) -> int:
        return (self.wait + self.warmup + self.active) * self.repeat


@dataclass
class ProfileRun:
    """What :func:`profile_generations` leaves: trace files, per-range op tables, the key_averages table text."""

    traces: list[Path] = field(default_factory=list)
    ops: Any = None  # DataFrame: cycle, range, scale, block, component, op, calls, self_cpu_us, self_device_us
    ranges: Any = None  # DataFrame: cycle, range, scale, block, component, calls, cpu_total_us, device_total_us
    key_averages: list[str] = field(default_factory=list)  # one torch key_averages table per cycle
    schedule: ProfileSchedule = ProfileSchedule()
    activities: tuple[str, ...] = ()

    def ops_per_range(self, top: int | None = None):
        """Mean over cycles of ``self_cpu_us`` (and device) per (range, op), largest first."""
        table = self.ops.groupby(["range", "op"], as_index=False)[
            ["calls", "self_cpu_us", "self_device_us"]].sum()
        cycles = max(1, self.ops["cycle"].nunique())
        table[["calls", "self_cpu_us", "self_device_us"]] /= cycles
        table = table.sort_values("self_cpu_us", ascending=False)
        return table.head(top) if top else table


def _device_self_us(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def _device_total_us(event) -> float:
    for attr in ("device_time_total", "cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def ops_by_range(events: Sequence, range_names: set[str] | None = None, cycle: int = 0):
    """Group profiler events by their innermost enclosing loop range.

    Each non-range event (an operator) is charged its **self** CPU time (and self device time) to the nearest
    ancestor (``cpu_parent`` chain) whose name is in ``range_names`` (default: any name that
    :func:`parse_range_name` recognises as a loop range, i.e. starting with ``scale``/``block``/``accel/`` or
    a bare loop component). Ops with no such ancestor go to ``"(outside)"``. Using self times means nested ops
    (``aten::linear`` → ``aten::addmm``) are not double counted, so the op times of a range add up to the
    range's total minus its nested ranges.

    Returns ``(ops, ranges)`` DataFrames (see :class:`ProfileRun`).
    """
    import pandas as pd

    loop_components = {"embed", "plan", "attn", "ffn", "cross", "restore", "lens", "head", "sampling",
                       "latent_update", "vq_decode", "text_encode"}

    def is_range(name: str) -> bool:
        if range_names is not None:
            return name in range_names
        return name.startswith(("scale", "block", "accel/")) or name in loop_components

    op_rows: dict[tuple[str, str], list[float]] = {}
    range_rows: dict[str, list[float]] = {}
    for event in events:
        name = event.name
        if is_range(name):
            # Only host-side range events (CUDA builds also emit device-side copies of user annotations).
            if str(getattr(event, "device_type", "CPU")).endswith("CPU"):
                row = range_rows.setdefault(name, [0, 0.0, 0.0])
                row[0] += 1
                row[1] += float(event.cpu_time_total)
                row[2] += _device_total_us(event)
            continue
        if not str(getattr(event, "device_type", "CPU")).endswith("CPU"):
            continue
        if name.startswith("ProfilerStep#"):
            continue
        parent = event.cpu_parent
        while parent is not None and not is_range(parent.name):
            parent = parent.cpu_parent
        owner = parent.name if parent is not None else "(outside)"
        row = op_rows.setdefault((owner, name), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += float(event.self_cpu_time_total)
        row[2] += _device_self_us(event)

    def parsed(name: str) -> tuple:
        if name == "(outside)":
            return (None, None, "(outside)")
        return parse_range_name(name)

    ops = pd.DataFrame(
        [(cycle, r, *parsed(r), op, v[0], v[1], v[2]) for (r, op), v in op_rows.items()],
        columns=["cycle", "range", "scale", "block", "component", "op", "calls", "self_cpu_us", "self_device_us"],
    )
    ranges = pd.DataFrame(
        [(cycle, r, *parsed(r), v[0], v[1], v[2]) for r, v in range_rows.items()],
        columns=["cycle", "range", "scale", "block", "component", "calls", "cpu_total_us", "device_total_us"],
    )
    return ops, ranges


def profile_generations(
    run: Callable[[Tracer], Any],
    schedule: ProfileSchedule = ProfileSchedule(),
    out_dir: str | Path | None = None,
    trace_name: str = "varscope",
    activities: Sequence[str] | None = None,
    record_shapes: bool = False,
    with_flops: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    extra_tracer: Tracer | None = None,
    row_limit: int = 25,
    device: torch.device | str | None = None,
) -> ProfileRun:
    """Call ``run(tracer)`` ``schedule.steps`` times under ``torch.profiler.profile``.

    ``run`` receives the tracer to hand to ``generate(..., tracer=tracer)`` (a :class:`RecordFunctionTracer`,
    composed with ``extra_tracer`` if given). After each active cycle the Chrome trace is written to
    ``out_dir/{trace_name}_cycle{n}.json`` (when ``out_dir`` is given) and the op tables are collected.

    ``activities``: ``("cpu",)`` or ``("cpu", "cuda")``; default: CPU, plus CUDA when available. Profiling
    options (shapes, FLOPs, memory, stacks) cost time: see ``specs/environment.md`` (about +7 %, +9 %, +89 %).
    ``device``: the device ``run`` generates on, synchronised between steps when CUDA is profiled (None: the
    current CUDA device).
    """
    from torch.profiler import ProfilerActivity, profile, schedule as make_schedule

    if activities is None:
        activities = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
    acts = [ProfilerActivity.CPU if a == "cpu" else ProfilerActivity.CUDA for a in activities]
    out_path = Path(out_dir) if out_dir is not None else None
    if out_path is not None:
        out_path.mkdir(parents=True, exist_ok=True)
    rf_tracer = RecordFunctionTracer()
    tracer: Tracer = CompositeTracer(extra_tracer, rf_tracer) if extra_tracer is not None else rf_tracer
    result = ProfileRun(schedule=schedule, activities=tuple(activities))
    op_frames, range_frames = [], []

    def on_trace_ready(prof) -> None:
        cycle = len(result.key_averages)
        if out_path is not None:
            path = out_path / f"{trace_name}_cycle{cycle}.json"
            prof.export_chrome_trace(str(path))
            result.traces.append(path)
        ops, ranges = ops_by_range(prof.events(), rf_tracer.names, cycle)
        op_frames.append(ops)
        range_frames.append(ranges)
        sort = "self_cuda_time_total" if "cuda" in activities else "self_cpu_time_total"
        result.key_averages.append(prof.key_averages().table(sort_by=sort, row_limit=row_limit))

    with profile(
        activities=acts,
        schedule=make_schedule(wait=schedule.wait, warmup=schedule.warmup, active=schedule.active,
                               repeat=schedule.repeat),
        on_trace_ready=on_trace_ready,
        record_shapes=record_shapes,
        with_flops=with_flops,
        profile_memory=profile_memory,
        with_stack=with_stack,
    ) as prof:
        for _ in range(schedule.steps):
            run(tracer)
            if "cuda" in activities:  # between steps only: the step boundary must see finished kernels
                synchronize(device if device is not None else torch.device("cuda", torch.cuda.current_device()))
            prof.step()

    import pandas as pd

    result.ops = pd.concat(op_frames, ignore_index=True) if op_frames else None
    result.ranges = pd.concat(range_frames, ignore_index=True) if range_frames else None
    return result


def profile_generate(adapter, conditions, seeds=None, sampling=None, policy=None, options=None,
                     **profile_kwargs) -> ProfileRun:
    """:func:`profile_generations` around ``var_core.engine.generate`` with fixed arguments (each step is one
    full generation, decoding included unless ``options.decode`` is False)."""
    from var_core.engine import GenerationOptions, SamplingConfig, generate

    sampling = sampling if sampling is not None else SamplingConfig()
    options = options if options is not None else GenerationOptions(check_finite=False)

    def run(tracer: Tracer):
        return generate(adapter, conditions, seeds=seeds, sampling=sampling, policy=policy, tracer=tracer,
                        options=options)

    profile_kwargs.setdefault("device", getattr(adapter, "device", None))
    return profile_generations(run, **profile_kwargs)
