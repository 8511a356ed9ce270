"""``python -m studies.latency``: a latency report of one acceleration method against others.

    python -m studies.latency                                   # nova vs baseline on the default model
    python -m studies.latency --model random:var-d16 --method nova --compare baseline fastvar \\
        --batch-size 1 --throughput-batch 4 --repeats 3 --warmup 1 --threads 1
    python -m studies.latency --model random:infinity-tiny --profile     # + torch.profiler trace and op table

Writes into ``--out`` (default ``results/latency/<model>_<method>_b<B>-<TB>``):

* ``report.md`` — environment, timing protocol, the side-by-side of methods (latency with spread, speedup, FLOPs
  ratio, memory, throughput), per-scale tables, the breakdown of one representative high-resolution scale per
  method (NOVA's Table 8 layout, with the entropy / scoring share), the figures;
* ``summary.csv`` (one row per method × batch size), ``repeats.csv`` (every timed run), ``per_scale.csv``,
  ``report.json`` (all of it plus the environment and the arguments);
* PNGs (seaborn): ``methods_latency.png``, ``methods_per_scale.png``, ``methods_memory.png`` and, per method at the
  latency batch (every batch with ``--all-breakdowns``), the ``profilers.breakdown.write_breakdown`` set under
  ``breakdown/<method>_b<B>/`` (stacked per-scale bars by component in ms and GFLOPs, per-layer heat maps in ms
  and GFLOPs, memory per scale, and their CSVs);
* with ``--profile``: ``profile/<method>_b<B>_cycle0.json`` (Chrome trace, open in chrome://tracing or Perfetto),
  ``profile/ops_by_range.csv`` and an operator table grouped by loop range in the report.

Measuring and writing are :func:`profilers.latency_report.report_latency`; :func:`run_latency` loads the model for it.
``--help`` ends with the measurement protocol.
"""

from __future__ import annotations

import argparse
import sys

import torch

from profilers.latency_report import (PROTOCOL, LatencySettings, arch_flops_summary, default_out_dir, latency_device,
                                      latency_methods, report_latency)
from studies._args import (PRECISION_HELP, ArgumentParser, device_setting, launch_banner, launch_precision,
                           model_family, model_name, non_negative_int, positive_int, precision_setting, preset_name,
                           results_folder, seed_int)
from studies._cli import run_cli
from studies._model_cli import add_model_arguments, model_settings


def run_latency(settings: LatencySettings, command: str | None = None, log=print) -> dict:
    """The study: check the methods, load the model (``ablations.runner``: the default model, checkpoint paths,
    the model's sampling with ``--cfg --top-k --top-p --temperature``), then
    :func:`profilers.latency_report.report_latency`. ``--threads`` is restored to its previous value afterwards."""
    from ablations.runner import images_root, load_study_model, resolve_model, resolve_sampling, sampling_overrides

    latency_methods(settings)  # a bad count or an unknown preset fails before anything is loaded
    previous_threads = torch.get_num_threads()
    try:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        from var_core.engine.precision import parameter_dtype, study_precision

        model, _, notes = resolve_model(settings.model, settings.weights)
        device = latency_device(settings)  # auto: cuda when torch sees a GPU, else cpu
        log(launch_banner("latency", settings.device or "auto", device, settings.precision
                          or (None if settings.dtype == "float32" else launch_precision(settings)),
                          model_family(model)))
        adapter = load_study_model(model, settings.weights, vae_weights=settings.vae_weights,
                                   text_encoder=settings.text_encoder, device=device,
                                   dtype=parameter_dtype(settings.precision, settings.dtype), seed=settings.seed)
        adapter.precision = study_precision(settings.precision, settings.dtype, adapter.family, adapter.device)
        check_breakdown_scale(settings.breakdown_scale, adapter.num_scales, model)
        sampling = resolve_sampling(adapter, model, settings.weights, sampling_overrides(settings))
        images = images_root(settings.save_images, default_out_dir(settings, adapter.model_name))
        return report_latency(settings, adapter, model, sampling, notes=notes, images_root=images, command=command,
                              log=log)
    finally:
        if torch.get_num_threads() != previous_threads:
            torch.set_num_threads(previous_threads)


