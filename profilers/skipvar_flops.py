"""``python -m profilers.skipvar_flops``: FLOPs-ideal speedup of each SkipVAR decision branch on an Infinity
architecture, and of the released decision models' mix of branches under an assumed feature distribution.

SkipVAR's plan is decided per sample from two image features (``skipvar_decision``), so its FLOPs are those of
one of seven fixed plans: ``c`` ∈ {1, 2, 3} last scales left out (guidance kept), or ``c = 0`` with the
unconditional rows dropped on the last ``u`` ∈ {0, 1, 2, 3} scales. Each branch is counted analytically (the same
counter as ``varscope preset-flops``). The mix needs the features' distribution on real prompts, which only a
real Infinity-2B run gives; as a stand-in the features are drawn from a Gaussian with the skip scaler's mean and
variance (the moments of the models' own training features, diagonal), and the branch shares and the
FLOPs-weighted speedup are printed — an estimate, labelled as such.
"""

from __future__ import annotations

import argparse

import torch

from profilers.flops import count_record_flops, dense_records
from profilers.plan_flops import ideal_speedup
from var_core.accel.policy import PolicyConfig, component_config
from var_core.accel.skipvar_models import DEFAULT_MODEL, SHIPPED, load_models
from var_core.engine import GuidanceMode


def branch_config(c: int, u: int) -> PolicyConfig:
    """The fixed plan of one decision: ``c`` last scales left out, else the last ``u`` scales conditional-only."""
    if c > 0:
        return PolicyConfig(name=f"skipvar_c{c}", skip=component_config("skip", "skip_last", count=c))
    if u > 0:
        return PolicyConfig(name=f"skipvar_u{u}", guidance=component_config("guidance", "stop_at", start_scale=-u))
    return PolicyConfig(name="skipvar_base")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profilers.skipvar_flops", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:infinity-2b", help="infinity-2b or infinity-8b (no weights)")
    parser.add_argument("--decision-model", default=DEFAULT_MODEL, choices=SHIPPED)
    parser.add_argument("--draws", type=int, default=100_000, help="Gaussian feature draws for the mix")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from profilers.flops import infinity_arch
    from var_core.models.infinity import scale_schedule
    from var_core.zoo import INFINITY_SPECS

    base = args.model.removeprefix("random:")
    if base not in ("infinity-2b", "infinity-8b"):
        parser.error(f"--model {args.model!r}: give infinity-2b or infinity-8b (or random:<name>)")
    spec = INFINITY_SPECS[base]
    arch = infinity_arch(spec.config, scale_schedule(spec.pn, 1.0, spec.num_scales), text_len=64)
    dense = count_record_flops(arch, dense_records(arch.scale_hw, GuidanceMode.BOTH), 1).total
    flops = {}
    print(f"{args.model}: dense {dense / 1e12:.2f} TFLOPs (13 scales, CFG, batch 1, text length 64)")
    for c, u in [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (3, 0)]:
        speedup, planned, _ = ideal_speedup(branch_config(c, u), arch)
        flops[(c, u)] = planned
        print(f"  c={c} u={u}: {speedup:5.2f}x  {planned / 1e12:6.2f} TFLOPs")

    models = load_models(args.decision_model)
    mean = torch.tensor(models.skip.mean, dtype=torch.float64)
    scale = torch.tensor(models.skip.scale, dtype=torch.float64)
    generator = torch.Generator().manual_seed(args.seed)
    features = mean + scale * torch.randn(args.draws, len(models.skip.mean), generator=generator,
                                          dtype=torch.float64)
    c_B = models.skip.predict(features)
    u_B = torch.where(c_B == 0, models.uncond.predict(features), torch.zeros_like(c_B))
    planned = torch.tensor([flops[(int(c), int(u) if c == 0 else 0)] for c, u in zip(c_B, u_B)], dtype=torch.float64)
    shares = {key: float(((c_B == key[0]) & ((u_B == key[1]) | (c_B > 0))).double().mean())
              for key in flops if (key[0] > 0) == (key[1] == 0) or key == (0, 0)}
    print(f"{args.decision_model} on Gaussian features at the skip scaler's moments ({args.draws} draws, seed "
          f"{args.seed}; an assumption, not real prompts):")
    print("  branch shares: " + ", ".join(f"c={c} u={u}: {share:.3f}" for (c, u), share in sorted(shares.items())
                                          if share > 0))
    print(f"  FLOPs-weighted: {dense / float(planned.mean()):.2f}x; mean of per-sample speedups: "
          f"{float((dense / planned).mean()):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
