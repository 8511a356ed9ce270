"""Check our Infinity (transformer + BSQ-VAE + engine loop) against golden outputs of the official code.

Called by ``python -m var_core.verify FOLDER`` for folders in the format of
``shared/fixtures/official_infinity_tiny`` (config.json, ``vae.pth``, ``infinity.pth``, ``inputs.pt``, golden
files), whatever their depth, width, bit count (2×2 patchify included), aspect ratio and batch. Tolerances are
the fixture README's: integer tensors (bits) exact; ``1e-4`` for logits, hidden states, raw features and
next-scale inputs; ``3e-4`` for guided logits; ``1e-6`` for codes and running sums; ``5e-4`` for float images;
the uint8 BGR image may differ by one level on at most 0.1 % of the values. RNG-dependent goldens are optional
(``INFO`` on a mismatch: they need the same generator calls on bit-identical probabilities).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.context import ScalePlan
from ..engine.policy import Policy
from ..models.loading import CheckpointError
from .common import (Check, Fixture, FixtureFileError, _close, _identical, absent, close_scales, fail, guard,
                     identical_scales, one_line, recorded_scales, require_keys, skip)

TOL_HIDDEN = 1e-4
TOL_CFG_LOGITS = 3e-4
TOL_CODES = 1e-6
TOL_IMAGE = 5e-4
UINT8_MAX_FRACTION = 1e-3


def load_fixture_models(folder: Path):
    """``(infinity, vae, config)`` from a fixture folder, through our own loaders (strict), each checked against
    what config.json says (sizes, codebook bits, patch schedule)."""
    from ..zoo import load_infinity_fixture_files

    model, vae, config = load_infinity_fixture_files(Path(folder))
    return model.eval().requires_grad_(False), vae.eval().requires_grad_(False), config


def _uint8_bgr(images_B3HW: torch.Tensor) -> torch.Tensor:
    """Our RGB [0, 1] images → the official return value (uint8, truncated, HWC, BGR)."""
    return images_B3HW.permute(0, 2, 3, 1).mul(255).to(torch.uint8).flip(dims=(3,))


def _uint8_check(name, ours: torch.Tensor, golden: torch.Tensor) -> Check:
    if ours.shape != golden.shape:
        return Check(name, False, f"shape {tuple(ours.shape)} != {tuple(golden.shape)}", "≤1 on ≤0.1%")
    diff = (ours.int() - golden.int()).abs()
    off = int((diff > 0).sum())
    ok = int(diff.max()) <= 1 and off <= UINT8_MAX_FRACTION * diff.numel()
    return Check(name, ok, f"max {int(diff.max())}, {off}/{diff.numel()} off", "≤1 on ≤0.1%")


def _bit_logits(guided_BNV: torch.Tensor) -> torch.Tensor:
    B, N, V = guided_BNV.shape
    return guided_BNV.reshape(B, N * (V // 2), 2)


class _BlockRecorder(Policy):
    """Records every block's output (all network rows) at every scale; changes nothing."""

    name = "verify/block-recorder"

    def start(self, info) -> None:
        self.outputs: list[list[torch.Tensor]] = []

    def plan_scale(self, ctx) -> ScalePlan:
        self.outputs.append([])
        return ScalePlan(observe_blocks=True)

    def observe_block(self, ctx, block, x_in_RNC, x_out_RNC) -> None:
        self.outputs[-1].append(x_out_RNC)


def verify_infinity_fixture(folder: Path | Fixture, partial: bool = False) -> list[Check]:
    """Every check of an Infinity fixture folder: manifest integrity, tokenizer, teacher forcing, AR runs,
    coverage of the listed goldens."""
    fx = folder if isinstance(folder, Fixture) else Fixture(folder, partial=partial)
    checks = fx.integrity_checks()
    checks += _infinity_model_checks(fx)
    checks += fx.coverage_checks()
    return checks


def _infinity_model_checks(fx: Fixture) -> list[Check]:
    checks: list[Check] = []
    try:
        model, vae, _ = load_fixture_models(fx.folder)
    except CheckpointError as exc:
        return [fail("load", f"infinity.pth / vae.pth could not be loaded: {one_line(exc)}")]
    try:
        inputs = fx.load("inputs.pt")
    except FixtureFileError as exc:
        return [fail("inputs", one_line(exc))]
    if inputs is None:
        return [fail("inputs", "inputs.pt (the image and the text conditions) is missing")]
    state: dict = {}
    if fx.has("golden_vae.pt"):
        guard(checks, "vae", lambda: _vae_checks(fx, vae, inputs, state, checks))
    if fx.has("golden_teacher_forcing.pt"):
        guard(checks, "teacher_forcing", lambda: _teacher_forcing_checks(fx, model, vae, inputs, state, checks))
    for name in fx.goldens("golden_ar_*.pt"):
        guard(checks, Path(name).stem.removeprefix("golden_"), lambda: _ar_checks(fx, name, model, vae, checks))
    return checks


