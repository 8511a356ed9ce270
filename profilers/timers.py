"""Per-component timing of the generation loop: CUDA events on GPU, ``time.perf_counter_ns`` on CPU.

:class:`ComponentTimer` implements the engine's :class:`~var_core.engine.tracing.Tracer` protocol. The loop
opens a span around each piece of work (``embed``, ``plan``, ``attn``, ``ffn``, ``cross``, ``restore``, ``lens``,
``head``, ``sampling``, ``latent_update``, ``vq_decode``; policies open ``accel/<name>``), and calls
``scale_begin(si)`` / ``scale_end(si)`` around every generated scale.

What is measured, and what is inside the timed region
-----------------------------------------------------
* **CPU** (``perf_counter_ns``): a span's time is the host wall-clock time between entering and leaving its
  ``with`` block, i.e. everything executed inside it (PyTorch op dispatch, kernels, Python). The clock is read as
  the last thing on entry and the first thing on exit, so the timer's own bookkeeping is outside the region.
  CPU kernels run synchronously, so no synchronisation is needed.
* **CUDA** (``torch.cuda.Event(enable_timing=True)``): an event pair is *recorded* on the current stream at
  entry and exit, without any synchronisation inside the loop; :meth:`ComponentTimer.finalize` synchronises once
  and resolves all pairs. A span's time is then the device time between the two events: the kernels queued
  inside the span, plus any idle gap when the host falls behind the GPU (launch-bound spans). The host time
  (``perf_counter_ns``) of each span is recorded as well (``host_ms``) so launch-bound spans can be spotted.
* **Scale windows**: ``scale_begin``..``scale_end`` is timed the same way (``scale_ms``). It contains the
  loop's own work between spans (token gathers, residual additions, hook calls that open no span), so
  ``coverage = Σ top-level spans / Σ scale windows`` says how much of a scale the spans account for.

Nested spans (e.g. ``accel/scorer`` inside ``plan``): ``inclusive_ms`` is a span's full time, ``self_ms`` excludes
the spans nested directly inside it. Self times therefore add up, without double counting, to the total time of
the top-level spans; inclusive times are the natural "cost of this step" numbers. A span opened without a scale
(and block) inherits those of the span that encloses it, or the scale currently open between
``scale_begin``/``scale_end``; otherwise it is reported with scale ``None`` (e.g. ``vq_decode``).

Cost when off: the engine's ``NULL_TRACER`` returns one shared ``nullcontext`` (no timer code runs at all).
Cost when on: two clock reads, one small object and one list append per span (on CUDA: two event records);
``python -m profilers.bench_overhead`` measures it (results in ``docs/benchmarks.md``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from var_core.engine.tracing import Tracer

__all__ = ["ComponentTimer", "SpanRecord", "cuda_timing_available"]

_perf_ns = time.perf_counter_ns


def cuda_timing_available(device: torch.device | str | None = None) -> bool:
    """True when CUDA events can be used (CUDA build, a visible GPU, and a CUDA ``device`` or none given)."""
    if not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


@dataclass(frozen=True)
class SpanRecord:
    """One resolved span (times in milliseconds)."""

    generation: int
    scale: int | None
    block: int | None
    component: str
    depth: int  # 0 for top-level spans
    parent: int  # index of the enclosing span in ComponentTimer.spans, -1 if none
    inclusive_ms: float
    self_ms: float
    host_ms: float  # host wall-clock time (== inclusive_ms on CPU)


class _TimedSpan:
    """The context manager returned by :meth:`ComponentTimer.span` (kept tiny: it runs in the hot loop)."""

    __slots__ = ("_timer", "_component", "_scale", "_block", "_index")

    def __init__(self, timer: "ComponentTimer", component: str, scale: int | None, block: int | None):
        self._timer = timer
        self._component = component
        self._scale = scale
        self._block = block

    def __enter__(self) -> "_TimedSpan":
        timer = self._timer
        stack = timer._stack
        scale, block = self._scale, self._block
        parent = stack[-1] if stack else -1
        if scale is None:
            if parent >= 0:
                enclosing = timer._raw[parent]
                scale = enclosing[1]
                if block is None:
                    block = enclosing[2]
            else:
                scale = timer._open_scale
        index = len(timer._raw)
        # [generation, scale, block, component, parent, depth, t0_ns, t1_ns, start_event, end_event]
        entry = [timer.generations, scale, block, self._component, parent, len(stack), 0, 0, None, None]
        timer._raw.append(entry)
        stack.append(index)
        self._index = index
        if timer._cuda:
            event = torch.cuda.Event(enable_timing=True)
            entry[8] = event
            entry[6] = _perf_ns()
            event.record(timer._stream)
        else:
            entry[6] = _perf_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        timer = self._timer
        entry = timer._raw[self._index]
        if timer._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(timer._stream)
            entry[7] = _perf_ns()
            entry[9] = event
        else:
            entry[7] = _perf_ns()
        stack = timer._stack
        # Pop this span (and anything an exception left open above it).
        while stack and stack.pop() != self._index:
            pass


class ComponentTimer(Tracer):
    """A :class:`Tracer` that times every span, aggregated per (scale, block, component).

    Use one instance for one or more ``generate()`` calls (each call is counted as a generation: a
    ``scale_begin`` with a scale index not above the previous one starts a new generation), then call
    :meth:`finalize` (implicit in every table method) and read :meth:`frame`, :meth:`per_scale`,
    :meth:`per_block`, :meth:`per_component` or :meth:`per_scale_block`. Table values are **mean milliseconds
    per generation** unless ``per_generation=False``.

    Args:
        device: the device the model runs on; CUDA events are used when it is a CUDA device (or, when not
            given, whenever CUDA is available). CUDA calls are guarded by ``torch.cuda.is_available()``. Events are
            recorded on that device's current stream (the one its kernels are queued on, also when it is not the
            current device, e.g. ``cuda:1`` from a process whose current device is ``cuda:0``), and
            :meth:`finalize` synchronises that device.
    """

    enabled = True

    def __init__(self, device: torch.device | str | None = None):
        self._cuda = cuda_timing_available(device)
        self.device_kind = "cuda-events" if self._cuda else "cpu-perf_counter"
        self._cuda_device = None
        self._stream = None
        if self._cuda:
            dev = torch.device(device) if device is not None else torch.device("cuda")
            self._cuda_device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
            self._stream = torch.cuda.current_stream(self._cuda_device)
        self.reset()

    # ----- Tracer protocol ---------------------------------------------------------------------------------
    def span(self, component: str, scale: int | None = None, block: int | None = None) -> _TimedSpan:
        return _TimedSpan(self, component, scale, block)

    def scale_begin(self, scale: int) -> None:
        if self._last_scale is None or scale <= self._last_scale:
            self.generations += 1
        self._last_scale = scale
        self._open_scale = scale
        entry = [self.generations, scale, 0, 0, None, None]
        self._scale_raw.append(entry)
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            entry[4] = event
            entry[2] = _perf_ns()
            event.record(self._stream)
        else:
            entry[2] = _perf_ns()

    def scale_end(self, scale: int) -> None:
        entry = self._scale_raw[-1] if self._scale_raw else None
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self._stream)
            t1 = _perf_ns()
        else:
            event, t1 = None, _perf_ns()
        if entry is not None and entry[1] == scale:
            entry[3] = t1
            entry[5] = event
        self._open_scale = None

    # ----- state -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._raw: list[list] = []
        self._stack: list[int] = []
        self._scale_raw: list[list] = []
        self._open_scale: int | None = None
        self._last_scale: int | None = None
        self.generations = 0
        self._resolved: list[SpanRecord] | None = None
        self._scale_resolved: list[tuple[int, int, float, float]] | None = None

    def finalize(self) -> list[SpanRecord]:
        """Resolve all recorded spans (one device synchronisation on CUDA); idempotent until new spans arrive."""
        if self._resolved is not None and len(self._resolved) == len(self._raw) \
                and self._scale_resolved is not None and len(self._scale_resolved) == len(self._scale_raw):
            return self._resolved
        if self._stack:
            raise RuntimeError(f"{len(self._stack)} span(s) still open: finalize after generate() returns")
        if self._cuda:
            torch.cuda.synchronize(self._cuda_device)
        inclusive, host = [], []
        for entry in self._raw:
            host_ms = (entry[7] - entry[6]) / 1e6
            dev_ms = entry[8].elapsed_time(entry[9]) if self._cuda else host_ms
            inclusive.append(dev_ms)
            host.append(host_ms)
        children = [0.0] * len(self._raw)
        for i, entry in enumerate(self._raw):
            if entry[4] >= 0:
                children[entry[4]] += inclusive[i]
        self._resolved = [
            SpanRecord(e[0], e[1], e[2], e[3], e[5], e[4], inclusive[i], inclusive[i] - children[i], host[i])
            for i, e in enumerate(self._raw)
        ]
        scales = []
        for gen, scale, t0, t1, ev0, ev1 in self._scale_raw:
            if not t1:
                continue
            host_ms = (t1 - t0) / 1e6
            scales.append((gen, scale, ev0.elapsed_time(ev1) if self._cuda else host_ms, host_ms))
        self._scale_resolved = scales
        return self._resolved

    @property
    def spans(self) -> list[SpanRecord]:
        return self.finalize()

    # ----- tables ------------------------------------------------------------------------------------------
    def spans_frame(self):
        """One row per span occurrence (pandas DataFrame)."""
        import pandas as pd

        columns = list(SpanRecord.__dataclass_fields__)
        return pd.DataFrame([tuple(getattr(s, c) for c in columns) for s in self.finalize()], columns=columns)

    def _divisor(self, per_generation: bool) -> int:
        return max(1, self.generations) if per_generation else 1

    def frame(self, per_generation: bool = True):
        """Aggregated per (scale, block, component): ``calls``, ``inclusive_ms``, ``self_ms``, ``host_ms``,
        ``top_level`` (whether the span is opened outside any other span).

        Scale / block are ``-1`` where absent (so they group and sort; ``vq_decode`` has scale -1)."""
        import pandas as pd

        spans = self.spans_frame()
        cols = ["scale", "block", "component", "calls", "inclusive_ms", "self_ms", "host_ms", "top_level"]
        if spans.empty:
            return pd.DataFrame(columns=cols)
        spans = spans.assign(
            scale=spans["scale"].fillna(-1).astype(int), block=spans["block"].fillna(-1).astype(int),
            top_level=spans["depth"] == 0, calls=1,
        )
        grouped = spans.groupby(["scale", "block", "component", "top_level"], as_index=False)[
            ["calls", "inclusive_ms", "self_ms", "host_ms"]].sum()
        div = self._divisor(per_generation)
        for col in ("calls", "inclusive_ms", "self_ms", "host_ms"):
            grouped[col] = grouped[col] / div
        return grouped[cols].sort_values(["scale", "block", "component"]).reset_index(drop=True)

    def per_component(self, per_generation: bool = True):
        """Per component: ``self_ms``, ``inclusive_ms``, ``calls`` and ``share`` (of the summed self time)."""
        frame = self.frame(per_generation)
        table = frame.groupby("component")[["calls", "self_ms", "inclusive_ms"]].sum()
        total = table["self_ms"].sum()
        table["share"] = table["self_ms"] / total if total > 0 else 0.0
        return table.sort_values("self_ms", ascending=False)

    def per_scale(self, value: str = "self_ms", per_generation: bool = True):
        """Scale × component pivot of ``value`` (``self_ms`` by default, so rows add up to the spans' total),
        plus ``total`` (sum of the row) and ``scale_ms`` (the scale_begin..scale_end window)."""
        frame = self.frame(per_generation)
        table = frame.pivot_table(index="scale", columns="component", values=value, aggfunc="sum", fill_value=0.0)
        table["total"] = table.sum(axis=1)
        windows = self.scale_windows(per_generation)
        table["scale_ms"] = windows.reindex(table.index).fillna(0.0)
        return table

    def per_block(self, value: str = "self_ms", per_generation: bool = True):
        """Block (layer) × component pivot summed over scales; spans outside blocks are left out."""
        frame = self.frame(per_generation)
        frame = frame[frame["block"] >= 0]
        return frame.pivot_table(index="block", columns="component", values=value, aggfunc="sum", fill_value=0.0)

    def per_scale_block(self, components: tuple[str, ...] | None = None, value: str = "self_ms",
                        per_generation: bool = True):
        """Block × scale matrix (heat-map data) of ``value`` summed over ``components`` (default: all)."""
        frame = self.frame(per_generation)
        frame = frame[frame["block"] >= 0]
        if components is not None:
            frame = frame[frame["component"].isin(components)]
        return frame.pivot_table(index="block", columns="scale", values=value, aggfunc="sum", fill_value=0.0)

    def scale_windows(self, per_generation: bool = True):
        """``scale_begin``..``scale_end`` time per scale (device time on CUDA), a pandas Series."""
        import pandas as pd

        self.finalize()
        rows = pd.DataFrame(self._scale_resolved or [], columns=["generation", "scale", "scale_ms", "host_ms"])
        series = rows.groupby("scale")["scale_ms"].sum() if not rows.empty else pd.Series(dtype=float)
        return series / self._divisor(per_generation)

    def total_ms(self, per_generation: bool = True) -> float:
        """Sum of the top-level spans (equal to the sum of all self times)."""
        spans = self.finalize()
        return sum(s.inclusive_ms for s in spans if s.depth == 0) / self._divisor(per_generation)

    def coverage(self) -> float:
        """Σ top-level spans inside scale windows / Σ scale windows (how much of each scale the spans explain)."""
        spans = self.finalize()
        inside = sum(s.inclusive_ms for s in spans if s.depth == 0 and s.scale is not None)
        windows = sum(w[2] for w in (self._scale_resolved or []))
        return inside / windows if windows > 0 else float("nan")

    def summary(self) -> dict:
        """A JSON-friendly summary (what was timed, how, totals)."""
        return {
            "timer": self.device_kind,
            "generations": self.generations,
            "spans": len(self._raw),
            "total_ms_per_generation": self.total_ms(),
            "coverage_of_scale_windows": self.coverage(),
            "per_component_ms": self.per_component()["self_ms"].round(4).to_dict(),
            "timed_region": "each span: from entering to leaving its with-block; self = inclusive - nested spans",
        }
