"""Numeric precision of a generation, as the official samplers run it (``--precision``).

The official samplers keep fp32 parameters and run under autocast: VAR ``torch.autocast("cuda", dtype=float16)``
with TF32 matmuls enabled (its demo), Infinity ``torch.autocast("cuda", dtype=bfloat16)``, HART
``torch.autocast("cuda", dtype=float16)``. The modes:

* ``fp32`` — fp32 parameters, full-precision fp32 matmuls (``torch.set_float32_matmul_precision("highest")``);
* ``tf32`` — fp32 parameters, TF32 matmuls (``"high"``; on a CPU the setting changes nothing);
* ``bf16-autocast`` / ``fp16-autocast`` — fp32 parameters, ``torch.autocast(device, dtype)`` around generation;
  ``+tf32`` (``fp16-autocast+tf32``) also enables TF32 for the matmuls autocast leaves in fp32;
* ``bf16`` — every parameter and buffer cast to bfloat16, no autocast (the former ``--dtype bfloat16``).

Logits leave the heads as fp32 (``.float()`` in every model's ``logits``), so guidance, softmax, the top-k / top-p
filter, the draw and the entropy maps (:mod:`var_core.accel.entropy`) stay fp32 under autocast, as they are in fp32.

The precision travels with the model (``adapter.precision``, set by whoever loads it) and :func:`under_precision`
makes :func:`var_core.engine.loop.generate` enter it, so every caller (Lightning runs, benchmarks, latency
reports, re-timings) runs and records the same mode. :func:`precision_record` is what ran, read inside the scope.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator

import torch

#: The ``--precision`` modes (an autocast mode may carry ``+tf32``).
PRECISIONS = ("fp32", "tf32", "bf16-autocast", "fp16-autocast", "bf16")

#: The official sampler's mode per model family on a GPU (on a CPU every family defaults to fp32).
OFFICIAL_GPU_PRECISION = {"var": "fp16-autocast+tf32", "infinity": "bf16-autocast", "hart": "fp16-autocast"}


@dataclass(frozen=True)
class Precision:
    """A parsed ``--precision``: parameter dtype, autocast dtype (or None) and whether TF32 matmuls are on."""

    name: str
    params: torch.dtype
    autocast: torch.dtype | None
    tf32: bool

    @property
    def matmul_precision(self) -> str:
        """``torch.set_float32_matmul_precision``'s value for this mode."""
        return "high" if self.tf32 else "highest"

    @property
    def param_dtype(self) -> str:
        return str(self.params).removeprefix("torch.")


