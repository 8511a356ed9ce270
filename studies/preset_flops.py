"""``python -m studies.preset_flops``: FLOPs-ideal speedup of every method preset on an Infinity architecture.

Fixed plans (``profilers.plan_flops.is_fixed_plan``) are counted analytically: the preset, resolved for the model,
plans every scale and block on placeholder states and ``profilers.flops`` counts the planned tokens; nothing is
loaded or generated. Adaptive plans (entropy / energy / attention driven) need a generation: with ``--proxy N``
they are run on N prompts through a *random, narrow proxy* of the architecture (same depth, schedule, bits per
token and branches; width 64, random text encoder, the adapter's default sampling), and the kept-token records of
those runs are counted with the real architecture's formulas. Random weights decide differently from trained
ones (their predictive and attention entropies are noise), so proxy figures show what a method's mechanics do
on this schedule, not what it does on the trained model. Output: one line per preset (speedup = dense FLOPs /
planned FLOPs, transformer + head + conditioning, CFG on, batch 1, the given text length, no decoder).
"""

from __future__ import annotations

import statistics
import sys

import torch

from studies._args import ArgumentParser, non_negative_int, positive_int, preset_name
from studies._cli import fail, run_cli

ARCHS = ("infinity-2b", "infinity-8b", "hart-0.7b")


def _arch(model: str, text_len: int):
    from profilers.flops import hart_arch, infinity_arch
    from var_core.models.infinity import scale_schedule
    from var_core.zoo import INFINITY_SPECS

    base = model.removeprefix("random:")
    if base not in ARCHS:
        raise fail(f"--model {model!r}: give one of {', '.join(ARCHS)} (or random:<name>)")
    if base == "hart-0.7b":
        from var_core.models.hart import HART_0P7B

        return HART_0P7B, hart_arch(HART_0P7B, soft_codes=True)
    spec = INFINITY_SPECS[base]
    return spec, infinity_arch(spec.config, scale_schedule(spec.pn, 1.0, spec.num_scales), text_len=text_len)


def _proxy_adapter(spec, seed: int):
    """A random Infinity with the spec's depth, bits, schedule and heads of 32 channels, 64 wide."""
    import dataclasses

    from var_core.engine.adapters.infinity_adapter import InfinityAdapter
    from var_core.models.bsq_vae import BSQVAEConfig
    from var_core.models.text_encoder import RandomTextEncoder
    from var_core.zoo import build_infinity_pair

    cfg = dataclasses.replace(spec.config, embed_dim=64, num_heads=2, text_channels=128, text_maxlen=64,
                              pool_heads=None)
    vae_cfg = BSQVAEConfig(codebook_dim=spec.vae_config.codebook_dim, base_ch=32, encoder_ch_mult=(1, 1, 1, 1, 1),
                           decoder_ch_mult=(1, 1, 1, 1, 1), patch_size=spec.vae_config.patch_size)
    model, vae = build_infinity_pair(cfg, vae_cfg, seed)
    encoder = RandomTextEncoder(out_dim=cfg.text_channels, max_length=cfg.text_maxlen, seed=seed)
    return InfinityAdapter(model.eval().requires_grad_(False), vae.eval().requires_grad_(False), encoder,
                           pn=spec.pn, num_scales=spec.num_scales)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m studies.preset_flops", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:infinity-2b", help="infinity-2b, infinity-8b or hart-0.7b (weights not needed)")
    p.add_argument("--presets", nargs="*", default=None, type=preset_name, help="presets (default: all)")
    p.add_argument("--text-len", type=positive_int, default=64, help="text tokens seen by cross-attention (default 64)")
    p.add_argument("--proxy", type=non_negative_int, default=0, metavar="N",
                   help="also estimate adaptive presets on N prompts through a random narrow proxy (default 0)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from profilers.flops import count_record_flops, dense_records
    from profilers.plan_flops import ideal_speedup
    from var_core.accel import build_policy
    from var_core.accel.presets import PRESETS, get_preset
    from var_core.engine import GenerationOptions, GuidanceMode, generate

    spec, arch = _arch(args.model, args.text_len)
    names = args.presets or list(PRESETS)
    for name in names:
        get_preset(name)  # unknown names fail before anything runs
    dense = count_record_flops(arch, dense_records(arch.scale_hw, GuidanceMode.BOTH), 1).total
    print(f"{args.model}: {len(arch.scale_hw)} scales up to {arch.scale_hw[-1]}, depth {arch.depth}, text length "
          f"{arch.text_len}, CFG, batch 1: dense {dense / 1e12:.2f} TFLOPs")
    proxy = None
    for name in names:
        try:
            speedup, planned, _ = ideal_speedup(get_preset(name), arch)
            print(f"{name:18s} {speedup:6.2f}x  {planned / 1e12:7.2f} TFLOPs  fixed plan (analytic)")
            continue
        except ValueError as exc:
            if "adaptive" not in str(exc):
                print(f"{name:18s}   n/a   {exc}")
                continue
        if not args.proxy:
            print(f"{name:18s}   n/a   adaptive plan (estimate it with --proxy N)")
            continue
        if proxy is None:
            if args.model.removeprefix("random:") == "hart-0.7b":
                from var_core.zoo import hart_proxy_adapter

                proxy = hart_proxy_adapter(spec)
            else:
                proxy = _proxy_adapter(spec, seed=0)
        totals = []
        for i in range(args.proxy):
            result = generate(proxy, [i], seeds=[1000 + i], sampling=proxy.default_sampling,
                              policy=build_policy(get_preset(name)),
                              options=GenerationOptions(decode=False, keep_raw_logits=False))
            totals.append(count_record_flops(arch, result.records, 1, initial_guidance=GuidanceMode.BOTH).total)
            print(f"  [{name} proxy prompt {i}: {dense / totals[-1]:.2f}x]", file=sys.stderr, flush=True)
        speeds = [dense / t for t in totals]
        print(f"{name:18s} {dense / statistics.mean(totals):6.2f}x  {statistics.mean(totals) / 1e12:7.2f} TFLOPs  "
              f"adaptive, random proxy, {args.proxy} prompts (per prompt {min(speeds):.2f}-{max(speeds):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
