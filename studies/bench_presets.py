"""``python -m studies.bench presets``: every method preset against the baseline, measured in one run.

Per preset: analytic FLOPs ratio (transformer + head, from the kept-token counts the run actually used),
wall-clock ratio (median of interleaved repeats, warm-up discarded, VQ decode outside the timed region),
measured speedup / FLOPs-ideal speedup, and two time shares measured with ``profilers.timers.ComponentTimer``:
``scoring`` — the components' own work (scorer spans and predictive-entropy computations: softmax/entropy,
top-k, maps) — and ``lens`` — the head projections of NOVA's logit lens, which are model FLOPs (counted in the
FLOPs ratio, so in the ideal) rather than overhead outside it.
The last line is ``speedup_vs_ideal_min=… entropy_overhead=… scoring_overhead_max=… lens_share=…``: the worst
token-pruning preset's measured/ideal ratio, NOVA's scoring share (entropy included), the largest scoring share
of any preset, and NOVA's lens-projection share.

The first generation of every preset is both the warm-up and the run whose kept-token counts give the FLOPs;
the timed repeats follow, interleaved across presets so that machine drift hits every preset alike. Progress
goes to stderr, the table to stdout.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from profilers.flops import count_flops
from profilers.timers import ComponentTimer
from studies.bench import environment_line, interleaved_medians
from var_core.accel import build_policy
from var_core.accel.presets import PRESETS, get_preset
from var_core.engine import GenerationOptions, SamplingConfig, generate

TOKEN_PRUNING = ("nova", "fastvar", "ldpruning", "toprovar", "sparsevar", "stagevar")
SCORING_SPANS = ("accel/scorer", "accel/entropy")
LENS_SPANS = ("lens",)


def _progress(message: str) -> None:
    print(f"[bench presets {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def bench_presets(args) -> int:
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    from studies.bench import bench_sampling, load_bench_model, save_bench_images

    adapter = load_bench_model(args)
    sampling = bench_sampling(args, getattr(adapter, "default_sampling", SamplingConfig()))
    options = GenerationOptions(check_finite=False, decode=False, keep_raw_logits=True)
    names = args.presets or sorted(PRESETS)
    if "baseline" not in names:
        names = ["baseline"] + names
    B = args.batch_size
    labels = torch.arange(B) % adapter.cfg.num_classes
    prompt_set = None
    if getattr(args, "prompts", None) is not None:  # text-to-image prompt set: sample i on prompt i mod P
        from studies.latency import conditions_for
        from var_core.eval.prompts import load_prompt_set

        prompt_set = load_prompt_set(args.prompts)
        labels = conditions_for(adapter, B, 0, prompt_set)
    seeds = list(range(1000, 1000 + B))
    policies = {name: build_policy(get_preset(name)) for name in names}
    print(environment_line(adapter, B))

    flops, results = {}, {}
    for name, policy in policies.items():
        _progress(f"warm-up + FLOPs: {name}")
        results[name] = generate(adapter, labels, seeds, sampling, policy=policy, options=options)
        flops[name] = count_flops(adapter, results[name], batch_size=B).total

    variants = {name: (lambda p=policy: generate(adapter, labels, seeds, sampling, policy=p, options=options))
                for name, policy in policies.items()}
    _progress(f"timing {len(variants)} presets x {args.repeats} interleaved repeats")
    times = interleaved_medians(variants, args.repeats, warmup=0)

    scoring_share, lens_share = {}, {}
    for name in names:
        _progress(f"component timers: {name}")
        timer = ComponentTimer()
        generate(adapter, labels, seeds, sampling, policy=policies[name], tracer=timer, options=options)
        table = timer.per_component()
        total = timer.total_ms()

        def share(spans):
            return float(table.loc[table.index.isin(spans), "self_ms"].sum()) / total if total > 0 else 0.0

        scoring_share[name], lens_share[name] = share(SCORING_SPANS), share(LENS_SPANS)

    base_t = statistics.median(times["baseline"])
    base_f = flops["baseline"]
    print(f"{'preset':10s} {'FLOPs ratio':>11s} {'ideal x':>8s} {'time s':>8s} {'time ratio':>10s} {'measured x':>10s} "
          f"{'meas/ideal':>10s} {'scoring %':>9s} {'lens %':>7s}  computed tokens per scale")
    ratios = {}
    for name in names:
        t = statistics.median(times[name])
        f_ratio = flops[name] / base_f
        ideal = 1 / f_ratio
        measured = base_t / t
        ratios[name] = measured / ideal
        tokens = results[name].computed_tokens_per_scale()
        print(f"{name:10s} {f_ratio:11.3f} {ideal:8.2f} {t:8.3f} {t / base_t:10.3f} {measured:10.2f} "
              f"{ratios[name]:10.2f} {100 * scoring_share[name]:8.2f}% {100 * lens_share[name]:6.2f}%  {tokens}")
    for name in names:  # --save-images: one untimed decoded generation per preset, after the measurements
        save_bench_images(args, adapter, f"{name}_b{B}", labels, seeds, sampling, policies[name], prompt_set)
    pruning = [n for n in names if n in TOKEN_PRUNING and flops[n] < 0.99 * base_f]
    worst = min((ratios[n] for n in pruning), default=float("nan"))
    entropy = scoring_share.get("nova", float("nan"))
    print(f"speedup_vs_ideal_min={worst:.3f} entropy_overhead={entropy:.4f} "
          f"scoring_overhead_max={max(scoring_share.values()):.4f} lens_share={lens_share.get('nova', float('nan')):.4f}")
    return 0
