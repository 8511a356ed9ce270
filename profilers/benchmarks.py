"""The wall-clock benchmarks of ``python -m studies.bench``: ratios measured in one run.

* :func:`bench_engine` — our hookable loop vs a straightforward implementation of the official algorithm
  (``var_core.engine.reference_loop``), the cost of a composed no-op policy, and the effect of pruning half of the
  last scale (FLOPs ratio and measured time ratio of that scale).
* :func:`bench_presets` — every method preset against the baseline.

Timing discipline: warm-up runs discarded; variants interleaved run by run (so machine noise hits all of them
alike); medians over repeats; the VQ decoder is outside the timed region unless ``--with-decode``. These are
benchmarks, not tests: the machines are shared and noisy, so read ratios, not absolute seconds. Both take a loaded
model (``studies.bench`` loads it with the study options) and print their tables.

Presets benchmark. Per preset: analytic FLOPs ratio (transformer + head, from the kept-token counts the run
actually used), wall-clock ratio (median of interleaved repeats, warm-up discarded, VQ decode outside the timed region),
measured speedup / FLOPs-ideal speedup, and two time shares measured with ``profilers.timers.ComponentTimer``:
``scoring`` — the components' own work (scorer spans and predictive-entropy computations: softmax/entropy,
top-k, maps) — and ``lens`` — the head projections of NOVA's logit lens, which are model FLOPs (counted in the
FLOPs ratio, so in the ideal) rather than overhead outside it.
Next to the FLOPs-ideal speedup, a **bandwidth-aware ideal** (``bw-ideal x``): the modelled time of the baseline
over the preset's on a roofline measured at the start (``profilers.memory``: every op costs its FLOPs at the
sustained GEMM rate plus the bytes it streams — weights, activations, cached keys — at the sustained weight-
streaming rate), with ``GB moved`` per generation. At batch 1 every scale streams all block weights however few
tokens it keeps, which the FLOPs-only ideal ignores.
The last line is ``speedup_vs_ideal_min=… entropy_overhead=… scoring_overhead_max=… lens_share=…
speedup_vs_bw_ideal_min=…``: the worst token-pruning preset's measured/ideal ratio, NOVA's scoring share (entropy
included), the largest scoring share of any preset, NOVA's lens-projection share, and the worst measured /
bandwidth-aware-ideal ratio.

The first generation of every preset is both the warm-up and the run whose kept-token counts give the FLOPs;
the timed repeats follow, interleaved across presets so that machine drift hits every preset alike. Progress
goes to stderr, the table to stdout.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from profilers.flops import count_flops
from profilers.latency_report import conditions_for
from profilers.device_sync import synchronize
from profilers.timers import ComponentTimer
from var_core.accel import PolicyConfig, build_policy
from var_core.accel.presets import PRESETS, get_preset
from var_core.engine import GenerationOptions, Policy, SamplingConfig, ScalePlan, Tracer, generate
from var_core.engine.loop import generation_info
from var_core.engine.reference_loop import reference_generate

TOKEN_PRUNING = ("nova", "fastvar", "ldpruning", "toprovar", "sparsevar", "stagevar")
SCORING_SPANS = ("accel/scorer", "accel/entropy")
LENS_SPANS = ("lens",)


class ScaleClock(Tracer):
    """Wall-clock per scale of a generation on ``device`` (synchronised there at each scale's start and end; on
    the CPU perf_counter is exact after each op returns)."""

    enabled = True

    def __init__(self, device: torch.device | str | None = None):
        self.per_scale: dict[int, float] = {}
        self._t0 = 0.0
        self.device = device

    def scale_begin(self, scale):
        synchronize(self.device)
        self._t0 = time.perf_counter()

    def scale_end(self, scale):
        synchronize(self.device)
        self.per_scale[scale] = time.perf_counter() - self._t0


class PruneLastScaleHalf(Policy):
    """Benchmark policy: keeps every other token of the last scale (a fixed, score-free plan)."""

    name = "half_last_scale"

    def plan_scale(self, ctx):
        return ScalePlan(prune=ctx.is_last)

    def plan_block(self, ctx, block, branch, x_RNC):
        keep = torch.arange(0, ctx.num_tokens, 2, device=x_RNC.device)
        return keep.expand(x_RNC.shape[0], -1)


def interleaved_medians(variants: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                        device: torch.device | str | None = None) -> dict[str, list[float]]:
    """Seconds per variant and repeat, the variants interleaved run by run; on a CUDA ``device`` every clock read
    follows a synchronisation of that device (not of the current one)."""
    device = torch.device(device) if device is not None else None
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            with torch.inference_mode():  # no autograd bookkeeping in the timed region (issue 27)
                fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def environment_line(adapter, batch_size: int) -> str:
    """The header of a benchmark table: the device the model is on (and its name), the parameter dtype and the
    precision generate() runs in (``adapter.precision``: autocast dtype, float32 matmul precision)."""
    from var_core.engine.precision import parse_precision
    from var_core.eval.environment import attention_backend, device_name, model_dtype

    device = getattr(adapter, "device", torch.device("cpu"))
    name = getattr(adapter, "precision", None)
    spec = parse_precision(name) if name else None
    autocast = str(spec.autocast).removeprefix("torch.") if spec is not None and spec.autocast is not None else None
    matmul = spec.matmul_precision if spec is not None else torch.get_float32_matmul_precision()
    return (f"# model={getattr(adapter, 'model_name', '?')} batch={batch_size} device={device} "
            f"device_name={device_name(device)!r} threads={torch.get_num_threads()} torch={torch.__version__} "
            f"dtype={model_dtype(adapter)} precision={name or 'unset'} autocast={autocast} matmul={matmul} "
            f"attention={attention_backend(adapter)}")


def bench_sampling(sampling: SamplingConfig, overrides: dict) -> SamplingConfig:
    """``sampling`` with ``overrides`` (``--cfg --top-k --top-p --temperature`` as set) applied; a value out of range
    is a :class:`~var_core.errors.UserError`."""
    from var_core.errors import UserError

    try:
        return dataclasses.replace(sampling, **overrides) if overrides else sampling
    except ValueError as exc:
        raise UserError(f"sampling: {exc} (check --cfg / --top-k / --top-p / --temperature)") from None


def save_bench_images(root: Path | None, adapter, arm: str, conditions, seeds, sampling, policy=None,
                      prompt_set=None) -> None:
    """``--save-images``: one untimed, decoded generation (same conditions and seeds as the timed ones), written in
    the evaluators' layouts under ``root`` (None: nothing is generated or written)."""
    if root is None:
        return
    from var_core.eval.export import export_images
    from var_core.eval.lightning import ConditionSet

    result = generate(adapter, conditions, seeds, sampling, policy=policy, options=GenerationOptions(decode=True))
    meta = None
    if prompt_set is not None:  # the prompt file's tags, categories and GenEval lines
        condition_set, meta = prompt_set.conditions(len(seeds)), prompt_set.geneval_metadata
    elif isinstance(conditions, torch.Tensor):
        condition_set = ConditionSet(tuple(int(v) for v in conditions.tolist()))
    else:
        condition_set = ConditionSet.from_prompts(list(conditions))
    out = export_images(root, arm, result.images, condition_set, seeds=seeds, prompt_metadata=meta)
    print(f"# images: {out['images']} PNGs of {arm} in {out['folder']}", file=sys.stderr)


