"""``python -m studies.bench {engine,presets,entropy}``: wall-clock benchmarks that print ratios measured in one run.

``engine``  — our hookable loop vs a straightforward implementation of the official algorithm
              (``var_core.engine.reference_loop``), the cost of a composed no-op policy, and the effect of pruning
              half of the last scale (FLOPs ratio and measured time ratio of that scale).
``presets`` — every method preset vs the baseline: FLOPs ratio, wall-clock ratio, measured/ideal speedup (FLOPs and
              bandwidth-aware), and the entropy scorer's share of generation time (see ``--help``).
``entropy`` — ToProVAR's attention entropy without the probabilities (fused kernel, chunked log-sum-exp) vs plain
              SDPA and vs the materialised probabilities.

Timing discipline: warm-up runs discarded; variants interleaved run by run (so machine noise hits all of
them alike); medians over repeats; the VQ decoder is outside the timed region unless ``--with-decode``.
These are benchmarks, not tests: the machines are shared and noisy, so read ratios, not absolute seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from profilers.benchmarks import ENGINE_SAMPLING, bench_engine, bench_presets, bench_sampling
from studies._args import (ArgumentParser, device_setting, launch_banner, launch_precision, model_family, model_name,
                           positive_int, precision_setting, preset_name, resolve_device, seed_int, torch_device)
from studies._cli import run_cli
from studies._model_cli import add_model_arguments
from var_core.engine import SamplingConfig


def run_bench(args) -> int:
    """Load ``--model`` (``--weights --vae-weights --text-encoder``), its sampling with ``--cfg --top-k --top-p
    --temperature`` and ``--prompts``, then :func:`profilers.benchmarks.bench_engine` or
    :func:`~profilers.benchmarks.bench_presets`. Images (``--save-images [DIR]``) go to DIR or
    ``results/bench/<command>_<model>/``."""
    from ablations.runner import images_root, load_prompts, load_study_model, sampling_overrides

    if args.what in ("presets", "entropy") and args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "entropy":
        from profilers.benchmarks import bench_attention_entropy

        return bench_attention_entropy(repeats=args.repeats, device=args.device)
    from var_core.engine.precision import parameter_dtype, study_precision

    device = resolve_device(args.device)
    precision = launch_precision(args)
    family = model_family(args.model)
    # the first line: where it times and in which precision (the table headers repeat it from the loaded model)
    print(launch_banner(f"bench {args.what}", args.device, device, precision, family), flush=True)
    adapter = load_study_model(args.model, args.weights, vae_weights=args.vae_weights,
                               text_encoder=args.text_encoder, seed=args.seed, dtype=parameter_dtype(precision),
                               device=device)
    adapter.precision = study_precision(precision, None, adapter.family, adapter.device)
    default_images = Path("results") / "bench" / f"{args.what}_{str(args.model).replace(':', '-')}"
    images = images_root(args.save_images, default_images)
    if args.what == "engine":
        return bench_engine(adapter, bench_sampling(ENGINE_SAMPLING, sampling_overrides(args)), args.batch_sizes,
                            args.repeats, with_decode=args.with_decode, images_root=images)
    sampling = bench_sampling(getattr(adapter, "default_sampling", SamplingConfig()), sampling_overrides(args))
    return bench_presets(adapter, sampling, args.batch_size, args.repeats, presets=args.presets,
                         prompt_set=load_prompts(args.prompts), images_root=images)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m studies.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    eng = sub.add_parser("engine", help="engine vs reference loop; empty-slot cost; half-pruned last scale")
    eng.add_argument("--model", default="random:var-d16", type=model_name)
    eng.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 8])
    eng.add_argument("--repeats", type=positive_int, default=3)
    eng.add_argument("--seed", type=seed_int, default=0)
    eng.add_argument("--with-decode", action="store_true", help="include the VQ decoder in the timed region")
    # the engine bench compares against the VAR reference loop: class labels only, so no --prompts
    add_model_arguments(eng, prompts=False)
    pre = sub.add_parser("presets", help="every preset vs baseline (FLOPs, wall clock, entropy overhead)")
    pre.add_argument("--model", default="testbed", type=model_name)
    pre.add_argument("--batch-size", type=positive_int, default=1)
    pre.add_argument("--repeats", type=positive_int, default=3)
    pre.add_argument("--seed", type=seed_int, default=0)
    pre.add_argument("--presets", nargs="*", default=None, type=preset_name)
    pre.add_argument("--threads", type=positive_int, default=None,
                     help="torch intra-op threads (default: torch's own; 1 gives the steadiest ratios on a shared CPU)")
    add_model_arguments(pre)  # --weights --vae-weights --text-encoder --cfg --top-k --top-p --temperature --prompts
    #                            --save-images (studies._model_cli)
    ent = sub.add_parser("entropy", help="ToProVAR's attention entropy (fused / chunked / materialised) vs SDPA")
    ent.add_argument("--repeats", type=positive_int, default=5)
    ent.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    ent.add_argument("--device", default="cpu", type=torch_device,
                     help="cpu or cuda (the fused entropy route is CPU-only; CUDA runs "
                     "the chunked pass)")
    for sub_parser in (eng, pre):
        sub_parser.add_argument("--device", default="auto", type=device_setting,
                                help="where to load and time: auto (default: cuda when torch sees a CUDA GPU, else "
                                     "cpu), cpu, cuda, cuda:N")
        sub_parser.add_argument("--precision", default=None, type=precision_setting,
                                help="fp32, tf32, bf16-autocast, fp16-autocast (+tf32) or bf16 (default: the official "
                                     "sampler's on a GPU, fp32 on a CPU)")
    args = parser.parse_args(argv)
    return run_bench(args)


if __name__ == "__main__":
    sys.exit(run_cli(main))
