"""Loading official checkpoint files unchanged, with errors that say exactly what does not fit.

* ``.pth`` / ``.pt`` files are read with ``torch.load(weights_only=True)`` (no pickled code is executed);
  ``.safetensors`` with the safetensors library.
* Architecture hyper-parameters are inferred from key names and shapes (``infer_var_config``,
  ``infer_vqvae_config``); what the user states explicitly is checked against them.
* Loading is strict; a mismatch raises :class:`CheckpointMismatchError` listing missing, unexpected and
  mis-shaped keys.
* Before any model is built, a model is checked against its tokenizer (``check_var_vqvae_pair``: vocabulary vs
  codebook entries, latent channels, scales; ``check_infinity_pair``: bits per token vs the BSQ codebook) and
  against the zoo entry it is loaded for (``check_var_entry``, ``check_vqvae_entry``, ``check_infinity_entry``:
  depth, width, vocabulary, AdaLN variant, patch_nums). Errors name the file(s) and both shapes.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Mapping

import torch

from ..errors import UserError
from .var import VARConfig

_WRAPPER_KEYS = ("state_dict", "model", "module", "ema", "vae")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint file is missing, unreadable or inconsistent with the requested architecture."""


class CheckpointMismatchError(CheckpointError):
    """The state_dict's keys or shapes do not match the model."""


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a state_dict from ``.pth``/``.pt``/``.bin`` (weights-only unpickling) or ``.safetensors``."""
    path = Path(path).expanduser()
    if not path.exists():
        hint = ""
        if path.parent.exists():
            near = sorted(p.name for p in path.parent.iterdir() if p.suffix in (".pth", ".pt", ".safetensors", ".bin"))
            hint = f"; checkpoint files in {path.parent}: {near[:10]}" if near else f"; {path.parent} holds no checkpoint files"
        raise CheckpointError(f"checkpoint not found: {path}{hint}. Pass the path of a local weight file "
                              f"(nothing is downloaded at run time).")
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a weights file: pass the file itself (or the folder that "
                              f"holds the official file names as --weights)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return dict(load_file(str(path), device="cpu"))
        except OSError as exc:
            raise CheckpointError(f"could not read {path} ({exc.strerror or exc}): check its permissions") from exc
        except Exception as exc:  # noqa: BLE001 - SafetensorError: a bad header or data that ends too early
            raise CheckpointError(
                f"{path} is corrupt or truncated: not a readable safetensors file ({_first_line(exc)}; "
                f"{_what_it_is(path)}). Download it again, or restore / re-export it "
                f"(python -m var_core.testbed.train export for the testbed)."
            ) from exc
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError(f"could not read {path} ({exc.strerror or exc}): check its permissions") from exc
    except Exception as exc:  # noqa: BLE001 - re-raised with the file name and the likely cause
        raise CheckpointError(
            f"could not read {path} as a weights file ({_first_line(exc)}): is it truncated, an HTML page saved "
            f"instead of the download, or a pickle of code / optimiser objects? Official VAR/Infinity files are "
            f"plain state_dicts; download the file again or convert it."
        ) from exc
    return unwrap_state_dict(obj, path)


def _what_it_is(path: Path) -> str:
    """A hint from a weights file's first bytes: an HTML page saved in place of a download, or its size."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(512).lstrip().lower()
        size = path.stat().st_size
    except OSError:
        return "unreadable"
    if head.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head")):
        return "it is an HTML page saved instead of the download"
    return f"{size:,} bytes" + (", empty" if size == 0 else "")


def read_json_file(path: str | Path, what: str, fix: str) -> dict:
    """A JSON object from ``path``; a missing, unreadable, corrupt or truncated file (or one nested too deeply to
    parse, or not an object) is a :class:`CheckpointError` naming it, saying what ``what`` is and how to ``fix``
    it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing: {fix}") from None
    except OSError as exc:
        raise CheckpointError(f"could not read {what} {path} ({exc.strerror or exc}): check its permissions") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError / UnicodeDecodeError are ValueErrors
        reason = "nested too deeply to parse" if isinstance(exc, RecursionError) else f"not valid JSON: {exc}"
        raise CheckpointError(f"{what} {path} is corrupt or truncated ({reason}): {fix}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} is corrupt: expected a JSON object, got {type(data).__name__}; {fix}")
    return data


def _first_line(exc: BaseException) -> str:
    """The gist of a loader's exception. torch's weights-only errors run to many lines of advice around the one
    that matters (one line suggests ``weights_only=False``, which must never be followed for an untrusted file)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    gist = " ".join(line.strip() for line in text.splitlines() if line.strip()) or type(exc).__name__
    return f"{type(exc).__name__}: {gist[:160]}"