#: the engine benchmark's sampling (VAR's official setting) before ``--cfg --top-k --top-p --temperature``
ENGINE_SAMPLING = SamplingConfig(cfg=1.5, top_k=900, top_p=0.96)


def bench_engine(adapter, sampling: SamplingConfig, batch_sizes, repeats: int, with_decode: bool = False,
                 images_root: Path | None = None) -> int:
    """The engine benchmark (module docstring) on a loaded VAR-family ``adapter``, per batch size; prints its
    tables and the ``engine_vs_reference=… half_prune_time_ratio=… half_prune_flops_ratio=…`` line."""
    options = GenerationOptions(check_finite=False, decode=with_decode, keep_raw_logits=False)
    noop_accel = build_policy(PolicyConfig(name="baseline"))
    # the official algorithm draws with torch.multinomial over the whole vocabulary; the engine row with the same
    # draw separates the loop from the sampler
    official = dataclasses.replace(sampling, draw="multinomial")
    for batch_size in batch_sizes:
        print(environment_line(adapter, batch_size))
        labels = (torch.arange(batch_size) % adapter.cfg.num_classes).to(adapter.device)
        seeds = list(range(batch_size))
        gens = lambda: [torch.Generator(adapter.device).manual_seed(s) for s in seeds]  # noqa: E731

        def reference():
            with torch.inference_mode():
                if with_decode:
                    return reference_generate(adapter.var, adapter.vae, labels, official, gens())
                return _reference_no_decode(adapter, labels, official, gens())

        variants = {"reference (official algorithm)": reference}
        if sampling != official:  # another draw (--draw inverse_cdf): the same loop with the official draw too
            variants["engine, empty slots, official draw"] = lambda: generate(adapter, labels, seeds, official,
                                                                              options=options)
        variants["engine, empty slots"] = lambda: generate(adapter, labels, seeds, sampling, options=options)
        variants["engine, composed no-op policy"] = lambda: generate(adapter, labels, seeds, sampling,
                                                                     policy=noop_accel, options=options)
        times = interleaved_medians(variants, repeats, device=adapter.device)
        ref = statistics.median(times["reference (official algorithm)"])
        print(f"{'variant':36s} {'median s':>9s} {'min s':>8s} {'ratio':>7s}")
        for name, values in times.items():
            med = statistics.median(values)
            print(f"{name:36s} {med:9.3f} {min(values):8.3f} {med / ref:7.3f}")

        clocks = {"dense": ScaleClock(adapter.device), "half": ScaleClock(adapter.device)}
        last_times = {"dense": [], "half": []}
        for _ in range(repeats + 1):
            for name, policy in (("dense", None), ("half", PruneLastScaleHalf())):
                result = generate(adapter, labels, seeds, sampling, policy=policy, tracer=clocks[name],
                                  options=options)
                last_times[name].append(clocks[name].per_scale[adapter.num_scales - 1])
                kept = result.records[-1].kept_tokens
        dense_t = statistics.median(last_times["dense"][1:])
        half_t = statistics.median(last_times["half"][1:])
        flops_ratio = _last_scale_block_flops(adapter, kept) / _last_scale_block_flops(adapter, None)
        print(f"last scale, half the tokens kept: FLOPs ratio {flops_ratio:.3f}  measured time ratio "
              f"{half_t / dense_t:.3f} ({half_t:.3f} s vs {dense_t:.3f} s)")
        engine_ratio = statistics.median(times["engine, empty slots"]) / ref
        loop_ratio = statistics.median(times.get("engine, empty slots, official draw",
                                                 times["engine, empty slots"])) / ref
        print(f"engine_vs_reference={engine_ratio:.3f} half_prune_time_ratio={half_t / dense_t:.3f} "
              f"half_prune_flops_ratio={flops_ratio:.3f} loop_vs_reference_same_draw={loop_ratio:.3f}")
        save_bench_images(images_root, adapter, f"engine_b{batch_size}", labels, seeds, sampling)
    return 0


