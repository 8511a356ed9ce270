"""Was an arm's timing taken on a quiet machine? Load average and process CPU time around its timed region.

The main runs time the arms one after the other, so a change in what else runs on the machine between (or during)
arms biases their sequential speedups: on a shared CPU an arm bit-identical to the baseline has shown sequential
"speedups" of 1.97 and 2.99 (issue 25). :class:`LoadProbe` reads, around every timed batch of a
:func:`var_core.eval.lightning.run_generation`, the 1-minute load average (``os.getloadavg``), this process's CPU time
(``time.process_time``: all its threads) and the wall clock; :func:`load_summary` reduces them to one entry per arm
(``record["timing"]["load"]``) with a ``flag`` when the timing is not trustworthy, by :data:`RULE`:

1. **the load moved**: the 1-minute load at the end of the arm's timed region (``L1``) left the band this process
   alone can explain by more than :data:`LOAD_TOLERANCE` (0.5). The kernel's 1-minute load moves towards the number
   of runnable threads with a 60 s time constant; with ``L0`` at the start, ``t`` seconds from the first reading to
   the last and this process keeping ``c`` threads busy (its CPU seconds / wall seconds), ``L1`` stays at ``L0``
   when the load already counted this process and rises to ``L0 + c·(1 − e^(−t/60))`` when it did not (a study
   starting on an idle machine); outside ``[L0 − 0.5, L0 + c·(1 − e^(−t/60)) + 0.5]`` other jobs started or
   stopped;
2. **the machine was busy** (CPU devices): the load of the others at the start, ``L0 − c``, exceeds the cores left
   to them (``cores − threads``) by more than 0.5: other jobs competed for this process's cores;
3. **the process did not get its cores** (CPU devices; on a GPU the host thread waits for the device): CPU seconds
   / wall seconds below :data:`MIN_CPU_SHARE` (0.85: it waited for a core more than 15 % of the time), or above
   ``threads + 0.5`` (it ran more threads than its setting, so its timing is not that of the setting).

A flagged arm's sequential timing (ms/image and sequential speedup, also the baseline's: every arm's speedup uses
it) is marked ``†`` in the table; the interleaved re-timing (the headline when the study has one) pairs arms within
rounds and is not affected the same way. The readers are module functions so tests can inject readings.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

__all__ = ["LoadProbe", "load_summary", "timing_flag", "RULE", "LOAD_TOLERANCE", "MIN_CPU_SHARE", "LOAD_TAU_S",
           "read_load", "read_cpu", "read_wall", "read_cores"]

LOAD_TOLERANCE = 0.5  # 1-min load units
MIN_CPU_SHARE = 0.85  # CPU seconds per wall second of the timed region, below which the process waited for a core
EXTRA_THREADS = 0.5  # CPU/wall above threads + this: more threads ran than the setting
LOAD_TAU_S = 60.0  # the 1-minute load average's time constant
RULE = (f"timing flagged (†) when the 1-min load at the end of the arm's timed region L1 leaves "
        f"[L0 − {LOAD_TOLERANCE}, L0 + c·(1 − e^(−t/60)) + {LOAD_TOLERANCE}] (L0 at its start, t seconds, "
        f"c = CPU s / wall s: the load moved), or, on a CPU, when the others' load L0 − c exceeds "
        f"cores − threads + {LOAD_TOLERANCE} (busy machine), or CPU s / wall s < {MIN_CPU_SHARE} (it waited for a "
        f"core) or > threads + {EXTRA_THREADS}")


def read_load() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return None


def read_cpu() -> float:
    """CPU seconds of this process, all threads (user + system)."""
    return time.process_time()


def read_wall() -> float:
    return time.perf_counter()


def read_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class LoadProbe:
    """A :func:`~var_core.eval.lightning.run_generation` probe: readings just before and just after every timed
    batch (``tracer()`` is called right before the batch's clock starts, ``after_batch`` right after it stops; put
    this probe first so no other probe's work falls inside its readings)."""

    name = "load"

    def __init__(self):
        self._start: tuple[float | None, float, float] | None = None

    def tracer(self):
        self._start = (read_load(), read_cpu(), read_wall())
        return None  # no tracer: only readings

    def after_batch(self, result, *, adapter, policy, batch_size: int, seconds: float) -> dict[str, Any] | None:
        if self._start is None:
            return None
        load0, cpu0, wall0 = self._start
        self._start = None
        load1, cpu1, wall1 = read_load(), read_cpu(), read_wall()
        return {"load_before": load0, "load_after": load1, "cpu_seconds": cpu1 - cpu0, "wall_seconds": wall1 - wall0,
                "wall_start": wall0, "wall_end": wall1}


def timing_flag(load_before: float | None, load_after: float | None, cpu_seconds: float | None,
                wall_seconds: float | None, threads: int | None, device_type: str = "cpu", *,
                span_seconds: float | None = None, cores: int | None = None) -> list[str]:
    """The reasons (by :data:`RULE`) why a timing with these readings is not trustworthy; empty when it is.
    ``wall_seconds``: of the timed region (CPU/wall); ``span_seconds``: from the first load reading to the last
    (default ``wall_seconds``); ``cores``: the CPU cores of the machine (None: the busy-machine test is skipped)."""
    reasons = []
    cpu = device_type == "cpu"
    share = cpu_seconds / wall_seconds if cpu_seconds is not None and wall_seconds else None
    own = share if share is not None and cpu else 0.0
    span = wall_seconds if span_seconds is None else span_seconds
    if load_before is not None and load_after is not None and span:
        ramp = own * (1 - math.exp(-span / LOAD_TAU_S))
        low, high = load_before - LOAD_TOLERANCE, load_before + ramp + LOAD_TOLERANCE
        if not low <= load_after <= high:
            reasons.append(f"the 1-min load moved: {load_before:.2f} -> {load_after:.2f} over {span:.1f} s "
                           f"(this process alone: {load_before:.2f} to {load_before + ramp:.2f})")
    if cpu and load_before is not None and cores and threads:
        others = load_before - own
        if others > cores - threads + LOAD_TOLERANCE:
            reasons.append(f"busy machine: the others' load {others:.2f} > {cores} cores - {threads} threads")
    if share is not None and cpu:
        if share < MIN_CPU_SHARE:
            reasons.append(f"CPU/wall {share:.2f} < {MIN_CPU_SHARE}: the process waited for a core")
        elif threads and share > threads + EXTRA_THREADS:
            reasons.append(f"CPU/wall {share:.2f} > {threads} threads + {EXTRA_THREADS}: more threads ran than set")
    return reasons


def load_summary(batches: list[dict], threads: int | None, device_type: str = "cpu") -> dict | None:
    """One arm's readings (its batches' ``probes["load"]``; rank 0's only: clocks of other processes do not compare)
    reduced to: the load before its first and after its last timed batch, the seconds between them, CPU and wall
    seconds summed over the timed batches and their ratio, the threads, and ``flag`` (the reasons of
    :func:`timing_flag`; an empty list when the timing is trustworthy)."""
    readings = [b.get("probes", {}).get("load") for b in batches if b.get("rank", 0) == 0]
    readings = [r for r in readings if r]
    if not readings:
        return None
    cpu = sum(r["cpu_seconds"] for r in readings)
    wall = sum(r["wall_seconds"] for r in readings)
    before, after = readings[0]["load_before"], readings[-1]["load_after"]
    span = readings[-1]["wall_end"] - readings[0]["wall_start"]  # the load decays over the whole span
    cores = read_cores()
    flag = timing_flag(before, after, cpu, wall, threads, device_type, span_seconds=span, cores=cores)
    return {"load_1min_before": before, "load_1min_after": after, "span_seconds": span, "cpu_seconds": cpu,
            "wall_seconds": wall, "cpu_per_wall": cpu / wall if wall else None, "threads": threads, "cores": cores,
            "device_type": device_type, "flag": flag, "rule": RULE}


# ----- what the table shows --------------------------------------------------------------------------------
FLAG_MARK = "†"
IDENTICAL_MARK = "(= baseline)"


def timing_flagged(record: dict) -> bool:
    """Whether a record's sequential timing was flagged (``timing.load.flag`` non-empty)."""
    load = (record.get("timing") or {}).get("load") or {}
    return bool(load.get("flag"))


def sequential_marks(records: list[dict]) -> dict[str, dict[str, bool]]:
    """Per arm: ``ms`` (its own sequential timing flagged) and ``speedup`` (its or the baseline's flagged: the
    sequential speedup divides the two; the baseline's own speedup is 1 by definition and never marked)."""
    base = next((r for r in records if r.get("role") == "baseline"), None)
    base_flag = timing_flagged(base) if base is not None else False
    return {r["arm"]: {"ms": timing_flagged(r),
                       "speedup": r.get("role") != "baseline" and (timing_flagged(r) or base_flag)}
            for r in records}


def is_identical(record: dict) -> bool | None:
    """True when every token and image of every sample equals the baseline's (``identical_to_baseline``,
    computed from the stored samples by the runner); None when the record does not say."""
    ident = record.get("identical_to_baseline")
    return None if not isinstance(ident, dict) else bool(ident.get("identical"))


def table_footnotes(records: list[dict]) -> list[str]:
    """The lines under the table that explain its ``†`` and ``(= baseline)`` marks (none when nothing is marked)."""
    out = []
    flagged = [r for r in records if timing_flagged(r)]
    if flagged:
        why = "; ".join(f"`{r['arm']}`: {', '.join(r['timing']['load']['flag'])}" for r in flagged)
        out.append(f"{FLAG_MARK} sequential timing not trustworthy: {RULE}. Flagged here: {why}. The sequential "
                   f"speedup of every arm uses the baseline's timing too. Prefer the interleaved re-timing "
                   f"(--timing-rounds), or re-run on a quiet machine.\n")
    same = [r["arm"] for r in records if r.get("role") != "baseline" and is_identical(r)]
    if same:
        out.append(f"{IDENTICAL_MARK}: every token and image of every sample equals the baseline's (compared from "
                   f"the stored samples): {', '.join(f'`{a}`' for a in same)} changed nothing on this model and "
                   f"these samples, so any speedup it shows is timing noise.\n")
    return out
