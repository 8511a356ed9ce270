"""The device and precision decision as every command states it (``--accelerator`` / ``--device`` ``auto`` and
``--precision``; see :mod:`var_core.eval.distributed` and :mod:`var_core.engine.precision`)."""

from __future__ import annotations

from var_core.errors import UserError


def launch_precision(args) -> str | None:
    """``args.precision``, or what the former ``args.dtype`` meant; None: the per-family default (decided where the
    device is known). ``--dtype float16`` and a ``--dtype`` that contradicts ``--precision`` are user errors."""
    from var_core.engine.precision import precision_from_dtype

    dtype = getattr(args, "dtype", None)
    precision = getattr(args, "precision", None)
    if dtype is None:
        return precision
    try:
        meant = precision_from_dtype(dtype)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if precision is not None and precision != meant:
        raise UserError(f"--dtype {dtype} (= --precision {meant}) contradicts --precision {precision}: give only "
                        f"--precision")
    return meant


def model_family(model: str | None) -> str:
    """The zoo family (var, infinity, hart) of a model name; ``var`` for the default model and unknown names."""
    from var_core.zoo import ZOO

    spec = ZOO.get(str(model or "testbed").removeprefix("random:"))
    return spec.family if spec is not None else "var"


def launch_banner(command: str, accelerator_setting: str, device, precision: str | None, family: str) -> str:
    """The first line every command prints: the device it runs on (and how ``auto`` decided) and the precision
    (and why: given, or the family's default on that device)."""
    import torch

    from var_core.engine.precision import default_precision, parse_precision
    from var_core.eval.environment import device_name

    device = torch.device(device)
    where = f"{device} ({device_name(device)})"
    how = {"auto": "auto: " + ("torch sees a CUDA GPU" if device.type == "cuda" else "no CUDA GPU"),
           }.get(str(accelerator_setting), "given")
    if precision is None:
        precision = default_precision(family, device)
        why = (f"the official {family} sampler's mode on a GPU" if device.type == "cuda" else "the default on a CPU")
    else:
        why = "given"
    spec = parse_precision(precision)
    detail = (f"autocast {spec.autocast}".replace("torch.", "") if spec.autocast is not None else "no autocast")
    return (f"{command}: device {where} [{how}]; precision {spec.name} ({why}; {detail}, float32 matmul "
            f"{spec.matmul_precision}, parameters {spec.param_dtype})")


def resolve_device(setting: str | None) -> str:
    """The device ``--device`` names (``auto``/None: ``cuda`` when torch sees a CUDA GPU, else ``cpu``)."""
    import torch

    if setting in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(setting)