def _reference_no_decode(adapter, labels, sampling, gens):
    """The reference loop without its final decode (so both sides time the transformer only)."""
    vae = adapter.vae
    decode = vae.fhat_to_img
    vae.fhat_to_img = lambda f: f  # noqa: E731 - temporarily bypass the decoder for timing
    try:
        return reference_generate(adapter.var, vae, labels, sampling, gens)
    finally:
        vae.fhat_to_img = decode


def _last_scale_block_flops(adapter, kept_tokens) -> float:
    """Analytic block FLOPs of the last scale (linear layers + attention over the cache) per network row."""
    cfg = adapter.cfg
    C, F = cfg.embed_dim, cfg.mlp_hidden
    N = adapter.scale_hw[-1][0] * adapter.scale_hw[-1][1]
    history = adapter.total_tokens - N
    total = 0.0
    for block in range(adapter.num_blocks):
        n_attn, n_ffn = (N, N) if kept_tokens is None else kept_tokens[block]
        keys = history + n_attn
        total += n_attn * (2 * C * 3 * C + 2 * C * C) + 4 * n_attn * keys * C + n_ffn * 4 * C * F
    return total


def _progress(message: str) -> None:
    print(f"[bench presets {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def bench_presets(adapter, sampling: SamplingConfig, batch_size: int, repeats: int, presets=None, prompt_set=None,
                  images_root: Path | None = None, roofline=None) -> int:
    """The presets benchmark (module docstring) on a loaded ``adapter``: ``presets`` (default: all; ``baseline`` is
    always added), ``prompt_set`` (text-to-image: sample ``i`` on prompt ``i mod P``); prints the table, progress on
    stderr. ``roofline``: a :class:`profilers.memory.Roofline` for the bandwidth-aware ideal (default: measured
    here on the model's MLP GEMM shape, :func:`profilers.memory.calibrate_roofline`)."""
    from profilers.memory import bytes_moved, calibrate_roofline, roofline_seconds

    options = GenerationOptions(check_finite=False, decode=False, keep_raw_logits=True)
    names = presets or sorted(PRESETS)
    if "baseline" not in names:
        names = ["baseline"] + names
    B = batch_size
    labels = (torch.arange(B) % adapter.cfg.num_classes).to(adapter.device)
    if prompt_set is not None:  # text-to-image prompt set: sample i on prompt i mod P
        labels = conditions_for(adapter, B, 0, prompt_set)
    seeds = list(range(1000, 1000 + B))
    print(environment_line(adapter, B))
    info = generation_info(adapter, B, adapter.initial_guidance(sampling), sampling=sampling)
    from var_core.eval.twomodel import model_switch_for

    policies, switches = {}, {}
    for name in names:  # a preset that cannot run on this model (e.g. fastvar_toprovar off Infinity) is reported
        policy = build_policy(get_preset(name))
        try:
            if hasattr(policy, "check_model"):
                policy.check_model(info)
            switches[name] = model_switch_for(policy.config, adapter)  # CoDe's refiner (engine.switch)
        except ValueError as exc:
            print(f"# unavailable: {name}: {exc}")
            continue
        policies[name] = policy
    names = [name for name in names if name in policies]

    flops, results, reports = {}, {}, {}
    for name, policy in policies.items():
        _progress(f"warm-up + FLOPs: {name}")
        results[name] = generate(adapter, labels, seeds, sampling, policy=policy, options=options,
                                 switch=switches[name])
        reports[name] = count_flops(adapter, results[name], batch_size=B)
        flops[name] = reports[name].total
    if roofline is None:
        _progress("roofline: calibrating GEMM throughput and weight streaming")
        arch = reports["baseline"].arch
        roofline = calibrate_roofline((arch.embed_dim, arch.mlp_hidden), device=adapter.device)
    print(f"# {roofline.describe()}")

    variants = {name: (lambda p=policy, s=switches[name]: generate(adapter, labels, seeds, sampling, policy=p,
                                                                   options=options, switch=s))
                for name, policy in policies.items()}
    _progress(f"timing {len(variants)} presets x {repeats} interleaved repeats")
    times = interleaved_medians(variants, repeats, warmup=0, device=adapter.device)

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
    base_model = roofline_seconds(reports["baseline"], roofline)
    print(f"{'preset':10s} {'FLOPs ratio':>11s} {'ideal x':>8s} {'GB moved':>8s} {'bw-ideal x':>10s} {'time s':>8s} "
          f"{'time ratio':>10s} {'measured x':>10s} {'meas/ideal':>10s} {'meas/bw':>7s} {'scoring %':>9s} "
          f"{'lens %':>7s}  computed tokens per scale")
    rows = {}
    for name in names:
        t = statistics.median(times[name])
        r = rows[name] = preset_ratios(base_t, t, base_f, flops[name], base_model,
                                       roofline_seconds(reports[name], roofline))
        tokens = results[name].computed_tokens_per_scale()
        print(f"{name:10s} {r['flops_ratio']:11.3f} {r['ideal']:8.2f} {bytes_moved(reports[name]) / 1e9:8.2f} "
              f"{r['bw_ideal']:10.2f} {t:8.3f} {r['time_ratio']:10.3f} {r['measured']:10.2f} "
              f"{r['meas_ideal']:10.2f} {r['meas_bw']:7.2f} "
              f"{100 * scoring_share[name]:8.2f}% {100 * lens_share[name]:6.2f}%  {tokens}")
    for name in names:  # --save-images: one untimed decoded generation per preset, after the measurements
        save_bench_images(images_root, adapter, f"{name}_b{B}", labels, seeds, sampling, policies[name], prompt_set)
    print(presets_summary_line(rows, scoring_share, lens_share))
    return 0