def unwrap_state_dict(obj, origin: str | Path = "<memory>") -> dict[str, torch.Tensor]:
    """Accept a flat state_dict, or one nested once under a common wrapper key (``model``, ``state_dict``…)."""
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return dict(obj)
    if isinstance(obj, Mapping):
        for key in _WRAPPER_KEYS:
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return dict(inner)
    raise CheckpointError(f"{origin} does not hold a state_dict (a mapping of names to tensors)")


def describe_mismatch(model_sd: Mapping[str, torch.Tensor], ckpt_sd: Mapping[str, torch.Tensor], limit: int = 12):
    missing = sorted(set(model_sd) - set(ckpt_sd))
    unexpected = sorted(set(ckpt_sd) - set(model_sd))
    misshaped = sorted(
        (k, tuple(ckpt_sd[k].shape), tuple(model_sd[k].shape))
        for k in set(model_sd) & set(ckpt_sd)
        if tuple(ckpt_sd[k].shape) != tuple(model_sd[k].shape)
    )
    return missing, unexpected, misshaped


def load_strict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], what: str, source: str | Path) -> None:
    """``load_state_dict(strict=True)`` with a readable report of every difference."""
    missing, unexpected, misshaped = describe_mismatch(model.state_dict(), state_dict)
    if missing or unexpected or misshaped:
        def fmt(items, n=12):
            shown = ", ".join(str(i) for i in items[:n])
            return shown + (f", … ({len(items) - n} more)" if len(items) > n else "")

        lines = [f"{what} checkpoint {source} does not match the model:"]
        if missing:
            lines.append(f"  missing keys ({len(missing)}): {fmt(missing)}")
        if unexpected:
            lines.append(f"  unexpected keys ({len(unexpected)}): {fmt(unexpected)}")
        if misshaped:
            lines.append("  mis-shaped keys (name, checkpoint shape, model shape) "
                         f"({len(misshaped)}): {fmt(misshaped)}")
        lines.append("  Check that the model name / config (depth, patch_nums, vocab, shared_aln) matches the file.")
        raise CheckpointMismatchError("\n".join(lines))
    model.load_state_dict(state_dict, strict=True)


def patch_nums_from_levels(lvl_1L: torch.Tensor) -> tuple[int, ...]:
    """Recover the scale schedule from the ``lvl_1L`` buffer (token count per level is pn²)."""
    counts = Counter(lvl_1L.flatten().tolist())
    patch_nums = []
    for level in range(len(counts)):
        side = math.isqrt(counts[level])
        if side * side != counts[level]:
            raise CheckpointError(f"level {level} holds {counts[level]} tokens, not a square number")
        patch_nums.append(side)
    return tuple(patch_nums)


def _where(source) -> str:
    return f"{source}: " if source is not None else ""


