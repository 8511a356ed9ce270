"""Command-line options every study shares for real checkpoints, sampling, prompt sets and image export.

``add_model_arguments(parser)`` adds::

    --weights PATH        transformer weights: a folder holding the official downloads, a Hugging Face cache
                          folder (models--org--name), or the file itself (var_core.zoo.resolve_weight_files)
    --vae-weights PATH    the VAE file (or a folder holding it), when it is not beside the transformer
    --text-encoder DIR    Infinity: a flan-t5-xl folder or its Hugging Face cache folder models--google--flan-t5-xl
    --cfg --top-k --top-p --temperature --draw
                          sampling knobs over the model's default (recorded with every other setting)
    --prompts FILE        text-to-image prompts: plain text, GenEval evaluation_metadata.jsonl, DPG-Bench /
                          DrawBench CSV, COCO captions JSON, MJHQ-30K meta_data.json (var_core.eval.prompts), or a
                          shipped set by name ("demo")
    --save-images [DIR]   every generated image as PNG per arm (var_core.eval.export): under the results folder,
                          or under DIR

Each value is checked when the command line is parsed (a missing path, a number out of range, an unreadable
prompt file), so a mistake fails in one line before any model is loaded. :func:`model_settings` returns the
values as keyword arguments of the study settings (``StudyOptions``, ``EvalSettings``, ``LatencySettings``).
"""

from __future__ import annotations

import argparse

from studies._args import existing_path, finite_float, non_negative_int
from var_core.engine.sampling import DRAWS

#: ``--cfg``: official defaults are 1.5-4 (VAR 1.5, Infinity 3-4, HART 4.5); far beyond that every distribution is
#: its arg-max already, and at 1e308 the guided logits overflow to inf / nan mid-run.
MAX_CFG = 100.0
#: ``--temperature`` (Infinity's tau; official 0.5-1): below 0.01 sampling is greedy in all but name and the
#: logits / tau overflow at 1e-300; above 100 it is uniform noise.
TEMPERATURE_RANGE = (0.01, 100.0)

cfg_strength = finite_float(0.0, MAX_CFG, why="(official defaults 1.5-4.5; 0: no guidance)")
temperature_value = finite_float(*TEMPERATURE_RANGE, why="(official 0.5-1; for greedy sampling use --top-k 1)")

MODEL_SETTINGS = ("vae_weights", "text_encoder", "cfg", "top_k", "top_p", "temperature", "draw", "prompts",
                  "save_images")


def non_negative_float(text) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def unit_interval(text) -> float:
    """A number in [0, 1] (``--top-p``; 0 disables the filter)."""
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1] (0 disables top-p), got {text}")
    return value


def prompt_file(text: str) -> str:
    """A prompt file that reads (see :mod:`var_core.eval.prompts`), or the name of a shipped set."""
    from var_core.errors import UserError
    from var_core.eval.prompts import load_prompt_set

    try:
        load_prompt_set(text)
    except UserError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def image_folder(text: str) -> str:
    """``--save-images DIR``: a folder (new or existing), not a file."""
    from pathlib import Path

    if not str(text).strip():
        raise argparse.ArgumentTypeError("an empty folder name (it would write into the current folder): give a "
                                         "folder, or --save-images alone for the results folder")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file: give a folder (its images/ tree is written inside)")
    return text


def add_model_arguments(p: argparse.ArgumentParser, *, weights: bool = True, prompts: bool = True,
                        save_images: bool = True) -> None:
    """Add the options of the module docstring (``weights=False`` when the parser declares ``--weights`` itself;
    ``prompts`` / ``save_images`` False where a command cannot use them)."""
    if weights:
        p.add_argument("--weights", default=None, type=existing_path,
                       help="transformer weights: a folder holding the official downloads (var_d16.pth, "
                            "infinity_2b_reg.pth, infinity_8b_weights/, ...), a Hugging Face cache folder, or the file")
    p.add_argument("--vae-weights", default=None, type=existing_path,
                   help="the VAE weights (vae_ch160v4096z32.pth, infinity_vae_d32reg.pth, ...) when not beside the "
                        "transformer")
    p.add_argument("--text-encoder", default=None, type=existing_path,
                   help="Infinity: the flan-t5-xl folder, or its Hugging Face cache folder models--google--flan-t5-xl")
    p.add_argument("--cfg", type=cfg_strength, default=None,
                   help="classifier-free guidance strength (default: the model's; VAR ramps to it over the scales)")
    p.add_argument("--top-k", type=non_negative_int, default=None, help="top-k filter (0: off; default: the model's)")
    p.add_argument("--top-p", type=unit_interval, default=None, help="top-p filter in [0, 1] (0: off; default: the "
                                                                      "model's)")
    p.add_argument("--temperature", type=temperature_value, default=None,
                   help="sampling temperature (default: the model's; Infinity's tau)")
    p.add_argument("--draw", choices=DRAWS, default=None,
                   help="how each sample's generator draws a token: multinomial (default: torch.multinomial over "
                        "the filtered vocabulary, as the official samplers) or inverse_cdf (one uniform per token "
                        "over the top-k survivors: cheaper, but a pruned run's tokens stay less coupled to the "
                        "baseline's, which lowers PSNR / SSIM / token agreement); same distribution either way")
    if prompts:
        p.add_argument("--prompts", default=None, type=prompt_file, metavar="FILE",
                       help="prompt file for text-to-image models: plain text (one per line), GenEval "
                            "evaluation_metadata.jsonl, DPG-Bench / DrawBench CSV, COCO captions JSON, MJHQ-30K "
                            "meta_data.json, or 'demo' (shipped); sample i uses prompt i mod P")
    if save_images:
        p.add_argument("--save-images", nargs="?", const=True, default=None, type=image_folder, metavar="DIR",
                       help="write every generated image as PNG per arm: images/<arm>/flat/, images/<arm>/geneval/ "
                            "(text-to-image), images/<arm>/samples.npz (class-conditional), under the results "
                            "folder or DIR")


def model_settings(args: argparse.Namespace) -> dict:
    """The values of :func:`add_model_arguments`' options that the parser has, as settings keyword arguments."""
    return {name: getattr(args, name) for name in MODEL_SETTINGS if hasattr(args, name)}
