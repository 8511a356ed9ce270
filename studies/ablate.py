"""``python -m studies.ablate FAMILY``: run one ablation family and write a self-describing results folder.

    python -m studies.ablate scorer                       # NOVA Table 4 on the default model, 64 samples per arm
    python -m studies.ablate linkage --samples 128 --set schedule.tau=0.7
    python -m studies.ablate options --method ldpruning --wandb disabled
    python -m studies.ablate ls                           # families, components per registry, presets
    python -m studies.ablate validate                     # build + run every arm of every family on official-tiny

Re-running with the same ``--out`` reuses the finished arms (same config, model, sampling and samples) and computes
only the missing ones. Families: scorer, activation, linkage, cache, guidance, extractor, method, options.
"""

from __future__ import annotations

import argparse
import os
import sys

from studies._args import (ArgumentParser, accelerator, at_least, check_devices, existing_path, lightning_interrupts,
                           model_name, non_negative_int, positive_int, preset_name, results_folder, threads_setting)
from studies._cli import note_results_folder, run_cli


def _families() -> list[str]:
    from ablations.base import family_names

    return family_names()


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m studies.ablate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", help="an ablation family, 'ls' or 'validate'")
    parser.add_argument("--model", default=None, type=model_name,
                        help="model name (default: testbed when its weights are shipped, else official-tiny)")
    parser.add_argument("--weights", default=None, type=existing_path,
                        help="local weights (file or folder) for --model")
    parser.add_argument("--samples", type=at_least(2, "(confidence intervals need spread)"), default=64,
                        help="samples per arm (default 64)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="generation batch size (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="base seed; sample i uses a hash of (seed, i)")
    parser.add_argument("--out", default=None, type=results_folder,
                        help="results folder (default results/ablate/<family>_<model>_n<N>_seed<S>); re-use it "
                             "to resume")
    parser.add_argument("--accelerator", default="cpu", type=accelerator,
                        help="Lightning accelerator: cpu, gpu, auto (default cpu)")
    parser.add_argument("--devices", type=positive_int, default=1, help="processes / devices (DDP when > 1)")
    parser.add_argument("--strategy", default="auto", help="Lightning strategy (auto: ddp_spawn when devices > 1)")
    parser.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                        help="W&B mirror of the results (default: $WANDB_MODE if set, else offline)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="typed override applied to every non-baseline arm, e.g. --set schedule.tau=0.7, "
                             "--set granularity=branch (repeatable)")
    parser.add_argument("--method", default="nova", type=preset_name,
                        help="base method of the 'options' family (default nova)")
    parser.add_argument("--arms", default=None, help="comma-separated arm names to run (baseline always runs)")
    parser.add_argument("--warmup", type=non_negative_int, default=1,
                        help="discarded warm-up generations per arm and process")
    parser.add_argument("--timing-rounds", type=non_negative_int, default=5,
                        help="after all arms, re-time a batch of --timing-batch per arm this many times with the "
                             "arms interleaved (speedups robust to load changes on a shared machine; 0: off)")
    parser.add_argument("--timing-batch", type=positive_int, default=1,
                        help="batch size of the interleaved re-timing (default 1: the latency regime)")
    parser.add_argument("--threads", default="auto", type=threads_setting,
                        help="intra-op threads per process: N, 'torch' (torch's default; DDP on CPU: cores / "
                             "processes) or 'auto' (default: torch's unless the load average shows other jobs on the "
                             "cores, then only the free ones, at least 1; decided once per study)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--classifier", default=None, type=existing_path,
                        help="testbed classifier weights (default: shipped file)")
    parser.add_argument("--inception-weights", default=None, type=existing_path,
                        help="local Inception-v3 weights for standard FID (never downloaded)")
    parser.add_argument("--clip-weights", default=None, type=existing_path,
                        help="local CLIP model folder for CLIP score")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-plots", action="store_true", help="skip the plots")
    parser.add_argument("--max-scales", type=positive_int, default=None,
                        help="validate: stop every policy after N scales")
    parser.add_argument("--family", action="append", default=None, help="validate: only these families")
    return parser


def cmd_ls() -> int:
    from ablations.base import FAMILIES, build_arms, family_names
    from var_core.accel.presets import PRESETS, preset_summary
    from var_core.accel.registry import REGISTRIES

    print("Ablation families (python -m studies.ablate FAMILY):")
    for name in family_names():
        _, doc = FAMILIES[name]
        try:
            arms = build_arms(name)
            bad = [a.name for a in arms if not a.ok]
            extra = f"; unavailable: {', '.join(bad)}" if bad else ""
            print(f"  {name:<11} {doc}\n  {'':<11} arms: {', '.join(a.name for a in arms)}{extra}")
        except Exception as exc:  # noqa: BLE001
            print(f"  {name:<11} {doc}\n  {'':<11} ERROR building arms: {exc}")
    print("\nComponents per registry:")
    for kind, registry in REGISTRIES.items():
        print(f"  {kind}:")
        for name in registry.names():
            print(f"    {name:<20} {registry.summary(name)}")
    print("\nPresets:")
    for name in PRESETS:
        print(f"  {name:<11} {preset_summary(name)}")
    return 0