def _vae_checks(fx: Fixture, vae, inputs, state: dict, checks: list[Check]) -> None:
    name = "golden_vae.pt"
    gv = fx.load(name)
    if gv is None:
        return
    problem = require_keys(gv, name, "vae", ("vae_scale_schedule",)) or require_keys(inputs, "inputs.pt", "vae",
                                                                                      ("image",))
    if problem:
        checks.append(problem)
        return
    vae_sched = [tuple(int(v) for v in s) for s in gv["vae_scale_schedule"]]
    with torch.no_grad():
        feat, summed, bits, var_inputs = vae.encode(inputs["image"], vae_sched)
        state["vae_bits"], state["vae_sched"] = bits, vae_sched
        wanted = {
            "raw_features": lambda: _close("vae/raw_features", feat, gv["raw_features"], TOL_HIDDEN),
            "bit_indices": lambda: identical_scales("vae/bit_indices", [b.int() for b in bits],
                                                    [b.int() for b in gv["bit_indices"]]),
            "quantized_sum": lambda: _close("vae/quantized_sum", summed, gv["quantized_sum"], TOL_CODES),
            "var_input": lambda: close_scales("vae/var_input", var_inputs, gv["var_input"], TOL_CODES, first=1),
            "recon": lambda: _close("vae/recon", vae.decode(summed), gv["recon"], TOL_IMAGE),
            "summed_codes_from_bits": lambda: _close(
                "vae/summed_codes_from_bits", vae.summed_codes_from_bits(gv["bit_indices"], vae_sched),
                gv["summed_codes_from_bits"], TOL_CODES),
        }
        for key, make in wanted.items():
            if key == "summed_codes_from_bits" and key in gv and "bit_indices" not in gv:
                checks.append(skip(f"vae/{key}", f"needs bit_indices, which is not in {name}"))
                continue
            if key == "summed_codes_from_bits" and key in gv and len(gv["bit_indices"]) != len(vae_sched):
                checks.append(skip(f"vae/{key}", f"needs bit_indices of all {len(vae_sched)} scales; {name} "
                                                 f"records {len(gv['bit_indices'])}"))
                continue
            checks.append(make() if key in gv else skip(f"vae/{key}", absent(name, key)))


