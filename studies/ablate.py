"""``python -m studies.ablate FAMILY``: run one ablation family and write a self-describing results folder.

    python -m studies.ablate scorer                       # NOVA Table 4 on the default model, 64 samples per arm
    python -m studies.ablate linkage --samples 128 --set schedule.tau=0.7
    python -m studies.ablate options --method ldpruning --wandb disabled
    python -m studies.ablate ls                           # families, components per registry, presets
    python -m studies.ablate ls families                  # each family, the paper table it reproduces, its arms
    python -m studies.ablate ls presets                   # each preset's description and resolved setting
    python -m studies.ablate ls metrics --clip-weights DIR  # every metric: direction, weights, can it run here
    python -m studies.ablate ls models                    # every zoo entry: files needed, scale schedule, tokens
    python -m studies.ablate validate                     # build + run every arm of every family on official-tiny

Re-running with the same ``--out`` reuses the finished arms (same config, model, sampling and samples) and computes
only the missing ones. Families: scorer, activation, linkage, cache, guidance, extractor, method, options, depth,
criterion.
"""

from __future__ import annotations

import argparse
import os
import sys

from studies._args import (ArgumentParser, add_config_arguments, add_launch_arguments, at_least, check_devices,
                           existing_path, format_config, launch_banner, launch_precision, lightning_interrupts,
                           model_family, model_name, non_negative_int, parse_with_config, positive_int, preset_name,
                           results_folder, seed_int, threads_setting)
from studies._cli import note_results_folder, run_cli
from studies._evaluation_cli import add_protocol_arguments, protocol_settings
from studies._model_cli import add_model_arguments, model_settings


def _families() -> list[str]:
    from ablations.base import family_names

    return family_names()


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m studies.ablate", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", help="an ablation family, 'ls' or 'validate'")
    parser.add_argument("topic", nargs="?", default=None,
                        help="ls only: families, components, presets, metrics or models (default: all of them)")
    parser.add_argument("--model", default=None, type=model_name,
                        help="model name (default: testbed when its weights are shipped, else official-tiny)")
    add_model_arguments(parser)  # --weights --vae-weights --text-encoder --cfg --top-k --top-p --temperature
    #                               --prompts --save-images (studies._model_cli)
    add_protocol_arguments(parser)  # --fid-reference --protocol --resolution --aspect --more-smooth
    #                                  --prompts-rewritten (studies._evaluation_cli)
    parser.add_argument("--samples", type=at_least(2, "(confidence intervals need spread)"), default=None,
                        help="samples per arm (default: the family's, 64; scorer 32, its 19 arms within the "
                             "default study's 5 minutes)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="generation batch size (default 16)")
    parser.add_argument("--seed", type=seed_int, default=0, help="base seed; sample i uses a hash of (seed, i)")
    parser.add_argument("--out", default=None, type=results_folder,
                        help="results folder (default results/ablate/<family>_<model>_n<N>_seed<S>, plus a part "
                             "per --set / --prompts / sampling / weights setting given, and _<cpu|gpu>_<precision> unless the CPU in fp32); re-use it to "
                             "resume (records of another configuration are moved to <out>/superseded/, never "
                             "deleted)")
    add_launch_arguments(parser)  # --accelerator (default auto) --devices --num-nodes --strategy --precision --dtype
    parser.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None,
                        help="W&B mirror of the results (default: $WANDB_MODE if set, else offline)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="typed override applied to every non-baseline arm, e.g. --set schedule.tau=0.7, "
                             "--set granularity=branch (repeatable)")
    parser.add_argument("--swap", dest="swaps", action="append", default=[], metavar="KIND=NAME[:K=V,...]",
                        help="replace a component of every non-baseline arm, e.g. --swap scorer=entropy:source=lens "
                             "(repeatable; ablations.swaps)")
    parser.add_argument("--extra-arm", dest="extra_arms", action="append", default=[],
                        metavar="NAME=PRESET[+EDIT...]", help="add an arm to the family: a preset, then edits "
                        "KIND=COMPONENT[:K=V,...] or KEY=VALUE joined by '+', e.g. mine=nova+scorer=entropy")
    parser.add_argument("--plugins", action="append", default=[], metavar="PATH",
                        help="a .py file or folder of plugins (components, presets, families) to load; also "
                             "$VARSCOPE_PLUGINS and installed 'varscope.plugins' entry points (var_core.plugins)")
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
    parser.add_argument("--retime", action="store_true",
                        help="re-measure the interleaved re-timing even when the results folder has one of the same "
                             "arms and settings (a resume reuses it otherwise; timing_interleaved.json records when "
                             "and why it was measured)")
    parser.add_argument("--threads", default="auto", type=threads_setting,
                        help="intra-op threads per process: N, 'torch' (torch's default; DDP on CPU: cores / "
                             "processes) or 'auto' (default: torch's unless the load average shows other jobs on the "
                             "cores, then only the free ones, at least 1; decided once per study)")
    parser.add_argument("--classifier", default=None, type=existing_path,
                        help="testbed classifier weights (default: shipped file)")
    parser.add_argument("--inception-weights", default=None, type=existing_path,
                        help="local Inception-v3 weights for standard FID (never downloaded)")
    parser.add_argument("--clip-weights", default=None, type=existing_path,
                        help="local CLIP model folder for CLIP score")
    parser.add_argument("--image-reward-weights", default=None, type=existing_path,
                        help="ImageReward.pt (or its folder, with a bert-base-uncased/ tokenizer folder beside it)")
    parser.add_argument("--hps-weights", default=None, type=existing_path,
                        help="HPS_v2.1_compressed.pt (or its folder, with a CLIP tokenizer/ folder beside it)")
    parser.add_argument("--lpips-backbone", default=None, type=existing_path,
                        help="LPIPS backbone weights (torchvision alexnet/vgg16 `features.N.*` layout) for LPIPS "
                             "against the baseline (never downloaded)")
    parser.add_argument("--lpips-lin", default=None, type=existing_path,
                        help="LPIPS linear layers (the lpips package's v0.1 `alex.pth` / `vgg.pth`)")
    parser.add_argument("--lpips-net", default="alex", choices=("alex", "vgg"), help="LPIPS backbone (default alex)")
    parser.add_argument("--fid-protocol", default=None, choices=("torch-fidelity", "pytorch-fid", "torchmetrics"),
                        help="input pipeline of the FID Inception network (default torch-fidelity, the ADM "
                             "evaluator's TF graph that VAR's numbers come from; named in every record)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--no-plots", action="store_true", help="skip the plots")
    parser.add_argument("--max-scales", type=positive_int, default=None,
                        help="validate: stop every policy after N scales")
    parser.add_argument("--family", action="append", default=None, help="validate: only these families")
    add_config_arguments(parser)  # --config FILE --print-config
    return parser