def parse_precision(text: str) -> Precision:
    """``fp32``, ``tf32``, ``bf16-autocast``, ``fp16-autocast`` (each autocast one optionally ``+tf32``) or ``bf16``;
    a ValueError names the modes otherwise."""
    name = str(text).strip().lower()
    base, _, extra = name.partition("+")
    if base not in PRECISIONS or extra not in ("", "tf32") or (extra and not base.endswith("-autocast")):
        raise ValueError(f"unknown precision {text!r}: use one of {', '.join(PRECISIONS)} (an autocast mode may "
                         f"add +tf32, e.g. fp16-autocast+tf32)")
    if base == "bf16":
        return Precision(name, torch.bfloat16, None, False)
    autocast = {"bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}.get(base)
    return Precision(name, torch.float32, autocast, base == "tf32" or extra == "tf32")


def default_precision(family: str | None, device: torch.device | str) -> str:
    """The official sampler's mode of ``family`` on a GPU (:data:`OFFICIAL_GPU_PRECISION`), fp32 on a CPU."""
    if torch.device(device).type != "cuda":
        return "fp32"
    return OFFICIAL_GPU_PRECISION.get(str(family or "var"), "fp32")


def precision_from_dtype(dtype: str | None) -> str | None:
    """The ``--precision`` that the former ``--dtype`` value meant (float32 → fp32, bfloat16 → bf16); None for
    ``None``; float16 parameters have no mode (use fp16-autocast)."""
    if dtype is None:
        return None
    table = {"float32": "fp32", "bfloat16": "bf16"}
    if dtype not in table:
        raise ValueError(f"--dtype {dtype}: casting every parameter to float16 is not a supported precision; use "
                         f"--precision fp16-autocast (fp32 parameters under fp16 autocast, as VAR and HART run)")
    return table[dtype]


@contextlib.contextmanager
def precision_scope(precision: str | Precision | None, device: torch.device | str) -> Iterator[Precision | None]:
    """Run the body in ``precision`` on ``device``: the float32 matmul precision (restored after) and, for an
    autocast mode, ``torch.autocast(device.type, dtype)``. ``None``: leave everything as it is."""
    if precision is None:
        yield None
        return
    spec = precision if isinstance(precision, Precision) else parse_precision(precision)
    device_type = torch.device(device).type
    previous = torch.get_float32_matmul_precision()
    previous_cudnn = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision(spec.matmul_precision)
    torch.backends.cudnn.allow_tf32 = spec.tf32
    try:
        if spec.autocast is not None:
            with torch.autocast(device_type, dtype=spec.autocast):
                yield spec
        else:
            yield spec
    finally:
        torch.set_float32_matmul_precision(previous)
        torch.backends.cudnn.allow_tf32 = previous_cudnn


def precision_record(precision: str | Precision | None = None, device: torch.device | str = "cpu") -> dict:
    """What a record states about precision, read from torch's state where this is called (inside the scope it
    is what ran): the mode, ``torch.get_float32_matmul_precision()``, the autocast dtype on ``device`` (None when
    autocast is off) and the parameter dtype of the mode."""
    device_type = torch.device(device).type
    spec = None if precision is None else (precision if isinstance(precision, Precision)
                                           else parse_precision(precision))
    autocast = None
    if torch.is_autocast_enabled(device_type):
        autocast = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    return {"precision": spec.name if spec else None, "matmul_precision": torch.get_float32_matmul_precision(),
            "autocast_dtype": autocast, "param_dtype": spec.param_dtype if spec else None}


def under_precision(generate_fn):
    """Decorator of the engine's ``generate(adapter, ...)``: run it in ``adapter.precision`` (see the module
    docstring) on ``adapter.device`` and leave the state as it was. An adapter without one runs as the caller set."""

    @functools.wraps(generate_fn)
    def wrapper(adapter, *args, **kwargs):
        precision = getattr(adapter, "precision", None)
        if precision is None:
            return generate_fn(adapter, *args, **kwargs)
        device = getattr(adapter, "device", "cpu")
        with precision_scope(precision, device) as spec:
            try:  # what ran, read inside the scope: the records state it (var_core.eval.lightning)
                adapter.precision_ran = precision_record(spec, device)
            except AttributeError:
                pass
            return generate_fn(adapter, *args, **kwargs)

    return wrapper


def resolved_precision(precision: str | None, family: str | None, device: torch.device | str) -> str:
    """``precision`` (normalised) or, when None, the family's default on ``device`` (:func:`default_precision`)."""
    return parse_precision(precision).name if precision else default_precision(family, device)


def run_tag(device_type: str, precision: str) -> str:
    """The part a default results folder gets for where and how it ran: empty on the CPU in fp32 (the folders of
    earlier runs keep their names), else ``_<cpu|gpu>_<precision>`` (``_gpu_fp16-autocast+tf32``), so that runs on
    another device or in another precision never share a default folder."""
    device_type = "gpu" if device_type in ("gpu", "cuda") else "cpu"
    if device_type == "cpu" and precision == "fp32":
        return ""
    return f"_{device_type}_{precision}"


def study_precision(precision: str | None, dtype: str | None, family: str | None,
                    device: torch.device | str) -> str:
    """The precision a study runs in: ``precision``, else the former ``dtype`` setting when it is not float32
    (bfloat16 = bf16), else :func:`default_precision` of ``family`` on ``device``."""
    given = precision or (precision_from_dtype(dtype) if dtype not in (None, "float32") else None)
    return resolved_precision(given, family, device)


def parameter_dtype(precision: str | None, dtype: str | None = None) -> torch.dtype:
    """The dtype to load parameters in: bfloat16 for ``bf16`` (or the former ``dtype`` bfloat16), else float32
    (every autocast mode and every default keep fp32 parameters)."""
    return parse_precision(study_precision(precision, dtype, None, "cpu")).params


def declared_precision(precision: str | None) -> dict:
    """The fields of :func:`precision_record` as ``precision`` declares them (for a header written before or after
    the runs, outside the scope): autocast dtype and matmul precision of the mode."""
    if precision is None:
        return {"precision": None, "matmul_precision": torch.get_float32_matmul_precision(), "autocast_dtype": None,
                "param_dtype": None}
    spec = parse_precision(precision)
    return {"precision": spec.name, "matmul_precision": spec.matmul_precision,
            "autocast_dtype": None if spec.autocast is None else str(spec.autocast).removeprefix("torch."),
            "param_dtype": spec.param_dtype}