def infer_var_config(sd: Mapping[str, torch.Tensor], patch_nums=None, source: str | Path | None = None,
                     **overrides) -> VARConfig:
    """Infer a :class:`VARConfig` from an official VAR state_dict; check ``patch_nums`` if given.

    ``source`` (the file) is named in every error."""
    where = _where(source)
    required = ("pos_1LC", "class_emb.weight", "lvl_embed.weight", "word_embed.weight", "head.weight")
    absent = [k for k in required if k not in sd]
    if absent:
        raise CheckpointMismatchError(
            f"{where}not a VAR transformer state_dict: missing {absent} (got keys like {sorted(sd)[:5]})"
        )
    variant = adaln_variant(sd)
    if variant == "mixed":
        raise CheckpointMismatchError(
            f"{where}mixes both AdaLN layouts: it has shared_ada_lin.* (shared-AdaLN, as var_d36) and "
            f"blocks.i.ada_lin.* (per-block AdaLN, as var_d16-d30); it is not an official VAR checkpoint"
        )
    depth = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)
    C = sd["pos_1LC"].shape[-1]
    L = sd["pos_1LC"].shape[1]
    num_scales = sd["lvl_embed.weight"].shape[0]
    if "blocks.0.attn.scale_mul_1H11" in sd:
        heads = sd["blocks.0.attn.scale_mul_1H11"].shape[1]
        l2 = True
    else:
        heads, l2 = overrides.pop("num_heads", max(1, C // 64)), False
    if "lvl_1L" in sd:
        inferred = patch_nums_from_levels(sd["lvl_1L"])
    else:
        inferred = None
    if patch_nums is not None:
        patch_nums = tuple(int(p) for p in patch_nums)
        total = sum(p * p for p in patch_nums)
        problems = []
        if len(patch_nums) != num_scales:
            problems.append(f"{len(patch_nums)} scales given, the checkpoint's lvl_embed has {num_scales}")
        if total != L:
            problems.append(f"the schedule holds {total} tokens, the checkpoint's pos_1LC holds {L}")
        if inferred is not None and inferred != patch_nums:
            problems.append(f"the checkpoint's lvl_1L encodes patch_nums {inferred}")
        if problems:
            raise CheckpointMismatchError(f"{where}patch_nums {patch_nums} are inconsistent with the checkpoint: "
                                          + "; ".join(problems))
    else:
        if inferred is None:
            raise CheckpointMismatchError(f"{where}the checkpoint has no lvl_1L buffer: pass patch_nums explicitly")
        patch_nums = inferred
    fields = dict(
        vocab_size=sd["head.weight"].shape[0],
        z_channels=sd["word_embed.weight"].shape[1],
        num_classes=sd["class_emb.weight"].shape[0] - 1,
        depth=depth,
        embed_dim=C,
        num_heads=heads,
        mlp_ratio=sd["blocks.0.ffn.fc1.weight"].shape[0] / C if depth else 4.0,
        shared_aln=variant == "shared",
        attn_l2_norm=l2,
        patch_nums=patch_nums,
    )
    for key, value in overrides.items():
        if key in fields and fields[key] != value:
            if key == "shared_aln":
                raise CheckpointMismatchError(
                    f"{where}{_variant_phrase(fields[key])}, but the {_variant_name(value)} variant was requested "
                    f"(shared_aln={value!r}); load it as the {_variant_name(fields[key])} model")
            raise CheckpointMismatchError(
                f"{where}{key}={value!r} was requested but the checkpoint has {key}={fields[key]!r}")
        fields[key] = value
    return VARConfig(**fields)


# ----------------------------------------------------------------------------------------------------------------
# consistency of a model with its tokenizer and with the zoo entry it is loaded for
# ----------------------------------------------------------------------------------------------------------------
def shape_str(t: torch.Tensor | tuple) -> str:
    shape = t.shape if isinstance(t, torch.Tensor) else t
    return "[" + ", ".join(str(int(v)) for v in shape) + "]"


def adaln_variant(sd: Mapping[str, torch.Tensor]) -> str | None:
    """``"shared"`` (``shared_ada_lin.*`` + ``blocks.i.ada_gss``, as var_d36), ``"per-block"``
    (``blocks.i.ada_lin.*``, as var_d16-d30), ``"mixed"`` (both) or None (neither)."""
    shared = any(k.startswith("shared_ada_lin.") for k in sd)
    per_block = any(re.match(r"blocks\.\d+\.ada_lin\.", k) for k in sd)
    if shared and per_block:
        return "mixed"
    return "shared" if shared else "per-block" if per_block else None


def _variant_name(shared_aln: bool) -> str:
    return "shared-AdaLN" if shared_aln else "per-block-AdaLN"


def _variant_phrase(shared_aln: bool) -> str:
    if shared_aln:
        return ("its keys (shared_ada_lin.1.weight and blocks.i.ada_gss, no blocks.i.ada_lin.*) make it the "
                "shared-AdaLN VAR variant (as var_d36)")
    return ("its keys (blocks.i.ada_lin.1.weight, no shared_ada_lin.*) make it the per-block-AdaLN VAR variant "
            "(as var_d16-d30)")


def check_var_vqvae_pair(var_sd: Mapping[str, torch.Tensor], vae_sd: Mapping[str, torch.Tensor],
                         var_source: str | Path, vae_source: str | Path, num_scales: int | None = None) -> None:
    """The VAR predicts indices into the VQVAE's codebook and reads its latents: vocabulary, latent channels
    and the number of scales must agree. Raises :class:`CheckpointMismatchError` naming both files and shapes."""
    problems = []
    head, emb = var_sd.get("head.weight"), vae_sd.get("quantize.embedding.weight")
    if head is not None and emb is not None and head.shape[0] != emb.shape[0]:
        problems.append(
            f"{var_source}: head.weight is {shape_str(head)} (a {head.shape[0]}-token vocabulary) but "
            f"{vae_source}'s codebook quantize.embedding.weight is {shape_str(emb)} ({emb.shape[0]} entries)")
    word = var_sd.get("word_embed.weight")
    if word is not None and emb is not None and word.shape[1] != emb.shape[1]:
        problems.append(
            f"{var_source}: word_embed.weight is {shape_str(word)} (it reads {word.shape[1]}-channel latents) but "
            f"{vae_source}'s codebook vectors have {emb.shape[1]} channels (quantize.embedding.weight "
            f"{shape_str(emb)})")
    hits = vae_sd.get("quantize.ema_vocab_hit_SV")
    if num_scales is not None and hits is not None and hits.shape[0] != num_scales:
        problems.append(
            f"{var_source} has {num_scales} scales (lvl_embed.weight {shape_str(var_sd['lvl_embed.weight'])}) "
            f"but {vae_source}'s quantize.ema_vocab_hit_SV is {shape_str(hits)} ({hits.shape[0]} scales)")
    if problems:
        raise CheckpointMismatchError(
            "; ".join(problems) + ". A VAR must be paired with the VQVAE it was trained with (official VAR-d16…d36: "
            "vae_ch160v4096z32.pth, 4096 codebook entries of 32 channels); pass the matching --vae-weights")


def _count_blocks(sd: Mapping[str, torch.Tensor]) -> int:
    return 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)


_VAR_FIELD_KEYS = {
    "depth": lambda sd: f"blocks.0…{_count_blocks(sd) - 1}",
    "embed_dim": lambda sd: f"pos_1LC {shape_str(sd['pos_1LC'])}",
    "num_heads": lambda sd: (f"blocks.0.attn.scale_mul_1H11 {shape_str(sd['blocks.0.attn.scale_mul_1H11'])}"
                             if "blocks.0.attn.scale_mul_1H11" in sd else "no per-head scale"),
    "vocab_size": lambda sd: f"head.weight {shape_str(sd['head.weight'])}",
    "z_channels": lambda sd: f"word_embed.weight {shape_str(sd['word_embed.weight'])}",
    "num_classes": lambda sd: f"class_emb.weight {shape_str(sd['class_emb.weight'])}, one row is the null class",
    "patch_nums": lambda sd: (f"lvl_1L / pos_1LC {shape_str(sd['pos_1LC'])}" if "lvl_1L" in sd
                              else f"pos_1LC {shape_str(sd['pos_1LC'])}"),
    "mlp_ratio": lambda sd: (f"blocks.0.ffn.fc1.weight {shape_str(sd['blocks.0.ffn.fc1.weight'])}"
                             if "blocks.0.ffn.fc1.weight" in sd else "no blocks"),
    "attn_l2_norm": lambda sd: "blocks.i.attn.scale_mul_1H11 " + ("present" if any(
        k.endswith("attn.scale_mul_1H11") for k in sd) else "absent"),
}
VAR_ENTRY_FIELDS = ("depth", "embed_dim", "num_heads", "vocab_size", "z_channels", "num_classes", "shared_aln",
                    "attn_l2_norm", "patch_nums", "mlp_ratio")


def check_var_entry(cfg: VARConfig, sd: Mapping[str, torch.Tensor], source: str | Path, entry: str,
                    expected: Mapping, entries: Mapping[str, Mapping] | None = None, hint: str = "",
                    label: str | None = None) -> None:
    """The architecture read from ``source`` must be the zoo entry's (``expected``: field -> value, any subset of
    :data:`VAR_ENTRY_FIELDS`). The error names the file, each differing field with the key and shape it comes
    from, and the zoo entries (``entries``) whose architecture the file has. ``label`` replaces
    ``zoo entry '<entry>'`` in the message."""
    label = label or f"zoo entry {entry!r}"
    diffs = []
    for name in VAR_ENTRY_FIELDS:
        if name not in expected:
            continue
        want, got = expected[name], getattr(cfg, name)
        if name == "patch_nums":
            want = tuple(int(p) for p in want)
        if got == want:
            continue
        if name == "shared_aln":
            diffs.append(f"{_variant_phrase(got)}, but {label} is the {_variant_name(bool(want))} variant")
        else:
            diffs.append(f"{name} is {got!r} ({_VAR_FIELD_KEYS[name](sd)}) but {label} has {name}={want!r}")
    if not diffs:
        return
    fits = []
    for other, arch in (entries or {}).items():
        if other != entry and all(getattr(cfg, f) == (tuple(arch[f]) if f == "patch_nums" else arch[f])
                                  for f in VAR_ENTRY_FIELDS if f in arch):
            fits.append(other)
    if fits:
        named = " / ".join(repr(f) for f in fits)
        advice = f" The file has the architecture of zoo entry {named}: load it by that name."
    elif hint:
        advice = ""
    else:
        advice = (f" No zoo entry has this architecture ({_variant_name(cfg.shared_aln)}, depth {cfg.depth}, "
                  f"patch_nums {cfg.patch_nums}); check that the file is the one {entry!r} expects.")
    raise CheckpointMismatchError(f"{source} does not fit {label}: " + "; ".join(diffs) + "."
                                  + advice + (f" {hint}" if hint else ""))


_VQVAE_ENTRY_FIELDS = ("vocab_size", "z_channels", "ch", "ch_mult", "num_res_blocks", "share_quant_resi")


def check_vqvae_entry(vq_kwargs: Mapping, sd: Mapping[str, torch.Tensor], source: str | Path, entry: str,
                      expected: Mapping, label: str | None = None) -> None:
    """The VQVAE read from ``source`` must be the one the zoo entry was trained with."""
    label = label or f"zoo entry {entry!r}"
    diffs = []
    for name in _VQVAE_ENTRY_FIELDS:
        if name not in expected:
            continue
        want, got = expected[name], vq_kwargs[name]
        if name == "ch_mult":
            want, got = tuple(want), tuple(got)
        if want != got:
            diffs.append(f"{name} is {got!r} but {label} expects {name}={want!r}")
    if diffs:
        emb = sd["quantize.embedding.weight"]
        raise CheckpointMismatchError(
            f"{source} is not the VQVAE of {label} (its codebook quantize.embedding.weight is "
            f"{shape_str(emb)}): " + "; ".join(diffs) + ". Pass the VQVAE that the VAR was trained with.")


def check_infinity_pair(cfg, sd: Mapping[str, torch.Tensor], vae_cfg, source: str | Path,
                        vae_source: str | Path) -> None:
    """Infinity predicts ``d_vae`` bits per token (``head.weight`` has 2·d_vae rows) and embeds ``d_vae``-bit
    codes; the BSQ-VAE's codebook has ``codebook_dim`` bits per latent position (×4 with the 2×2 patchify)."""
    problems = []
    word, head = sd.get("word_embed.weight"), sd.get("head.weight")
    if word is not None and head is not None and head.shape[0] != 2 * word.shape[1]:
        problems.append(f"{source}: head.weight is {shape_str(head)} but word_embed.weight is {shape_str(word)}: "
                        f"a bitwise head has 2 logits per bit, {2 * word.shape[1]} rows")
    factor = 4 if cfg.apply_spatial_patchify else 1
    if cfg.d_vae != factor * vae_cfg.codebook_dim:
        shown = f"word_embed.weight {shape_str(word)}, " if word is not None else ""
        msg = (f"{source} reads {cfg.d_vae} bits per token ({shown}head.weight "
               f"{shape_str(head) if head is not None else '?'}) but {vae_source}'s BSQ codebook has codebook_dim "
               f"{vae_cfg.codebook_dim}" + (f" (×4 = {factor * vae_cfg.codebook_dim} with the 2×2 patchify)"
                                             if factor == 4 else ""))
        if factor == 1 and cfg.d_vae == 4 * vae_cfg.codebook_dim:
            msg += ("; 4×codebook_dim bits is the 2×2 spatial-patchify layout (as infinity-8b): load it with "
                    "apply_spatial_patchify=True (the infinity-8b entry)")
        elif factor == 4 and cfg.d_vae == vae_cfg.codebook_dim:
            msg += "; that is the layout without the 2×2 patchify (as infinity-2b): load it without patchify"
        else:
            msg += "; pair the transformer with the BSQ-VAE it was trained with"
        problems.append(msg)
    if problems:
        raise CheckpointMismatchError("; ".join(problems))


def check_infinity_schedule(cfg, schedule, source: str | Path, origin: str = "the schedule") -> None:
    """A scale schedule must fit the transformer's level embedding (and the 2×2 patchify's even grids)."""
    hw = [tuple(int(v) for v in s[-2:]) for s in schedule]
    if len(hw) > cfg.num_levels:
        raise CheckpointMismatchError(
            f"{source}: lvl_embed.weight has {cfg.num_levels} rows (scale levels) but {origin} has {len(hw)} "
            f"scales {hw}; use a schedule of at most {cfg.num_levels} scales")


INFINITY_ENTRY_FIELDS = ("depth", "embed_dim", "num_heads", "text_channels", "d_vae", "block_chunks")
BSQ_ENTRY_FIELDS = ("codebook_dim", "patch_size", "base_ch", "encoder_ch_mult", "decoder_ch_mult")


def check_infinity_entry(cfg, vae_cfg, source: str | Path, vae_source: str | Path, entry: str,
                         expected: Mapping | None = None, expected_vae: Mapping | None = None,
                         entries: Mapping[str, object] | None = None) -> None:
    """The transformer and BSQ-VAE read from the files must have the zoo entry's architecture (``expected`` /
    ``expected_vae``: field -> value, any subset of :data:`INFINITY_ENTRY_FIELDS` / :data:`BSQ_ENTRY_FIELDS`;
    ``entries``: other zoo entries' transformer configs, to say which one the file is)."""
    diffs = []
    for name in INFINITY_ENTRY_FIELDS:
        if expected and name in expected and getattr(cfg, name) != expected[name]:
            diffs.append(f"{source} has {name}={getattr(cfg, name)!r} but zoo entry {entry!r} has "
                         f"{name}={expected[name]!r}")
    for name in BSQ_ENTRY_FIELDS:
        if expected_vae and name in expected_vae:
            want, got = expected_vae[name], getattr(vae_cfg, name)
            if isinstance(want, (list, tuple)):
                want, got = tuple(want), tuple(got)
            if want != got:
                diffs.append(f"{vae_source} has {name}={got!r} but zoo entry {entry!r} has {name}={want!r}")
    if not diffs:
        return
    fits = [n for n, other in (entries or {}).items()
            if n != entry and other is not None
            and all(getattr(cfg, f) == getattr(other, f) for f in INFINITY_ENTRY_FIELDS if f != "block_chunks")]
    advice = (f" The transformer has the architecture of zoo entry {' / '.join(repr(f) for f in fits)}."
              if fits else "")
    raise CheckpointMismatchError(f"the files do not fit zoo entry {entry!r}: " + "; ".join(diffs) + "." + advice)


def infer_vqvae_config(sd: Mapping[str, torch.Tensor], patch_nums, source: str | Path | None = None) -> dict:
    """Constructor kwargs of ``var_core.models.vqvae.VQVAE`` from an official-layout VQVAE state_dict."""
    if "quantize.embedding.weight" not in sd or "encoder.conv_in.weight" not in sd:
        raise CheckpointMismatchError(
            f"{_where(source)}not a VQVAE state_dict: expected quantize.embedding.weight and encoder.conv_in.weight "
            f"(got keys like {sorted(sd)[:5]})"
        )
    V, Cvae = sd["quantize.embedding.weight"].shape
    ch = sd["encoder.conv_in.weight"].shape[0]
    levels = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.down\.(\d+)\.", k)))
    ch_mult = tuple(sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] // ch for i in range(levels))
    num_res_blocks = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k)))
    num_phi = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"quantize\.quant_resi\.qresi_ls\.(\d+)\.", k))),
                      default=0)
    return dict(vocab_size=V, z_channels=Cvae, ch=ch, ch_mult=ch_mult, num_res_blocks=num_res_blocks,
                patch_nums=tuple(patch_nums), share_quant_resi=num_phi)


