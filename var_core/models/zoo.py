"""Named model specs: ``var-d16`` … ``var-d36``, ``testbed``, ``official-tiny``, ``infinity-2b``, ``infinity-8b``,
``infinity-tiny``, ``official-infinity-tiny``, and ``random:<name>``.

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

from ..errors import UserError
from .loading import (VAR_ENTRY_FIELDS, CheckpointError, check_infinity_entry, check_infinity_pair,
                      check_infinity_schedule, check_var_entry, check_var_vqvae_pair, check_vqvae_entry,
                      infer_var_config, infer_vqvae_config, load_strict, read_state_dict)
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


class UnknownModelError(UserError, ValueError):
    """An unknown ``--model`` name (a user error: exit 2 on the command line; still a ValueError for old callers)."""


def _unknown(name: str) -> UnknownModelError:
    prefix = "random:" if name.startswith("random:") else ""
    base = name.removeprefix("random:")
    close = [prefix + c for c in difflib.get_close_matches(base, list(ZOO), n=3, cutoff=0.5)]
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return UnknownModelError(f"unknown model {name!r}.{hint} Known models: {', '.join(sorted(ZOO))} "
                             f"(and random:<name> of each for seeded random weights)")


def check_model_name(name: str) -> str:
    """``name`` if it is a zoo entry or ``random:<entry>``, else :class:`UnknownModelError` (with a did-you-mean)."""
    if name.removeprefix("random:") not in ZOO:
        raise _unknown(name)
    return name


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
                   var_overrides: dict | None = None, *, entry: str | None = None, expected: dict | None = None,
                   expected_vqvae: dict | None = None, label: str | None = None, hint: str = ""):
    """Load an official-layout VAR + VQVAE pair from two files (config inferred and checked).

    Before any model is built, the VAR is checked against the VQVAE (vocabulary vs codebook entries, latent
    channels, number of scales) and, when ``expected`` / ``expected_vqvae`` are given, against the zoo entry
    ``entry`` (depth, width, vocabulary, AdaLN variant, patch_nums): a mismatch is a
    :class:`~var_core.models.loading.CheckpointMismatchError` naming the file(s) and both shapes."""
    var_path, vae_path = Path(var_path), Path(vae_path)
    var_sd = read_state_dict(var_path)
    overrides = dict(var_overrides or {})
    if expected is not None and "lvl_1L" in var_sd:
        # read the file's own schedule first, so that a wrong file is reported as such (with the entry to use)
        cfg = infer_var_config(var_sd, source=var_path, **overrides)
    else:
        cfg = infer_var_config(var_sd, patch_nums=patch_nums, source=var_path, **overrides)
    vae_sd = read_state_dict(vae_path)
    vq_kwargs = infer_vqvae_config(vae_sd, cfg.patch_nums, source=vae_path)
    check_var_vqvae_pair(var_sd, vae_sd, var_path, vae_path, num_scales=cfg.num_scales)
    if expected is not None:
        check_var_entry(cfg, var_sd, var_path, entry or "?", expected, entries=_zoo_var_architectures(),
                        hint=hint, label=label)
    if expected_vqvae is not None:
        check_vqvae_entry(vq_kwargs, vae_sd, vae_path, entry or "?", expected_vqvae, label=label)
    vq_kwargs.update(vqvae_overrides or {})
    var = VAR(cfg)
    load_strict(var, var_sd, "VAR", var_path)
    vae = _vqvae(vq_kwargs)
    load_strict(vae, vae_sd, "VQVAE", vae_path)
    return var, vae


def _zoo_var_architectures() -> dict[str, dict]:
    """Zoo entry -> the architecture fields a checkpoint can be compared on."""
    return {name: _entry_fields(spec) for name, spec in ZOO.items() if spec.var_config is not None}


def _entry_fields(spec: ModelSpec) -> dict:
    return {f: getattr(spec.var_config, f) for f in VAR_ENTRY_FIELDS}


def _fixture_expectations(config: dict, saln: bool) -> tuple[dict, dict]:
    """What config.json says ``var.pth`` (or ``var_saln.pth``) and ``vae.pth`` of a fixture folder hold."""
    kwargs = dict(config["build_vae_var_kwargs"])
    if saln:
        kwargs = dict(config.get("build_vae_var_kwargs_saln", kwargs))
        kwargs.setdefault("shared_aln", True)
    names = {"V": "vocab_size", "Cvae": "z_channels", "num_classes": "num_classes", "depth": "depth",
             "shared_aln": "shared_aln", "attn_l2_norm": "attn_l2_norm", "patch_nums": "patch_nums"}
    var_expected = {ours: kwargs[theirs] for theirs, ours in names.items() if theirs in kwargs}
    if "shared_aln" in var_expected:
        var_expected["shared_aln"] = bool(var_expected["shared_aln"])
    if saln:
        var_expected["shared_aln"] = True
    vq_names = {"V": "vocab_size", "Cvae": "z_channels", "ch": "ch", "share_quant_resi": "share_quant_resi"}
    vq_expected = {ours: kwargs[theirs] for theirs, ours in vq_names.items() if theirs in kwargs}
    return var_expected, vq_expected


def load_fixture_files(folder: str | Path | None = None, saln: bool = False):
    """``(var, vae)`` of an official VAR fixture folder (``var.pth`` or, with ``saln``, ``var_saln.pth``), each
    checked against what the folder's config.json says it holds."""
    folder = Path(folder) if folder is not None else default_fixture_dir()
    if not (folder / "config.json").exists():
        raise CheckpointError(
            f"official VAR fixture not found in {folder}: expected config.json, var.pth, vae.pth. Set "
            f"VARSCOPE_VAR_FIXTURE or pass --weights pointing at a folder in that format"
        )
    try:
        config = json.loads((folder / "config.json").read_text())
        kwargs = config["build_vae_var_kwargs"]
        patch_nums = kwargs["patch_nums"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder / 'config.json'} is not a VAR fixture config (it needs "
                              f"build_vae_var_kwargs.patch_nums): {exc}") from exc
    var_expected, vq_expected = _fixture_expectations(config, saln)
    file = "var_saln.pth" if saln else "var.pth"
    if saln:
        label = "the fixture's var_saln.pth (the shared-AdaLN model)"
        hint = ("In a fixture folder var_saln.pth holds the shared-AdaLN model (config.json build_vae_var_kwargs_saln) "
                "and var.pth the per-block-AdaLN one (build_vae_var_kwargs).")
    else:
        label = "zoo entry 'official-tiny' (var.pth)"
        hint = ("'official-tiny' loads var.pth, the per-block-AdaLN model (config.json build_vae_var_kwargs); "
                "the fixture's shared-AdaLN model belongs in var_saln.pth.")
    return load_var_files(folder / file, folder / "vae.pth", patch_nums=patch_nums, entry="official-tiny",
                          expected=var_expected, expected_vqvae=vq_expected, label=label, hint=hint)


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
    var_sd, vae_sd = read_state_dict(folder / "var.safetensors"), read_state_dict(folder / "vqvae.safetensors")
    check_var_vqvae_pair(var_sd, vae_sd, folder / "var.safetensors", folder / "vqvae.safetensors",
                         num_scales=var_cfg.num_scales)
    var = VAR(var_cfg)
    load_strict(var, var_sd, "testbed VAR", folder / "var.safetensors")
    vae = _vqvae(vq_kwargs)
    load_strict(vae, vae_sd, "testbed VQVAE", folder / "vqvae.safetensors")
    return var, vae


