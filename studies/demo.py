"""``python -m studies.demo``: generate a class-conditional sample grid and write it as a PNG."""

from __future__ import annotations

import sys
import time

import torch

from studies._args import (ArgumentParser, class_conditional_model, existing_path, output_file, positive_int,
                           seed_int)
from studies._model_cli import cfg_strength
from studies._cli import run_cli
from var_core.engine import SamplingConfig, generate
from var_core.errors import UserError
from var_core.eval.images import save_grid
from var_core.zoo import load_model


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m studies.demo", description=__doc__)
    parser.add_argument("--model", default="testbed", type=class_conditional_model,
                        help="a class-conditional model (testbed, var-d16, ...; default testbed)")
    parser.add_argument("--weights", default=None, type=existing_path)
    parser.add_argument("--per-class", type=positive_int, default=4)
    parser.add_argument("--classes", type=positive_int, default=10, help="first N classes")
    parser.add_argument("--cfg", type=cfg_strength, default=None, help="guidance strength (default: the model's)")
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument("--out", default="results/demo_grid.png", type=output_file, help="the PNG to write")
    args = parser.parse_args(argv)
    adapter = load_model(args.model, weights=args.weights)
    sampling = getattr(adapter, "default_sampling", SamplingConfig())
    if args.cfg is not None:
        sampling = SamplingConfig(cfg=args.cfg, top_k=sampling.top_k, top_p=sampling.top_p)
    classes = args.classes
    if classes > adapter.cfg.num_classes:
        raise UserError(f"argument --classes: {args.model} has {adapter.cfg.num_classes} classes, got {classes}; "
                        f"give --classes {adapter.cfg.num_classes} or fewer")
    labels = torch.arange(classes).repeat_interleave(args.per_class)
    seeds = [args.seed * 100_000 + i for i in range(len(labels))]
    start = time.perf_counter()
    result = generate(adapter, labels, seeds=seeds, sampling=sampling)
    seconds = time.perf_counter() - start
    path = save_grid(result.images, args.out, nrow=args.per_class * 2, upscale=2)
    print(f"wrote {path} ({len(labels)} samples of {args.model}, {seconds:.2f} s, sampling {sampling})")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
