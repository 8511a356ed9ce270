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
from typing import Sequence

import torch

from .errors import UserError, did_you_mean
from .models.loading import (VAR_ENTRY_FIELDS, check_infinity_entry, check_infinity_pair, check_infinity_schedule,
                             check_var_entry, check_var_vqvae_pair, check_vqvae_entry, CheckpointError,
                             hf_snapshot_dir, infer_var_config, infer_vqvae_config, is_shard_folder, load_strict,
                             read_json_file, read_sharded_state_dict, read_state_dict, shard_files)
from .models.var import VAR, VARConfig, official_var_config

PATCH_NUMS_256 = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
PATCH_NUMS_512 = (1, 2, 3, 4, 6, 9, 13, 18, 24, 32)
OFFICIAL_VQVAE = dict(vocab_size=4096, z_channels=32, ch=160, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2,
                      share_quant_resi=4)
OFFICIAL_VAE_FILE = "vae_ch160v4096z32.pth"
TESTBED_DIR = Path(__file__).resolve().parent / "testbed" / "weights"
TESTBED_SMALL_DIR = TESTBED_DIR / "small"
# the trained testbeds: zoo name -> shipped folder (testbed.json, var.safetensors; the VQVAE file they share is named
# in the card's "vqvae_file", default vqvae.safetensors beside it)
TESTBED_FOLDERS = {"testbed": TESTBED_DIR, "testbed-small": TESTBED_SMALL_DIR}


def is_testbed(name: str) -> bool:
    """Whether ``name`` (``random:`` allowed) is one of the trained testbeds (``testbed``, ``testbed-small``)."""
    return str(name).removeprefix("random:") in TESTBED_FOLDERS


def testbed_folder(name: str = "testbed", weights: str | Path | None = None) -> Path:
    """The folder a testbed loads from: ``weights`` if given, else the shipped folder of entry ``name``."""
    return Path(weights) if weights is not None else TESTBED_FOLDERS[str(name).removeprefix("random:")]


def fixture_dir(env_var: str, name: str) -> Path:
    """An official golden fixture folder: ``$env_var`` if set, else ``shared/fixtures/<name>`` beside the checkout."""
    env = os.environ.get(env_var)
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "fixtures" / name


def default_fixture_dir() -> Path:
    """The official VAR golden fixture: ``$VARSCOPE_VAR_FIXTURE`` or ``../shared/fixtures/official_var_tiny``."""
    return fixture_dir("VARSCOPE_VAR_FIXTURE", "official_var_tiny")


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
        ModelSpec("testbed", "var", "the project's trained class-conditional VAR, depth 8, width 256 (default; "
                                    "shipped weights)"),
        ModelSpec("testbed-small", "var", "the first testbed, depth 4, width 128: same VQVAE, data and classes, "
                                          "6x fewer FLOPs (fast tests; shipped weights)"),
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
    from .models.vqvae import VQVAE

    return VQVAE(**kwargs)


# ----- official file names: which file a --weights / --vae-weights path means --------------------------------
#: Other spellings of official file names, as users download them. The model hub calls the Infinity-2B VAE
#: ``infinity_vae_d32reg.pth`` while the repository's scripts spell it ``infinity_vae_d32_reg.pth``.
ALTERNATE_FILE_NAMES: dict[str, tuple[str, ...]] = {
    "infinity_vae_d32_reg.pth": ("infinity_vae_d32reg.pth",),
}
#: Entries whose transformer is a folder of shards (``model-0000i-of-0000n.safetensors`` + its index json).
SHARDED_ENTRIES = frozenset({"infinity-8b"})
SHARDS_NOTE = ("a folder of shards: model-0000i-of-0000n.safetensors with model.safetensors.index.json, or "
               "pytorch_model-*.bin with pytorch_model.bin.index.json")


@dataclass(frozen=True)
class WeightFiles:
    """The files a zoo entry loads, as :func:`resolve_weight_files` found them (``searched``: the folders looked
    in; ``sharded``: ``transformer`` is a folder of shards)."""

    entry: str
    transformer: Path
    vae: Path
    sharded: bool = False
    searched: tuple[Path, ...] = ()


