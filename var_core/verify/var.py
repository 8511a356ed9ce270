"""VAR fixture checks (folders in the format of ``shared/fixtures/official_var_tiny``): VQVAE, teacher forcing,
greedy and seeded generation against the official goldens."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError
from ..models.loading import CheckpointError
from .common import (Check, Fixture, FixtureFileError, _close, _identical, _max_dev, absent, close_scales,  # noqa: F401
                     fail, guard, identical_scales, one_line, read_config, require_keys, skip, summary_line)

TOL_LOGITS = 1e-4
TOL_IMAGE = 2e-4

__all__ = ["TOL_IMAGE", "TOL_LOGITS", "verify_var_fixture"]


def verify_var_fixture(folder: Path | Fixture, partial: bool = False) -> list[Check]:
    """Every check of a VAR fixture folder: manifest integrity, VQVAE, teacher forcing, AR runs, coverage."""
    fx = folder if isinstance(folder, Fixture) else Fixture(folder, partial=partial)
    checks = fx.integrity_checks()
    checks += _var_model_checks(fx)
    checks += fx.coverage_checks()
    return checks


def _var_model_checks(fx: Fixture) -> list[Check]:
    from ..zoo import load_fixture_files

    config = fx.config()
    if "build_vae_var_kwargs" not in config or "patch_nums" not in config["build_vae_var_kwargs"]:
        return [fail("config", "config.json lacks build_vae_var_kwargs.patch_nums (the official build_vae_var "
                               "arguments)")]
    checks: list[Check] = []
    variants = [("var", "var.pth", "golden_var", False)]
    if fx.has("var_saln.pth") or fx.goldens("golden_var_saln_*"):
        variants.append(("var_saln", "var_saln.pth", "golden_var_saln", True))

    loaded = []
    for tag, weight_file, prefix, saln in variants:
        try:
            var, vae = load_fixture_files(fx.folder, saln=saln)
        except CheckpointError as exc:
            checks.append(fail(f"{tag}/load", f"{weight_file} / vae.pth could not be loaded: {one_line(exc)}"))
            continue
        loaded.append((tag, prefix, var.eval(), vae.eval()))

    vq_golden = None
    if loaded and fx.has("golden_vqvae.pt"):
        try:
            vq_golden = _vqvae_checks(fx, loaded[0][3], checks)
        except FixtureFileError as exc:
            checks.append(fail("vqvae", one_line(exc)))

    for tag, prefix, var, vae in loaded:
        tf_name = f"{prefix}_teacher_forcing.pt"
        if fx.has(tf_name):
            guard(checks, f"{tag}/teacher_forcing",
                   lambda: _teacher_forcing_checks(fx, tf_name, tag, var, vae, vq_golden, checks))
        from ..engine.adapters.var_adapter import VARAdapter

        adapter = VARAdapter(var, vae)
        for name in fx.goldens(f"{prefix}_ar_greedy_cfg*.pt"):
            guard(checks, f"{tag}/{name}", lambda: _greedy_checks(fx, name, tag, adapter, vae, checks))
        for name in fx.goldens(f"{prefix}_ar_sampled_rng_*.pt"):
            guard(checks, f"{tag}/{name}", lambda: _rng_checks(fx, name, tag, adapter, checks))
        for name in fx.goldens(f"{prefix}_ar_smooth_*.pt"):
            fx.consume(name)
            checks.append(skip(f"{tag}/optional/{Path(name).stem}",
                               "gumbel 'more_smooth' is a visualisation mode we do not implement"))
    return checks


def _vqvae_checks(fx: Fixture, vae, checks: list[Check]):
    name = "golden_vqvae.pt"
    golden = fx.load(name)
    if golden is None:
        return None
    problem = require_keys(golden, name, "vqvae", ("image",))
    if problem:
        checks.append(problem)
        return golden if isinstance(golden, dict) else None
    with torch.no_grad():
        f = vae.encode_features(golden["image"])
        f_hats = vae.quantize.f_to_fhat_list(f)
        wanted = {
            "f_encoded": lambda: _close("vqvae/f_encoded", f, golden["f_encoded"], TOL_LOGITS),
            "idx_Bl": lambda: identical_scales("vqvae/idx_Bl", vae.quantize.f_to_idx_list(f), golden["idx_Bl"]),
            "f_hat_per_scale": lambda: close_scales("vqvae/f_hat_per_scale", f_hats, golden["f_hat_per_scale"],
                                                    TOL_LOGITS),
            "recon": lambda: _close("vqvae/recon", vae.fhat_to_img(f_hats[-1]), golden["recon"], TOL_IMAGE),
        }
        for key, make in wanted.items():
            checks.append(make() if key in golden else skip(f"vqvae/{key}", absent(name, key)))
    return golden


def _teacher_forcing_checks(fx: Fixture, name: str, tag: str, var, vae, vq_golden, checks: list[Check]) -> None:
    tf = fx.load(name)
    if tf is None:
        return
    problem = require_keys(tf, name, f"{tag}/teacher_forcing", ("labels", "x_BLCv_wo_first_l"))
    if problem:
        checks.append(problem)
        return
    with torch.no_grad():
        if vq_golden is not None and "idx_Bl" in vq_golden:
            x_in = vae.quantize.idx_list_to_var_input(vq_golden["idx_Bl"])
            checks.append(_close(f"{tag}/teacher_forcing/input", x_in, tf["x_BLCv_wo_first_l"], TOL_LOGITS))
        else:
            checks.append(skip(f"{tag}/teacher_forcing/input",
                               "needs idx_Bl from golden_vqvae.pt, which is unavailable"))
        logits, blocks = var(tf["labels"], tf["x_BLCv_wo_first_l"], return_block_outputs=True)
    for key, ours, label in (("logits_BLV", logits, "logits"), ("block_outputs", blocks, "block_outputs")):
        if key in tf:
            checks.append(_close(f"{tag}/teacher_forcing/{label}", ours, tf[key], TOL_LOGITS))
        else:
            checks.append(skip(f"{tag}/teacher_forcing/{label}", absent(name, key)))


def _labels_and_args(g, name: str, tag: str, needed: tuple[str, ...], checks: list[Check]):
    problem = require_keys(g, name, tag, ("args",))
    if problem is None:
        problem = require_keys(g["args"], f"{name}['args']", tag, needed)
    if problem:
        checks.append(problem)
        return None
    return g["args"]


def _greedy_checks(fx: Fixture, name: str, tag: str, adapter, vae, checks: list[Check]) -> None:
    from ..engine import GenerationOptions, SamplingConfig, generate

    g = fx.load(name)
    if g is None:
        return
    args = _labels_and_args(g, name, f"{tag}/{Path(name).stem}", ("cfg", "label_B"), checks)
    if args is None:
        return
    cfg_value = float(args["cfg"])
    label = f"{tag}/greedy_cfg{cfg_value:g}"
    labels = torch.as_tensor(args["label_B"])
    sampling = SamplingConfig(cfg=cfg_value, top_k=int(args.get("top_k", 1)), top_p=float(args.get("top_p", 0)))
    result = generate(adapter, labels, seeds=[0] * len(labels), sampling=sampling, options=GenerationOptions())
    wanted = {
        "raw_logits": lambda: close_scales(f"{label}/raw_logits", [r.raw_logits_RNV for r in result.records],
                                           g["raw_logits"], TOL_LOGITS),
        "cfg_logits": lambda: close_scales(f"{label}/cfg_logits", [r.guided_logits_BNV for r in result.records],
                                           g["cfg_logits"], TOL_LOGITS),
        "idx_Bl": lambda: identical_scales(f"{label}/tokens", result.tokens, g["idx_Bl"]),
        "f_hat": lambda: close_scales(f"{label}/f_hat", _fhat_trajectory(vae, result.tokens), g["f_hat"],
                                      TOL_LOGITS),
        "image": lambda: _close(f"{label}/image", result.images, g["image"], TOL_IMAGE),
    }
    optional = {"raw_logits"}  # recorded only in the cfg 1.5 files: its absence is not worth a line
    for key, make in wanted.items():
        if key in g:
            checks.append(make())
        elif key not in optional:
            checks.append(skip(f"{label}/{'tokens' if key == 'idx_Bl' else key}", absent(name, key)))


def _rng_checks(fx: Fixture, name: str, tag: str, adapter, checks: list[Check]) -> None:
    from ..engine import SamplingConfig, generate

    g = fx.load(name)
    if g is None:
        return
    label = f"{tag}/optional/{Path(name).stem}/tokens"
    args = _labels_and_args(g, name, label, ("cfg", "label_B", "top_k", "top_p", "g_seed"), checks)
    if args is None:
        return
    if "idx_Bl" not in g:
        checks.append(skip(label, absent(name, "idx_Bl")))
        return
    labels = torch.as_tensor(args["label_B"])
    sampling = SamplingConfig(cfg=float(args["cfg"]), top_k=int(args["top_k"]), top_p=float(args["top_p"]))
    gen = torch.Generator().manual_seed(int(args["g_seed"]))
    result = generate(adapter, labels, sampling=sampling, shared_generator=gen)
    checks.append(identical_scales(label, result.tokens, g["idx_Bl"], optional=True))


def _fhat_trajectory(vae, tokens):
    """Cumulative f_hat after each scale, recomputed from tokens exactly as the official sampler does."""
    quantize = vae.quantize
    B = tokens[0].shape[0]
    p_last = quantize.patch_nums[-1]
    f_hat = torch.zeros(B, quantize.embedding.weight.shape[1], p_last, p_last)
    out = []
    with torch.no_grad():
        for si, idx in enumerate(tokens):
            h = quantize.embed_idx(idx, quantize.patch_nums[si])
            f_hat = quantize.next_autoregressive_input(si, f_hat, h)[0]
            out.append(f_hat)
    return out