def load_model(name: str = "testbed", weights: str | Path | None = None, vae_weights: str | Path | None = None,
               device: str | torch.device = "cpu", seed: int = 0, dtype: torch.dtype = torch.float32, **options):
    """Return an engine adapter for a named model.

    ``name``: a zoo entry, or ``random:<entry>`` for the same architecture with weights drawn from ``seed``.
    ``weights``: a weight file or a directory holding the official file names.
    ``options`` (Infinity only): ``text_encoder`` (a local flan-t5 directory, or an encoder object), ``pn``,
    ``h_div_w``, ``num_scales``, ``schedule``, ``cfg_insertion_layer``, ``negative_prompt``.
    """
    from ..engine.adapters.var_adapter import VARAdapter

    random_weights = name.startswith("random:")
    base = name.removeprefix("random:")
    if base not in ZOO:
        raise _unknown(name)
    spec = ZOO[base]
    if spec.family == "infinity":
        return load_infinity_model(name, weights, vae_weights, device=device, seed=seed, dtype=dtype, **options)
    if options:
        raise TypeError(f"unexpected options for the VAR model {name!r}: {sorted(options)}")
    if base == "testbed":
        var, vae = _load_testbed(weights, seed, random_weights)
    elif base == "official-tiny":
        var, vae = load_fixture_files(weights)
        if random_weights:
            var, vae = build_var_pair(var.cfg, vae.config, seed)
    elif random_weights:
        var, vae = build_var_pair(spec.var_config, spec.vqvae_kwargs, seed)
    else:
        var_path, vae_path = _resolve_files(spec, weights, vae_weights)
        var, vae = load_var_files(var_path, vae_path, patch_nums=spec.var_config.patch_nums, entry=spec.name,
                                  expected=_entry_fields(spec), expected_vqvae=spec.vqvae_kwargs)
    var.to(device=device, dtype=dtype).eval().requires_grad_(False)
    vae.to(device=device).eval().requires_grad_(False)
    adapter = VARAdapter(var, vae)
    adapter.model_name = name
    if base == "testbed":
        from ..engine.sampling import SamplingConfig

        folder = Path(weights) if weights is not None else TESTBED_DIR
        meta = json.loads((folder / "testbed.json").read_text())
        if "default_sampling" in meta:
            known = {"cfg", "top_k", "top_p", "temperature"}
            adapter.default_sampling = SamplingConfig(**{k: v for k, v in meta["default_sampling"].items()
                                                         if k in known})
    return adapter


