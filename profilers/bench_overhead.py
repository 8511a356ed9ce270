"""Overhead of the profilers on a full generation: ``python -m profilers.bench_overhead --model random:var-d16``.

Modes (each one ``generate()`` call with the same labels, seeds and sampling settings):

* ``null``      — the engine's ``NULL_TRACER`` (the baseline);
* ``timer``     — :class:`~profilers.timers.ComponentTimer`;
* ``rf``        — :class:`~profilers.torch_profiler.RecordFunctionTracer` with no profiler running;
* ``profiler``  — ``RecordFunctionTracer`` inside an active ``torch.profiler.profile`` (CPU activity, plus CUDA on
  a GPU; no shapes, FLOPs, memory or stacks).

Timed region: the ``generate()`` call only (on CUDA bracketed by a synchronisation of the run's device). Outside it:
building the tracer, starting/stopping the profiler and resolving its events, ``ComponentTimer.finalize()``.
One warm-up generation per mode is discarded; then ``--repeats`` rounds, each running every mode once in a
shuffled order (seeded; interleaving spreads slow drifts of a shared machine over all modes, shuffling avoids
a fixed predecessor: a rotation would always run ``null`` right after ``profiler`` and charge it the profiler's
teardown), with ``gc.collect()`` before every timed region; the report gives the
median and the spread (min–max) per mode, the ratio of medians to ``null`` and the ratio of minima (noise on a
shared machine only adds time, so minima are the less noisy estimator). The process CPU time
(``time.process_time``) of the same region is recorded too: time spent descheduled by other jobs does not count
in it, so its ratio is the more stable end-to-end figure on a contended CPU.

Because end-to-end differences of a fraction of a percent drown in the noise of a shared CPU, the script also
measures the **per-span cost** of each tracer in a tight loop (empty spans) and multiplies it by the number of
spans one generation opens: ``predicted overhead = spans × cost per span / null median``, a noise-free
estimate of the same quantity.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

from var_core.engine import NULL_TRACER, GenerationOptions, SamplingConfig, generate
from var_core.zoo import load_model

from .device_sync import synchronize
from .timers import ComponentTimer
from .torch_profiler import RecordFunctionTracer

MODES = ("null", "timer", "rf", "profiler")


def _sync(device: torch.device | str | None) -> None:
    synchronize(device)  # the run's device, not the current CUDA device


def _activities():
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    return acts


def run_once(mode: str, adapter, labels, seeds, sampling, options) -> tuple[float, float, int]:
    """One generation in ``mode``; returns (wall ms, process CPU ms, spans opened) of the timed region."""
    spans = 0
    if mode == "null":
        tracer = NULL_TRACER
    elif mode == "timer":
        tracer = ComponentTimer(device=adapter.device)
    elif mode in ("rf", "profiler"):
        tracer = RecordFunctionTracer()
    else:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    profiler = None
    if mode == "profiler":
        from torch.profiler import profile

        profiler = profile(activities=_activities())
        profiler.__enter__()
    gc.collect()  # outside the timed region: no mode pays for the garbage of the one before it
    try:
        _sync(adapter.device)
        t0, c0 = time.perf_counter_ns(), time.process_time_ns()
        generate(adapter, labels, seeds=seeds, sampling=sampling, tracer=tracer, options=options)
        _sync(adapter.device)
        wall, cpu = (time.perf_counter_ns() - t0) / 1e6, (time.process_time_ns() - c0) / 1e6
    finally:
        if profiler is not None:
            profiler.__exit__(None, None, None)
    if mode == "timer":
        spans = len(tracer.finalize())
    return wall, cpu, spans


def span_cost_ns(mode: str, n: int = 20000) -> float:
    """Nanoseconds per empty span (enter + exit) for a tracer, measured in a tight loop."""
    if mode == "null":
        tracer = NULL_TRACER
    elif mode == "timer":
        tracer = ComponentTimer()
    else:
        tracer = RecordFunctionTracer()
    profiler = None
    if mode == "profiler":
        from torch.profiler import profile

        profiler = profile(activities=_activities())
        profiler.__enter__()
    try:
        tracer.scale_begin(0)
        t0 = time.perf_counter_ns()
        for i in range(n):
            with tracer.span("attn", 0, i & 15):
                pass
        elapsed = time.perf_counter_ns() - t0
        tracer.scale_end(0)
    finally:
        if profiler is not None:
            profiler.__exit__(None, None, None)
    return elapsed / n


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:var-d16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--cfg", type=float, default=1.5)
    parser.add_argument("--top-k", type=int, default=900)
    parser.add_argument("--top-p", type=float, default=0.96)
    parser.add_argument("--no-decode", action="store_true", help="leave VQ decoding out of the generation")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "null" not in modes:
        modes.insert(0, "null")

    adapter = load_model(args.model, device=args.device)
    labels = [i % adapter.cfg.num_classes for i in range(args.batch)]
    seeds = list(range(args.batch))
    sampling = SamplingConfig(cfg=args.cfg, top_k=args.top_k, top_p=args.top_p)
    options = GenerationOptions(check_finite=False, decode=not args.no_decode)

    times: dict[str, dict[str, list[float]]] = {m: {"wall": [], "cpu": []} for m in modes}
    spans_per_generation = 0
    rng = random.Random(0)
    for mode in modes:  # warm-up, discarded
        _, _, spans = run_once(mode, adapter, labels, seeds, sampling, options)
        spans_per_generation = max(spans_per_generation, spans)
    for r in range(args.repeats):
        order = list(modes)
        rng.shuffle(order)
        for mode in order:
            wall, cpu, spans = run_once(mode, adapter, labels, seeds, sampling, options)
            times[mode]["wall"].append(wall)
            times[mode]["cpu"].append(cpu)
            spans_per_generation = max(spans_per_generation, spans)
            print(f"  round {r + 1}/{args.repeats} {mode:9s} wall {wall:10.1f} ms  cpu {cpu:10.1f} ms", flush=True)

    costs = {m: span_cost_ns(m) for m in modes}
    results = {
        "command": "python -m profilers.bench_overhead " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": args.model, "batch": args.batch, "cfg": args.cfg, "decode": not args.no_decode,
        "device": str(adapter.device), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "machine": platform.machine(), "processor": platform.processor(),
        "repeats": args.repeats, "warmup_per_mode": 1, "spans_per_generation": spans_per_generation,
        "timed_region": "generate() only (CUDA: synchronize before and after); profiler start/stop excluded; "
                        "wall = perf_counter, cpu = process_time (all threads of this process)",
        "modes": {},
    }
    print(f"\nmodel {args.model}, batch {args.batch}, cfg {args.cfg}, decode {not args.no_decode}, "
          f"device {adapter.device}, torch threads {torch.get_num_threads()}, "
          f"{spans_per_generation} spans per generation")
    header = (f"{'mode':9s} {'wall med ms':>12s} {'wall min':>10s} {'wall max':>10s} {'ratio':>7s} {'min ratio':>9s} "
              f"{'cpu med ms':>11s} {'cpu ratio':>9s} {'ns/span':>8s} {'predicted':>9s}")
    print(header)
    base = {k: statistics.median(times["null"][k]) for k in ("wall", "cpu")}
    base_min = min(times["null"]["wall"])
    for mode in modes:
        wall, cpu = times[mode]["wall"], times[mode]["cpu"]
        med, cpu_med = statistics.median(wall), statistics.median(cpu)
        predicted = spans_per_generation * (costs[mode] - costs["null"]) / 1e6 / base["wall"] if mode != "null" else 0.0
        results["modes"][mode] = {
            "wall_median_ms": med, "wall_min_ms": min(wall), "wall_max_ms": max(wall), "wall_ms": wall,
            "cpu_median_ms": cpu_med, "cpu_ms": cpu,
            "wall_ratio_of_medians": med / base["wall"], "wall_ratio_of_mins": min(wall) / base_min,
            "cpu_ratio_of_medians": cpu_med / base["cpu"],
            "ns_per_span": costs[mode], "predicted_overhead": predicted,
        }
        print(f"{mode:9s} {med:12.1f} {min(wall):10.1f} {max(wall):10.1f} {med / base['wall']:7.4f} "
              f"{min(wall) / base_min:9.4f} {cpu_med:11.1f} {cpu_med / base['cpu']:9.4f} {costs[mode]:8.0f} "
              f"{100 * predicted:8.3f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
