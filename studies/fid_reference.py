"""``varscope fid-reference``: reference statistics for ``--fid-reference`` (:mod:`var_core.eval.reference`).

    varscope fid-reference make DIR OUT.npz --model testbed        # mu/sigma (per sub-folder too) in the study's
                                                                   # feature space (testbed: classifier features)
    varscope fid-reference make mjhq30k/ mjhq.npz --model infinity-2b --inception-weights pt_inception-....pth
    varscope fid-reference export-testbed DIR --per-class 30 [--per-category]   # the testbed's training images
"""

from __future__ import annotations

import argparse
import sys

from studies._args import existing_path, positive_int
from studies._cli import run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="varscope fid-reference", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="action", required=True)
    make = sub.add_parser("make", help="write an .npz of FID reference statistics from a folder of images")
    make.add_argument("folder", type=existing_path, help="images (sub-folders: one set of statistics per category)")
    make.add_argument("out", help="the .npz to write")
    make.add_argument("--model", default="testbed",
                      help="the model whose studies will use it (its feature space; default testbed)")
    make.add_argument("--classifier", default=None, type=existing_path, help="testbed classifier weights")
    make.add_argument("--inception-weights", default=None, type=existing_path,
                      help="FID Inception weights: the Inception feature space (real models)")
    make.add_argument("--fid-protocol", default=None, choices=("torch-fidelity", "pytorch-fid", "torchmetrics"))
    make.add_argument("--threads", type=positive_int, default=None)
    export = sub.add_parser("export-testbed", help="write the testbed's training images as PNG")
    export.add_argument("out", help="folder to write")
    export.add_argument("--per-class", type=positive_int, default=30)
    export.add_argument("--per-category", action="store_true", help="one sub-folder per class name")
    export.add_argument("--image-size", type=positive_int, default=64)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.action == "export-testbed":
        from var_core.eval.reference import export_testbed_images

        n = export_testbed_images(args.out, args.per_class, image_size=args.image_size,
                                  per_category=args.per_category)
        print(f"{n} testbed training images in {args.out}")
        return 0
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from var_core.eval.reference import feature_space_for_model, make_reference_npz

    space = feature_space_for_model(args.model, classifier=args.classifier, inception_weights=args.inception_weights,
                                    fid_protocol=args.fid_protocol)
    out, counts = make_reference_npz(args.folder, args.out, space)
    cats = ", ".join(f"{c} {n}" for c, n in counts.items() if c != "all")
    print(f"{out}: {space.name} ({space.dim}-d) statistics of {counts['all']} images"
          + (f"; per category: {cats}" if cats else ""))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
