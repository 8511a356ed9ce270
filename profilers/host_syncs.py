"""Host synchronisations per generation: the device→host transfers that stall a GPU, counted on any machine.

On CUDA, every operation that needs a tensor's VALUE on the host (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, ``bool/int/float(tensor)``, using a tensor as a Python index) waits for the stream to drain; so do
operations whose output SIZE depends on values (``nonzero``, ``torch.where(cond)``, boolean-mask indexing and
assignment, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``), and a blocking
host→device copy (``torch.tensor(host data, device=…)``, ``host_tensor.to(device)``). At batch 1 each is a GPU
stall between two tiny kernels (issue 27).

:class:`HostSyncCounter` is a ``TorchFunctionMode`` that counts these operations, by kind and by call site, on a
CPU run too: there no real transfer happens, so it counts the operations that WOULD synchronise if the tensors
lived on a GPU. To tell device tensors from host ones on a CPU-only run it tracks tensors the code itself put on
the host: results of ``.cpu()`` / ``.numpy()``, tensors created by a factory without a ``device=`` argument
(``torch.zeros(B)``), and everything computed only from such tensors. Reading those is free on a GPU too and is
not counted; every other tensor (model weights, activations, anything made with ``device=``) counts as on the
device. Limits: ``x.to("cpu")`` on a device tensor cannot be told from ``x.to(device)`` when the device IS the CPU
and is counted as a no-op (grep the hot path for it); a Python-level torch function is counted once, not by what
it calls inside.

Benchmark (docs/benchmarks.md)::

    python -m profilers.host_syncs --model testbed --batch 1 8            # every preset
    python -m profilers.host_syncs --presets nova --batch 1 --sites 10    # the 10 busiest call sites
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

_HOST_MARK = "_host_syncs_on_host"
_TB = torch.Tensor

# device→host: the value is read on the host
_READ_KINDS = {
    _TB.item: "item", _TB.tolist: "tolist", _TB.cpu: "cpu", _TB.numpy: "numpy", _TB.__bool__: "bool",
    _TB.__int__: "int", _TB.__float__: "float", _TB.__index__: "index", _TB.__complex__: "complex",
    torch.equal: "equal", torch.allclose: "allclose", _TB.equal: "equal", _TB.allclose: "allclose",
}
# output size depends on the values
_SIZE_KINDS = {
    torch.nonzero: "nonzero", _TB.nonzero: "nonzero", torch.argwhere: "nonzero", _TB.argwhere: "nonzero",
    torch.masked_select: "masked_select", _TB.masked_select: "masked_select", torch.unique: "unique",
    _TB.unique: "unique", torch.unique_consecutive: "unique", _TB.unique_consecutive: "unique",
    torch.nonzero_static: None,  # static size: no sync
}
_FACTORIES_FROM_DATA = {torch.tensor, torch.as_tensor}
_DATA_KINDS = {torch.tensor: "tensor(host data)", torch.as_tensor: "as_tensor(host data)"}
_SKIP_FILES = (str(Path(__file__).resolve()), str(Path(torch.__file__).resolve().parent))


def _tensors(obj, out: list) -> list:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    return out


def _on_host(t: torch.Tensor) -> bool:
    return getattr(t, _HOST_MARK, False)


def _mark_host(obj) -> None:
    for t in _tensors(obj, []):
        try:
            setattr(t, _HOST_MARK, True)
        except (AttributeError, RuntimeError):  # e.g. a tensor subclass without __dict__
            pass


def _is_bool_index(index) -> bool:
    return any(t.dtype == torch.bool and t.dim() > 0 for t in _tensors(index, []))


def _device_arg(args, kwargs):
    """The target device of ``.to(...)`` (a device, a string, or a tensor's device), else None."""
    for value in list(args[1:]) + [kwargs.get("device")]:
        if isinstance(value, (torch.device, str)):
            return torch.device(value)
        if isinstance(value, torch.Tensor):
            return value.device
    return None


@dataclass
class SyncEvent:
    kind: str
    site: str  # "path:line in function" of the first frame outside torch and this module
    scale: int | None


@dataclass
class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as counter: ...`` counts would-be host synchronisations (module docstring).

    ``counter.scale`` (set by :class:`ScaleTracer`) labels each event with the scale in progress."""

    events: list[SyncEvent] = field(default_factory=list)
    scale: int | None = None
    root: Path = Path(__file__).resolve().parents[1]

    def __post_init__(self):
        super().__init__()

    def _site(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FILES):
            frame = frame.f_back
        if frame is None:
            return "?"
        path = Path(frame.f_code.co_filename)
        try:
            path = path.resolve().relative_to(self.root)
        except ValueError:
            pass
        return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"

    def _count(self, kind: str) -> None:
        self.events.append(SyncEvent(kind, self._site(), self.scale))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, []) + _tensors(kwargs, [])
        device_inputs = [t for t in inputs if not _on_host(t)]
        kind = _READ_KINDS.get(func) or _SIZE_KINDS.get(func)
        if kind and device_inputs:
            self._count(kind)
        elif func is torch.where and len(args) + len(kwargs) == 1 and device_inputs:
            self._count("nonzero")
        elif func is torch.repeat_interleave or func is _TB.repeat_interleave:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and not _on_host(repeats) and kwargs.get("output_size") is None:
                self._count("repeat_interleave")
        elif func in (_TB.__getitem__, _TB.__setitem__, _TB.index_put_, _TB.index_put, torch.index_put) and \
                len(args) > 1 and not _on_host(args[0]) and _is_bool_index(args[1]):
            self._count("bool_mask_" + ("get" if func is _TB.__getitem__ else "set"))
        elif func in _FACTORIES_FROM_DATA and kwargs.get("device") is not None and not (
                args and isinstance(args[0], torch.Tensor)):
            self._count(_DATA_KINDS[func])
        elif func is _TB.to and args and _on_host(args[0]):
            target = _device_arg(args, kwargs)
            if target is not None:
                self._count("to(device)")
        out = func(*args, **kwargs)
        moved = (func is _TB.cpu and device_inputs) or (func is _TB.to and inputs and _on_host(args[0])
                                                        and _device_arg(args, kwargs) is not None)
        if moved and isinstance(out, torch.Tensor) and out is args[0]:
            out = out.view_as(out)  # on the CPU the "copy" is the tensor itself: mark a fresh alias, not it
        if func in (_TB.cpu, _TB.numpy):
            _mark_host(out)
        elif func is _TB.to:
            if inputs and _on_host(args[0]) and _device_arg(args, kwargs) is None:
                _mark_host(out)  # a dtype change on the host stays on the host
        elif not inputs:  # a factory: on the host unless given a device
            if kwargs.get("device") is None:
                _mark_host(out)
        elif not device_inputs:
            if kwargs.get("device") is None:
                _mark_host(out)
        return out

    # ---------------------------------------------------------------------------------------- summaries
    @property
    def total(self) -> int:
        return len(self.events)

    def by_kind(self) -> Counter:
        return Counter(e.kind for e in self.events)

    def by_site(self) -> Counter:
        return Counter(f"{e.site} [{e.kind}]" for e in self.events)

    def by_scale(self) -> Counter:
        return Counter(e.scale for e in self.events)


class ScaleTracer:
    """A tracer (``var_core.engine.tracing.Tracer`` slots) telling the counter which scale is in progress. Work
    between two scales (the policy planning the next one) counts to the next scale; before the first, to
    ``None`` (setup)."""

    def __init__(self, counter: HostSyncCounter):
        from contextlib import nullcontext

        self.counter = counter
        self._null = nullcontext

    def span(self, component, scale=None, block=None):
        return self._null()

    def scale_begin(self, scale: int) -> None:
        self.counter.scale = scale

    def scale_end(self, scale: int) -> None:
        self.counter.scale = scale + 1


@dataclass(frozen=True)
class SyncCount:
    preset: str
    batch_size: int
    num_scales: int
    counter: HostSyncCounter

    @property
    def total(self) -> int:
        return self.counter.total

    @property
    def per_scale(self) -> float:
        return self.total / self.num_scales

    @property
    def max_per_scale(self) -> int:
        scales = self.counter.by_scale()
        return max((n for s, n in scales.items() if s is not None), default=0)


def count_generation(adapter, preset: str | None = "baseline", batch_size: int = 1, check_finite: bool = False,
                     decode: bool = False, seed: int = 1000, policy=None) -> SyncCount:
    """Host syncs of one ``generate()`` of ``batch_size`` samples (classes ``0..B-1``, seeds ``seed..``) with the
    named preset (or ``policy``), under ``torch.inference_mode()`` as timed runs use it. ``check_finite`` off by
    default: timing runs turn it off (it is one sync per scale by design)."""
    from var_core.accel.policy import build_policy
    from var_core.accel.presets import get_preset
    from var_core.engine.loop import GenerationOptions, generate
    from var_core.engine.sampling import SamplingConfig

    from var_core.eval.twomodel import attach_model_switch  # a two-model preset runs with its refiner (CoDe)

    if policy is None:
        policy = (attach_model_switch(build_policy(get_preset(preset)), adapter) if preset and preset != "baseline"
                  else None)
    labels = torch.arange(batch_size) % adapter.cfg.num_classes
    seeds = list(range(seed, seed + batch_size))
    options = GenerationOptions(check_finite=check_finite, decode=decode)
    counter = HostSyncCounter()
    with torch.inference_mode():
        labels = labels.to(adapter.device)
        with counter:
            generate(adapter, labels, seeds, SamplingConfig(), policy=policy, tracer=ScaleTracer(counter),
                     options=options)
    return SyncCount(preset or "baseline", batch_size, adapter.num_scales, counter)


def main(argv: list[str] | None = None) -> int:
    from var_core.accel.presets import PRESETS, _unknown_preset
    from var_core.errors import UserError  # noqa: F401  (kept for the CLI's error convention)
    from var_core.zoo import load_model

    parser = argparse.ArgumentParser(prog="python -m profilers.host_syncs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="testbed", help="zoo entry of a class-conditional VAR (default testbed)")
    parser.add_argument("--weights", default=None, help="weight file or folder (default: the zoo entry's)")
    parser.add_argument("--presets", nargs="+", default=None, help="presets (default: every preset)")
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 8], help="batch sizes (default 1 8)")
    parser.add_argument("--check-finite", action="store_true", help="keep the loop's per-scale finite check on")
    parser.add_argument("--sites", type=int, default=0, help="also print the N busiest call sites per row")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.presets or sorted(PRESETS)
    for name in names:
        if name not in PRESETS:
            print(f"error: {_unknown_preset(name)}", file=sys.stderr)
            return 2
    if any(b < 1 for b in args.batch):
        print("error: --batch sizes must be at least 1", file=sys.stderr)
        return 2
    adapter = load_model(args.model, weights=args.weights)
    print(f"# host syncs per generation: model={args.model} scales={adapter.num_scales} "
          f"check_finite={args.check_finite} torch={torch.__version__} (would-be syncs counted on "
          f"{adapter.device}; profilers.host_syncs)")
    print(f"{'preset':18s} {'batch':>5s} {'total':>6s} {'/scale':>7s} {'max/scale':>9s}  by kind")
    for name in names:
        for B in args.batch:
            try:
                result = count_generation(adapter, name, B, check_finite=args.check_finite)
            except ValueError as exc:  # a preset that cannot run on this model
                print(f"{name:18s} {B:5d}  unavailable: {exc}")
                continue
            kinds = " ".join(f"{k}={n}" for k, n in sorted(result.counter.by_kind().items()))
            print(f"{name:18s} {B:5d} {result.total:6d} {result.per_scale:7.1f} {result.max_per_scale:9d}  {kinds}")
            for site, n in result.counter.by_site().most_common(args.sites):
                print(f"    {n:5d}  {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