def accepted_file_names(entry: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(transformer names, VAE names)`` accepted for zoo entry ``entry`` (``random:`` stripped), the spelling of
    the official repository's scripts first, then the other spellings of :data:`ALTERNATE_FILE_NAMES`."""
    base = entry.removeprefix("random:")
    if base not in ZOO:
        raise _unknown(entry)
    spec = ZOO[base]
    if spec.weight_file is None or spec.vae_file is None:
        raise ValueError(f"zoo entry {base!r} has no official file names (it loads its own folder)")

    def spellings(name: str) -> tuple[str, ...]:
        return (name, *ALTERNATE_FILE_NAMES.get(name, ()))

    return spellings(spec.weight_file), spellings(spec.vae_file)


def _download_folder(path: Path) -> Path:
    """``path``, or the snapshot folder when it is a Hugging Face cache folder (``models--org--name``)."""
    if path.is_dir():
        snapshot = hf_snapshot_dir(path)
        if snapshot is not None:
            return snapshot
    return path


def _find_named(folder: Path, names: Sequence[str], sharded: bool = False) -> Path | None:
    for name in names:
        candidate = folder / name
        if (candidate.is_dir() and is_shard_folder(candidate)) if sharded else candidate.is_file():
            return candidate
    return None


def _not_found(entry: str, missing: Sequence[tuple[str, Sequence[Path], Sequence[str], str, bool]]
               ) -> CheckpointError:
    """One error for every missing file ``(what, folders searched, accepted names, flag, sharded)``: names each
    folder searched, every accepted name and what the folders do hold (with a did-you-mean)."""
    parts, flags, held_all = [], [], []
    for what, folders, names, flag, sharded in missing:
        accepted = " or ".join(f"{n}/" if sharded else n for n in names)
        held: list[str] = []
        for folder in folders:
            if folder.is_dir():
                held += [p.name + ("/" if p.is_dir() else "") for p in sorted(folder.iterdir())]
        where = ", ".join(str(f) for f in folders)
        close = did_you_mean(names[0], [h.rstrip("/") for h in held], cutoff=0.85).strip()
        parts.append(f"{what} weights: searched {where} for {accepted}" + (f" ({SHARDS_NOTE})" if sharded else "")
                     + (f" ({close[0].lower()}{close[1:]})" if close else ""))
        flags.append(flag)
        held_all += [h for h in held if h not in held_all]
    found = (f" Found there: {', '.join(held_all[:12])}{', …' if len(held_all) > 12 else ''}." if held_all
             else " The folder is empty.")
    return CheckpointError(f"{entry} weights not found: " + "; ".join(parts) + "." + found
                           + f" Put the files there under one of those names, or pass {' / '.join(flags)} PATH; or "
                             f"use 'random:{entry}' for seeded random weights")


def resolve_weight_files(entry: str, weights: str | Path | None, vae_weights: str | Path | None = None
                         ) -> WeightFiles:
    """Which files ``--weights`` / ``--vae-weights`` mean for zoo entry ``entry`` (file names only: nothing is read
    except a shard index).

    ``weights`` may be a folder holding the official downloads (under any accepted name, see
    :func:`accepted_file_names`), a Hugging Face cache folder (``models--FoundationVision--var``: its snapshot is
    searched), the transformer file itself (the VAE is then looked for beside it) or, for ``infinity-8b``, the
    sharded folder itself. ``vae_weights`` (a file, or a folder to search) overrides where the VAE is found. Files
    that are not there raise one :class:`CheckpointError` naming every folder searched and every accepted name;
    an incomplete shard folder names the missing shards."""
    base = entry.removeprefix("random:")
    t_names, v_names = accepted_file_names(base)
    sharded = base in SHARDED_ENTRIES
    if weights is None:
        extra = f" and {T5_DIR_NAME}/" if ZOO[base].family == "infinity" and INFINITY_SPECS[base].needs_t5 else ""
        raise CheckpointError(
            f"model {base!r} needs local weights: pass --weights DIR (holding {' or '.join(t_names)}"
            f"{'/' if sharded else ''}, {' or '.join(v_names)}{extra}) or --weights "
            f"{t_names[0]} --vae-weights {v_names[0]}; or use 'random:{base}' for seeded random weights")
    given = Path(weights).expanduser()
    if not given.exists():
        raise CheckpointError(f"--weights {given} does not exist: give the folder holding {' or '.join(t_names)} "
                              f"and {' or '.join(v_names)}, or the transformer file itself")
    folder = _download_folder(given)
    missing = []
    if folder.is_dir() and not (sharded and is_shard_folder(folder)):
        transformer = _find_named(folder, t_names, sharded)
        if transformer is None:
            missing.append(("transformer", [folder], t_names, "--weights", sharded))
        vae_folders = [folder]
    else:  # the transformer itself: a file, or (infinity-8b) the folder of shards
        transformer = folder
        vae_folders = [folder.parent]
    vae = None
    if vae_weights is not None:
        v = _download_folder(Path(vae_weights).expanduser())
        if not v.exists():
            raise CheckpointError(f"--vae-weights {v} does not exist: give the VAE file ({' or '.join(v_names)}) or "
                                  f"the folder holding it")
        vae, vae_folders = (v, []) if v.is_file() else (None, [v])
    if vae is None:
        vae = next((f for f in (_find_named(d, v_names) for d in vae_folders) if f is not None), None)
        if vae is None:
            missing.append(("VAE", vae_folders, v_names, "--vae-weights", False))
    if missing:
        raise _not_found(base, missing)
    searched = tuple(dict.fromkeys(([folder] if folder.is_dir() else []) + vae_folders))
    if transformer.is_dir():
        shard_files(transformer)  # complete before anything is read
    return WeightFiles(base, transformer, vae, transformer.is_dir(), searched)


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


_CARD_FIX = ("restore it from the checkout (git checkout -- var_core/testbed/weights) or from the folder it was "
             "exported from (python -m var_core.testbed.train export)")


def read_testbed_card(folder: str | Path) -> dict:
    """A testbed folder's ``testbed.json`` (the card: architecture, VQVAE file, default sampling); a corrupt,
    truncated or unreadable card is a :class:`CheckpointError` naming it."""
    return read_json_file(Path(folder) / "testbed.json", "testbed card", _CARD_FIX)


def _load_testbed(name: str, weights: str | Path | None, seed: int | None, random_weights: bool):
    folder = testbed_folder(name, weights)
    card = folder / "testbed.json"
    if not card.exists():
        shipped = TESTBED_FOLDERS[name.removeprefix("random:")]
        raise CheckpointError(
            f"testbed weights not found: {card} is missing. The shipped weights live in {shipped}; "
            f"train them with `python -m var_core.testbed.train` or pass --weights DIR"
        )
    meta = read_testbed_card(folder)
    try:
        var_cfg = VARConfig(**meta["var_config"])
        vq_kwargs = dict(meta["vqvae_config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"testbed card {card} is corrupt: its var_config / vqvae_config cannot build the "
                              f"model ({type(exc).__name__}: {exc}); {_CARD_FIX}") from None
    if random_weights:
        return build_var_pair(var_cfg, vq_kwargs, seed)
    var_file, vae_file = folder / "var.safetensors", (folder / meta.get("vqvae_file", "vqvae.safetensors")).resolve()
    var_sd, vae_sd = read_state_dict(var_file), read_state_dict(vae_file)
    check_var_vqvae_pair(var_sd, vae_sd, var_file, vae_file, num_scales=var_cfg.num_scales)
    var = VAR(var_cfg)
    load_strict(var, var_sd, "testbed VAR", var_file)
    vae = _vqvae(vq_kwargs)
    load_strict(vae, vae_sd, "testbed VQVAE", vae_file)
    return var, vae


def load_model(name: str = "testbed", weights: str | Path | None = None, vae_weights: str | Path | None = None,
               device: str | torch.device = "cpu", seed: int = 0, dtype: torch.dtype = torch.float32, **options):
    """Return an engine adapter for a named model.

    ``name``: a zoo entry, or ``random:<entry>`` for the same architecture with weights drawn from ``seed``.
    ``weights``: a weight file or a directory holding the official file names.
    ``options`` (Infinity only): ``text_encoder`` (a local flan-t5 directory, or an encoder object), ``pn``,
    ``h_div_w``, ``num_scales``, ``schedule``, ``cfg_insertion_layer``, ``negative_prompt``.
    """
    from .engine.adapters.var_adapter import VARAdapter

    random_weights = name.startswith("random:")
    base = name.removeprefix("random:")
    if base not in ZOO:
        raise _unknown(name)
    spec = ZOO[base]
    if spec.family == "infinity":
        return load_infinity_model(name, weights, vae_weights, device=device, seed=seed, dtype=dtype, **options)
    if spec.family == "hart":
        return load_hart_model(name, weights, vae_weights, device=device, seed=seed, dtype=dtype, **options)
    if options:
        raise TypeError(f"unexpected options for the VAR model {name!r}: {sorted(options)}")
    if base in TESTBED_FOLDERS:
        var, vae = _load_testbed(base, weights, seed, random_weights)
    elif base == "official-tiny":
        var, vae = load_fixture_files(weights)
        if random_weights:
            var, vae = build_var_pair(var.cfg, vae.config, seed)
    elif random_weights:
        var, vae = build_var_pair(spec.var_config, spec.vqvae_kwargs, seed)
    else:
        files = resolve_weight_files(spec.name, weights, vae_weights)
        var, vae = load_var_files(files.transformer, files.vae, patch_nums=spec.var_config.patch_nums, entry=spec.name,
                                  expected=_entry_fields(spec), expected_vqvae=spec.vqvae_kwargs)
    var.to(device=device, dtype=dtype).eval().requires_grad_(False)
    vae.to(device=device).eval().requires_grad_(False)
    adapter = VARAdapter(var, vae)
    adapter.model_name = name
    if base in TESTBED_FOLDERS:
        from .engine.sampling import SamplingConfig

        meta = read_testbed_card(testbed_folder(base, weights))
        if isinstance(meta.get("default_sampling"), dict):
            known = {"cfg", "top_k", "top_p", "temperature"}
            adapter.default_sampling = SamplingConfig(**{k: v for k, v in meta["default_sampling"].items()
                                                         if k in known})
    return adapter


# ================================================================================================================
# Infinity (bitwise text-to-image)
# ================================================================================================================
T5_DIR_NAME = "flan-t5-xl"
T5_CACHE_NAME = "models--google--flan-t5-xl"  # its Hugging Face cache folder (snapshots/<hash>/ inside)
T5_ENV = "VARSCOPE_T5_DIR"


def default_infinity_fixture_dir() -> Path:
    """The official Infinity golden fixture: ``$VARSCOPE_INFINITY_FIXTURE`` or
    ``../shared/fixtures/official_infinity_tiny``."""
    return fixture_dir("VARSCOPE_INFINITY_FIXTURE", "official_infinity_tiny")


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
    from .models.bsq_vae import VAE_2B, VAE_8B, BSQVAEConfig
    from .models.infinity import INFINITY_2B, INFINITY_8B, InfinityConfig

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


def load_infinity_files(infinity_path: Path, vae_path: Path, *, entry: str | None = None,
                        expected: dict | None = None, expected_vae: dict | None = None, **config_overrides):
    """Load an official-layout Infinity transformer and BSQ-VAE (architecture inferred, strict load).

    Both files are read and checked before any model is built: bits per token vs the BSQ codebook (with the
    2×2 patchify), and, with ``expected`` / ``expected_vae``, the zoo entry ``entry``'s architecture."""
    from .models.bsq_vae import BSQVAE, infer_bsq_vae_config, remap_vae_keys
    from .models.infinity import Infinity, infer_infinity_config, prepare_infinity_state_dict

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
    from .models.bsq_vae import BSQVAE
    from .models.infinity import Infinity, randomize_infinity_

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


def hf_hub_cache_dir() -> Path:
    """The Hugging Face hub cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def t5_candidates(text_encoder: str | Path | None, weights: str | Path | None) -> list[Path]:
    """Where the flan-t5-xl encoder is looked for, in order: ``text_encoder`` alone when given; else
    ``<weights folder>/flan-t5-xl`` and ``<weights folder>/models--google--flan-t5-xl`` (the folder of a weights
    file counts), ``$VARSCOPE_T5_DIR``, and the Hugging Face hub cache's ``models--google--flan-t5-xl`` when it
    exists. Each is resolved by :func:`var_core.models.text_encoder.resolve_t5_directory` (cache snapshots)."""
    if text_encoder is not None:
        return [Path(text_encoder).expanduser()]
    candidates: list[Path] = []
    if weights is not None:
        folder = Path(weights).expanduser()
        folder = folder if folder.is_dir() else folder.parent
        candidates += [folder / T5_DIR_NAME, folder / T5_CACHE_NAME]
    if os.environ.get(T5_ENV):
        candidates.append(Path(os.environ[T5_ENV]).expanduser())
    cached = hf_hub_cache_dir() / T5_CACHE_NAME
    if cached.is_dir():
        candidates.append(cached)
    return candidates


def find_t5_directory(spec_name: str, text_encoder: str | Path | None, weights: str | Path | None) -> Path:
    """The first of :func:`t5_candidates` that holds a usable flan-t5 folder (a cache folder resolved to its
    snapshot); else :class:`CheckpointError` naming every folder searched and what each lacks. Checks file names
    only, so a missing encoder fails before any weights are read."""
    from .models.text_encoder import check_t5_directory, resolve_t5_directory

    candidates = t5_candidates(text_encoder, weights)
    if not candidates:
        raise CheckpointError(
            f"model {spec_name!r} needs the flan-t5-xl text encoder: pass text_encoder=DIR (--text-encoder), put "
            f"it at --weights DIR/{T5_DIR_NAME}, or set ${T5_ENV}; a Hugging Face cache folder "
            f"({T5_CACHE_NAME}, also found by itself in {hf_hub_cache_dir()}) works too. The directory must hold "
            f"config.json, the model weights (model.safetensors or pytorch_model.bin, or their *.index.json and "
            f"shards) and the tokenizer (spiece.model or tokenizer.json). Nothing is downloaded."
        )
    problems = []
    for path in candidates:
        try:
            resolved = resolve_t5_directory(path)
            if not resolved.exists():
                problems.append(f"{path} (absent)")
                continue
            check_t5_directory(resolved)
            return resolved
        except (FileNotFoundError, CheckpointError) as exc:
            problems.append(str(exc))
    raise CheckpointError(
        f"flan-t5-xl text encoder for {spec_name!r} not found: searched {'; '.join(problems)}. Pass --text-encoder "
        f"DIR (a {T5_DIR_NAME} folder, or its Hugging Face cache folder {T5_CACHE_NAME}), put it at --weights "
        f"DIR/{T5_DIR_NAME}, or set ${T5_ENV}. Nothing is downloaded.")


def _t5_encoder(spec_name: str, text_encoder, weights: Path | None, device, dtype):
    """The flan-t5 encoder for a real Infinity model (see :func:`t5_candidates` for where it is looked for)."""
    from .models.text_encoder import T5TextEncoder

    if text_encoder is not None and not isinstance(text_encoder, (str, Path)):
        return text_encoder  # an encoder object
    path = find_t5_directory(spec_name, text_encoder, weights)
    t5_dtype = torch.float16 if torch.device(device).type == "cuda" and dtype != torch.float32 else torch.float32
    return T5TextEncoder(path, device=device, dtype=t5_dtype)


def load_infinity_model(name: str, weights=None, vae_weights=None, device="cpu", seed: int = 0,
                        dtype: torch.dtype = torch.float32, text_encoder=None, pn: str | None = None,
                        h_div_w: float = 1.0, num_scales: int | None = None, schedule=None,
                        cfg_insertion_layer: int = 0, negative_prompt=None):
    """An :class:`~var_core.engine.adapters.infinity_adapter.InfinityAdapter` for a named Infinity model."""
    from .engine.adapters.infinity_adapter import InfinityAdapter
    from .models.text_encoder import RandomTextEncoder

    random_weights = name.startswith("random:")
    base = name.removeprefix("random:")
    spec = INFINITY_SPECS[base]
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
        files = resolve_weight_files(base, weights, vae_weights)
        inf_path, vae_path = files.transformer, files.vae
        weights = Path(weights).expanduser()
        if spec.needs_t5 and (text_encoder is None or isinstance(text_encoder, (str, Path))):
            text_encoder = find_t5_directory(base, text_encoder, weights)  # before the large files are read
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


# ================================================================================================================
# HART (hybrid autoregressive transformer: discrete next-scale tokens + a residual diffusion head)
# ================================================================================================================
HART_TEXT_DIR_NAME = "Qwen2-VL-1.5B-Instruct"
HART_TEXT_CACHE_NAME = "models--mit-han-lab--Qwen2-VL-1.5B-Instruct"
HART_TEXT_ENV = "VARSCOPE_QWEN2_DIR"
HART_EMA_FILE = "ema_model.bin"  # the official scripts load these weights by default (use_ema=True)


def default_hart_fixture_dir() -> Path:
    """The official HART golden fixture: ``$VARSCOPE_HART_FIXTURE`` or ``../shared/fixtures/official_hart_tiny``."""
    return fixture_dir("VARSCOPE_HART_FIXTURE", "official_hart_tiny")


@dataclass(frozen=True)
class HARTSpec:
    """How to build / find one HART model. ``config`` None: read from the folder's config.json files."""

    config: object | None  # HARTConfig
    tokenizer_config: object | None  # HARTTokenizerConfig
    needs_text_encoder: bool = True
    assumptions: dict = field(default_factory=dict)  # field -> (value, evidence): checked against real files


#: What ``hart-0.7b`` assumes of the release where specs/hart.md §2.2 could only infer it (the release config.json
#: files were not available): field -> (assumed value, evidence). A checkpoint whose config.json disagrees is refused
#: with the field named (``check_assumptions=False`` loads it as its config.json says).
HART_0P7B_ASSUMPTIONS: dict[str, tuple[object, str]] = {
    "context_token": (300, "sample.py / app.py pad every prompt to max_token_length=300"),
    "context_dim": (1536, "the hidden size of the Qwen2-1.5B text model"),
    "patch_nums": ((1, 2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64), "FastVAR's HART port writes this list"),
    "depth": (24, "24 x 1536 wide gives 729.7 M parameters = '0.7b' with the paper's 37 M diffusion head"),
    "embed_dim": (1536, "see depth"),
    "num_heads": (24, "head_dim 64"),
    "disable_aln": (True, "FastVAR's port modifies exactly this branch; with per-block AdaLN the model is 1.07 B"),
    "mlp_ratio": (4.0, "SwiGLU hidden 4096"),
    "diff_width": (1024, "class default; gives the paper's 37 M diffusion head"),
    "diff_depth": (6, "class default; see diff_width"),
    "num_sampling_steps": (8, "class default '8'"),
    "tokenizer.vocab_size": (4096, "HART's tokenizer is VAR's vae_ch160v4096z32 with the hybrid quantizer"),
    "tokenizer.z_channels": (32, "see tokenizer.vocab_size"),
    "tokenizer.ch": (160, "see tokenizer.vocab_size"),
    "tokenizer.ch_mult": ((1, 1, 2, 2, 4), "16x downsampling gives the 64x64 latent of 1024 px"),
}


def _hart_specs() -> dict[str, HARTSpec]:
    from .models.hart import HART_0P7B, HARTConfig
    from .models.hart_tokenizer import HARTTokenizerConfig

    tiny_tok = HARTTokenizerConfig(vocab_size=1024, z_channels=16, ch=32, ch_mult=(1, 1, 2, 2, 4),
                                   v_patch_nums=(1, 2, 3, 4, 5, 6, 8))
    tiny = HARTConfig(context_token=16, context_dim=64, depth=4, embed_dim=64, num_heads=2,
                      patch_nums=(1, 2, 3, 4, 5, 6, 8), vocab_size=1024, z_channels=16, diff_width=64, diff_depth=2)
    return {
        "hart-0.7b": HARTSpec(HART_0P7B, HARTTokenizerConfig(), assumptions=HART_0P7B_ASSUMPTIONS),
        "hart-tiny": HARTSpec(tiny, tiny_tok, needs_text_encoder=False),
        "official-hart-tiny": HARTSpec(None, None, needs_text_encoder=False),
    }


HART_SPECS: dict[str, HARTSpec] = _hart_specs()
ZOO.update({
    spec.name: spec
    for spec in (
        ModelSpec("hart-0.7b", "hart", "official HART-0.7B (Qwen2-1.5B text, hybrid tokenizer + 37M residual diffusion "
                  "head), 1024px; --weights: the hart-0.7b-1024px folder (llm/, tokenizer/)"),
        ModelSpec("hart-tiny", "hart", "a 4-layer, 64-wide HART on a 7-scale schedule (128px) with a tiny random text "
                  "encoder and diffusion head; use random:hart-tiny (tests, demos, CPU benchmarks)"),
        ModelSpec("official-hart-tiny", "hart", "the official-code golden fixture's random tiny HART (llm/, or "
                  "llm_aln/ with variant='llm_aln'; precomputed contexts or a random text encoder)"),
    )
})


def _hart_llm_weights(llm_dir: Path, use_ema: bool) -> Path:
    from .models.hart_tokenizer import hf_weight_file

    if use_ema and (llm_dir / HART_EMA_FILE).is_file():
        return llm_dir / HART_EMA_FILE
    return hf_weight_file(llm_dir, "HART transformer")


def hart_folders(weights: str | Path, vae_weights: str | Path | None = None, variant: str = "llm"
                 ) -> tuple[Path, Path]:
    """``(llm folder, tokenizer folder)`` from ``--weights``: the checkpoint folder holding ``llm/`` and
    ``tokenizer/`` (a Hugging Face cache folder: its snapshot), or the ``llm/`` folder itself (the tokenizer is then
    its sibling ``../tokenizer``, the official rule); ``vae_weights`` overrides the tokenizer folder."""
    given = _download_folder(Path(weights).expanduser())
    if not given.is_dir():
        raise CheckpointError(f"--weights {given} is not a folder: give the HART checkpoint folder (holding "
                              f"{variant}/ and tokenizer/) or its {variant}/ folder")
    if (given / variant / "config.json").is_file():
        llm = given / variant
    elif (given / "config.json").is_file() and (given / "config.json").read_text().find("hart_transformer") >= 0:
        llm = given
    else:
        held = sorted(p.name + ("/" if p.is_dir() else "") for p in given.iterdir())[:12]
        raise CheckpointError(f"HART weights not found: {given} holds neither {variant}/config.json nor a HART "
                              f"transformer config.json (found: {held}). Pass the folder of the download "
                              f"(hart-0.7b-1024px with llm/ and tokenizer/), or 'random:<entry>' for seeded random "
                              f"weights")
    tok = _download_folder(Path(vae_weights).expanduser()) if vae_weights is not None else llm.parent / "tokenizer"
    if not (tok / "config.json").is_file():
        raise CheckpointError(f"HART tokenizer folder not found: {tok} has no config.json (pass --vae-weights "
                              f"TOKENIZER_DIR, or keep tokenizer/ next to {llm.name}/ as in the download)")
    return llm, tok


def _check_hart_assumptions(entry: str, spec: HARTSpec, cfg, tok_cfg, llm_dir: Path, tok_dir: Path) -> None:
    from .models.loading import CheckpointMismatchError

    diffs = []
    for name, (want, evidence) in spec.assumptions.items():
        if name.startswith("tokenizer."):
            got, where = getattr(tok_cfg, name.split(".", 1)[1]), tok_dir / "config.json"
        else:
            got, where = getattr(cfg, name), llm_dir / "config.json"
        if isinstance(want, tuple):
            got = tuple(got)
        if got != want:
            diffs.append(f"{where} has {name.removeprefix('tokenizer.')}={got!r} but zoo entry {entry!r} assumes "
                         f"{want!r} (inferred, not read from a release config: {evidence})")
    if diffs:
        raise CheckpointMismatchError(
            "; ".join(diffs) + f". If these files are the genuine release, the inference (specs/hart.md §2.2) was "
            f"wrong for that field: load them as their config.json says with load_model({entry!r}, weights=..., "
            f"check_assumptions=False) and report the value")


def read_hart_configs(llm_dir: Path, tok_dir: Path):
    """``(HARTConfig, HARTTokenizerConfig)`` from the two config.json files (nothing else is read)."""
    from .models.hart import HARTConfig
    from .models.hart_tokenizer import HARTTokenizerConfig, read_hf_config

    tok_data = read_hf_config(tok_dir, "HART tokenizer")
    tok_cfg = HARTTokenizerConfig.from_json(tok_data, tok_dir / "config.json")
    data = read_hf_config(llm_dir, "HART transformer")
    if data.get("model_type") not in (None, "hart_transformer_t2i"):
        raise CheckpointError(f"{llm_dir / 'config.json'} has model_type {data.get('model_type')!r}: not a HART "
                              f"transformer (hart_transformer_t2i)")
    return HARTConfig.from_json(data, tok_cfg, source=str(llm_dir / "config.json")), tok_cfg


def load_hart_files(llm_dir: Path, tok_dir: Path, *, use_ema: bool = True, log=None, check=None):
    """``(transformer, tokenizer, info)`` from an official ``llm/`` and ``tokenizer/`` folder (configs from their
    config.json files, strict loads; ``lvl_1L`` checked against the schedule, ``disc.*`` ignored). ``check``:
    called with ``(config, tokenizer config)`` before any weights are read."""
    from .models.hart import HARTTransformer, prepare_hart_state_dict
    from .models.hart_tokenizer import load_hart_tokenizer

    cfg, tok_cfg = read_hart_configs(llm_dir, tok_dir)
    if check is not None:
        check(cfg, tok_cfg)
    tok, info = load_hart_tokenizer(tok_dir, log=log)
    path = _hart_llm_weights(llm_dir, use_ema)
    sd = read_sharded_state_dict(path)
    gate = sd.get("blocks.0.ffn.gate_proj.weight")
    if gate is not None and gate.shape[0] != cfg.mlp_hidden:
        import dataclasses as _dc

        cfg = _dc.replace(cfg, mlp_hidden_override=int(gate.shape[0]))
    model = HARTTransformer(cfg)
    load_strict(model, prepare_hart_state_dict(sd, model, str(path)), "HART transformer", path)
    info.update(transformer_weights=str(path), ema=path.name == HART_EMA_FILE)
    return model.eval(), tok, info


def build_hart_pair(cfg, tok_cfg, seed: int = 0):
    """HART transformer + tokenizer with seeded random weights (private RNG; the global RNG state is untouched)."""
    from .models.hart import HARTTransformer, randomize_hart_
    from .models.hart_tokenizer import HARTTokenizer

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        tok = HARTTokenizer(tok_cfg)
        with torch.no_grad():
            tok.vae.quantize.embedding.weight.normal_(0, 0.1)  # a codebook at the encoder features' spread
    model = HARTTransformer(cfg)
    randomize_hart_(model, seed)
    return model, tok


def hart_text_candidates(text_encoder: str | Path | None, weights: str | Path | None) -> list[Path]:
    """Where the Qwen2 encoder is looked for: ``text_encoder`` alone when given; else beside / inside the weights
    folder (``Qwen2-VL-1.5B-Instruct``, its cache folder), ``$VARSCOPE_QWEN2_DIR``, the hub cache."""
    if text_encoder is not None:
        return [Path(text_encoder).expanduser()]
    out: list[Path] = []
    if weights is not None:
        folder = Path(weights).expanduser()
        for base in (folder, folder.parent):
            out += [base / HART_TEXT_DIR_NAME, base / HART_TEXT_CACHE_NAME]
    if os.environ.get(HART_TEXT_ENV):
        out.append(Path(os.environ[HART_TEXT_ENV]).expanduser())
    cached = hf_hub_cache_dir() / HART_TEXT_CACHE_NAME
    if cached.is_dir():
        out.append(cached)
    return out


def find_qwen2_directory(entry: str, text_encoder, weights) -> Path:
    from .models.hart_text import check_qwen2_directory, resolve_qwen2_directory

    problems = []
    for path in hart_text_candidates(text_encoder, weights):
        resolved = resolve_qwen2_directory(path)
        if not resolved.exists():
            problems.append(f"{path} (absent)")
            continue
        try:
            check_qwen2_directory(resolved)
            return resolved
        except FileNotFoundError as exc:
            problems.append(str(exc))
    raise CheckpointError(
        f"the Qwen2 text encoder of {entry!r} was not found" + (f": searched {'; '.join(problems)}" if problems
                                                                else "") +
        f". Pass text_encoder=DIR (a local {HART_TEXT_DIR_NAME} folder or its cache folder {HART_TEXT_CACHE_NAME}), "
        f"put it next to the weights, or set ${HART_TEXT_ENV}; or pass text_encoder=False and give precomputed "
        f"HARTContext conditions. Nothing is downloaded.")


def load_hart_model(name: str, weights=None, vae_weights=None, device="cpu", seed: int = 0,
                    dtype: torch.dtype = torch.float32, text_encoder=None, system_prompt: str | None = None,
                    use_ema: bool = True, check_assumptions: bool = True, variant: str = "llm",
                    keep_diffusion_trace: bool = False):
    """A :class:`~var_core.engine.adapters.hart_adapter.HARTAdapter` for a named HART model.

    ``weights``: the checkpoint folder (``llm/`` + ``tokenizer/``; ``official-hart-tiny``: the fixture folder,
    default ``$VARSCOPE_HART_FIXTURE``). ``use_ema``: ``llm/ema_model.bin`` when present (the official scripts'
    default). ``text_encoder``: a Qwen2 folder, an encoder object, or False (precomputed contexts only).
    ``variant``: the transformer subfolder (``llm_aln`` for the fixture's AdaLN model)."""
    from .engine.adapters.hart_adapter import HARTAdapter
    from .models.hart_text import Qwen2TextEncoder, RandomHARTTextEncoder

    random_weights = name.startswith("random:")
    base = name.removeprefix("random:")
    spec = HART_SPECS[base]
    info: dict = {}
    if base == "official-hart-tiny":
        folder = Path(weights) if weights is not None else default_hart_fixture_dir()
        llm_dir, tok_dir = hart_folders(folder, vae_weights, variant)
        model, tok, info = load_hart_files(llm_dir, tok_dir, use_ema=use_ema)
        if random_weights:
            model, tok = build_hart_pair(model.cfg, tok.cfg, seed)
    elif random_weights:
        model, tok = build_hart_pair(spec.config, spec.tokenizer_config, seed)
    else:
        if weights is None:
            raise CheckpointError(f"model {base!r} needs local weights: pass --weights DIR (the checkpoint folder "
                                  f"holding llm/ and tokenizer/); or use 'random:{base}' for seeded random weights")
        llm_dir, tok_dir = hart_folders(weights, vae_weights, variant)
        if spec.needs_text_encoder and text_encoder is None:
            text_encoder = find_qwen2_directory(base, None, weights)  # before the large files are read
        check = None
        if check_assumptions and spec.assumptions:
            def check(cfg, tok_cfg):
                _check_hart_assumptions(base, spec, cfg, tok_cfg, llm_dir, tok_dir)
        model, tok, info = load_hart_files(llm_dir, tok_dir, use_ema=use_ema, check=check)
    cfg = model.cfg
    if text_encoder is False:
        encoder = None
    elif text_encoder is not None and not isinstance(text_encoder, (str, Path)):
        encoder = text_encoder
    elif text_encoder is not None or (spec.needs_text_encoder and not random_weights):
        path = find_qwen2_directory(base, text_encoder, weights)
        te_dtype = torch.float16 if torch.device(device).type == "cuda" and dtype != torch.float32 else torch.float32
        encoder = Qwen2TextEncoder(path, device=device, dtype=te_dtype, max_length=cfg.context_token,
                                   system_prompt=system_prompt)
    else:
        encoder = RandomHARTTextEncoder(out_dim=cfg.context_dim, max_length=cfg.context_token, seed=seed)
        encoder.to(device)
    if encoder is not None and encoder.out_dim != cfg.context_dim:
        raise CheckpointError(f"the text encoder gives {encoder.out_dim}-dim features but {base} reads "
                              f"context_dim={cfg.context_dim}")
    model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    tok.to(device=device).eval().requires_grad_(False)
    adapter = HARTAdapter(model, tok, encoder, keep_diffusion_trace=keep_diffusion_trace)
    adapter.model_name = name
    adapter.load_info = info
    return adapter


def hart_proxy_adapter(config=None, width: int = 64, seed: int = 0):
    """A random, narrow proxy of a HART architecture (default HART-0.7B): its depth, schedule, context length,
    vocabulary and branches at ``width`` (2 heads), a ``ch=32`` tokenizer, a random text encoder. For estimating
    what adaptive presets keep on that schedule (their decisions need a generation; random weights decide on noise,
    so the figures show mechanics, not trained behaviour)."""
    import dataclasses as _dc

    from .engine.adapters.hart_adapter import HARTAdapter
    from .models.hart import HART_0P7B
    from .models.hart_text import RandomHARTTextEncoder
    from .models.hart_tokenizer import HARTTokenizerConfig

    config = config or HART_0P7B
    cfg = _dc.replace(config, embed_dim=width, num_heads=2, context_dim=width, diff_width=width, diff_depth=2,
                      mlp_hidden_override=None)
    tok_cfg = HARTTokenizerConfig(vocab_size=config.vocab_size, z_channels=config.z_channels, ch=32,
                                  v_patch_nums=config.patch_nums)
    model, tok = build_hart_pair(cfg, tok_cfg, seed)
    encoder = RandomHARTTextEncoder(out_dim=cfg.context_dim, max_length=cfg.context_token, seed=seed)
    return HARTAdapter(model.eval().requires_grad_(False), tok.eval().requires_grad_(False), encoder)


# ----- --resolution / --aspect -------------------------------------------------------------------------------
#: ``--resolution`` in pixels for Infinity's ``pn`` names (the last scale of each schedule x 16 at h/w = 1).
INFINITY_RESOLUTION_ALIASES = {"256": "0.06M", "512": "0.25M", "768": "0.60M", "1024": "1M"}


def size_options(name: str, resolution: str | None = None, aspect: float | None = None) -> dict:
    """``load_model`` options for ``--resolution`` / ``--aspect`` on ``name``: Infinity's ``pn`` (``0.06M``,
    ``0.25M``, ``0.60M``, ``1M``, or 256 / 512 / 768 / 1024) and ``h_div_w`` (one of the official templates of
    ``infinity/utils/dynamic_resolution.py``, :data:`~var_core.models.infinity.H_DIV_W_TEMPLATES`; the official
    code silently takes the nearest, here another ratio is an error so a study never measures a size it did not
    ask for). Other families generate one square size per checkpoint: ``{}`` after checking the aspect is 1 (the
    resolution is checked against the loaded model by :func:`check_native_size`). A :class:`UserError` lists the
    valid values."""
    base = name.removeprefix("random:")
    family = getattr(ZOO.get(base), "family", None)
    if family != "infinity":
        if aspect is not None and abs(float(aspect) - 1.0) > 1e-9:
            raise UserError(f"--aspect {aspect:g}: {name} ({family}) generates square images only (valid --aspect: 1); "
                            f"non-square schedules are Infinity's (h_div_w)")
        return {}
    from .models.infinity import H_DIV_W_TEMPLATES, PN_NUM_SCALES

    out: dict = {}
    if resolution is not None:
        pn = INFINITY_RESOLUTION_ALIASES.get(str(resolution), str(resolution))
        if pn not in PN_NUM_SCALES:
            valid = ", ".join(f"{k} ({v}px)" for v, k in INFINITY_RESOLUTION_ALIASES.items())
            raise UserError(f"--resolution {resolution}: {name} cannot generate it; valid: {valid}")
        out["pn"] = pn
    if aspect is not None:
        match = [t for t in H_DIV_W_TEMPLATES if abs(t - float(aspect)) <= 5e-3]
        if not match:
            valid = ", ".join(f"{t:g}" for t in sorted(H_DIV_W_TEMPLATES))
            raise UserError(f"--aspect {aspect:g} (height / width) is not one of {name}'s schedules; valid: {valid}")
        out["h_div_w"] = match[0]
    return out


def check_native_size(name: str, adapter, resolution: str | None, aspect: float | None = None) -> None:
    """``--resolution`` on a model with one size (VAR, HART, the testbed): it must be that size. ``--aspect`` on
    an Infinity whose schedule is fixed by its files (the official fixture): the loaded schedule must have it."""
    if getattr(ZOO.get(name.removeprefix("random:")), "family", None) == "infinity":
        hw = getattr(adapter, "_scale_hw", None)
        if aspect is not None and hw:
            from .models.infinity import nearest_template

            h, w = hw[-1]
            if abs(nearest_template(h / w) - float(aspect)) > 5e-3:
                raise UserError(f"--aspect {aspect:g}: {name}'s scale schedule is fixed by its files ({h}x{w} "
                                f"tokens last, h/w {h / w:.3g}); use infinity-tiny / infinity-2b for other ratios")
        return
    if resolution is None:
        return
    native = int(getattr(adapter, "image_size", 0) or 0)
    if str(resolution) != str(native):
        raise UserError(f"--resolution {resolution}: {name} generates {native}px images only (valid --resolution: "
                        f"{native}); other sizes need another checkpoint (VAR-d36 is 512px, HART-0.7B 1024px) or "
                        f"an Infinity model (pn)")