def cmd_ls(topic: str | None = None, args=None) -> int:
    """``ls`` (everything) or ``ls TOPIC``: :func:`ablations.listing.listing` (families with the paper table each
    reproduces, components, presets with their whole description, metrics, models)."""
    from ablations.listing import listing

    print(listing(topic, args))
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


def default_samples(args) -> int:
    """``--samples``, else the family's default (``FamilyInfo.samples``: 64, fewer for a family with many arms)."""
    if args.samples is not None:
        return args.samples
    from ablations.base import family_info

    try:
        return family_info(args.command).samples
    except KeyError:  # an unknown family: plan_study reports it with a did-you-mean
        return 64


def cmd_family(args) -> int:
    from ablations.overrides import OverrideError
    from ablations.runner import StudyOptions, plan_study, run_study

    wandb_mode = args.wandb or os.environ.get("WANDB_MODE") or "offline"
    if wandb_mode not in ("offline", "online", "disabled"):
        wandb_mode = "disabled" if wandb_mode in ("dryrun", "off") else "offline"
    options = StudyOptions(
        family=args.command, model=args.model, weights=args.weights, samples=default_samples(args),
        batch_size=args.batch_size, seed=args.seed, out=args.out, accelerator=args.accelerator,
        devices=args.devices, num_nodes=args.num_nodes, strategy=args.strategy, wandb=wandb_mode,
        overrides=tuple(args.overrides), swaps=tuple(args.swaps), extra_arms=tuple(args.extra_arms),
        method=args.method, warmup=args.warmup, progress=not args.no_progress, precision=launch_precision(args),
        arms=tuple(a.strip() for a in args.arms.split(",")) if args.arms else None,
        inception_weights=args.inception_weights, clip_weights=args.clip_weights, classifier=args.classifier,
        image_reward_weights=args.image_reward_weights, hps_weights=args.hps_weights, lpips_backbone=args.lpips_backbone,
        lpips_lin=args.lpips_lin, lpips_net=args.lpips_net, fid_protocol=args.fid_protocol, plots=not args.no_plots,
        threads=args.threads, timing_rounds=args.timing_rounds,
        timing_batch=args.timing_batch, retime=args.retime, **model_settings(args), **protocol_settings(args))
    try:
        plan = plan_study(options)
    except (OverrideError, ValueError, KeyError) as exc:
        print(f"error: {exc if not isinstance(exc, KeyError) else exc.args[0]}", file=sys.stderr)
        return 2
    note_results_folder(plan.out_dir)  # Ctrl-C from here on names it: finished arms are kept there
    with lightning_interrupts():
        result = run_study(options, plan=plan)
    from var_core.eval.distributed import is_secondary_rank

    if is_secondary_rank():  # rank 0 wrote the records and prints the summary
        return 0
    from ablations.listing import study_summary

    print(study_summary(result, options))
    return 0


def main(argv=None) -> int:
    from var_core.plugins import take_plugin_args

    argv = take_plugin_args(list(sys.argv[1:] if argv is None else argv))  # before parsing: --method may name one
    parser = build_parser()
    args = parse_with_config(parser, argv)  # --config FILE (flags override it)
    if args.print_config:  # the resolved study as YAML: --config of it runs the same study
        print(format_config(parser, args), end="")
        return 0
    if args.command == "ls":
        return cmd_ls(args.topic, args)
    if args.topic is not None:
        from var_core.errors import UserError

        from ablations.listing import LS_TOPICS

        raise UserError(f"unexpected argument {args.topic!r} after {args.command!r} (only 'ls' takes a topic: "
                        f"{', '.join(LS_TOPICS)})")
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
    protocol_settings(args)  # --protocol sets --samples / sampling first (studies._evaluation_cli)
    check_devices(args.accelerator, args.devices, args.num_nodes, args.strategy, samples=default_samples(args),
                  batch_size=args.batch_size)
    from var_core.eval.distributed import is_secondary_rank, resolve_launch

    from ablations.runner import resolve_model

    if not is_secondary_rank():  # the device and precision, first (every rank runs the same)
        launch = resolve_launch(args.accelerator, args.devices, args.num_nodes, args.strategy)
        print(launch_banner(f"ablate {args.command}", args.accelerator, launch.device, launch_precision(args),
                            model_family(resolve_model(args.model, args.weights)[0])), flush=True)
    return cmd_family(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
