"""Argument types and up-front checks shared by the ``python -m studies.X`` entry points (``studies._args`` re-exports them).

Everything here fails before anything is loaded or generated, in one line (see :mod:`studies._cli`):

* :class:`ArgumentParser` — argparse whose errors are :class:`~var_core.errors.UserError` (``error: argument
  --samples: must be >= 2, got -1``) instead of a usage block;
* ``type=`` functions — :func:`positive_int`, :func:`non_negative_int`, :func:`at_least`, :func:`positive_float`,
  :func:`finite_float`, :func:`seed_int`, :func:`threads_setting`, :func:`preset_name`, :func:`model_name`,
  :func:`class_conditional_model`, :func:`strategy_name`, :func:`existing_path`, :func:`results_folder`,
  :func:`output_file`, :func:`accelerator`, :func:`devices_setting`, :func:`torch_device`;
* :func:`check_args` — the same types applied after parsing to options declared elsewhere
  (:func:`check_evaluation_args` for the shared evaluation options);
* :func:`check_devices` — ``--devices`` / ``--num-nodes`` / ``--strategy`` against the GPUs this machine has and what
  launched the process (:func:`var_core.eval.distributed.resolve_launch`, the same decision the run makes);
* :func:`lightning_interrupts` — Lightning turns Ctrl-C into ``sys.exit(1)``; this turns it back into
  ``KeyboardInterrupt`` so that the entry point reports what was kept and exits 130.
"""

from __future__ import annotations