def cmd_validate(args) -> int:
    from ablations.runner import resolve_threads
    from ablations.validate import validate_families

    report = validate_families(args.family, model=args.model or "official-tiny", weights=args.weights,
                               max_scales=args.max_scales, overrides=args.overrides, method=args.method,
                               threads=resolve_threads(args.threads)[0])
    print(f"validate: {len(report.checked)} arms ok, {len(report.errors)} failed ({report.seconds:.1f} s)")
    for family, arm, message in report.errors:
        print(f"  {family}/{arm}: {message}")
    return 0 if report.ok else 1


def cmd_family(args) -> int:
    from ablations.overrides import OverrideError
    from ablations.runner import StudyOptions, plan_study, run_study

    wandb_mode = args.wandb or os.environ.get("WANDB_MODE") or "offline"
    if wandb_mode not in ("offline", "online", "disabled"):
        wandb_mode = "disabled" if wandb_mode in ("dryrun", "off") else "offline"
    options = StudyOptions(
        family=args.command, model=args.model, weights=args.weights, samples=args.samples,
        batch_size=args.batch_size, seed=args.seed, out=args.out, accelerator=args.accelerator,
        devices=args.devices, strategy=args.strategy, wandb=wandb_mode, overrides=tuple(args.overrides),
        method=args.method, warmup=args.warmup, progress=not args.no_progress, dtype=args.dtype,
        arms=tuple(a.strip() for a in args.arms.split(",")) if args.arms else None,
        inception_weights=args.inception_weights, clip_weights=args.clip_weights, classifier=args.classifier,
        plots=not args.no_plots, threads=args.threads, timing_rounds=args.timing_rounds,
        timing_batch=args.timing_batch)
    try:
        plan = plan_study(options)
    except (OverrideError, ValueError, KeyError) as exc:
        print(f"error: {exc if not isinstance(exc, KeyError) else exc.args[0]}", file=sys.stderr)
        return 2
    note_results_folder(plan.out_dir)  # Ctrl-C from here on names it: finished arms are kept there
    with lightning_interrupts():
        result = run_study(options, plan=plan)
    print()
    table = result.out_dir / "table.md"
    if table.is_file():
        text = table.read_text().splitlines()
        start = next((i for i, line in enumerate(text) if line.startswith("| arm")), None)
        if start is not None:
            end = start
            while end < len(text) and text[end].startswith("|"):
                end += 1
            print("\n".join(text[start:end]))
            print()
    o = result.outputs
    print(f"done in {result.seconds:.1f} s: {len(result.computed)} arms computed, {len(result.reused)} reused"
          + (f", {len(result.unavailable)} unavailable" if result.unavailable else ""))
    print(f"results folder : {result.out_dir}")
    print(f"  manifest     : {result.out_dir / 'study.json'}")
    print(f"  arm records  : {result.out_dir / 'arms'}/*.json ({len(result.records)})")
    print(f"  table        : {o.get('markdown')}  and  {o.get('csv')}")
    for name, path in (o.get("plots") or {}).items():
        print(f"  plot         : {path}")
    grids = o.get("grids") or {}
    if grids:
        print(f"  sample grids : {result.out_dir / 'grids'} ({len(grids)} files; overview.png: one row per arm, "
              f"same seeds)")
    if o.get("wandb"):
        print(f"  W&B ({options.wandb}) : {o['wandb']}" + ("  (sync later: wandb sync " + o["wandb"] + ")"
                                                          if options.wandb == "offline" else ""))
    elif o.get("wandb_error"):
        print(f"  W&B          : failed ({o['wandb_error']})")
    else:
        print("  W&B          : disabled")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "ls":
        return cmd_ls()
    if args.command == "validate":
        return cmd_validate(args)
    families = _families()
    if args.command not in families:
        import difflib

        close = difflib.get_close_matches(args.command, families + ["ls", "validate"], n=3, cutoff=0.4)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        print(f"error: unknown command {args.command!r}.{hint} Use a family ({', '.join(families)}), 'ls' or "
              f"'validate'.", file=sys.stderr)
        return 2
    check_devices(args.accelerator, args.devices)
    return cmd_family(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