# ================================================================================================================
# Where the files are: Hugging Face cache folders and sharded checkpoints (file names only; nothing is read here)
# ================================================================================================================
HF_REPO_PREFIX = "models--"


def hf_repo_cache_name(repo_id: str) -> str:
    """The folder name the Hugging Face hub cache gives a model repository: ``google/flan-t5-xl`` ->
    ``models--google--flan-t5-xl``."""
    return HF_REPO_PREFIX + repo_id.replace("/", "--")


def hf_snapshot_dir(folder: str | Path) -> Path | None:
    """The snapshot folder of a Hugging Face cache repository folder (``models--org--name`` with ``snapshots/``),
    or ``None`` when ``folder`` is not one.

    The snapshot is the one ``refs/main`` names when that file exists (what ``from_pretrained`` would load);
    otherwise the only snapshot, or, among several, the most recently modified one. A cache folder whose
    snapshots are all gone raises :class:`CheckpointError` naming it."""
    folder = Path(folder).expanduser()
    snapshots = folder / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = folder / "refs" / "main"
    if ref.is_file():
        commit = ref.read_text().strip()
        if commit and (snapshots / commit).is_dir():
            return snapshots / commit
    found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        raise CheckpointError(f"{folder} is a Hugging Face cache folder without any snapshot ({snapshots} is empty): "
                              f"download the model again, or pass the folder that holds its files")
    return found[-1]