import argparse
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from var_core.errors import UserError, did_you_mean
from var_core.cli_config import add_config_arguments, format_config, parse_with_config  # noqa: F401
from var_core.launch import launch_banner, launch_precision, model_family, resolve_device  # noqa: F401

ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are user errors: one ``error: ...`` line and exit 2 under ``run_cli``."""

    def error(self, message: str):  # argparse: "print usage, exit 2"
        raise UserError(f"{message} (see {self.prog} --help)")


# ----- numbers ------------------------------------------------------------------------------------------------
def _whole(text) -> int:
    if isinstance(text, bool):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if isinstance(text, int):
        return text
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    """A ``type=`` for whole numbers ``>= minimum`` (``why`` is added to the message, e.g. "(CIs need spread)")."""

    def parse(text) -> int:
        value = _whole(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{' ' + why if why else ''}, got {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


positive_int = at_least(1)
non_negative_int = at_least(0)


def positive_float(text) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def finite_float(low: float | None = None, high: float | None = None, *, low_open: bool = False,
                 why: str = "") -> Callable[[str], float]:
    """A ``type=`` for finite numbers in ``[low, high]`` (``low_open``: ``(low, high]``): ``nan``, ``inf`` and
    values that overflow a float (``1e400``) are refused with the range in the message; ``why`` is added to it."""
    lo = "-inf" if low is None else f"{low:g}"
    hi = "inf" if high is None else f"{high:g}"
    span = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high is None else ']'}"
    note = f" {why}" if why else ""

    def parse(text) -> float:
        try:
            value = float(str(text).strip())
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number in {span}{note}, got {text}")
        if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in {span}{note}, got {text}")
        return value

    parse.__name__ = f"float in {span}"
    return parse


#: The largest ``--seed``: 2**32 - 1, accepted by every generator the seed reaches (torch, numpy's legacy
#: ``RandomState``, Optuna's samplers) and still a valid torch seed after the commands' ``seed * 100_000 + i``.
MAX_SEED = 2**32 - 1


def seed_int(text) -> int:
    """``--seed``: a whole number in ``[0, 2**32 - 1]`` (a negative or huge seed fails in a generator mid-run)."""
    value = _whole(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be a whole number in [0, {MAX_SEED}] (2**32 - 1), got {value}")
    return value


def threads_setting(text) -> int | str:
    """``--threads`` of the ablation runner: a number >= 1, ``auto`` or ``torch``."""
    if text in ("auto", "torch"):
        return text
    try:
        value = int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 1, 'auto' or 'torch', got {text!r}"
                                         + did_you_mean(str(text), ("auto", "torch"))) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, 'auto' or 'torch', got {value}")
    return value


# ----- names --------------------------------------------------------------------------------------------------
def preset_name(text: str) -> str:
    """A method preset (``nova``, ``fastvar``, …), with a did-you-mean."""
    from var_core.accel.presets import get_preset

    try:
        get_preset(text)
    except KeyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def model_name(text: str) -> str:
    """A zoo model (``testbed``, ``var-d16``, ``random:var-d16``, …), with a did-you-mean."""
    from var_core.zoo import check_model_name

    try:
        return check_model_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def class_conditional_model(text: str) -> str:
    """A zoo model that generates from class labels (VAR family: ``testbed``, ``var-d16``, ...), not a
    text-to-image one (Infinity, HART), with a did-you-mean."""
    from var_core.zoo import ZOO

    name = model_name(text)
    spec = ZOO.get(name.removeprefix("random:"))
    if spec is not None and spec.family != "var":
        choices = sorted(n for n, s in ZOO.items() if s.family == "var")
        raise argparse.ArgumentTypeError(f"{text} is a text-to-image model ({spec.family}); this command draws "
                                         f"class-conditional grids: use one of {', '.join(choices)}")
    return name


#: ``--strategy`` values a generation can run under: Lightning's data-parallel strategies (every process generates
#: its share of the batches; the ``ddp*`` names of ``lightning.pytorch.strategies.StrategyRegistry``, listed here so
#: that parsing does not import Lightning). Sharding strategies (deepspeed, fsdp) and TPU ones have nothing to shard.
STRATEGIES = ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook",
              *(f"{base}_find_unused_parameters_{flag}" for base in ("ddp", "ddp_spawn", "ddp_fork", "ddp_notebook")
                for flag in ("false", "true")))


def strategy_name(text: str) -> str:
    """``--strategy``: auto, ddp, ddp_spawn or another of Lightning's ``ddp*`` strategies, with a did-you-mean."""
    name = str(text).strip()
    known = STRATEGIES
    if name in known:
        return name
    why = (" (it shards a model for training; generation runs a whole copy per process)"
           if name.startswith(("deepspeed", "fsdp")) else "")
    raise argparse.ArgumentTypeError(f"unknown strategy {text!r}{why}.{did_you_mean(name, known)} Use auto, ddp or "
                                     f"ddp_spawn (or {', '.join(known[3:6])}, ...)")


# ----- paths --------------------------------------------------------------------------------------------------
def _file_on_the_way(path: Path) -> Path | None:
    """The existing non-folder that ``path`` or one of its parents is (it cannot become a folder), else None."""
    for p in (path, *path.parents):
        if p.exists():
            return None if p.is_dir() else p
    return None


def existing_path(text: str) -> str:
    """A file or folder that exists (weights, classifier, ...); an empty name (which would mean the current
    folder) is refused."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("an empty path: give the file or folder")
    path = Path(text).expanduser()
    if not path.exists():
        hint = ""
        parent = path.parent
        if parent.is_dir():
            hint = did_you_mean(path.name, [p.name for p in parent.iterdir()])
        raise argparse.ArgumentTypeError(f"{text} does not exist.{hint}")
    return text


def results_folder(text: str) -> str:
    """A results folder: new, or an existing folder to resume; an existing *file* is refused."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("an empty folder name (it would write into the current folder): give a "
                                         "folder, e.g. results/my_study, or omit the option for the default folder")
    path = Path(text).expanduser()
    blocker = _file_on_the_way(path)
    if blocker is not None:
        what = "is a file" if blocker == path else f"is inside {blocker}, which is a file"
        raise argparse.ArgumentTypeError(f"{text} {what}, not a folder: give a new folder, or the results folder "
                                         f"of an earlier run to resume it")
    return text


