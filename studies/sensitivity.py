"""``python -m studies.sensitivity FIELD --values V1 V2 …``: one knob over a grid, the rest at the method's preset.

    python -m studies.sensitivity tau --values 0.6 0.7 0.8 0.9                  # NOVA's τ (nova is the default)
    python -m studies.sensitivity schedule.scale_lam+schedule.layer_lam --values 0.01 0.05 0.1 0.3 1.0  # NOVA's λ
    python -m studies.sensitivity rho --values 0.3 0.5 0.7 0.9 --method ldpruning
    python -m studies.sensitivity delta --values 0.05 0.1 0.15 0.25 0.4 --method ldpruning

FIELD: a dotted path (``schedule.tau``), an alias resolved against the method (``tau``, ``lambda``, ``t_est``,
``alpha``, ``rho``, ``delta``) or a ``+``-tie of paths set together. ``--method`` defaults to nova when it has the
field, else the one preset that has it. Every point runs the same samples (same seeds) as the cached baseline;
each metric gets its 95 % bootstrap interval.

Writes ``sensitivity.csv`` / ``sensitivity.json`` / ``sensitivity.png`` and one record per point under ``arms/``
(default folder ``results/sensitivity/<method>_<field>_<model>_n<N>_seed<S>``; re-running reuses finished points).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from studies._args import (ArgumentParser, add_config_arguments, check_evaluation_args, format_config,
                           lightning_interrupts, parse_with_config, preset_name, results_folder)
from studies._cli import note_results_folder, run_cli
from studies._evaluation_cli import add_evaluation_arguments, evaluation_banner, evaluation_settings, wandb_mode
from var_core.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m studies.sensitivity", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("field", help="the knob: dotted path, alias (tau, lambda, t_est, alpha, rho, delta) or a+b tie")
    p.add_argument("--values", nargs="+", required=True, help="grid values (parsed into the knob's type)")
    p.add_argument("--method", default=None, type=preset_name, help="method preset (default: nova if it has the field)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="fixed setting of the base policy (repeatable)")
    p.add_argument("--metrics", nargs="+", default=None,
                   help="metrics to plot (default: speedup flops_ratio psnr ssim class_acc fid_proxy — those that "
                        "apply to the model)")
    p.add_argument("--seed", type=int, default=0)
    add_evaluation_arguments(p, unit="point", threads_default="torch's")
    p.add_argument("--out", default=None, type=results_folder, help="output folder (re-use it to resume)")
    p.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                   help="W&B mirror (default $WANDB_MODE, else offline)")
    add_config_arguments(p)  # --config FILE --print-config
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_with_config(parser, argv)  # --config FILE (flags override it)
    if args.print_config:  # the resolved study as YAML: --config of it runs the same study
        print(format_config(parser, args), end="")
        return 0
    check_evaluation_args(args)
    from sweeps.sensitivity import (DEFAULT_METRICS, SensitivityError, SensitivitySpec, default_out_dir,
                                    resolve_grid, run_sensitivity)

    spec = SensitivitySpec(
        param=args.field, values=tuple(args.values), method=args.method, overrides=tuple(args.overrides),
        metrics=tuple(args.metrics) if args.metrics else DEFAULT_METRICS,
        eval=evaluation_settings(args, args.threads),
        out=args.out, wandb=wandb_mode(args.wandb))
    try:
        method = resolve_grid(spec)[0]  # the grid values parse into the knob's type, before any model is loaded
    except UserError:
        raise
    except (ValueError, TypeError) as exc:
        raise UserError(f"--values: {exc}") from None
    from ablations.runner import resolve_model

    print(evaluation_banner("sensitivity", args), flush=True)
    model = resolve_model(spec.eval.model, spec.eval.weights)[0]
    note_results_folder(Path(spec.out) if spec.out else default_out_dir(spec, method, model))
    try:
        with lightning_interrupts():
            result = run_sensitivity(spec)
    except SensitivityError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(f"done in {result['seconds']:.0f} s")
    out = result["spec"]["out"]
    print(f"table : {result['csv']}")
    print(f"json  : {out}/sensitivity.json")
    print(f"plot  : {result['plot']}")
    if result.get("wandb"):
        print(f"W&B   : {result['wandb']}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
