"""``varscope frontier``: which method keeps the most quality at a given cost (speed–quality frontiers, issue 30).

    varscope frontier --methods nova fastvar ldpruning stagevar --model testbed --samples 8 --points 3
    varscope frontier --methods nova ldpruning --flops-levels 0.7 0.55 0.4 --speedup-levels 1.5 2

Each method's declared cost knob(s) (var_core/accel/cost_knobs.py) are swept over the same FLOPs-ratio range;
every point is a full arm against one baseline (same samples, interleaved timing, bootstrap CIs). Writes
``frontier.png``, ``frontier.md`` (matched-cost tables: value [95 % CI], paired tests with Holm correction,
dominance summary, area under each frontier), CSVs and ``frontier.json`` into the results folder (default
``results/frontier/<model>_n<N>_seed<S>``; re-running, or adding methods, reuses the finished points).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from studies._args import (ArgumentParser, check_evaluation_args, lightning_interrupts, positive_float, positive_int,
                           results_folder)
from studies._cli import note_results_folder, run_cli
from studies._evaluation_cli import add_evaluation_arguments, evaluation_banner, evaluation_settings, wandb_mode


def build_parser() -> argparse.ArgumentParser:
    from sweeps.frontier import DEFAULT_METHODS, QUALITY_METRICS

    p = ArgumentParser(prog="varscope frontier", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help="method presets (at least two)")
    p.add_argument("--points", type=positive_int, default=4, help="grid points per method over the common cost "
                                                                  "range (default 4; the published one is added)")
    p.add_argument("--cost-range", nargs=2, type=positive_float, default=None, metavar=("LO", "HI"),
                   help="FLOPs-ratio range the grids target (default: where every method's candidates overlap)")
    p.add_argument("--flops-levels", nargs="+", type=positive_float, default=(), help="matched FLOPs-ratio levels")
    p.add_argument("--speedup-levels", nargs="+", type=positive_float, default=(), help="matched speedup levels")
    p.add_argument("--metrics", nargs="+", default=["ssim", "psnr"], help=f"quality metrics ({', '.join(QUALITY_METRICS)})")
    p.add_argument("--bootstrap", type=positive_int, default=2000, help="bootstrap replicates (default 2000)")
    p.add_argument("--calibration-samples", type=positive_int, default=2,
                   help="samples whose analytic FLOPs place each candidate on the cost axis (default 2)")
    p.add_argument("--seed", type=int, default=0)
    add_evaluation_arguments(p, unit="point", threads_default="torch's")
    p.add_argument("--timing-rounds", dest="timing_repeats", type=positive_int, default=argparse.SUPPRESS,
                   help="= --timing-repeats (interleaved baseline/arm rounds; each batch keeps its fastest)")
    p.add_argument("--out", default=None, type=results_folder, help="output folder (re-use it to resume)")
    p.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                   help="accepted for symmetry with the other studies; the frontier writes no W&B run")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_evaluation_args(args)
    from sweeps.frontier import FrontierSpec, check_spec, default_out_dir, run_frontier

    spec = FrontierSpec(methods=tuple(args.methods), points=args.points,
                        cost_range=tuple(args.cost_range) if args.cost_range else None,
                        flops_levels=tuple(args.flops_levels), speedup_levels=tuple(args.speedup_levels),
                        metrics=tuple(args.metrics), calibration_samples=args.calibration_samples,
                        n_boot=args.bootstrap, eval=evaluation_settings(args, args.threads), out=args.out,
                        wandb=wandb_mode(args.wandb))
    check_spec(spec)  # names and ranges, before the model loads
    from ablations.runner import resolve_model

    print(evaluation_banner("frontier", args), flush=True)
    model = resolve_model(spec.eval.model, spec.eval.weights)[0]
    note_results_folder(Path(spec.out) if spec.out else default_out_dir(spec, model))
    with lightning_interrupts():
        result = run_frontier(spec)
    out = result["spec"]["out"]
    print()
    print(Path(result["markdown"]).read_text())
    print(f"done in {result['seconds']:.0f} s")
    print(f"tables: {out}/frontier.md, {out}/matched_cost.csv, {out}/matched_tests.csv, {out}/frontier_points.csv")
    print(f"plot  : {result['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
