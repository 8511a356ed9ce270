"""``python -m studies.report RUN_DIR``: rebuild the table, plots and grids of an ablation run folder from its
JSON records (e.g. after editing the plotting code, or to add the W&B mirror later with ``--wandb offline``).

    python -m studies.report RUN_DIR --import geneval geneval_results.jsonl   # GenEval's evaluate_images.py output
    python -m studies.report RUN_DIR --import dpg dpg_results.csv --import-arm nova

``--import KIND FILE`` (repeatable; KIND: geneval, dpg) joins an external benchmark's result file to the table, per
arm, with intervals over prompts (``ablations.imports``: formats, the image layout of ``--save-images`` that maps
results to arms, and ``imports/<kind>.json`` where they are kept)."""

from __future__ import annotations

import sys
from pathlib import Path

from studies._args import ArgumentParser, existing_path
from studies._cli import run_cli
from var_core.errors import UserError


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m studies.report", description=__doc__)
    parser.add_argument("run_dir", type=existing_path, help="a results folder written by python -m studies.ablate")
    parser.add_argument("--wandb", choices=("offline", "online", "disabled"), default="disabled")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--import", dest="imports", nargs=2, action="append", default=[], metavar=("KIND", "FILE"),
                        help="join a benchmark's result file: geneval RESULTS.jsonl (GenEval's evaluate_images.py) "
                             "or dpg RESULTS.csv (DPG-Bench); repeatable")
    parser.add_argument("--import-arm", default=None, metavar="ARM",
                        help="assign every line of the --import files to this arm (default: from the image paths, "
                             "images/<arm>/...)")
    args = parser.parse_args(argv)

    from ablations.report import read_folder, write_report

    out_dir = Path(args.run_dir)
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} is a file: give the results folder of python -m studies.ablate")
    from var_core.eval.records import refuse_links_in

    refuse_links_in(out_dir)  # the table, plots, grids and imports are written here: never through a planted link
    # JSON records, and tensors read with weights_only=True: nothing in the folder is run. An arm that cannot be
    # read is listed (naming the file) in the table and below, never dropped.
    contents = read_folder(out_dir)
    if not contents.records:
        why = "".join(f"; {line}" for line in contents.problems)
        raise UserError(f"no readable finished arm record in {out_dir / 'arms'}{why}: is {out_dir} a results "
                        f"folder of python -m studies.ablate? (sweep and sensitivity folders write their own "
                        f"reports)")
    if args.import_arm is not None and not args.imports:
        raise UserError("--import-arm needs --import KIND FILE")
    try:
        return _report(args, out_dir, contents, write_report)
    except OSError as exc:  # a read-only folder, a full disk: the records are only read, never changed
        where = exc.filename or out_dir
        raise UserError(f"cannot write {where} ({exc.strerror or exc}): the report is written into the results "
                        f"folder; make it writable, or copy it (cp -r {out_dir} COPY) and report the copy") from None


def _report(args, out_dir: Path, contents, write_report) -> int:
    if args.imports:
        from ablations.imports import import_results

        names = [r["arm"] for r in contents.records]
        samples = {r["arm"]: (r.get("samples") or {}).get("n") for r in contents.records
                   if isinstance(r.get("samples"), dict) and isinstance((r.get("samples") or {}).get("n"), int)}
        for kind, file in args.imports:
            done = import_results(out_dir, kind, file, arm=args.import_arm, arm_names=names, arm_samples=samples)
            matched = done["lines"] - len(done["unmatched"])
            print(f"imported {kind}: {file}: {done['lines']} results, {matched} into {len(done['arms'])} arm(s)"
                  + (f", {len(done['unmatched'])} matched no arm" if done["unmatched"] else ""))
            overall = f"{kind}_overall"
            for arm, entry in done["arms"].items():
                s = entry["summary"].get(overall) or {}
                print(f"imported {kind}: {arm}: overall {s.get('mean', float('nan')):.4g} "
                      f"[{s.get('low', float('nan')):.4g}, {s.get('high', float('nan')):.4g}] over "
                      f"{entry['n_prompts']} prompts")
            if done["unmatched"]:
                print(f"warning: {len(done['unmatched'])} lines of {file} match no arm of {out_dir} (e.g. "
                      f"{done['unmatched'][0]!r})")
            print(f"        -> {done['file']}")
    outputs = write_report(out_dir, contents.records, contents.unavailable, plots=not args.no_plots,
                           wandb_mode=args.wandb, problems=contents.problems, log=lambda line: None)
    for line in outputs.get("problems") or []:
        print(f"warning: {line}")
    print(f"table : {outputs.get('markdown')}  and  {outputs.get('csv')}")
    for name, path in (outputs.get("plots") or {}).items():
        print(f"plot  : {path}")
    print(f"grids : {len(outputs.get('grids') or {})} files in {out_dir / 'grids'}")
    if outputs.get("wandb"):
        print(f"W&B   : {outputs['wandb']}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
