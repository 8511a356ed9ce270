"""``python -m studies.calibrate toprovar|hack``: ToProVAR's τ calibration (ToProVAR Fig. 8, appendix A.2), or HACK's
offline head calibration (structural vs contextual heads, written as ``hack_calibration.json`` for
``--set kv.calibration=FILE``; see ``var_core.accel.kv.hack``).

    python -m studies.calibrate toprovar                          # testbed (or official-tiny), 32 samples
    python -m studies.calibrate hack --model testbed --samples 8  # HACK's heads, one file
    python -m studies.calibrate toprovar --samples 50 --ssim 0.8 --source attention_block0 --threads 1

Generates the samples densely, measures per sample ρ_s (share of tokens whose attention entropy is below the
scale's mean) at every scale and the SSIM of exiting after each scale against the full image, and prints ρ_s per
scale, the distribution of ρ* (ρ at each sample's good depth: the earliest scale from which every exit keeps SSIM
above the threshold) and the τ it implies, with the share of samples the rule would cut too early at that τ and at
the paper's 0.4 (see ``ablations.calibrate``). Writes ``calibration.json`` and ``rho_calibration.png`` to ``--out``
(default ``results/calibrate/toprovar_<model>_n<N>_seed<S>``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from studies._args import ArgumentParser, at_least, existing_path, model_name, positive_int, results_folder, seed_int
from studies._cli import note_results_folder, run_cli

METHODS = ("toprovar", "hack")


def _method(text: str) -> str:
    from var_core.errors import did_you_mean

    if text not in METHODS:
        raise argparse.ArgumentTypeError(f"no calibration for {text!r}.{did_you_mean(text, METHODS)} Calibrations: "
                                         f"{', '.join(METHODS)}")
    return text


def _unit_interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from ablations.calibrate import RHO_SOURCES, STATISTICS

    p = ArgumentParser(prog="python -m studies.calibrate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", type=_method, help="what to calibrate: toprovar (tau of the scale depth D), hack "
                   "(HACK's structural / contextual heads: writes hack_calibration.json for --set kv.calibration=)")
    p.add_argument("--model", default=None, type=model_name,
                   help="model (default: testbed when its weights are shipped, else official-tiny)")
    p.add_argument("--weights", default=None, type=existing_path, help="local weights for --model")
    p.add_argument("--samples", type=at_least(2, "(a distribution needs spread)"), default=32,
                   help="samples (default 32; the paper: ~50 prompts)")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--seed", type=seed_int, default=0, help="base seed; sample i uses a hash of (seed, i)")
    p.add_argument("--ssim", type=_unit_interval, default=0.8, help="SSIM threshold of a good exit (default 0.8)")
    p.add_argument("--source", choices=RHO_SOURCES, default="attention_block0",
                   help="entropy map behind rho_s (default attention_block0, as low_entropy_ratio)")
    p.add_argument("--min-test-tokens", type=positive_int, default=16,
                   help="scales with fewer tokens are not tested (default 16, as low_entropy_ratio)")
    p.add_argument("--statistic", choices=STATISTICS, default="median", help="tau = this statistic of rho*")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (on a shared CPU use 1)")
    p.add_argument("--out", default=None, type=results_folder, help="output folder")
    return p


def _fmt(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.3f}"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import numpy as np
    import torch

    from ablations.calibrate import implied_tau, measure_rho_ssim
    from ablations.report import plot_rho_calibration
    from ablations.runner import resolve_model, resolve_sampling
    from var_core.eval.lightning import ConditionSet
    from var_core.eval.records import arm_slug
    from var_core.eval.stats import bootstrap_ci
    from var_core.zoo import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, weights, notes = resolve_model(args.model, args.weights)
    out = Path(args.out) if args.out else (Path("results") / "calibrate" /
                                           f"{args.method}_{arm_slug(model.replace(':', '-'))}_n{args.samples}_seed{args.seed}")
    note_results_folder(out)
    for note in notes:
        print(f"note: {note}")
    adapter = load_model(model, weights=weights)
    sampling = resolve_sampling(adapter, model, weights)
    num_classes = int(getattr(getattr(adapter, "cfg", None), "num_classes", 1) or 1)
    conditions = ConditionSet.balanced(args.samples, num_classes, args.seed)
    if args.method == "hack":
        return _hack(args, adapter, model, conditions, sampling, out)
    print(f"ToProVAR tau calibration on {model} ({adapter.num_scales} scales), {args.samples} samples, rho from "
          f"{args.source}, good exit: SSIM > {args.ssim:g}")
    table = measure_rho_ssim(adapter, conditions, sampling, samples=args.samples, batch_size=args.batch_size,
                             source=args.source, min_test_tokens=args.min_test_tokens, log=print)
    calib = implied_tau(table.rho, table.ssim, ssim_threshold=args.ssim, statistic=args.statistic)

    print("\n| scale | grid | rho_s mean [95% CI] | exit SSIM mean | share SSIM > thr | good depth here |")
    print("|---|---|---|---|---|---|")
    for s, (h, w) in enumerate(table.scale_hw):
        rho = [v for v in table.rho[:, s] if math.isfinite(v)]
        ci = bootstrap_ci(rho, seed=args.seed) if len(rho) >= 2 else None
        cell = f"{ci.mean:.3f} [{ci.low:.3f}, {ci.high:.3f}]" if ci is not None else "not tested"
        ssim = table.ssim[:, s]
        print(f"| {s} | {h}x{w} | {cell} | {np.nanmean(ssim):.3f} | {np.mean(ssim > args.ssim):.2f} | "
              f"{sum(1 for g in calib.good_depth if g == s)} |")
    stars = [r for r in calib.rho_star if r is not None]
    if stars:
        q = np.quantile(stars, [0.1, 0.25, 0.5, 0.75, 0.9])
        print(f"\nrho* over {len(stars)} samples: quantiles 10/25/50/75/90 % = "
              + ", ".join(f"{v:.3f}" for v in q) + f"; mean {np.mean(stars):.3f}")
    print(f"implied tau ({args.statistic} of rho*): {_fmt(calib.tau)}; largest tau keeping "
          f"{calib.safe_target:.0%} of the samples safe: {_fmt(calib.tau_safe)}")
    for key, label in (("tau", f"tau = {_fmt(calib.tau)}"), ("paper", "paper tau = 0.4")):
        if key in calib.safe_share:
            exits = [d for d in calib.depth[key] if d is not None]
            print(f"  {label}: {calib.safe_share[key]:.2f} of the samples exit at or after their good depth; "
                  f"{len(exits)} of {len(calib.depth[key])} exit before the last scale")
    out.mkdir(parents=True, exist_ok=True)
    data = {"method": args.method, "model": model, "samples": args.samples, "seed": args.seed,
            "sampling": {"cfg": sampling.cfg, "top_k": sampling.top_k, "top_p": sampling.top_p},
            "table": table.to_dict(), "calibration": calib.to_dict()}
    (out / "calibration.json").write_text(json.dumps(data, indent=1))
    plot = plot_rho_calibration(data, out / "rho_calibration.png")
    print(f"\ncalibration : {out / 'calibration.json'}")
    if plot is not None:
        print(f"plot        : {plot}")
    return 0


def _hack(args, adapter, model, conditions, sampling, out: Path) -> int:
    from ablations.calibrate import calibrate_hack

    print(f"HACK head calibration on {model} ({adapter.num_blocks} blocks), {args.samples} samples")
    data = calibrate_hack(adapter, conditions, sampling, samples=args.samples, batch_size=args.batch_size)
    data.update(model=model, seed=args.seed)
    for block, heads in enumerate(data["structural"]):
        print(f"block {block}: " + "".join("S" if s else "c" for s in heads) + "  (S structural, c contextual)")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hack_calibration.json"
    path.write_text(json.dumps(data, indent=1))
    print(f"\ncalibration : {path}\nuse it      : --set kv.calibration={path}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