def preset_ratios(base_seconds: float, seconds: float, base_flops: float, flops: float, base_model_seconds: float,
                  model_seconds: float) -> dict[str, float]:
    """One row of the presets table from the baseline's and the preset's median time, FLOPs and roofline-modelled
    time: ``flops_ratio``, ``ideal`` (FLOPs-ideal speedup), ``bw_ideal`` (bandwidth-aware ideal speedup),
    ``time_ratio``, ``measured`` (speedup), ``meas_ideal`` = measured / ideal and ``meas_bw`` = measured / bw_ideal."""
    flops_ratio = flops / base_flops
    ideal = 1 / flops_ratio
    bw_ideal = base_model_seconds / model_seconds
    measured = base_seconds / seconds
    return {"flops_ratio": flops_ratio, "ideal": ideal, "bw_ideal": bw_ideal, "time_ratio": seconds / base_seconds,
            "measured": measured, "meas_ideal": measured / ideal, "meas_bw": measured / bw_ideal}


def presets_summary_line(rows: dict[str, dict[str, float]], scoring_share: dict[str, float],
                         lens_share: dict[str, float]) -> str:
    """The last line of the presets benchmark from :func:`preset_ratios` rows: the worst measured / ideal and
    measured / bandwidth-aware-ideal ratio over the token-pruning presets that prune (FLOPs ratio below 0.99),
    NOVA's scoring and lens shares and the largest scoring share."""
    pruning = [n for n in rows if n in TOKEN_PRUNING and rows[n]["flops_ratio"] < 0.99]
    worst = min((rows[n]["meas_ideal"] for n in pruning), default=float("nan"))
    worst_bw = min((rows[n]["meas_bw"] for n in pruning), default=float("nan"))
    entropy = scoring_share.get("nova", float("nan"))
    return (f"speedup_vs_ideal_min={worst:.3f} entropy_overhead={entropy:.4f} "
            f"scoring_overhead_max={max(scoring_share.values()):.4f} "
            f"lens_share={lens_share.get('nova', float('nan')):.4f} speedup_vs_bw_ideal_min={worst_bw:.3f}")


