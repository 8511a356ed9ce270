"""Command-line options shared by the commands that evaluate one policy against a cached baseline
(``studies.sweep`` per trial, ``studies.sensitivity`` per grid point): model, samples, timing, threads, W&B."""

from __future__ import annotations

import argparse
import os

from studies._model_cli import add_model_arguments, model_settings

THREADS_NOTE = ("on a shared CPU use 1: with 2 threads and other processes on the 2 cores, OpenMP spin-waiting "
                "made generation 20-70x slower here (MEASURED: 100 %% system time)")


def add_evaluation_arguments(p: argparse.ArgumentParser, unit: str, threads_default: str) -> None:
    """``--model --samples --batch-size --warmup --no-paired-timing --timing-repeats --classifier --threads`` and
    the options of :func:`studies._model_cli.add_model_arguments` (``--weights`` … ``--save-images``); ``unit``
    names what one evaluation is ("trial", "point")."""
    p.add_argument("--model", default=None, help="model (default: testbed when its weights are shipped, else "
                                                  "official-tiny)")
    add_model_arguments(p)  # --weights --vae-weights --text-encoder --cfg --top-k --top-p --temperature --prompts
    #                          --save-images (studies._model_cli)
    p.add_argument("--samples", type=int, default=32, help=f"samples per {unit} (default 32)")
    p.add_argument("--batch-size", type=int, default=8, help="generation batch size (default 8)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-paired-timing", action="store_true",
                   help="do not re-time the baseline before every evaluation (halves the time; speedups then pair "
                        "with the baseline timed once, which drifts on a loaded machine)")
    p.add_argument("--timing-repeats", type=int, default=1,
                   help="interleaved timed repeats of (baseline, arm); each batch keeps its minimum time (default 1)")
    p.add_argument("--classifier", default=None, help="testbed classifier weights (default: the shipped file)")
    p.add_argument("--threads", type=int, default=None, help=f"torch threads (default: {threads_default}); {THREADS_NOTE}")


def evaluation_settings(args: argparse.Namespace, threads: int | None):
    """The :class:`sweeps.evaluate.EvalSettings` those options describe."""
    from sweeps.evaluate import EvalSettings

    return EvalSettings(model=args.model, weights=args.weights, samples=args.samples, batch_size=args.batch_size,
                        seed=args.seed, warmup=args.warmup, classifier=args.classifier,
                        paired_timing=not args.no_paired_timing, timing_repeats=args.timing_repeats, threads=threads,
                        **model_settings(args))


def wandb_mode(choice: str | None) -> str:
    """``--wandb``, else ``$WANDB_MODE`` (``dryrun``/``off`` read as disabled), else offline."""
    mode = choice or os.environ.get("WANDB_MODE") or "offline"
    if mode not in ("offline", "online", "disabled"):
        mode = "disabled" if mode in ("dryrun", "off") else "offline"
    return mode