def check_breakdown_scale(scale: int | None, num_scales: int, model: str) -> None:
    """``--breakdown-scale`` must name a scale of the loaded model (0 … num_scales - 1): the report would otherwise
    break down another scale than the one asked for."""
    from var_core.errors import UserError

    if scale is not None and not 0 <= scale < num_scales:
        raise UserError(f"argument --breakdown-scale: {model} has {num_scales} scales (0 … {num_scales - 1}), got "
                        f"{scale}; give one of them or leave the option out for the last scale")


def _arch_flops_main(args) -> int:
    for line in arch_flops_summary(args.model or "infinity-2b", args.text_len, args.batch_size,
                                   guidance=not args.no_guidance, out=args.out):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m studies.latency", description=__doc__ + "\n" + PROTOCOL,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, type=model_name,
                   help="model name (default: testbed when its weights are shipped, else official-tiny); "
                        "random:var-d16, random:infinity-tiny, ...")
    add_model_arguments(p)  # --weights --vae-weights --text-encoder --cfg --top-k --top-p --temperature --prompts
    #                          --save-images (studies._model_cli)
    p.add_argument("--method", default="nova", type=preset_name, help="the method preset to report (default nova)")
    p.add_argument("--compare", nargs="*", default=["baseline"], type=preset_name,
                   help="presets to compare against (default: baseline; baseline is always added as the reference)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="latency batch (default 1)")
    p.add_argument("--throughput-batch", type=non_negative_int, default=16,
                   help="throughput batch (default 16; 0: none)")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="discarded generations per method and batch (default 2)")
    p.add_argument("--out", default=None, type=results_folder, help="output folder")
    p.add_argument("--profile", action="store_true", help="also a torch.profiler chrome trace and op table")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default="auto", type=device_setting,
                   help="auto (default: cuda when torch sees a CUDA GPU, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--precision", default=None, type=precision_setting, help=PRECISION_HELP)
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="former option, an alias: float32 = --precision fp32, bfloat16 = --precision bf16")
    p.add_argument("--breakdown-scale", type=non_negative_int, default=None,
                   help="scale of the Table-8 breakdown, 0-indexed (default: the last)")
    p.add_argument("--no-plots", action="store_true", help="tables only")
    p.add_argument("--arch-flops", action="store_true",
                   help="only print the analytic per-scale FLOPs of --model's architecture for a dense generation "
                        "(no weights loaded, nothing run; works for infinity-2b, var-d30, ...)")
    p.add_argument("--text-len", type=positive_int, default=64,
                   help="with --arch-flops (Infinity): text tokens (default 64)")
    p.add_argument("--no-guidance", action="store_true", help="with --arch-flops: one row per sample (no CFG)")
    p.add_argument("--all-breakdowns", action="store_true",
                   help="per-method breakdown figures (breakdown/<method>_b<B>/) for the throughput batch too "
                        "(default: the latency batch only)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.arch_flops:
        return _arch_flops_main(args)
    settings = LatencySettings(
        model=args.model, weights=args.weights, method=args.method, compare=tuple(args.compare),
        batch_size=args.batch_size, throughput_batch=args.throughput_batch, repeats=args.repeats,
        warmup=args.warmup, out=args.out, profile=args.profile, seed=args.seed, threads=args.threads,
        device=args.device, precision=launch_precision(args), breakdown_scale=args.breakdown_scale, plots=not args.no_plots,
        all_breakdowns=args.all_breakdowns, **model_settings(args),
    )
    command = "python -m studies.latency " + " ".join(sys.argv[1:] if argv is None else argv)
    result = run_latency(settings, command=command.strip())
    summary = result["summary"]
    cols = ["method", "batch", "total_ms", "transformer_ms", "speedup_transformer", "speedup_total", "flops_ratio",
            "peak_mib", "memory_source"]
    print(summary[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"report: {result['paths']['report_md']}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
