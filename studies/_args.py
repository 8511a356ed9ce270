"""Argument types and up-front checks shared by the ``python -m studies.X`` entry points.

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


def launch_precision(args: argparse.Namespace) -> str | None:
    """``--precision``, or what the former ``--dtype`` meant; None: the per-family default (decided where the
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


def device_setting(text: str) -> str:
    """``--device`` of the single-process commands (bench, latency, gpucheck): ``auto`` (a CUDA GPU when torch sees
    one, else the CPU: the same decision as ``--accelerator auto``) or a device of :func:`torch_device`."""
    if str(text).strip().lower() == "auto":
        return "auto"
    return torch_device(text)


def resolve_device(setting: str | None) -> str:
    """The device ``--device`` names (``auto``/None: ``cuda`` when torch sees a CUDA GPU, else ``cpu``)."""
    import torch

    if setting in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(setting)


# ----- studies as files (--config FILE, --print-config) ---------------------------------------------------------
#: options that are about the invocation itself, never part of a study file
_NOT_IN_CONFIG = {"help", "config", "print_config"}


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` (a study as a file: JSON or YAML, every option; flags on the command line override it)
    and ``--print-config`` (write the resolved study as YAML and exit), as LightningCLI users expect."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="read the study's options from a YAML or JSON file (keys: the option names, e.g. "
                        "batch_size or batch-size, and the positional arguments' names); flags given on the command "
                        "line override the file. 'COMMAND ... --print-config > study.yaml' writes one")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved options (file, then flags, then defaults) as YAML and exit without "
                        "running; '--config' of that output runs the same study")


def _config_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in _NOT_IN_CONFIG and a.dest != argparse.SUPPRESS}


def _config_aliases(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key a study file may use for an option: its dest (``params``) and its long name (``param``)."""
    out = dict(_config_actions(parser))
    for action in list(out.values()):
        for name in action.option_strings:
            if name.startswith("--"):
                out.setdefault(name[2:].replace("-", "_"), action)
    return out


def read_config(path: str) -> dict:
    """The mapping a study file holds (YAML, of which JSON is a subset); one-line errors for a missing file, a
    parse error or a file that is not a mapping."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        hint = did_you_mean(file.name, [q.name for q in file.parent.iterdir()]) if file.parent.is_dir() else ""
        raise UserError(f"--config {path}: no such file.{hint}")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        reason = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        raise UserError(f"--config {path}: not valid YAML or JSON{line}: {reason}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of option names to values (e.g. samples: 64), got "
                        f"a {type(data).__name__}")
    return data


def _option_string(action: argparse.Action) -> str:
    return max(action.option_strings, key=len)


def _tokens_of(action: argparse.Action, value, path: str) -> list[str]:
    """The command-line words that give ``action`` the file's ``value``."""
    name = _option_string(action)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise UserError(f"--config {path}: {action.dest} must be true or false, got {value!r}")
        return [name] if value != action.default else []
    if value is None:
        return []
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    if many:
        values = value if isinstance(value, (list, tuple)) else [value]
        if isinstance(action, argparse._AppendAction):
            return [word for v in values for word in (name, str(v))]
        return [name, *map(str, values)] if values else []
    if action.nargs == "?" and value is True and action.const is True:
        return [name]
    if isinstance(value, (list, tuple)):  # GPU indices: 0,1 (a single index keeps its comma: 3, is GPU 3)
        return [name, ",".join(map(str, value)) + ("," if len(value) == 1 else "")]
    if isinstance(value, dict):
        raise UserError(f"--config {path}: {action.dest} takes a single value, got a mapping")
    return [name, str(value).lower() if isinstance(value, bool) else str(value)]


def _given_on_command_line(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[set[str], int]:
    """The dests of the options the command line gives, and how many positional words it has."""
    by_string = {s: a for a in parser._actions for s in a.option_strings}
    given: set[str] = set()
    positionals = 0
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            positionals += len(argv) - i - 1
            break
        if word.startswith("-") and len(word) > 1 and not _is_number(word):
            name = word.split("=", 1)[0]
            action = by_string.get(name) or next((a for s, a in by_string.items() if s.startswith(name)), None)
            i += 1
            if action is None:
                continue
            given.add(action.dest)
            if "=" in word or action.nargs == 0:
                continue
            if action.nargs in (None, 1):
                i += 1
            else:  # ?, +, *: the following words that are not options
                while i < len(argv) and not (argv[i].startswith("-") and not _is_number(argv[i])):
                    i += 1
                    if action.nargs == "?":
                        break
            continue
        positionals += 1
        i += 1
    return given, positionals


def _is_number(word: str) -> bool:
    try:
        float(word)
        return True
    except ValueError:
        return False


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``--config FILE`` read first: every key of the file becomes the words of its
    option (a positional's key: its value, unless the command line gives positionals), placed before the command
    line's words, so a flag on the command line wins (a repeatable option given there replaces the file's list).
    An unknown key is one error line with a did-you-mean. The caller prints :func:`format_config` and stops when
    ``args.print_config``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--config", default=None)
    known, _ = probe.parse_known_args([w for w in argv if w not in ("-h", "--help")])
    words: list[str] = []
    if known.config:
        data = read_config(known.config)
        actions = _config_aliases(parser)
        given, positional_words = _given_on_command_line(parser, argv)
        leading: dict[str, str] = {}
        for raw_key, value in data.items():
            key = str(raw_key).lstrip("-").replace("-", "_")
            action = actions.get(key)
            if action is None:
                keys = sorted(_config_actions(parser))
                raise UserError(f"--config {known.config}: unknown key {raw_key!r}.{did_you_mean(key, keys)} Keys: "
                                f"{', '.join(keys)}")
            if not action.option_strings:  # a positional argument
                if value is not None and positional_words == 0:
                    leading[action.dest] = str(value)
                continue
            if action.dest in given:
                continue  # the command line gives it
            words += _tokens_of(action, value, known.config)
        order = [a.dest for a in parser._actions if not a.option_strings and a.dest in leading]
        argv = [leading[dest] for dest in order] + words + argv
    return parser.parse_args(argv)


def config_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The resolved study: every option and positional of ``parser`` with its value (given or default)."""
    out = {}
    for dest in _config_actions(parser):
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        out[dest] = list(value) if isinstance(value, tuple) else value
    return out


def format_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """:func:`config_of` as YAML (``--config`` reads it back)."""
    import yaml

    header = f"# {parser.prog} --config FILE: a study as a file (flags on the command line override it)\n"
    return header + yaml.safe_dump(config_of(parser, args), sort_keys=False, default_flow_style=None)
