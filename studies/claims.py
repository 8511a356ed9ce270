"""``varscope claims``: the claims ledger — each paper's headline beside what varscope measures here (issue 30).

    varscope claims --model testbed --samples 8 --threads 1
    varscope claims nova fastvar --out results/frontier/testbed_n8_seed0   # reuse a frontier's published points

For each preset: the published speedup, model, resolution, batch, GPU, baseline kernel and source table
(var_core/data/claims/headlines.json; ``unknown`` where the source is silent) beside the FLOPs-ideal and
bandwidth-aware-ideal speedups (bounds), the measured interleaved speedup and the quality deltas (measured) of the
same preset at its published setting on this model and machine. Writes ``claims.json`` and ``claims.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from studies._args import ArgumentParser, check_evaluation_args, lightning_interrupts, positive_int, results_folder
from studies._cli import note_results_folder, run_cli
from studies._evaluation_cli import add_evaluation_arguments, evaluation_banner, evaluation_settings

DEFAULT = ("nova", "fastvar", "ldpruning", "toprovar", "sparsevar", "skipvar", "stagevar")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="varscope claims", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("presets", nargs="*", default=list(DEFAULT), help=f"presets (default: {' '.join(DEFAULT)})")
    p.add_argument("--seed", type=int, default=0)
    add_evaluation_arguments(p, unit="preset", threads_default="torch's")
    p.add_argument("--timing-rounds", dest="timing_repeats", type=positive_int, default=argparse.SUPPRESS,
                   help="= --timing-repeats")
    p.add_argument("--out", default=None, type=results_folder, help="results folder (default results/claims/<model>"
                                                                    "_n<N>_seed<S>; a frontier's folder reuses its arms)")
    p.add_argument("--wandb", choices=("offline", "online", "disabled"), default=None, help="accepted; unused")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_evaluation_args(args)
    from ablations.runner import resolve_model
    from sweeps.evaluate import launch_tag
    from sweeps.frontier_claims import load_headlines, run_claims
    from var_core.accel.presets import PRESETS
    from var_core.errors import UserError, did_you_mean

    known = load_headlines()
    for p in args.presets:
        if p not in PRESETS or p not in known:
            raise UserError(f"no published headline for {p!r}.{did_you_mean(p, list(known))} Presets with one: "
                            f"{', '.join(known)}")
    settings = evaluation_settings(args, args.threads)
    model = resolve_model(settings.model, settings.weights)[0]
    out = Path(args.out) if args.out else (Path("results") / "claims" / f"{model.replace(':', '-')}_n{settings.samples}"
                                           f"_seed{settings.seed}{launch_tag(settings, model)}")
    print(evaluation_banner("claims", args), flush=True)
    note_results_folder(out)
    with lightning_interrupts():
        result = run_claims(tuple(args.presets), settings, out)
    print()
    print((out / "claims.md").read_text())
    print(f"done in {result['seconds']:.0f} s; {out}/claims.json")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
