"""``python -m var_core.verify FIXTURE_DIR``: check our models against golden outputs of the official code.

Accepts any folder in the format of ``shared/fixtures/official_var_tiny`` (config.json + weights + golden
files), whatever its scales, vocabulary, depth and batch. Prints one line per check with the maximum
deviation and the tolerance, ends with ``verify: N passed, M failed`` and exits non-zero on any failure.
RNG-dependent goldens are optional: a mismatch there is reported as ``SKIP``/``INFO``, not a failure, because
our per-sample sampler may consume randomness differently from the official single-generator one.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

TOL_LOGITS = 1e-4
TOL_IMAGE = 2e-4


@dataclass
class Check:
    name: str
    passed: bool | None  # None: optional check, reported only
    deviation: float | str
    tolerance: float | str

    def line(self) -> str:
        status = {True: "PASS", False: "FAIL", None: "INFO"}[self.passed]
        dev = f"{self.deviation:.3g}" if isinstance(self.deviation, float) else self.deviation
        tol = f"{self.tolerance:.3g}" if isinstance(self.tolerance, float) else self.tolerance
        return f"{status}  {self.name:<48s} max_dev={dev:<10s} tol={tol}"


def _max_dev(a, b) -> float:
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


def _close(name, ours, golden, tol) -> Check:
    if isinstance(golden, (list, tuple)):
        devs = [_max_dev(o, g) for o, g in zip(ours, golden)]
        dev = max(devs) if len(ours) == len(golden) else float("inf")
    else:
        dev = _max_dev(ours, golden)
    return Check(name, dev <= tol, dev, tol)


def _identical(name, ours, golden, optional=False) -> Check:
    ours, golden = list(ours), list(golden)
    mismatches = sum(int((o != g).sum()) if o.shape == g.shape else g.numel() for o, g in zip(ours, golden))
    mismatches += abs(len(ours) - len(golden))
    total = sum(g.numel() for g in golden)
    ok = mismatches == 0
    return Check(name, ok if not optional else (None if not ok else True), f"{mismatches}/{total} differ", "exact")


def verify_var_fixture(folder: Path) -> list[Check]:
    from .engine import GenerationOptions, SamplingConfig, generate
    from .engine.adapters.var_adapter import VARAdapter
    from .models.zoo import load_var_files

    config = json.loads((folder / "config.json").read_text())
    patch_nums = config["build_vae_var_kwargs"]["patch_nums"]
    checks: list[Check] = []
    variants = [("var", "var.pth", "golden_var")]
    if (folder / "var_saln.pth").exists():
        variants.append(("var_saln", "var_saln.pth", "golden_var_saln"))

    var, vae = load_var_files(folder / "var.pth", folder / "vae.pth", patch_nums=patch_nums)
    vae.eval()
    golden = torch.load(folder / "golden_vqvae.pt", weights_only=True)
    with torch.no_grad():
        f = vae.encode_features(golden["image"])
        checks.append(_close("vqvae/f_encoded", f, golden["f_encoded"], TOL_LOGITS))
        checks.append(_identical("vqvae/idx_Bl", vae.quantize.f_to_idx_list(f), golden["idx_Bl"]))
        checks.append(_close("vqvae/f_hat_per_scale", vae.quantize.f_to_fhat_list(f), golden["f_hat_per_scale"],
                             TOL_LOGITS))
        recon = vae.fhat_to_img(vae.quantize.f_to_fhat_list(f)[-1])
        checks.append(_close("vqvae/recon", recon, golden["recon"], TOL_IMAGE))

    for tag, weight_file, prefix in variants:
        var, _ = load_var_files(folder / weight_file, folder / "vae.pth", patch_nums=patch_nums)
        var.eval()
        adapter = VARAdapter(var, vae)
        tf_path = folder / f"{prefix}_teacher_forcing.pt"
        if tf_path.exists():
            tf = torch.load(tf_path, weights_only=True)
            with torch.no_grad():
                x_in = vae.quantize.idx_list_to_var_input(golden["idx_Bl"])
                checks.append(_close(f"{tag}/teacher_forcing/input", x_in, tf["x_BLCv_wo_first_l"], TOL_LOGITS))
                logits, blocks = var(tf["labels"], tf["x_BLCv_wo_first_l"], return_block_outputs=True)
            checks.append(_close(f"{tag}/teacher_forcing/logits", logits, tf["logits_BLV"], TOL_LOGITS))
            checks.append(_close(f"{tag}/teacher_forcing/block_outputs", blocks, tf["block_outputs"], TOL_LOGITS))
        for ar_path in sorted(folder.glob(f"{prefix}_ar_greedy_cfg*.pt")):
            g = torch.load(ar_path, weights_only=True)
            args = g["args"]
            cfg_value = float(args["cfg"])
            name = f"{tag}/greedy_cfg{cfg_value:g}"
            labels = torch.as_tensor(args["label_B"])
            sampling = SamplingConfig(cfg=cfg_value, top_k=int(args.get("top_k", 1)), top_p=float(args.get("top_p", 0)))
            result = generate(adapter, labels, seeds=[0] * len(labels), sampling=sampling,
                              options=GenerationOptions())
            if "raw_logits" in g:
                checks.append(_close(f"{name}/raw_logits", [r.raw_logits_RNV for r in result.records],
                                     g["raw_logits"], TOL_LOGITS))
            checks.append(_close(f"{name}/cfg_logits", [r.guided_logits_BNV for r in result.records],
                                 g["cfg_logits"], TOL_LOGITS))
            checks.append(_identical(f"{name}/tokens", result.tokens, g["idx_Bl"]))
            f_hats = _fhat_trajectory(vae, result.tokens)
            checks.append(_close(f"{name}/f_hat", f_hats, g["f_hat"], TOL_LOGITS))
            checks.append(_close(f"{name}/image", result.images, g["image"], TOL_IMAGE))
        for rng_path in sorted(folder.glob(f"{prefix}_ar_sampled_rng_*.pt")):
            g = torch.load(rng_path, weights_only=True)
            args = g["args"]
            labels = torch.as_tensor(args["label_B"])
            sampling = SamplingConfig(cfg=float(args["cfg"]), top_k=int(args["top_k"]), top_p=float(args["top_p"]))
            gen = torch.Generator().manual_seed(int(args["g_seed"]))
            result = generate(adapter, labels, sampling=sampling, shared_generator=gen)
            checks.append(_identical(f"{tag}/optional/{rng_path.stem}/tokens", result.tokens, g["idx_Bl"],
                                     optional=True))
        for smooth_path in sorted(folder.glob(f"{prefix}_ar_smooth_*.pt")):
            checks.append(Check(f"{tag}/optional/{smooth_path.stem}", None, "skipped",
                                "gumbel 'more_smooth' is a visualisation mode we do not implement"))
    return checks


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


def detect_family(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    if "build_vae_var_kwargs" in config:
        return "var"
    if (folder / "infinity.pth").exists():
        return "infinity"
    raise ValueError(f"{folder}/config.json is neither a VAR fixture (build_vae_var_kwargs) nor an Infinity one")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m var_core.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("fixture_dir", type=Path, help="folder in the format of shared/fixtures/official_var_tiny")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.fixture_dir
    if not (folder / "config.json").exists():
        print(f"verify: {folder} has no config.json; is it a fixture folder?", file=sys.stderr)
        return 2
    family = detect_family(folder)
    if family == "var":
        checks = verify_var_fixture(folder)
    else:
        try:
            from .verify_infinity import verify_infinity_fixture
        except ImportError:
            print("verify: Infinity fixtures are not supported yet in this build", file=sys.stderr)
            return 2
        checks = verify_infinity_fixture(folder)
    for check in checks:
        print(check.line())
    failed = sum(c.passed is False for c in checks)
    passed = sum(c.passed is True for c in checks)
    print(f"verify: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
