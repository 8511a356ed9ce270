"""Command-line options shared by the commands that evaluate one policy against a cached baseline
(``studies.sweep`` per trial, ``studies.sensitivity`` per grid point): model, samples, timing, threads, W&B."""

from __future__ import annotations

import argparse
import os

from studies._args import add_launch_arguments, launch_precision
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
    add_fid_reference_argument(p)  # as ablate's
    add_launch_arguments(p, processes=False)  # --accelerator --devices --precision --dtype (studies._args)


def evaluation_settings(args: argparse.Namespace, threads: int | None):
    """The :class:`sweeps.evaluate.EvalSettings` those options describe."""
    from sweeps.evaluate import EvalSettings

    return EvalSettings(model=args.model, weights=args.weights, samples=args.samples, batch_size=args.batch_size,
                        seed=args.seed, warmup=args.warmup, classifier=args.classifier,
                        paired_timing=not args.no_paired_timing, timing_repeats=args.timing_repeats, threads=threads,
                        accelerator=args.accelerator, devices=args.devices, precision=launch_precision(args),
                        fid_reference=getattr(args, "fid_reference", None), **model_settings(args))


def evaluation_banner(command: str, args: argparse.Namespace) -> str:
    """The first line of ``sweep`` / ``sensitivity``: the device and precision every evaluation runs in (the
    evaluator's own decision: :func:`var_core.eval.distributed.resolve_launch`, the family's default precision)."""
    from var_core.eval.distributed import resolve_launch

    from ablations.runner import resolve_model
    from studies._args import launch_banner, model_family

    launch = resolve_launch(args.accelerator, args.devices, 1, "auto", external=False)
    model = resolve_model(args.model, args.weights)[0]
    return launch_banner(command, args.accelerator, launch.device, launch_precision(args), model_family(model))


def wandb_mode(choice: str | None) -> str:
    """``--wandb``, else ``$WANDB_MODE`` (``dryrun``/``off`` read as disabled), else offline."""
    mode = choice or os.environ.get("WANDB_MODE") or "offline"
    if mode not in ("offline", "online", "disabled"):
        mode = "disabled" if mode in ("dryrun", "off") else "offline"
    return mode


# ----- the papers' evaluation protocols (ablate) -----------------------------------------------------------------
PROTOCOL_SETTINGS = ("fid_reference", "protocol", "more_smooth", "resolution", "aspect", "prompts_rewritten")


def fid_reference_path(text: str) -> str:
    """``--fid-reference``: an existing ``.npz`` or folder of images (read when the study starts)."""
    from pathlib import Path

    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file or folder (an .npz with mu/sigma, the ADM "
                                         f"evaluator's reference batch, or a folder of images)")
    if path.is_file() and path.suffix != ".npz":
        raise argparse.ArgumentTypeError(f"{text} is not an .npz: give mu/sigma statistics as .npz (varscope "
                                         f"fid-reference make DIR OUT.npz) or a folder of images")
    return text


def aspect_value(text: str) -> float:
    """``--aspect``: height / width (Infinity's ``h_div_w``) as ``0.5`` or ``1:2`` (``H:W``)."""
    try:
        if ":" in text:
            h, w = text.split(":", 1)
            value = float(h) / float(w)
        else:
            value = float(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected height/width as a number (0.5) or H:W (1:2), got {text!r}") \
            from None
    if not 0 < value < 100:
        raise argparse.ArgumentTypeError(f"the aspect (height / width) must be > 0, got {text}")
    return value


def add_protocol_arguments(p: argparse.ArgumentParser) -> None:
    """``--fid-reference --protocol --resolution --aspect --more-smooth/--no-more-smooth --prompts-rewritten``
    (README "The papers' protocols"; every record names them under ``protocol``)."""
    from var_core.eval.reference import PROTOCOLS

    add_fid_reference_argument(p)
    p.add_argument("--protocol", default=None, choices=sorted(PROTOCOLS),
                   help="a paper's evaluation protocol as one flag: imagenet-50k = 50 samples per class (50,000 on "
                        "ImageNet), VAR's sampling (cfg 1.5, top-k 900, top-p 0.96), FID vs --fid-reference")
    p.add_argument("--resolution", default=None, metavar="PN",
                   help="output size: Infinity's pn (0.06M, 0.25M, 0.60M, 1M) or HART's resolution (512, 1024); "
                        "an unsupported value lists the valid ones")
    p.add_argument("--aspect", default=None, type=aspect_value, metavar="H/W",
                   help="height / width (Infinity's h_div_w: 1, 0.5, 2, 1:2, ...), the nearest of the model's "
                        "ratios is refused unless exact; Infinity only")
    p.add_argument("--more-smooth", dest="more_smooth", action=argparse.BooleanOptionalAction, default=None,
                   help="HART's Gumbel smoothing of the latent (on in the official demo; it inflates FID, HART "
                        "issue #14; default: the model's); recorded in sampling.more_smooth")
    p.add_argument("--prompts-rewritten", default=None, type=existing_file, metavar="FILE",
                   help="GenEval: the rewritten prompts (one per line or a .jsonl with 'prompt'), line i for "
                        "metadata row i of --prompts; varscope does not rewrite prompts itself")


def add_fid_reference_argument(p: argparse.ArgumentParser) -> None:
    """``--fid-reference NPZ|DIR`` (ablate, sweep, sensitivity)."""
    p.add_argument("--fid-reference", default=None, type=fid_reference_path, metavar="NPZ|DIR",
                   help="FID of every arm (and the baseline) against reference statistics, with a bootstrap interval "
                        "over the generated samples: an .npz with mu/sigma "
                        "(pytorch-fid, the ADM evaluator's reference batch, or varscope fid-reference make) or a "
                        "folder of images (sub-folders: per-category FIDs, MJHQ-30K); in the study's feature space "
                        "(FID Inception with --inception-weights, else the testbed classifier's: FID-proxy)")


def existing_file(text: str) -> str:
    from pathlib import Path

    if not Path(text).expanduser().is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def protocol_settings(args: argparse.Namespace) -> dict:
    """The protocol options as study settings. ``--protocol`` is expanded first, into ``args`` itself
    (:func:`var_core.eval.reference.expand_protocol`: ``--samples --cfg --top-k --top-p`` set by the preset unless
    given on the command line, which wins)."""
    if getattr(args, "protocol", None):
        from var_core.eval.reference import expand_protocol

        given = {k: getattr(args, k) for k in ("samples", "cfg", "top_k", "top_p")
                 if getattr(args, k, None) is not None}
        for key, value in expand_protocol(args.protocol, args.model, given).items():
            setattr(args, key, value)
    if getattr(args, "resolution", None) is not None or getattr(args, "aspect", None) is not None:
        from var_core.zoo import size_options

        size_options(args.model or "testbed", args.resolution, args.aspect)  # an impossible size: an error now
    return {name: getattr(args, name) for name in PROTOCOL_SETTINGS if hasattr(args, name)}