def _teacher_forcing_checks(fx: Fixture, model, vae, inputs, state: dict, checks: list[Check]) -> None:
    from ..engine.adapters.infinity_adapter import InfinityAdapter
    from ..models.text_encoder import TextTokens

    name = "golden_teacher_forcing.pt"
    tf = fx.load(name)
    if tf is None:
        return
    problem = require_keys(tf, name, "teacher_forcing", ("scale_schedule", "label_B_or_BLT", "x_BLC_wo_prefix"))
    if problem:
        checks.append(problem)
        return
    schedule = [tuple(int(v) for v in s) for s in tf["scale_schedule"]]
    adapter = InfinityAdapter(model, vae, schedule=schedule)
    text = TextTokens.from_official(tf["label_B_or_BLT"])
    with torch.no_grad():
        vae_sched = [tuple(s) for s in adapter.vae_schedule]
        bits = state.get("vae_bits") if state.get("vae_sched") == vae_sched else None
        if bits is None and "image" in inputs:
            bits = vae.encode(inputs["image"], vae_sched)[2]
        if bits is not None:
            x_in = _teacher_forcing_input(adapter, vae, bits, vae_sched)
            checks.append(_close("teacher_forcing/x_BLC_wo_prefix", x_in, tf["x_BLC_wo_prefix"], TOL_HIDDEN))
            gt_bits = torch.cat([_transformer_bits(adapter, b, si) for si, b in enumerate(bits)], dim=1)
            if "gt_bits_BLd" in tf:
                checks.append(_identical("teacher_forcing/gt_bits", [gt_bits.to(torch.uint8)], [tf["gt_bits_BLd"]]))
            else:
                checks.append(skip("teacher_forcing/gt_bits", absent(name, "gt_bits_BLd")))
        else:
            checks.append(skip("teacher_forcing/x_BLC_wo_prefix", "needs inputs.pt's image, which is absent"))
        logits, inter = model(text, tf["x_BLC_wo_prefix"], schedule, return_intermediates=True)
    mask = inter["mask"]
    ours = {
        "text_norm_out": inter["text_norm_out"][mask],
        "cond_BD": inter["cond_BD"],
        "ca_kv": inter["ca_kv"][mask],
        "cond_BD_or_gss": inter["cond_BD_or_gss"],
        "block0_input": inter["block0_input"],
        "block_outputs": inter["block_outputs"],
        "logits_BLV": logits,
    }
    for key, value in ours.items():
        label = "teacher_forcing/" + ("logits" if key == "logits_BLV" else key)
        checks.append(_close(label, value, tf[key], TOL_HIDDEN) if key in tf else skip(label, absent(name, key)))
    if "loss" in tf or "bit_ce_per_token" in tf:
        if "gt_bits_BLd" not in tf:
            checks.append(skip("teacher_forcing/loss", f"needs gt_bits_BLd, which is not in {name}"))
            return
        B, L, V = logits.shape
        ce = F.cross_entropy(logits.reshape(-1, 2), tf["gt_bits_BLd"].reshape(-1).long(), reduction="none")
        per_token = ce.view(B, L, V // 2).mean(-1)
        loss = per_token.mul(1 / L).sum(-1).mean()
        for key, value, label in (("bit_ce_per_token", per_token, "teacher_forcing/bit_ce_per_token"),
                                  ("loss", loss, "teacher_forcing/loss")):
            if key in tf:
                checks.append(_close(label, value, torch.as_tensor(tf[key], dtype=torch.float32), TOL_HIDDEN))
            else:
                checks.append(skip(label, absent(name, key)))


def _ar_checks(fx: Fixture, name: str, model, vae, checks: list[Check]) -> None:
    from ..engine import GenerationOptions, SamplingConfig, generate
    from ..engine.adapters.infinity_adapter import InfinityAdapter, InfinityConditions
    from ..models.text_encoder import TextTokens

    g = fx.load(name)
    if g is None:
        return
    tag = Path(name).stem.removeprefix("golden_")
    problem = require_keys(g, name, tag, ("args", "scale_schedule", "label_B_or_BLT"))
    if problem is None:
        problem = require_keys(g["args"], f"{name}['args']", tag, ("cfg_list", "tau_list", "top_k", "top_p"))
    if problem:
        checks.append(problem)
        return
    args = g["args"]
    sched = [tuple(int(v) for v in s) for s in g["scale_schedule"]]
    cfg_values, tau_values = set(args["cfg_list"]), set(args["tau_list"])
    if len(cfg_values) != 1 or len(tau_values) != 1:
        checks.append(skip(tag, "per-scale cfg/tau lists are not supported"))
        return
    insertion = [int(v) for v in args.get("cfg_insertion_layer", [0])]
    if len(insertion) != 1:
        checks.append(skip(tag, "several cfg insertion layers are not supported"))
        return
    adapter = InfinityAdapter(model, vae, schedule=sched, cfg_insertion_layer=insertion[0])
    text = TextTokens.from_official(g["label_B_or_BLT"])
    negative = g.get("negative_label_B_or_BLT")
    conditions = InfinityConditions(text, TextTokens.from_official(negative) if negative else None)
    sampling = SamplingConfig(cfg=float(next(iter(cfg_values))), top_k=int(args["top_k"]),
                              top_p=float(args["top_p"]), temperature=float(next(iter(tau_values))))
    rng_free = int(args["top_k"]) == 1
    if not rng_free:
        if "g_seed" not in args or "bits" not in g:
            checks.append(skip(f"optional/{tag}/bits", f"needs args['g_seed'] and bits in {name}"))
            return
        gen = torch.Generator().manual_seed(int(args["g_seed"]))
        result = generate(adapter, conditions, sampling=sampling, shared_generator=gen,
                          options=GenerationOptions(decode=False))
        checks.append(identical_scales(f"optional/{tag}/bits", [t.to(torch.uint8) for t in result.tokens],
                                       g["bits"], optional=True))
        return
    recorder = _BlockRecorder() if "block_outputs" in g else None
    options = GenerationOptions(decode="img_float" in g or "img_uint8_bgr" in g)
    result = generate(adapter, conditions, seeds=[0] * text.rows, sampling=sampling, policy=recorder,
                      options=options)
    ours_bits = [t.to(torch.uint8) for t in result.tokens]
    # the keys every greedy run records (the others are recorded only for some runs: see the fixture README)
    for key, label in (("bits", "bits"), ("cfg_logits", "cfg_logits")):
        if key not in g:
            checks.append(skip(f"{tag}/{label}", absent(name, key)))
    if "bits" in g:
        checks.append(identical_scales(f"{tag}/bits", ours_bits, g["bits"]))
    if "cfg_logits" in g:
        checks.append(close_scales(f"{tag}/cfg_logits", [_bit_logits(r.guided_logits_BNV) for r in result.records],
                                   g["cfg_logits"], TOL_CFG_LOGITS))
    if "raw_logits" in g:
        ours_raw = [r.raw_logits_RNV for r in result.records]
        window = recorded_scales(f"{tag}/raw_logits", ours_raw, g["raw_logits"])
        if isinstance(window, Check):
            checks.append(window)
        else:
            rows = g["raw_logits"][0].shape[0]
            checks.append(close_scales(f"{tag}/raw_logits", [x[:rows] for x in ours_raw], g["raw_logits"],
                                       TOL_HIDDEN))
    trajectory = _latent_trajectory(adapter, result.tokens)
    if "next_input" in g:
        nxt = [adapter.next_input(trajectory["summed"][si], si + 1) for si in range(len(sched) - 1)]
        checks.append(close_scales(f"{tag}/next_input", nxt, g["next_input"], TOL_HIDDEN, first=1))
    if "codes" in g:
        checks.append(close_scales(f"{tag}/codes", trajectory["codes"], g["codes"], TOL_CODES))
    if "summed_codes" in g:
        checks.append(close_scales(f"{tag}/summed_codes", trajectory["summed"], g["summed_codes"], TOL_CODES))
    if "summed_codes_last" in g:
        checks.append(_close(f"{tag}/summed_codes_last", result.latent, g["summed_codes_last"], TOL_CODES))
    if "img_float" in g:
        checks.append(_close(f"{tag}/img_float", result.images * 2 - 1, g["img_float"], TOL_IMAGE))
    if "img_uint8_bgr" in g:
        checks.append(_uint8_check(f"{tag}/img_uint8_bgr", _uint8_bgr(result.images), g["img_uint8_bgr"]))
    if recorder is not None:
        checks.append(close_scales(f"{tag}/block_outputs", recorder.outputs, g["block_outputs"], TOL_HIDDEN))


def _transformer_bits(adapter, vae_bits_B1hwd: torch.Tensor, si: int) -> torch.Tensor:
    """VAE bits of a scale → transformer bits ``[B, h·w, d_vae]`` (2×2 pixel-unshuffle with the patchify)."""
    bits = vae_bits_B1hwd.squeeze(1)
    if adapter.patchify:
        bits = F.pixel_unshuffle(bits.permute(0, 3, 1, 2).float(), 2).permute(0, 2, 3, 1)
    return bits.reshape(bits.shape[0], -1, bits.shape[-1])


def _teacher_forcing_input(adapter, vae, vae_bits, vae_sched) -> torch.Tensor:
    """``x_BLC_wo_prefix`` from the VAE bits: per later scale, the trilinear downsampling of the running sum."""
    full = tuple(vae_sched[-1])
    summed = None
    parts = []
    for si, bits in enumerate(vae_bits[:-1]):
        codes = F.interpolate(vae.bits_to_codes(bits), size=full, mode="trilinear")
        summed = codes if summed is None else summed + codes
        parts.append(adapter.next_input(summed, si + 1))
    return torch.cat(parts, dim=1)


def _latent_trajectory(adapter, tokens) -> dict:
    """Codes and running sums after each scale, recomputed from the bits with plain torch."""
    codes_list, summed_list = [], []
    summed = None
    full = adapter.vae_schedule[-1]
    for si, bits in enumerate(tokens):
        codes = adapter.vae.bits_to_codes(adapter.bits_to_vae_grid(bits, si))
        codes_list.append(codes)
        up = codes if tuple(codes.shape[2:]) == tuple(full) else F.interpolate(codes, size=full, mode="trilinear")
        summed = up if summed is None else summed + up
        summed_list.append(summed)
    return {"codes": codes_list, "summed": summed_list}