# ================================================================================================================
# Infinity (bitwise text-to-image)
# ================================================================================================================
T5_DIR_NAME = "flan-t5-xl"
T5_ENV = "VARSCOPE_T5_DIR"


def default_infinity_fixture_dir() -> Path:
    """The official Infinity golden fixture: ``$VARSCOPE_INFINITY_FIXTURE`` or
    ``../shared/fixtures/official_infinity_tiny``."""
    env = os.environ.get("VARSCOPE_INFINITY_FIXTURE")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "official_infinity_tiny"


@dataclass(frozen=True)
class InfinitySpec:
    """How to build / find one Infinity model. ``config`` None: inferred from the files (fixtures)."""

    config: object | None  # InfinityConfig
    vae_config: object | None  # BSQVAEConfig
    weight_file: str | None  # file or sharded directory (official name), inside --weights DIR
    vae_file: str | None
    needs_t5: bool = True
    pn: str = "1M"
    num_scales: int | None = None


def _infinity_specs() -> dict[str, InfinitySpec]:
    from .bsq_vae import VAE_2B, VAE_8B, BSQVAEConfig
    from .infinity import INFINITY_2B, INFINITY_8B, InfinityConfig

    tiny = InfinityConfig(depth=4, embed_dim=64, num_heads=2, text_channels=128, text_maxlen=64, d_vae=16,
                          block_chunks=2)
    tiny_vae = BSQVAEConfig(codebook_dim=16, base_ch=32, encoder_ch_mult=(1, 1, 1, 1, 1),
                            decoder_ch_mult=(1, 1, 1, 1, 1), patch_size=16)
    return {
        "infinity-2b": InfinitySpec(INFINITY_2B, VAE_2B, "infinity_2b_reg.pth", "infinity_vae_d32_reg.pth"),
        "infinity-8b": InfinitySpec(INFINITY_8B, VAE_8B, "infinity_8b_weights", "infinity_vae_d56_f8_14_patchify.pth"),
        "infinity-tiny": InfinitySpec(tiny, tiny_vae, "infinity.pth", "vae.pth", needs_t5=False, num_scales=5),
        "official-infinity-tiny": InfinitySpec(None, None, "infinity.pth", "vae.pth", needs_t5=False),
    }