_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<index>\d+)-of-(?P<total>\d+)\.(?P<ext>safetensors|bin|pth|pt)$")
SHARD_INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")


def is_shard_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds a sharded checkpoint itself (an ``*.index.json`` or ``*-0000i-of-0000n.*`` shards)."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    return any(folder.glob("*.index.json")) or any(_SHARD_RE.match(p.name) for p in folder.iterdir())


def shard_files(folder: str | Path) -> list[Path]:
    """The shard files of a sharded checkpoint folder, checked complete before anything is read.

    * With an index (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``, as
      ``transformers`` writes them; any other ``*.index.json`` too): the files its ``weight_map`` names; a file
      it names that is absent is an error listing every absent one.
    * Without: the ``<stem>-0000i-of-0000n.<ext>`` files, all ``n`` of them required; else every weight file.
    """
    import json

    folder = Path(folder).expanduser()
    indexes = [folder / n for n in SHARD_INDEX_NAMES if (folder / n).is_file()] or sorted(folder.glob("*.index.json"))
    present = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{indexes[0]} is not a shard index (JSON with a weight_map): {exc}") from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{indexes[0]} has no weight_map naming the shards: download the index again")
        names = sorted(set(str(v) for v in weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(f"sharded checkpoint {folder} is incomplete: {indexes[0].name} names "
                                  f"{len(names)} shards and {len(missing)} are missing ({', '.join(missing[:8])}"
                                  f"{', …' if len(missing) > 8 else ''}); download them into {folder}")
        return [folder / n for n in names]
    groups: dict[tuple[str, str, str], dict[int, str]] = {}
    for name in present:
        m = _SHARD_RE.match(name)
        if m:
            groups.setdefault((m["stem"], m["ext"], m["total"]), {})[int(m["index"])] = name
    if groups:
        if len(groups) > 1:
            raise CheckpointError(f"{folder} holds shards of {len(groups)} different checkpoints "
                                  f"({', '.join(f'{s}-*-of-{t}.{e}' for s, e, t in sorted(groups))}): keep one")
        (stem, ext, total_text), have = next(iter(groups.items()))
        total = int(total_text)
        width = len(total_text)
        missing = [f"{stem}-{i:0{width}d}-of-{total_text}.{ext}" for i in range(1, total + 1) if i not in have]
        if missing:
            raise CheckpointError(f"sharded checkpoint {folder} is incomplete: {len(missing)} of {total} shards are "
                                  f"missing ({', '.join(missing[:8])}{', …' if len(missing) > 8 else ''})")
        return [folder / have[i] for i in range(1, total + 1)]
    files = [folder / n for n in present if Path(n).suffix in _WEIGHT_SUFFIXES]
    if not files:
        raise CheckpointError(f"no weight shards in {folder}: expected {' or '.join(SHARD_INDEX_NAMES)} with the "
                              f"shards it names, or model-0000i-of-0000n.safetensors files (found: {present[:10]})")
    return files


def read_sharded_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A file, or a directory of shards (``*.index.json`` naming them, or ``*-0000i-of-0000n.*`` / every weight
    file in it; see :func:`var_core.models.loading.shard_files`, which checks them complete first)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return read_state_dict(path)
    merged: dict[str, torch.Tensor] = {}
    for shard in shard_files(path):
        merged.update(read_state_dict(shard))
    return merged