#: (label, rows, heads, queries, keys, head_dim): the last VAR-d16 scale at batch 1 with CFG, and Infinity-2B's
#: 32x32 scale (the first one FastVAR's Infinity setting prunes) at batch 1 with CFG (its probabilities: 330 MB)
ENTROPY_SHAPES = (("var-d16 16x16", 2, 16, 256, 680, 64), ("infinity-2b 32x32", 2, 16, 1024, 2521, 128))


def bench_attention_entropy(shapes=ENTROPY_SHAPES, repeats: int = 5, device: str | torch.device = "cpu") -> int:
    """ToProVAR's attention entropy against plain SDPA on the given shapes: the attention itself (``sdpa``), the
    entropy by the fused kernel, by the chunked log-sum-exp pass, and materialised (eager softmax, ``−Σ p log p``),
    median ms of ``repeats`` (one warm-up), the ratio to SDPA and the largest deviation from the materialised
    entropy; prints a table and ``entropy_fused_vs_sdpa=… entropy_chunked_vs_sdpa=…`` (the last shape)."""
    from var_core.engine.attention import attention_entropy, fused_available

    device = torch.device(device)
    def sync():
        synchronize(device)
    print(f"# attention entropy vs SDPA: device={device} threads={torch.get_num_threads()} "
          f"torch={torch.__version__} dtype=float32")
    print(f"{'shape':18s} {'method':13s} {'median ms':>9s} {'x sdpa':>7s} {'max |dH|':>9s} {'extra MiB':>9s}")
    last: dict[str, float] = {}
    for label, R, H, n, L, d in shapes:
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(R, H, n, d, generator=generator).to(device)
        k = torch.randn(R, H, L, d, generator=generator).to(device)
        v = torch.randn(R, H, L, d, generator=generator).to(device)
        q = torch.nn.functional.normalize(q, dim=-1) * 4.0  # VAR-style cosine logits with temperature 4
        k = torch.nn.functional.normalize(k, dim=-1)
        methods = {"sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                   "chunked": lambda: attention_entropy(q, k, 1.0, method="chunked"),
                   "materialised": lambda: attention_entropy(q, k, 1.0, method="materialised")}
        if fused_available(q):
            methods["fused"] = lambda: attention_entropy(q, k, 1.0, method="fused")
        reference = attention_entropy(q, k, 1.0, method="materialised")
        times: dict[str, float] = {}
        for name, fn in methods.items():
            fn()
            runs = []
            for _ in range(repeats):
                sync()
                start = time.perf_counter()
                out = fn()
                sync()
                runs.append(time.perf_counter() - start)
            times[name] = statistics.median(runs)
            deviation = 0.0 if name == "sdpa" else float((out - reference).abs().max())
            extra = R * H * n * L * 4 / 2**20 if name == "materialised" else 0.0
            print(f"{label:18s} {name:13s} {1e3 * times[name]:9.2f} {times[name] / times['sdpa']:7.2f} "
                  f"{deviation:9.1e} {extra:9.1f}")
        last = {name: times[name] / times["sdpa"] for name in times}
    print(f"entropy_fused_vs_sdpa={last.get('fused', float('nan')):.3f} "
          f"entropy_chunked_vs_sdpa={last['chunked']:.3f} entropy_materialised_vs_sdpa={last['materialised']:.3f}")
    return 0