INFINITY_SPECS: dict[str, InfinitySpec] = _infinity_specs()
ZOO.update({
    spec.name: spec
    for spec in (
        ModelSpec("infinity-2b", "infinity", "official Infinity-2B (flan-t5-xl text, d32 BSQ-VAE), 1024px",
                  weight_file="infinity_2b_reg.pth", vae_file="infinity_vae_d32_reg.pth"),
        ModelSpec("infinity-8b", "infinity", "official Infinity-8B (flan-t5-xl text, d14 BSQ-VAE with 2x2 patchify), "
                  "1024px", weight_file="infinity_8b_weights", vae_file="infinity_vae_d56_f8_14_patchify.pth"),
        ModelSpec("infinity-tiny", "infinity", "a 4-layer, 64-wide Infinity on a 5-scale schedule (128px) with a tiny "
                  "random text encoder; use random:infinity-tiny (tests, demos, CPU benchmarks)",
                  weight_file="infinity.pth", vae_file="vae.pth"),
        ModelSpec("official-infinity-tiny", "infinity", "the official-code golden fixture's random tiny Infinity "
                  "(pre-encoded text or a random text encoder)", weight_file="infinity.pth", vae_file="vae.pth"),
    )
})


def read_sharded_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A file, or a directory of shards (``*.index.json`` naming them, or every weight file in it)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return read_state_dict(path)
    index = sorted(path.glob("*.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text()).get("weight_map", {})
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pth", ".pt"))
    if not shards:
        raise CheckpointError(f"no weight shards in {path}: expected *.index.json with its shards, or "
                              f"*.safetensors / *.bin / *.pth files")
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        merged.update(read_state_dict(path / shard))
    return merged


def load_infinity_files(infinity_path: Path, vae_path: Path, *, entry: str | None = None,
                        expected: dict | None = None, expected_vae: dict | None = None, **config_overrides):
    """Load an official-layout Infinity transformer and BSQ-VAE (architecture inferred, strict load).

    Both files are read and checked before any model is built: bits per token vs the BSQ codebook (with the
    2×2 patchify), and, with ``expected`` / ``expected_vae``, the zoo entry ``entry``'s architecture."""
    from .bsq_vae import BSQVAE, infer_bsq_vae_config, remap_vae_keys
    from .infinity import Infinity, infer_infinity_config, prepare_infinity_state_dict

    vae_sd = read_state_dict(vae_path)
    try:
        vae_cfg = infer_bsq_vae_config(vae_sd)
    except KeyError as exc:
        raise CheckpointError(f"{vae_path}: {exc}") from exc
    inf_sd = read_sharded_state_dict(infinity_path)
    try:
        cfg = infer_infinity_config(inf_sd, **config_overrides)
    except KeyError as exc:
        raise CheckpointError(f"{infinity_path}: {exc}") from exc
    check_infinity_pair(cfg, inf_sd, vae_cfg, infinity_path, vae_path)
    if expected is not None or expected_vae is not None:
        others = {n: s.config for n, s in INFINITY_SPECS.items() if s.config is not None}
        check_infinity_entry(cfg, vae_cfg, infinity_path, vae_path, entry or "?", expected, expected_vae, others)
    vae = BSQVAE(vae_cfg)
    load_strict(vae, remap_vae_keys(vae_sd, vae), "Infinity BSQ-VAE", vae_path)
    model = Infinity(cfg)
    load_strict(model, prepare_infinity_state_dict(inf_sd, model), "Infinity", infinity_path)
    return model, vae


_INFINITY_SPEC_FIELDS = ("depth", "embed_dim", "num_heads", "text_channels", "d_vae")
_BSQ_SPEC_FIELDS = ("codebook_dim", "patch_size")


def load_infinity_fixture_files(folder: str | Path | None = None):
    """``(infinity, vae, config)`` of an official Infinity fixture folder, checked against its config.json
    (transformer sizes, BSQ codebook bits, patch schedule)."""
    folder = Path(folder) if folder is not None else default_infinity_fixture_dir()
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"official Infinity fixture not found in {folder}: expected config.json, infinity.pth, vae.pth. Set "
            f"VARSCOPE_INFINITY_FIXTURE or pass --weights pointing at a folder in that format"
        )
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as exc:
        raise CheckpointError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
    kwargs = config.get("infinity_ctor_kwargs", {})
    expected = {k: int(kwargs[k]) for k in ("depth", "embed_dim", "num_heads", "block_chunks", "text_channels")
                if k in kwargs}
    vae_call = config.get("vae_model_call", {})
    expected_vae = {k: vae_call[k] for k in ("codebook_dim", "patch_size", "encoder_ch_mult", "decoder_ch_mult")
                    if k in vae_call}
    model, vae = load_infinity_files(folder / "infinity.pth", folder / "vae.pth", entry="official-infinity-tiny",
                                     expected=expected, expected_vae=expected_vae,
                                     apply_spatial_patchify=bool(kwargs.get("apply_spatial_patchify", 0)),
                                     text_maxlen=int(kwargs.get("text_maxlen", 512)))
    if "scale_schedule" in config:
        check_infinity_schedule(model.cfg, config["scale_schedule"], folder / "infinity.pth",
                                origin=f"{folder / 'config.json'}'s scale_schedule")
    return model, vae, config


def build_infinity_pair(cfg, vae_cfg, seed: int = 0):
    """Infinity + BSQ-VAE with seeded random weights (private RNG; the global RNG state is untouched)."""
    from .bsq_vae import BSQVAE
    from .infinity import Infinity, randomize_infinity_

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = BSQVAE(vae_cfg)
    with torch.device("meta"):  # every parameter is redrawn below: skip the default initialisation
        model = Infinity(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.zero_()  # the zero_k_bias buffers (the only buffers)
    randomize_infinity_(model, seed)
    return model, vae


def _t5_encoder(spec_name: str, text_encoder, weights: Path | None, device, dtype):
    """The flan-t5 encoder for a real Infinity model, from an explicit directory, ``--weights DIR/flan-t5-xl``
    or ``$VARSCOPE_T5_DIR``."""
    from .text_encoder import T5TextEncoder

    if text_encoder is not None and not isinstance(text_encoder, (str, Path)):
        return text_encoder  # an encoder object
    candidates = []
    if text_encoder is not None:
        candidates.append(Path(text_encoder).expanduser())
    else:
        if weights is not None and Path(weights).is_dir():
            candidates.append(Path(weights) / T5_DIR_NAME)
        if os.environ.get(T5_ENV):
            candidates.append(Path(os.environ[T5_ENV]).expanduser())
    if not candidates:
        raise CheckpointError(
            f"model {spec_name!r} needs the flan-t5-xl text encoder: pass text_encoder=DIR (--text-encoder), put "
            f"it at --weights DIR/{T5_DIR_NAME}, or set ${T5_ENV}. The directory must hold config.json, the model "
            f"weights (model.safetensors or pytorch_model.bin, or their *.index.json and shards) and the tokenizer "
            f"(spiece.model or tokenizer.json). Nothing is downloaded."
        )
    t5_dtype = torch.float16 if torch.device(device).type == "cuda" and dtype != torch.float32 else torch.float32
    errors = []
    for path in candidates:
        try:
            return T5TextEncoder(path, device=device, dtype=t5_dtype)
        except FileNotFoundError as exc:
            errors.append(str(exc))
    raise CheckpointError("; ".join(errors))


def load_infinity_model(name: str, weights=None, vae_weights=None, device="cpu", seed: int = 0,
                        dtype: torch.dtype = torch.float32, text_encoder=None, pn: str | None = None,
                        h_div_w: float = 1.0, num_scales: int | None = None, schedule=None,
                        cfg_insertion_layer: int = 0, negative_prompt=None):
    """An :class:`~var_core.engine.adapters.infinity_adapter.InfinityAdapter` for a named Infinity model."""
    from ..engine.adapters.infinity_adapter import InfinityAdapter
    from .text_encoder import RandomTextEncoder

    random_weights = name.startswith("random:")
    base = name.removeprefix("random:")
    spec = INFINITY_SPECS[base]
    zoo_spec = ZOO[base]
    default_num_scales = spec.num_scales
    if base == "official-infinity-tiny":
        model, vae, config = load_infinity_fixture_files(weights)
        if random_weights:
            model, vae = build_infinity_pair(model.cfg, vae.cfg, seed)
        if schedule is None and pn is None and num_scales is None:
            schedule = [tuple(s) for s in config["scale_schedule"]]
    elif random_weights:
        model, vae = build_infinity_pair(spec.config, spec.vae_config, seed)
    else:
        if weights is None:
            raise CheckpointError(
                f"model {base!r} needs local weights: pass --weights DIR (holding {zoo_spec.weight_file}, "
                f"{zoo_spec.vae_file}" + (f" and {T5_DIR_NAME}/" if spec.needs_t5 else "") + f") or --weights "
                f"{zoo_spec.weight_file} --vae-weights {zoo_spec.vae_file}; or use 'random:{base}' for seeded random "
                f"weights"
            )
        weights = Path(weights).expanduser()
        if weights.is_dir() and (weights / spec.weight_file).exists():
            inf_path = weights / spec.weight_file
            vae_path = weights / spec.vae_file
        else:
            inf_path, vae_path = weights, weights.parent / spec.vae_file
        if vae_weights is not None:
            vae_path = Path(vae_weights).expanduser()
        for what, path in (("transformer", inf_path), ("VAE", vae_path)):
            if not path.exists():
                raise CheckpointError(f"Infinity {what} weights not found: {path} (expected the official file "
                                      f"{spec.weight_file if what == 'transformer' else spec.vae_file})")
        overrides = {}
        if spec.config is not None:
            overrides = dict(apply_spatial_patchify=spec.config.apply_spatial_patchify,
                             text_maxlen=spec.config.text_maxlen,
                             expected={f: getattr(spec.config, f) for f in _INFINITY_SPEC_FIELDS})
        if spec.vae_config is not None:
            overrides["expected_vae"] = {f: getattr(spec.vae_config, f) for f in _BSQ_SPEC_FIELDS}
        model, vae = load_infinity_files(inf_path, vae_path, entry=base, **overrides)
    cfg = model.cfg
    if spec.needs_t5 and not random_weights:
        encoder = _t5_encoder(base, text_encoder, weights if not random_weights else None, device, dtype)
    elif text_encoder is not None and not isinstance(text_encoder, (str, Path)):
        encoder = text_encoder
    elif text_encoder is not None:
        encoder = _t5_encoder(base, text_encoder, None, device, dtype)
    else:
        encoder = RandomTextEncoder(out_dim=cfg.text_channels, max_length=cfg.text_maxlen, seed=seed)
        encoder.to(device)
    if encoder.out_dim != cfg.text_channels:
        raise CheckpointError(f"the text encoder gives {encoder.out_dim}-dim features but {base} reads "
                              f"{cfg.text_channels}")
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    vae.to(device=device).eval().requires_grad_(False)
    if schedule is None and pn is None and num_scales is None:
        num_scales = default_num_scales
    adapter = InfinityAdapter(model, vae, encoder, schedule=schedule, pn=pn or "1M", h_div_w=h_div_w,
                              num_scales=num_scales, cfg_insertion_layer=cfg_insertion_layer,
                              negative_prompt=negative_prompt)
    adapter.model_name = name
    return adapter
