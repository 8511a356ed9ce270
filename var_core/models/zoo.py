"""Named model specs: ``var-d16`` … ``var-d36``, ``testbed``, ``official-tiny``, and ``random:<name>``.

``load_model(name, weights=...)`` returns an engine adapter ready for ``var_core.engine.generate``.
Weights always come from local files; ``random:<name>`` builds the architecture with seeded random weights
(for speed and FLOPs benchmarks without checkpoints). Nothing is ever downloaded.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .loading import CheckpointError, infer_var_config, infer_vqvae_config, load_strict, read_state_dict
from .var import VAR, VARConfig, official_var_config

PATCH_NUMS_256 = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
PATCH_NUMS_512 = (1, 2, 3, 4, 6, 9, 13, 18, 24, 32)
OFFICIAL_VQVAE = dict(vocab_size=4096, z_channels=32, ch=160, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2,
                      share_quant_resi=4)
OFFICIAL_VAE_FILE = "vae_ch160v4096z32.pth"
TESTBED_DIR = Path(__file__).resolve().parents[1] / "testbed" / "weights"


def default_fixture_dir() -> Path:
    """The official VAR golden fixture: ``$VARSCOPE_VAR_FIXTURE`` or ``../shared/fixtures/official_var_tiny``."""
    env = os.environ.get("VARSCOPE_VAR_FIXTURE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "official_var_tiny"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    description: str
    var_config: VARConfig | None = None
    vqvae_kwargs: dict = field(default_factory=dict)
    weight_file: str | None = None  # the official file name, looked up inside a --weights directory
    vae_file: str | None = None


def _official(depth: int, patch_nums=PATCH_NUMS_256, shared_aln=False) -> ModelSpec:
    reso = 16 * patch_nums[-1]
    return ModelSpec(
        name=f"var-d{depth}", family="var",
        description=f"official class-conditional VAR-d{depth}, ImageNet {reso}px"
                    + (", shared AdaLN" if shared_aln else ""),
        var_config=official_var_config(depth, patch_nums=patch_nums, shared_aln=shared_aln, vocab_size=4096,
                                       z_channels=32, num_classes=1000),
        vqvae_kwargs=dict(OFFICIAL_VQVAE, patch_nums=patch_nums),
        weight_file=f"var_d{depth}.pth", vae_file=OFFICIAL_VAE_FILE,
    )


ZOO: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _official(16), _official(20), _official(24), _official(30),
        _official(36, PATCH_NUMS_512, shared_aln=True),
        ModelSpec("testbed", "var", "the project's trained tiny class-conditional VAR (default; shipped weights)"),
        ModelSpec("official-tiny", "var", "the official-code golden fixture's random tiny VAR (tests and demos)"),
    )
}


def model_names() -> list[str]:
    return sorted(ZOO) + [f"random:{n}" for n in sorted(ZOO)]


def _unknown(name: str) -> ValueError:
    base = name.removeprefix("random:")
    close = difflib.get_close_matches(base, list(ZOO), n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown model {name!r}.{hint} Known models: {', '.join(model_names())}")


def _vqvae(kwargs: dict):
    from .vqvae import VQVAE

    return VQVAE(**kwargs)


def _resolve_files(spec: ModelSpec, weights: str | Path | None, vae_weights: str | Path | None) -> tuple[Path, Path]:
    if weights is None:
        raise CheckpointError(
            f"model {spec.name!r} needs local weights: pass --weights DIR (holding {spec.weight_file} and "
            f"{spec.vae_file}) or --weights {spec.weight_file} --vae-weights {spec.vae_file}; "
            f"or use 'random:{spec.name}' for seeded random weights"
        )
    weights = Path(weights).expanduser()
    if weights.is_dir():
        var_path, vae_path = weights / spec.weight_file, weights / spec.vae_file
    else:
        var_path = weights
        vae_path = weights.parent / spec.vae_file
    if vae_weights is not None:
        vae_path = Path(vae_weights).expanduser()
    return var_path, vae_path


def build_var_pair(var_cfg: VARConfig, vqvae_kwargs: dict, seed: int | None = 0):
    """Build a VAR and VQVAE; with ``seed`` their weights are drawn from a private RNG (no global effect)."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        vae = _vqvae(vqvae_kwargs)
        var = VAR(var_cfg)
        var.init_weights(init_adaln_gamma=0.2)  # non-trivial blocks, so every sub-layer matters in benchmarks
    return var, vae


