"""``python -m studies.report RUN_DIR``: rebuild the table, plots and grids of an ablation run folder from its
JSON records (e.g. after editing the plotting code, or to add the W&B mirror later with ``--wandb offline``)."""

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
    args = parser.parse_args(argv)

    from ablations.report import read_folder, write_report

    out_dir = Path(args.run_dir)
    if not out_dir.is_dir():
        raise UserError(f"{out_dir} is a file: give the results folder of python -m studies.ablate")
    # JSON records, and tensors read with weights_only=True: nothing in the folder is run. An arm that cannot be
    # read is listed (naming the file) in the table and below, never dropped.
    contents = read_folder(out_dir)
    if not contents.records:
        why = "".join(f"; {line}" for line in contents.problems)
        raise UserError(f"no readable finished arm record in {out_dir / 'arms'}{why}: is {out_dir} a results "
                        f"folder of python -m studies.ablate? (sweep and sensitivity folders write their own "
                        f"reports)")
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
