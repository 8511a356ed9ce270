"""``python -m studies.report RUN_DIR``: rebuild the table, plots and grids of an ablation run folder from its
JSON records (e.g. after editing the plotting code, or to add the W&B mirror later with ``--wandb offline``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.report", description=__doc__)
    parser.add_argument("run_dir", help="a results folder written by python -m studies.ablate")
    parser.add_argument("--wandb", choices=("offline", "online", "disabled"), default="disabled")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)

    from ablations.base import Arm
    from ablations.report import load_records, write_report

    out_dir = Path(args.run_dir)
    records = load_records(out_dir)
    if not records:
        print(f"error: no finished arm records in {out_dir / 'arms'}", file=sys.stderr)
        return 2
    unavailable = []
    manifest = out_dir / "study.json"
    if manifest.is_file():
        for a in json.loads(manifest.read_text()).get("arms", []):
            if a.get("error"):
                unavailable.append(Arm(a["name"], None, a.get("description", ""), role=a.get("role", "arm"),
                                       error=a["error"], changes=a.get("changes", "")))
    outputs = write_report(out_dir, records, unavailable, plots=not args.no_plots, wandb_mode=args.wandb)
    print(f"table : {outputs.get('markdown')}  and  {outputs.get('csv')}")
    for name, path in (outputs.get("plots") or {}).items():
        print(f"plot  : {path}")
    print(f"grids : {len(outputs.get('grids') or {})} files in {out_dir / 'grids'}")
    if outputs.get("wandb"):
        print(f"W&B   : {outputs['wandb']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