def output_file(text: str) -> str:
    """A file to write (an image): refused when it is empty, an existing folder or lies under a file."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError("an empty file name: give the file to write, e.g. results/grid.png")
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file name, e.g. {path / 'grid.png'}")
    blocker = _file_on_the_way(path.parent)
    if blocker is not None:
        raise argparse.ArgumentTypeError(f"{text} is inside {blocker}, which is a file, not a folder")
    return text


# ----- devices ------------------------------------------------------------------------------------------------
def _no_cuda(option: str, value: str, instead: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"{value}: this machine has no CUDA GPU (torch.cuda.is_available() is False); "
                                      f"use {option} {instead}")


def accelerator(text: str) -> str:
    """Lightning accelerator of the ablation runner: cpu, gpu (= cuda) or auto; a GPU must be present."""
    import torch

    name = str(text).strip().lower()
    if name not in ACCELERATORS:
        raise argparse.ArgumentTypeError(f"unknown accelerator {text!r}.{did_you_mean(name, ACCELERATORS)} "
                                         f"Choose from {', '.join(ACCELERATORS)}")
    if name in ("gpu", "cuda") and not torch.cuda.is_available():
        raise _no_cuda("--accelerator", text, "cpu")
    return name


def devices_setting(text) -> int | str | list[int]:
    """``--devices`` in Lightning's forms: a number of processes per node (``2``), ``auto``, ``-1`` (every GPU) or
    GPU indices (``0,1``; ``3,`` is the single GPU 3)."""
    from var_core.eval.distributed import parse_devices

    try:
        return parse_devices(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--devices: ")) from None


def torch_device(text: str) -> str:
    """A torch device string (``cpu``, ``cuda``, ``cuda:1``) that exists on this machine."""
    import torch

    try:
        device = torch.device(str(text).strip())
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}.{did_you_mean(str(text), ('cpu', 'cuda'))} "
                                         f"Use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise _no_cuda("--device", text, "cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s) (cuda:0 … "
                                             f"cuda:{count - 1})")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"device {text!r} is not supported here: use cpu or cuda")
    return str(text).strip()


def check_devices(accelerator_name: str, devices, num_nodes: int = 1, strategy: str = "auto",
                  samples: int | None = None, batch_size: int | None = None) -> None:
    """``--devices`` (any Lightning form), ``--num-nodes`` and ``--strategy`` must fit this machine and its launch
    (GPU count and indices; torchrun / SLURM process counts): the run's own decision, taken here first so that a
    misfit fails before anything is loaded. With ``samples`` and ``batch_size``: every process must get at least one
    batch (``var_core.eval.lightning.shard_indices`` deals whole batches round-robin; a process with none has an
    empty data loader)."""
    from var_core.eval.distributed import resolve_launch

    launch = resolve_launch(accelerator_name, devices, num_nodes, strategy)
    if samples is None or batch_size is None or launch.world_size <= 1:
        return
    batches = -(-int(samples) // int(batch_size))
    if batches < launch.world_size:
        largest = max(1, int(samples) // launch.world_size)
        raise UserError(f"--samples {samples} with --batch-size {batch_size} makes {batches} batch(es) for "
                        f"{launch.world_size} processes: every process needs at least one batch; use --batch-size "
                        f"{largest} or less, --samples {(launch.world_size - 1) * int(batch_size) + 1} or more, or "
                        f"fewer processes (--devices)")


# ----- after parsing ------------------------------------------------------------------------------------------
def check_args(args: argparse.Namespace, **types: Callable) -> None:
    """Apply ``type=`` functions to options another module declared (``samples=at_least(2)``): the value is
    replaced by the checked one; ``None`` (not given, no default) is left alone. Errors read like argparse's."""
    for dest, fn in types.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        try:
            setattr(args, dest, fn(value))
        except argparse.ArgumentTypeError as exc:
            raise UserError(f"argument --{dest.replace('_', '-')}: {exc}") from None


