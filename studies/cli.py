"""``varscope COMMAND [ARGS ...]``: the one console command; each command is one study's ``main(argv)``.

    varscope ablate scorer                  # = python -m studies.ablate scorer
    varscope ls models                      # = python -m studies.ablate ls models
    varscope verify ../shared/fixtures/official_var_tiny   # = python -m var_core.verify ...
    varscope help latency                   # = varscope latency --help

``[project.scripts] varscope = "studies.cli:main"`` (pyproject.toml). Every ``python -m studies.X`` keeps working:
this module only picks the study by its first word and hands it the rest, under :func:`studies._cli.run_cli` (a
user error prints one ``error:`` line and exits 2; an unknown command gets a did-you-mean).
"""

from __future__ import annotations

import importlib
import sys

from studies._cli import run_cli
from var_core.errors import UserError, did_you_mean, importing

#: command -> (module whose ``main(argv)`` runs it, words put before the user's arguments, one-line summary)
COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "ablate": ("studies.ablate", (), "run one ablation family (a paper table, arm for arm) into a results folder "
                                     "(also: ablate validate)"),
    "sweep": ("studies.sweep", (), "multi-objective Optuna tuning of a method's knobs (cost down, quality up)"),
    "sensitivity": ("studies.sensitivity", (), "one knob over a grid of values, the rest at the method's preset"),
    "latency": ("studies.latency", (), "latency report of one method against others: per scale, per component, "
                                       "memory, throughput"),
    "bench": ("studies.bench", (), "wall-clock benchmarks: the engine against the official loop, every preset "
                                   "against the baseline"),
    "report": ("studies.report", (), "rebuild a results folder's table, plots and grids from its records"),
    "verify": ("var_core.verify", (), "check our models against the official code's golden outputs (a fixture "
                                      "folder)"),
    "ls": ("studies.ablate", ("ls",), "list families, components, presets, metrics or models (ls TOPIC)"),
    "calibrate": ("studies.calibrate", (), "calibrations that write a file: ToProVAR's tau (Fig. 8), HACK's structural / contextual heads"),
    "gpucheck": ("studies.gpucheck", (), "the first check to run on a GPU machine (GPU tests, then a latency "
                                         "report)"),
    "demo": ("studies.demo", (), "generate a class-conditional sample grid as one PNG"),
    "fid-reference": ("studies.fid_reference", (), "make FID reference statistics (.npz) from a folder of images "
                                                   "for --fid-reference; export the testbed's training images"),
    "frontier": ("studies.frontier", (), "which method keeps the most quality at a given cost: speed-quality "
                                         "frontiers, matched-cost table, dominance"),
    "claims": ("studies.claims", (), "claims ledger: each paper's headline beside what varscope measures here"),
    "preset-flops": ("studies.preset_flops", (), "FLOPs-ideal speedup of every preset on an Infinity "
                                                 "architecture (nothing loaded)"),
}


def version() -> str:
    """The installed distribution's version (pyproject.toml), with the git commit of a checkout when there is one."""
    from importlib import metadata
    from pathlib import Path

    try:
        number = metadata.version("varscope")
    except metadata.PackageNotFoundError:
        number = "unknown (not installed)"
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{number} (git {commit})" if commit else number


def help_text() -> str:
    """What ``varscope``, ``varscope --help`` and ``varscope help`` print."""
    width = max(map(len, COMMANDS))
    lines = ["usage: varscope COMMAND [ARGS ...]   (varscope --version)", "",
             "Profiling and ablation of training-free acceleration for visual autoregressive (next-scale) image",
             "generators. 'varscope COMMAND --help' (or 'varscope help COMMAND') gives a command's options; each",
             "command is also 'python -m MODULE' (the module is named in its --help).", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, _, summary) in COMMANDS.items()]
    lines += ["", "examples:", "  varscope ablate scorer", "  varscope ls models",
              "  varscope latency --method nova --compare baseline fastvar --threads 1"]
    return "\n".join(lines)


def unknown_command(word: str) -> UserError:
    return UserError(f"unknown command {word!r}.{did_you_mean(word, COMMANDS)} Commands: {', '.join(COMMANDS)} "
                     f"(varscope --help)")


def dispatch(argv: list[str] | None = None) -> int:
    """Run ``argv[0]``'s study with the other words (``help`` / ``-h`` / ``--help`` / nothing: the command list)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from var_core.plugins import take_plugin_args

    argv = take_plugin_args(argv)  # --plugins PATH, any command: into $VARSCOPE_PLUGINS (var_core.plugins)
    if argv and argv[0] in ("--version", "-V"):
        print(f"varscope {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        if len(argv) >= 2 and argv[0] == "help":
            return dispatch([argv[1], "--help"])
        print(help_text(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2  # a bare 'varscope' is a mistake: the list, exit 2
    word, rest = argv[0], argv[1:]
    if word not in COMMANDS:
        raise unknown_command(word)
    module_name, before, _ = COMMANDS[word]
    with importing():  # Ctrl-C while torch & co. load: exit 130 at once (an interrupted import can be swallowed)
        module = importlib.import_module(module_name)
    return int(module.main([*before, *rest]) or 0)


def main(argv: list[str] | None = None) -> int:
    """The ``varscope`` console script: :func:`dispatch` under the user-error convention (exit 2, Ctrl-C 130)."""
    return run_cli(dispatch, argv)


if __name__ == "__main__":
    sys.exit(main())