def load_var_files(var_path: Path, vae_path: Path, patch_nums=None, vqvae_overrides: dict | None = None,
                   var_overrides: dict | None = None):
    """Load an official-layout VAR + VQVAE pair from two files (config inferred and checked)."""
    var_sd = read_state_dict(var_path)
    cfg = infer_var_config(var_sd, patch_nums=patch_nums, **(var_overrides or {}))
    vae_sd = read_state_dict(vae_path)
    vq_kwargs = infer_vqvae_config(vae_sd, cfg.patch_nums)
    vq_kwargs.update(vqvae_overrides or {})
    var = VAR(cfg)
    load_strict(var, var_sd, "VAR", var_path)
    vae = _vqvae(vq_kwargs)
    load_strict(vae, vae_sd, "VQVAE", vae_path)
    return var, vae


def _load_fixture(weights: str | Path | None, saln: bool = False):
    folder = Path(weights) if weights is not None else default_fixture_dir()
    if not (folder / "config.json").exists():
        raise CheckpointError(
            f"official VAR fixture not found in {folder}: expected config.json, var.pth, vae.pth. Set "
            f"VARSCOPE_VAR_FIXTURE or pass --weights pointing at a folder in that format"
        )
    config = json.loads((folder / "config.json").read_text())
    kwargs = config["build_vae_var_kwargs"]
    return load_var_files(folder / ("var_saln.pth" if saln else "var.pth"), folder / "vae.pth",
                          patch_nums=kwargs["patch_nums"])


def _load_testbed(weights: str | Path | None, seed: int | None, random_weights: bool):
    folder = Path(weights) if weights is not None else TESTBED_DIR
    card = folder / "testbed.json"
    if not card.exists():
        raise CheckpointError(
            f"testbed weights not found: {card} is missing. The shipped weights live in {TESTBED_DIR}; "
            f"train them with `python -m var_core.testbed.train` or pass --weights DIR"
        )
    meta = json.loads(card.read_text())
    var_cfg = VARConfig(**meta["var_config"])
    vq_kwargs = dict(meta["vqvae_config"])
    if random_weights:
        return build_var_pair(var_cfg, vq_kwargs, seed)
    var = VAR(var_cfg)
    load_strict(var, read_state_dict(folder / "var.safetensors"), "testbed VAR", folder / "var.safetensors")
    vae = _vqvae(vq_kwargs)
    load_strict(vae, read_state_dict(folder / "vqvae.safetensors"), "testbed VQVAE", folder / "vqvae.safetensors")
    return var, vae


def load_model(name: str = "testbed", weights: str | Path | None = None, vae_weights: str | Path | None = None,
               device: str | torch.device = "cpu", seed: int = 0, dtype: torch.dtype = torch.float32):
    """Return an engine adapter for a named model.

    ``name``: a zoo entry, or ``random:<entry>`` for the same architecture with weights drawn from ``seed``.
    ``weights``: a weight file or a directory holding the official file names.
    """
    from ..engine.adapters.var_adapter import VARAdapter

    random_weights = name.startswith("random:")
    base = name.removeprefix("random:")
    if base not in ZOO:
        raise _unknown(name)
    spec = ZOO[base]
    if base == "testbed":
        var, vae = _load_testbed(weights, seed, random_weights)
    elif base == "official-tiny":
        var, vae = _load_fixture(weights)
        if random_weights:
            var, vae = build_var_pair(var.cfg, vae.config, seed)
    elif random_weights:
        var, vae = build_var_pair(spec.var_config, spec.vqvae_kwargs, seed)
    else:
        var_path, vae_path = _resolve_files(spec, weights, vae_weights)
        var, vae = load_var_files(var_path, vae_path, patch_nums=spec.var_config.patch_nums,
                                  var_overrides=dict(shared_aln=spec.var_config.shared_aln))
    var.to(device=device, dtype=dtype).eval().requires_grad_(False)
    vae.to(device=device).eval().requires_grad_(False)
    adapter = VARAdapter(var, vae)
    adapter.model_name = name
    return adapter