def check_evaluation_args(args: argparse.Namespace) -> None:
    """The options of :func:`studies._evaluation_cli.add_evaluation_arguments` (``studies.sweep``,
    ``studies.sensitivity``), checked before anything is loaded."""
    check_args(args, model=model_name, weights=existing_path, classifier=existing_path,
               samples=at_least(2, "(confidence intervals need spread)"), batch_size=positive_int,
               warmup=non_negative_int, timing_repeats=positive_int, threads=positive_int, seed=seed_int)


@contextmanager
def lightning_interrupts() -> Iterator[None]:
    """Lightning catches Ctrl-C inside ``Trainer`` calls, shuts down and calls ``sys.exit(1)``; re-raise that as
    the ``KeyboardInterrupt`` it was, so ``run_cli`` reports the kept results and exits 130."""
    try:
        yield
    except SystemExit as exc:
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from exc
        raise


# ----- where and in which precision a command runs --------------------------------------------------------------
def precision_setting(text: str) -> str:
    """``--precision``: fp32, tf32, bf16-autocast, fp16-autocast (optionally ``+tf32``) or bf16, with a
    did-you-mean (see :mod:`var_core.engine.precision`)."""
    from var_core.engine.precision import PRECISIONS, parse_precision

    try:
        return parse_precision(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}.{did_you_mean(str(text), PRECISIONS)}") from None


PRECISION_HELP = ("numeric precision: fp32, tf32, bf16-autocast, fp16-autocast (an autocast mode may add +tf32) or "
                  "bf16 (every parameter cast to bfloat16); default: the official sampler's on a GPU (VAR "
                  "fp16-autocast+tf32, Infinity bf16-autocast, HART fp16-autocast; parameters stay fp32 under "
                  "autocast), fp32 on a CPU. Stated in the first lines of the output and in every record")


def add_launch_arguments(p: argparse.ArgumentParser, *, processes: bool = True) -> None:
    """``--accelerator`` (default auto: a CUDA GPU when torch sees one, else the CPU), ``--precision``, the former
    ``--dtype`` (an alias: float32 = fp32, bfloat16 = bf16), ``--devices`` and, with ``processes``, ``--num-nodes``
    ``--strategy`` (Lightning's forms, see :func:`check_devices`; without: one process, one device)."""
    p.add_argument("--accelerator", default="auto", type=accelerator,
                   help="where generation runs: auto (default: a CUDA GPU when torch sees one, else the CPU), cpu, "
                        "gpu")
    if processes:
        p.add_argument("--devices", type=devices_setting, default=1,
                       help="processes per node (DDP when > 1), auto, -1 (every GPU) or GPU indices (0,1; 3, is "
                            "GPU 3); under torchrun / SLURM the launcher's process count (leave it out)")
    else:
        p.add_argument("--devices", type=devices_setting, default=1,
                       help="the GPU of every evaluation (one process each): 1 (default: the first) or an index "
                            "(3, is GPU 3); local --workers run side by side on it")
    if processes:
        p.add_argument("--num-nodes", type=positive_int, default=1,
                       help="machines (default 1): with --strategy ddp run the same command on every node with "
                            "MASTER_ADDR, MASTER_PORT and NODE_RANK set; torchrun / SLURM set it themselves")
        p.add_argument("--strategy", default="auto", type=strategy_name,
                       help="Lightning strategy: auto (ddp_spawn when devices > 1 on one node, ddp on several "
                            "nodes or under torchrun / SLURM), ddp (every process runs this command; rank 0 writes "
                            "the results), ddp_spawn")
    p.add_argument("--precision", default=None, type=precision_setting, help=PRECISION_HELP)
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="former option, an alias: float32 = --precision fp32, bfloat16 = --precision bf16")


def device_setting(text: str) -> str:
    """``--device`` of the single-process commands (bench, latency, gpucheck): ``auto`` (a CUDA GPU when torch sees
    one, else the CPU: the same decision as ``--accelerator auto``) or a device of :func:`torch_device`."""
    if str(text).strip().lower() == "auto":
        return "auto"
    return torch_device(text)

