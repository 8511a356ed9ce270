"""Loading official checkpoint files unchanged, with errors that say exactly what does not fit.

* ``.pth`` / ``.pt`` files are read with ``torch.load(weights_only=True)`` (no pickled code is executed);
  ``.safetensors`` with the safetensors library.
* Architecture hyper-parameters are inferred from key names and shapes (``infer_var_config``,
  ``infer_vqvae_config``); what the user states explicitly is checked against them.
* Loading is strict; a mismatch raises :class:`CheckpointMismatchError` listing missing, unexpected and
  mis-shaped keys.
"""

from __future__ import annotations

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
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return dict(load_file(str(path), device="cpu"))
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with the file name and the likely cause
        raise CheckpointError(
            f"could not read {path} with torch.load(weights_only=True): {exc}. Official VAR/Infinity files are "
            f"plain state_dicts; a file that pickles code or optimiser objects must be converted first."
        ) from exc
    return unwrap_state_dict(obj, path)


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


def infer_var_config(sd: Mapping[str, torch.Tensor], patch_nums=None, **overrides) -> VARConfig:
    """Infer a :class:`VARConfig` from an official VAR state_dict; check ``patch_nums`` if given."""
    required = ("pos_1LC", "class_emb.weight", "lvl_embed.weight", "word_embed.weight", "head.weight")
    absent = [k for k in required if k not in sd]
    if absent:
        raise CheckpointMismatchError(
            f"not a VAR transformer state_dict: missing {absent} (got keys like {sorted(sd)[:5]})"
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
            raise CheckpointMismatchError(f"patch_nums {patch_nums} are inconsistent with the checkpoint: "
                                          + "; ".join(problems))
    else:
        if inferred is None:
            raise CheckpointMismatchError("the checkpoint has no lvl_1L buffer: pass patch_nums explicitly")
        patch_nums = inferred
    fields = dict(
        vocab_size=sd["head.weight"].shape[0],
        z_channels=sd["word_embed.weight"].shape[1],
        num_classes=sd["class_emb.weight"].shape[0] - 1,
        depth=depth,
        embed_dim=C,
        num_heads=heads,
        mlp_ratio=sd["blocks.0.ffn.fc1.weight"].shape[0] / C if depth else 4.0,
        shared_aln="shared_ada_lin.1.weight" in sd,
        attn_l2_norm=l2,
        patch_nums=patch_nums,
    )
    for key, value in overrides.items():
        if key in fields and fields[key] != value:
            raise CheckpointMismatchError(f"{key}={value!r} was requested but the checkpoint has {key}={fields[key]!r}")
        fields[key] = value
    return VARConfig(**fields)


def infer_vqvae_config(sd: Mapping[str, torch.Tensor], patch_nums) -> dict:
    """Constructor kwargs of ``var_core.models.vqvae.VQVAE`` from an official-layout VQVAE state_dict."""
    if "quantize.embedding.weight" not in sd or "encoder.conv_in.weight" not in sd:
        raise CheckpointMismatchError(
            f"not a VQVAE state_dict: expected quantize.embedding.weight and encoder.conv_in.weight "
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
