"""HART's hybrid tokenizer (Tang et al., 2024, "HART: Efficient Visual Generation with Hybrid Autoregressive
Transformer"), re-implemented in the official parameter layout.

The official ``HARTAutoEncoderWithDisc`` (``tokenizer/`` folder of a HART checkpoint, specs/hart.md §4 and §8.3)
holds VAR's multi-scale VQVAE under ``vae.*`` and a PatchGAN discriminator under ``disc.*`` (training only).
:class:`HARTTokenizer` is that VQVAE (our :class:`~var_core.models.vqvae.VQVAE`, registered as ``vae`` so the keys
match unchanged) plus the **hybrid** rules of ``HARTHybridQuantizer``:

* scales ``0 … N−2`` are quantised and accumulated exactly as in VAR (bicubic up, Phi, area down);
* at the last scale the discrete code is added **without** Phi (and without interpolation: it is at full size);
* what the codes cannot represent is the continuous residual ``f − f_hat``, the target of the residual diffusion
  head (:mod:`var_core.models.hart_diffusion`).

The inherited VAR decoding helpers (:meth:`VQVAE.idx_list_to_img` …) still apply Phi at the last scale, as the
official ones do: they are VAR's rules, not HART's (``golden_vae.pt`` checks both).

Loading (:func:`load_hart_tokenizer`): ``disc.*`` entries are ignored (a note says how many); everything else must
match strictly. Tokenizer config fields the code does not implement (``using_znorm``, ``quant_conv_ks != 3``,
``double_decoder``, ``disable_quant_resi``, a non-hybrid ``quantizer_type``) are refused with a
:class:`~var_core.models.loading.CheckpointMismatchError` naming the field, never silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .loading import CheckpointError, CheckpointMismatchError, load_strict
from .vqvae import VQVAE

__all__ = ["HARTTokenizer", "HARTTokenizerConfig", "load_hart_tokenizer", "split_tokenizer_state_dict"]

HART_PATCH_NUMS_1024 = (1, 2, 3, 4, 5, 7, 9, 12, 16, 21, 27, 36, 48, 64)


@dataclass(frozen=True)
class HARTTokenizerConfig:
    """The fields of ``HARTAutoEncoderWithDiscConfig`` the inference code reads (defaults: the class defaults,
    i.e. the VAR VQVAE ``vae_ch160v4096z32`` with HART's 14-scale 1024-px schedule)."""

    vocab_size: int = 4096
    z_channels: int = 32
    ch: int = 160
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    v_patch_nums: tuple[int, ...] = HART_PATCH_NUMS_1024
    share_quant_resi: int = 4
    quant_resi: float = 0.5
    beta: float = 0.25
    default_qresi_counts: int = 0
    quantizer_type: str = "var_hybrid"
    num_res_blocks: int = 2  # not a config field: the official VQVAE always has 2
    extra: dict = field(default_factory=dict, compare=False)  # the rest of config.json, kept for the record

    # fields of config.json that must have the value our code implements (name -> accepted values)
    UNSUPPORTED = {"using_znorm": (False,), "quant_conv_ks": (3,), "double_decoder": (False,),
                   "disable_quant_resi": (False,), "quantizer_type": ("var_hybrid",)}

    @classmethod
    def from_json(cls, data: Mapping, source: str | Path = "config.json") -> "HARTTokenizerConfig":
        for name, accepted in cls.UNSUPPORTED.items():
            if name in data and data[name] not in accepted:
                raise CheckpointMismatchError(
                    f"{source}: {name}={data[name]!r} is not supported (this tokenizer implements "
                    f"{name}={accepted[0]!r}, the HART release's value); the official checkpoints use the hybrid "
                    f"quantizer of specs/hart.md §4.2")
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", "num_res_blocks")}
        kwargs = {k: data[k] for k in known if k in data}
        for key in ("ch_mult", "v_patch_nums"):
            if key in kwargs:
                kwargs[key] = tuple(int(v) for v in kwargs[key])
        return cls(**kwargs, extra={k: v for k, v in data.items() if k not in known})

    @property
    def num_phis(self) -> int:
        """Phi convolutions in ``quant_resi.qresi_ls`` (official: ``default_qresi_counts or share_quant_resi``)."""
        if self.share_quant_resi >= 2:
            return self.default_qresi_counts or self.share_quant_resi
        return self.share_quant_resi

    def vqvae_kwargs(self) -> dict:
        return dict(vocab_size=self.vocab_size, z_channels=self.z_channels, ch=self.ch, ch_mult=self.ch_mult,
                    num_res_blocks=self.num_res_blocks, patch_nums=self.v_patch_nums,
                    share_quant_resi=self.num_phis, quant_resi=self.quant_resi, beta=self.beta)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        return out


class HARTTokenizer(nn.Module):
    """VAR's VQVAE (as ``vae``) with HART's hybrid last-scale rule and continuous residual.

    Latent maps are ``[B, Cvae, pn_N, pn_N]``; token maps ``[B, pn²]`` int64 row-major; images in ``[-1, 1]``.
    """

    def __init__(self, cfg: HARTTokenizerConfig = HARTTokenizerConfig()):
        super().__init__()
        self.cfg = cfg
        self.vae = VQVAE(**cfg.vqvae_kwargs())

    # ----- description -------------------------------------------------------------------------------------
    @property
    def quantize(self):
        return self.vae.quantize

    @property
    def patch_nums(self) -> tuple[int, ...]:
        return self.vae.patch_nums

    @property
    def num_scales(self) -> int:
        return len(self.vae.patch_nums)

    @property
    def z_channels(self) -> int:
        return self.vae.z_channels

    @property
    def vocab_size(self) -> int:
        return self.vae.vocab_size

    @property
    def downsample_factor(self) -> int:
        return self.vae.downsample_factor

    @property
    def image_size(self) -> int:
        return self.vae.image_size

    @property
    def codebook(self) -> torch.Tensor:
        """``[V, Cvae]``"""
        return self.vae.quantize.embedding.weight

    # ----- the hybrid rules --------------------------------------------------------------------------------
    def embed_idx(self, idx_Bl: torch.Tensor, pn: int) -> torch.Tensor:
        """Codebook vectors of a row-major token map as ``[B, Cvae, pn, pn]``."""
        return self.vae.quantize.embed_idx(idx_Bl, pn)

    def next_autoregressive_input(self, si: int, f_hat_BChw: torch.Tensor, h_BChw: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(f_hat', next input)`` after adding scale ``si``'s code map ``h``: ``f_hat + Phi_si(bicubic(h))`` and its
        area downsampling to the next scale for ``si < N−1``; at the last scale ``f_hat + h`` (no Phi, the HART rule)
        and no next input. Not in place."""
        if si == self.num_scales - 1:
            return f_hat_BChw + h_BChw, None
        return self.vae.quantize.next_autoregressive_input(si, f_hat_BChw, h_BChw)

    def teacher_forcing_input(self, idx_list: Sequence[torch.Tensor]) -> torch.Tensor:
        """``x_BLCv_wo_first_l`` ``[B, L − 1, Cvae]``: the next-scale inputs of scales 1 … N−1 (only scales 0 … N−2
        enter them, where HART and VAR agree)."""
        return self.vae.quantize.idx_list_to_var_input(idx_list)

    def encode_features(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """``quant_conv(encoder(img))``: the continuous latent ``f``."""
        return self.vae.encode_features(img_B3HW)

    def img_to_idx_and_residual(self, img_B3HW: torch.Tensor):
        """The official ``img_to_idxBl_and_frest``: token maps of every scale (hybrid rule) and the residual
        ``f_rest`` BEFORE the last discrete subtraction, token-major ``[B, l_N, Cvae]``. The continuous tokens the
        diffusion head models are ``f_rest − embedding(idx_last)`` (:meth:`continuous_residual`)."""
        return self.f_to_idx_and_residual(self.encode_features(img_B3HW))

    def f_to_idx_and_residual(self, f_BChw: torch.Tensor):
        quantize = self.vae.quantize
        quantize._check_f(f_BChw)
        B, C = f_BChw.shape[:2]
        f_rest = f_BChw.detach().clone()
        idx_list: list[torch.Tensor] = []
        last = self.num_scales - 1
        rest_before_last = None
        for si, pn in enumerate(self.patch_nums):
            idx_N = quantize._nearest_code(quantize._scale_input(si, f_rest))
            h = quantize.embed_idx(idx_N.view(B, pn * pn), pn)
            if si != last:
                h = quantize.phi(si, F.interpolate(h, size=f_rest.shape[-2:], mode="bicubic", align_corners=False))
            else:
                rest_before_last = f_rest.permute(0, 2, 3, 1).reshape(B, -1, C)
            f_rest = f_rest - h
            idx_list.append(idx_N.reshape(B, pn * pn))
        return idx_list, rest_before_last

    def continuous_residual(self, rest_before_last_BlC: torch.Tensor, idx_last_Bl: torch.Tensor) -> torch.Tensor:
        """``f_rest − embedding(idx_last)`` ``[B, l_N, Cvae]``: the part of the latent the codes do not carry."""
        return rest_before_last_BlC - self.vae.quantize.embedding(idx_last_Bl)

    def idx_to_fhat(self, idx_list: Sequence[torch.Tensor], residual_BlC: torch.Tensor | None = None) -> torch.Tensor:
        """``f_hat`` by the HART rule: ``Σ_{s<N−1} Phi_s(bicubic(emb_s)) + emb_{N−1} (+ residual)``."""
        B = idx_list[0].shape[0]
        full = self.patch_nums[-1]
        f_hat = self.codebook.new_zeros(B, self.z_channels, full, full)
        for si, idx in enumerate(idx_list):
            f_hat = self.next_autoregressive_input(si, f_hat, self.embed_idx(idx, self.patch_nums[si]))[0]
        if residual_BlC is not None:
            f_hat = f_hat + tokens_to_map(residual_BlC, full)
        return f_hat

    def fhat_to_img(self, f_hat_BChw: torch.Tensor) -> torch.Tensor:
        """``decoder(post_quant_conv(f_hat)).clamp(−1, 1)``"""
        return self.vae.fhat_to_img(f_hat_BChw)


def tokens_to_map(x_BlC: torch.Tensor, side: int) -> torch.Tensor:
    """Token-major ``[B, side², C]`` → ``[B, C, side, side]`` (row-major tokens)."""
    B, _, C = x_BlC.shape
    return x_BlC.transpose(1, 2).reshape(B, C, side, side)


# ----- checkpoint ----------------------------------------------------------------------------------------------
def split_tokenizer_state_dict(sd: Mapping[str, torch.Tensor], source: str | Path = "tokenizer"
                               ) -> tuple[dict[str, torch.Tensor], int]:
    """``(vae state_dict without the 'vae.' prefix, number of ignored 'disc.*' entries)``.

    The discriminator (``disc.*``: PatchGAN, BatchNorm statistics included, training only) is not part of inference;
    the fixture leaves it out, a real checkpoint saved by ``HARTAutoEncoderWithDisc`` has it."""
    vae = {k[len("vae."):]: v for k, v in sd.items() if k.startswith("vae.")}
    disc = sum(1 for k in sd if k.startswith("disc."))
    other = sorted(k for k in sd if not k.startswith(("vae.", "disc.")))
    if not vae:
        raise CheckpointMismatchError(
            f"{source} holds no 'vae.*' entries (keys like {sorted(sd)[:5]}): not a HART tokenizer checkpoint "
            f"(HARTAutoEncoderWithDisc saves the VQVAE under 'vae.' and the discriminator under 'disc.')")
    if other:
        raise CheckpointMismatchError(f"{source} has entries outside 'vae.*' / 'disc.*': {other[:8]}"
                                      + (" …" if len(other) > 8 else ""))
    return vae, disc


def read_hf_config(folder: Path, what: str) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{what} folder {folder} has no config.json (a Hugging Face folder written by "
                              f"save_pretrained holds config.json and the weights)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


HF_WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                   "pytorch_model.bin.index.json")


def hf_weight_file(folder: Path, what: str, names: Sequence[str] = HF_WEIGHT_NAMES) -> Path:
    """The weights of a ``save_pretrained`` folder: the first of ``names`` present (a shard index: its folder)."""
    folder = Path(folder)
    for name in names:
        if (folder / name).is_file():
            return folder if name.endswith(".index.json") else folder / name
    present = sorted(p.name for p in folder.iterdir())[:12] if folder.is_dir() else []
    raise CheckpointError(f"{what} weights not found in {folder}: expected one of {', '.join(names)} "
                          f"(found: {present})")


def load_hart_tokenizer(folder: str | Path, log=None) -> tuple[HARTTokenizer, dict]:
    """``(tokenizer, info)`` from an official ``tokenizer/`` folder (config.json + weights), loaded strictly;
    ``info`` says what was ignored (``disc_entries_ignored``)."""
    from .loading import read_sharded_state_dict

    folder = Path(folder).expanduser()
    data = read_hf_config(folder, "HART tokenizer")
    if data.get("model_type") not in (None, "hart_autoencoder_with_disc", "hart_autoencoder"):
        raise CheckpointMismatchError(f"{folder / 'config.json'} has model_type {data.get('model_type')!r}: not a "
                                      f"HART tokenizer (hart_autoencoder_with_disc)")
    cfg = HARTTokenizerConfig.from_json(data, folder / "config.json")
    path = hf_weight_file(folder, "HART tokenizer")
    vae_sd, disc = split_tokenizer_state_dict(read_sharded_state_dict(path), path)
    tok = HARTTokenizer(cfg)
    load_strict(tok.vae, vae_sd, "HART tokenizer (vae.*)", path)
    info = {"tokenizer_weights": str(path), "disc_entries_ignored": disc}
    if disc and log is not None:
        log(f"note: {path}: ignored {disc} 'disc.*' entries (the training-only discriminator)")
    return tok.eval(), info
