"""``python -m studies.sweep METHOD``: multi-objective Optuna tuning of a method's knobs (cost ↓, quality ↑).

    python -m studies.sweep nova --trials 40                       # every tunable knob of NOVA, NSGA-II, FLOPs vs PSNR
    python -m studies.sweep nova --param tau --param schedule.scale_lam+schedule.layer_lam --sampler tpe
    python -m studies.sweep ldpruning --param rho --param delta --quality class_acc --constraint "class_acc>=baseline-1"
    python -m studies.sweep nova --trials 40 --workers 2           # 2 local worker processes on one study
    python -m studies.sweep nova --storage postgresql://user:pw@host/db   # an RDB shared by several machines
    python -m studies.sweep nova --list                            # the tunable fields of the method, then exit

Fields (``--param``, repeatable; default: every knob of the method that declares a search space): a dotted path
into the policy (``schedule.tau``, ``activation.t_est``, ``guidance.delta``), an alias of a paper symbol resolved
against the method (``tau``, ``lambda``/``lam``, ``t_est``, ``alpha``, ``rho``, ``delta``), or a ``+``-tie of paths
sampled as one value (``schedule.scale_lam+schedule.layer_lam`` is NOVA's single λ). A range overrides the knob's
declared search space: ``tau=0.5:0.95``, ``guidance.delta=0.02:0.5:log``, ``restorer.interpolation=area,nearest``.
A field the method's components do not have fails before the first trial, listing the method's tunable fields.

Results (``--out``, default ``results/sweeps/<method>_<model>_n<N>_seed<S>_<cost>-<quality>[_<hash>]``):
``trials.csv``, ``results.json`` (Pareto front, best trade-off under the constraint, importances, baseline),
``pareto.png``, ``pareto_optuna.png``, ``importance_<objective>.png``, ``arms/*.json`` (one record per trial, the
cached baseline ``arms/baseline.{json,pt}``), ``study.journal`` (the Optuna storage), ``wandb/`` (offline runs,
one per trial, grouped by study; ``wandb sync <out>/wandb/offline-run-*`` uploads them later).

Resume: re-run the same command. Completed trials are kept; trials left RUNNING by a killed worker are marked FAIL
and their parameters re-queued (the dead worker's pid is detected on this host; RDB storages also use optuna's
heartbeat, ``fail_stale_trials``, for workers of other hosts); a journal whose last line was cut off by a killed
worker is repaired (the original kept as ``study.journal.bak-<time>``). Dashboard (offline):
``python -m sweeps.dashboard <out>/study.journal`` or ``python -m sweeps.dashboard sqlite:///path.db``
(optuna-dashboard with Optuna 5's constraints honoured), then open http://127.0.0.1:8080.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from studies._args import (ArgumentParser, add_config_arguments, check_evaluation_args, format_config,
                           lightning_interrupts, parse_with_config, positive_float, positive_int, preset_name,
                           results_folder)
from studies._cli import note_results_folder, run_cli
from studies._evaluation_cli import add_evaluation_arguments, evaluation_banner, evaluation_settings, wandb_mode


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m studies.sweep", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", type=preset_name,
                   help="a method preset: nova, fastvar, ldpruning, toprovar, sparsevar, skipvar, stagevar")
    p.add_argument("--param", dest="params", action="append", default=[], metavar="FIELD[=RANGE]",
                   help="field to tune (repeatable; default: every tunable knob of the method)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="fixed setting of the base policy, e.g. --set schedule.ratio_is=kept (repeatable)")
    p.add_argument("--trials", type=positive_int, default=40, help="COMPLETE trials the study should hold (default 40)")
    p.add_argument("--cost", choices=("flops", "latency"), default="flops",
                   help="cost objective: FLOPs ratio (default; deterministic) or latency ratio vs the baseline")
    p.add_argument("--quality", default="psnr",
                   help="quality objective: psnr (default), ssim, ms_ssim, token_agreement, class_acc, fid_proxy, "
                        "kid_proxy")
    p.add_argument("--constraint", default="auto",
                   help="feasibility constraint, e.g. 'class_acc>=baseline-1', 'psnr>=30', 'none' (default auto: "
                        "class accuracy within 1 point of the baseline where the classifier applies)")
    p.add_argument("--sampler", choices=("nsga2", "tpe", "random"), default="nsga2")
    p.add_argument("--population", type=positive_int, default=None,
                   help="NSGA-II population (default trials/4 in [4, 50])")
    p.add_argument("--seed", type=int, default=0, help="base seed of the samples and of the sampler")
    add_evaluation_arguments(p, unit="trial", threads_default="cores / workers")
    p.add_argument("--out", default=None, type=results_folder, help="output folder (re-use it to resume)")
    p.add_argument("--storage", default=None,
                   help="Optuna storage: default a journal file <out>/study.journal; sqlite:///x.db, "
                        "postgresql://…, mysql://… are passed to optuna's RDBStorage; a plain path is a journal file")
    p.add_argument("--study-name", default=None, help="default <method>-<cost>-<quality>")
    p.add_argument("--workers", type=positive_int, default=1, help="local worker processes on the study (default 1)")
    p.add_argument("--timeout", type=positive_float, default=None, help="stop each worker after this many seconds")
    p.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                   help="W&B mirror, one run per trial grouped by study (default $WANDB_MODE, else offline)")
    p.add_argument("--no-default-trial", action="store_true",
                   help="do not enqueue the preset's own values as the first trial")
    p.add_argument("--list", action="store_true", help="print the method's tunable fields and exit")
    add_config_arguments(p)  # --config FILE --print-config
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_with_config(parser, argv)  # --config FILE (flags override it)
    if args.print_config:  # the resolved study as YAML: --config of it runs the same study
        print(format_config(parser, args), end="")
        return 0
    check_evaluation_args(args)
    from sweeps.optuna_study import SweepError, SweepSpec, default_out_dir, run_sweep

    if args.list:
        from sweeps.spaces import SpaceError, apply_overrides, format_tunable
        from var_core.accel.presets import get_preset

        try:
            policy = apply_overrides(get_preset(args.method), args.overrides)
        except (KeyError, SpaceError) as exc:
            print(f"error: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
            return 2
        print(f"tunable fields of {args.method} (path, search space from the knob metadata, current value):")
        print(format_tunable(policy))
        return 0
    constraint = None if (args.constraint or "").lower() in ("", "none") else args.constraint
    spec = SweepSpec(
        method=args.method, params=tuple(args.params), overrides=tuple(args.overrides), cost=args.cost,
        quality=args.quality, constraint=constraint, sampler=args.sampler, seed=args.seed, trials=args.trials,
        population=args.population,
        eval=evaluation_settings(args, args.threads),
        out=args.out, storage=args.storage, study_name=args.study_name, wandb=wandb_mode(args.wandb),
        enqueue_default=not args.no_default_trial, timeout=args.timeout)
    from ablations.runner import resolve_model

    print(evaluation_banner("sweep", args), flush=True)
    note_results_folder(Path(spec.out) if spec.out else default_out_dir(spec, resolve_model(spec.eval.model,
                                                                                            spec.eval.weights)[0]))
    try:
        with lightning_interrupts():
            result = run_sweep(spec, workers=args.workers)
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    counts = result["counts"]
    print()
    print(f"study {result['study']}: " + ", ".join(f"{v} {k.lower()}" for k, v in counts.items())
          + f" ({result['seconds']:.0f} s)")
    cost, quality = result["objectives"]["cost"]["metric"], result["objectives"]["quality"]["metric"]
    print(f"Pareto front ({len(result['pareto_front'])} trials, {cost} ↓ / {quality}):")
    for row in sorted(result["pareto_front"], key=lambda r: r[cost]):
        params = ", ".join(f"{k.removeprefix('param:')}={v:.4g}" if isinstance(v, float) else
                           f"{k.removeprefix('param:')}={v}" for k, v in row.items() if k.startswith("param:"))
        print(f"  trial {row['number']:>3}: {cost} {row[cost]:.3f}  {quality} {row[quality]:.3f}   {params}")
    best = result["best_tradeoff"]
    if best is not None:
        label = f"under {result['constraint']['text']}" if result["constraint"] else "(no constraint: lowest cost)"
        print(f"best trade-off {label}: trial {best['number']} ({cost} {best[cost]:.3f}, {quality} "
              f"{best[quality]:.3f})")
    elif result["constraint"]:
        print(f"no trial satisfies {result['constraint']['text']}")
    out = result["spec"]["out"]
    print(f"results : {out}/results.json, {result['trials_csv']}")
    for name, path in result["plots"].items():
        print(f"plot    : {path}")
    for name, err in result["plot_errors"].items():
        print(f"plot    : {name} not drawn ({err})")
    print(f"dashboard: {result['dashboard']}  (then open http://127.0.0.1:8080)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
