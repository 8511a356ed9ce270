"""Infinity's multi-scale BSQ tokenizer (FLUX-style conv autoencoder + binary spherical quantization).

Re-implemented in the official parameter layout (``infinity/models/bsq_vae/flux_vqgan.py`` wrapper names:
``….conv.weight`` for convolutions, ``….norm.weight`` for group norms), so that an official VAE checkpoint
(``{'vae': state_dict}``, e.g. ``infinity_vae_d32_reg.pth``) loads unchanged. See
``specs/reference_models.md`` §2.1 and the fixture ``shared/fixtures/official_infinity_tiny``.

What the tokenizer does (image path, ``cnn_type='2d'``, no attention, no projections):

* ``encode_features``: conv encoder → ``[B, d, H, W]`` raw features (``d`` = codebook_dim = z_channels).
* ``quantize_multiscale``: for every scale ``(1, h, w)``: the residual is **area**-downsampled, each token is
  l2-normalised over its ``d`` channels and replaced by ``±1/√d`` (straight-through form ``z + (ẑ − z)``, exactly as
  the official code computes it), upsampled back with **trilinear** and subtracted. Bits are ``code > 0``.
* ``bits_to_codes``: ``normalize(bit·2s − s)`` with ``s = 1/√d`` → ``[B, d, t, h, w]``.
* ``decode``: decoder on the summed codes, clamped to ``[-1, 1]``.

The 8B tokenizer applies a 2×2 spatial patchify in the transformer (``apply_spatial_patchify``): the
transformer sees ``4d`` channels on an ``(h, w)`` grid while the VAE works at ``(2h, 2w)``; see
:func:`patchify_latent` / :func:`unpatchify_bits`.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class BSQVAEConfig:
    """Architecture of the FLUX-style BSQ autoencoder (``vae_model`` in the official code)."""

    codebook_dim: int = 32  # d: bits per token = z_channels
    base_ch: int = 128
    encoder_ch_mult: tuple[int, ...] = (1, 2, 4, 4, 4)
    decoder_ch_mult: tuple[int, ...] = (1, 2, 4, 4, 4)
    num_res_blocks: int = 2
    patch_size: int = 16  # spatial stride of the latent grid
    mid_attention: bool = False  # official ``cnn_attention='no'``
    in_channels: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder_ch_mult", tuple(int(m) for m in self.encoder_ch_mult))
        object.__setattr__(self, "decoder_ch_mult", tuple(int(m) for m in self.decoder_ch_mult))
        downs = int(round(math.log2(self.patch_size)))
        if 2**downs != self.patch_size:
            raise ValueError(f"patch_size must be a power of two, got {self.patch_size}")
        if downs > len(self.encoder_ch_mult) or downs >= len(self.decoder_ch_mult) + 1:
            raise ValueError(f"patch_size {self.patch_size} needs more levels than ch_mult provides")

    @property
    def num_down(self) -> int:
        return int(round(math.log2(self.patch_size)))

    def to_dict(self) -> dict:
        return asdict(self)


# official factory settings (``vae_model`` with base_ch 128)
VAE_2B = BSQVAEConfig(codebook_dim=32, base_ch=128, encoder_ch_mult=(1, 2, 4, 4, 4),
                      decoder_ch_mult=(1, 2, 4, 4, 4), patch_size=16)
VAE_8B = BSQVAEConfig(codebook_dim=14, base_ch=128, encoder_ch_mult=(1, 2, 4, 4),
                      decoder_ch_mult=(1, 2, 4, 4), patch_size=8)


# ----------------------------------------------------------------------------------------------------------------
# building blocks (wrapper modules reproduce the official key names)
# ----------------------------------------------------------------------------------------------------------------
class _Conv(nn.Module):
    """A 2-D convolution stored under ``.conv`` (the official ``Conv`` wrapper)."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int = 1, padding: int = 0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class _GroupNorm(nn.Module):
    """GroupNorm(32 groups, or 24 when 32 does not divide the channels), eps 1e-6, stored under ``.norm``."""

    def __init__(self, channels: int):
        super().__init__()
        if channels % 32 == 0:
            groups = 32
        elif channels % 24 == 0:
            groups = 24
        else:
            raise ValueError(f"the official Normalize needs channels divisible by 32 or 24, got {channels}")
        self.norm = nn.GroupNorm(groups, channels, eps=1e-6, affine=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def _swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.in_channels, self.out_channels = cin, cout
        self.norm1 = _GroupNorm(cin)
        self.conv1 = _Conv(cin, cout, 3, 1, 1)
        self.norm2 = _GroupNorm(cout)
        self.conv2 = _Conv(cout, cout, 3, 1, 1)
        if cin != cout:
            self.nin_shortcut = _Conv(cin, cout, 1, 1, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(_swish(self.norm1(x)))
        h = self.conv2(_swish(self.norm2(h)))
        if self.in_channels != self.out_channels:
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head spatial self-attention (only built when a checkpoint has ``mid.attn_1``)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = _GroupNorm(channels)
        self.q = _Conv(channels, channels, 1)
        self.k = _Conv(channels, channels, 1)
        self.v = _Conv(channels, channels, 1)
        self.proj_out = _Conv(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.norm(x)
        q, k, v = (m(h).flatten(2).transpose(1, 2).unsqueeze(1) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1).transpose(1, 2).reshape(B, C, H, W)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Pad right/bottom by one, then a stride-2 3×3 convolution (no symmetric padding)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = _Conv(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Upsample(nn.Module):
    """Nearest ×2, then a 3×3 convolution."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = _Conv(channels, channels, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``block`` (and an empty ``attn`` list, as in the official modules)."""

    def __init__(self):
        super().__init__()
        self.block = nn.ModuleList()
        self.attn = nn.ModuleList()


class _Mid(nn.Module):
    def __init__(self, channels: int, attention: bool):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        if attention:
            self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.block_1(h)
        if hasattr(self, "attn_1"):
            h = self.attn_1(h)
        return self.block_2(h)


class Encoder(nn.Module):
    def __init__(self, cfg: BSQVAEConfig):
        super().__init__()
        ch, mult = cfg.base_ch, cfg.encoder_ch_mult
        self.conv_in = _Conv(cfg.in_channels, ch, 3, 1, 1)
        in_mult = (1,) + tuple(mult)
        self.down = nn.ModuleList()
        block_in = ch
        for level in range(len(mult)):
            lv = _Level()
            block_in, block_out = ch * in_mult[level], ch * mult[level]
            for _ in range(cfg.num_res_blocks):
                lv.block.append(ResnetBlock(block_in, block_out))
                block_in = block_out
            if level < cfg.num_down:
                lv.downsample = Downsample(block_in)
            self.down.append(lv)
        self.mid = _Mid(block_in, cfg.mid_attention)
        self.norm_out = _GroupNorm(block_in)
        self.conv_out = _Conv(block_in, cfg.codebook_dim, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for lv in self.down:
            for block in lv.block:
                h = block(h)
            if hasattr(lv, "downsample"):
                h = lv.downsample(h)
        h = self.mid(h)
        return self.conv_out(_swish(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: BSQVAEConfig):
        super().__init__()
        ch, mult = cfg.base_ch, cfg.decoder_ch_mult
        block_in = ch * mult[-1]
        self.conv_in = _Conv(cfg.codebook_dim, block_in, 3, 1, 1)
        self.mid = _Mid(block_in, cfg.mid_attention)
        levels: list[_Level] = []
        for level in reversed(range(len(mult))):
            lv = _Level()
            block_out = ch * mult[level]
            for _ in range(cfg.num_res_blocks + 1):
                lv.block.append(ResnetBlock(block_in, block_out))
                block_in = block_out
            if 1 <= level <= cfg.num_down:
                lv.upsample = Upsample(block_in)
            levels.insert(0, lv)
        self.up = nn.ModuleList(levels)
        self.norm_out = _GroupNorm(block_in)
        self.conv_out = _Conv(block_in, cfg.in_channels, 3, 1, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for level in reversed(range(len(self.up))):
            lv = self.up[level]
            for block in lv.block:
                h = block(h)
            if hasattr(lv, "upsample"):
                h = lv.upsample(h)
        return self.conv_out(_swish(self.norm_out(h)))


# ----------------------------------------------------------------------------------------------------------------
# quantizer
# ----------------------------------------------------------------------------------------------------------------
class BSQ(nn.Module):
    """Binary spherical quantization of ``d``-dim tokens (no learned weights; ``mask`` = 2^(d−1) … 2^0)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.codebook_scale = 1.0 / math.sqrt(dim)
        self.register_buffer("mask", 2 ** torch.arange(dim - 1, -1, -1))

    def quantize(self, z_BCthw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes [B,d,t,h,w], bits [B,t,h,w,d] int32)``; codes in the official straight-through form."""
        z = z_BCthw.permute(0, 2, 3, 4, 1).float()  # channel last
        z = F.normalize(z, dim=-1)
        q_scale = 1.0 / (self.dim**0.5)
        zhat = torch.where(z > 0, torch.tensor(1.0, dtype=z.dtype), torch.tensor(-1.0, dtype=z.dtype)) * q_scale
        quantized = z + (zhat - z)
        bits = (quantized > 0).int()
        return quantized.permute(0, 4, 1, 2, 3), bits

    def bits_to_codes(self, bits_Bthwd: torch.Tensor) -> torch.Tensor:
        """``[B, t, h, w, d]`` bits (any int/float dtype) → ``[B, d, t, h, w]`` codes ``±1/√d`` (l2-normalised)."""
        s = self.codebook_scale
        codes = bits_Bthwd.float() * (2 * s) - s
        codes = F.normalize(codes, dim=-1)
        return codes.movedim(-1, 1)


class MultiScaleBSQ(nn.Module):
    """The residual multi-scale quantizer: area down, BSQ, trilinear up (no Phi convolutions)."""

    interp_up = "trilinear"
    interp_down = "area"

    def __init__(self, dim: int):
        super().__init__()
        self.lfq = BSQ(dim)

    def forward(self, feat: torch.Tensor, vae_schedule: Sequence[tuple[int, int, int]]):
        """``feat`` ``[B,d,H,W]`` or ``[B,d,1,H,W]`` → ``(summed_codes [B,d,1,H,W], bits list, var_inputs list)``."""
        x = feat.unsqueeze(2) if feat.ndim == 4 else feat
        x = x.float()
        B, C, T, H, W = x.shape
        full = (T, H, W)
        residual = x
        summed = torch.zeros_like(x)
        bits_list, var_inputs = [], []
        for si, pthw in enumerate(vae_schedule):
            pthw = tuple(int(v) for v in pthw)
            small = residual if pthw == full else F.interpolate(residual, size=pthw, mode=self.interp_down)
            codes, bits = self.lfq.quantize(small)
            if pthw != full:
                codes = F.interpolate(codes, size=full, mode=self.interp_up).contiguous()
            residual = residual - codes
            summed = summed + codes
            bits_list.append(bits)
            if si != len(vae_schedule) - 1:
                nxt = tuple(int(v) for v in vae_schedule[si + 1])
                var_inputs.append(F.interpolate(summed, size=nxt, mode=self.interp_down).contiguous())
        return summed, bits_list, var_inputs


# ----------------------------------------------------------------------------------------------------------------
# the autoencoder
# ----------------------------------------------------------------------------------------------------------------
class BSQVAE(nn.Module):
    """``AutoEncoder`` in the official layout: ``encoder``, ``decoder``, ``quantizer`` (also as ``quantize``)."""

    def __init__(self, cfg: BSQVAEConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantizer = MultiScaleBSQ(cfg.codebook_dim)
        self.quantize = self.quantizer  # the official module is registered under both names

    @property
    def codebook_dim(self) -> int:
        return self.cfg.codebook_dim

    @property
    def downsample_factor(self) -> int:
        return self.cfg.patch_size

    # encode -------------------------------------------------------------------------------------------------
    def encode_features(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """Raw encoder features ``[B, d, H/p, W/p]`` of images in ``[-1, 1]`` (no quantisation)."""
        return self.encoder(img_B3HW).float()

    def quantize_multiscale(self, feat: torch.Tensor, vae_schedule):
        return self.quantizer(feat, vae_schedule)

    def encode(self, img_B3HW: torch.Tensor, vae_schedule):
        """``(raw_features, summed_codes [B,d,H,W], bits per scale [B,1,h,w,d], var_inputs)``."""
        feat = self.encode_features(img_B3HW)
        summed, bits, var_inputs = self.quantizer(feat, vae_schedule)
        return feat, summed.squeeze(2), bits, var_inputs

    # decode -------------------------------------------------------------------------------------------------
    def bits_to_codes(self, bits_Bthwd: torch.Tensor) -> torch.Tensor:
        return self.quantizer.lfq.bits_to_codes(bits_Bthwd)

    def summed_codes_from_bits(self, bits_list: Sequence[torch.Tensor], vae_schedule) -> torch.Tensor:
        """``Σ trilinear_up(codes)`` over the scales → ``[B, d, 1, H, W]`` (the official ``decode_from_indices``)."""
        full = tuple(int(v) for v in vae_schedule[-1])
        summed = None
        for bits in bits_list:
            codes = F.interpolate(self.bits_to_codes(bits), size=full, mode=MultiScaleBSQ.interp_up)
            summed = codes if summed is None else summed + codes
        return summed

    def decode(self, summed_codes: torch.Tensor) -> torch.Tensor:
        """Images in ``[-1, 1]`` from ``[B, d, H, W]`` (or ``[B, d, 1, H, W]``) summed codes."""
        z = summed_codes.squeeze(2) if summed_codes.ndim == 5 else summed_codes
        return self.decoder(z.to(self.decoder.conv_in.conv.weight.dtype)).float().clamp(-1, 1)


# ----------------------------------------------------------------------------------------------------------------
# 2×2 spatial patchify (Infinity-8B)
# ----------------------------------------------------------------------------------------------------------------
def unpatchify_bits(bits_Bhwd4: torch.Tensor) -> torch.Tensor:
    """Transformer bits ``[B, h, w, 4d]`` → VAE bits ``[B, 2h, 2w, d]`` (``pixel_shuffle`` by 2)."""
    return F.pixel_shuffle(bits_Bhwd4.permute(0, 3, 1, 2), 2).permute(0, 2, 3, 1)


def patchify_latent(latent_BdHW: torch.Tensor) -> torch.Tensor:
    """VAE latent ``[B, d, 2h, 2w]`` → transformer grid ``[B, 4d, h, w]`` (``pixel_unshuffle`` by 2)."""
    return F.pixel_unshuffle(latent_BdHW, 2)


# ----------------------------------------------------------------------------------------------------------------
# checkpoint helpers
# ----------------------------------------------------------------------------------------------------------------
def _strip_wrapper(key: str) -> str:
    """Wrapper name → plain name: ``a.conv1.conv.weight`` → ``a.conv1.weight``, ``a.norm1.norm.bias`` → ``a.norm1.bias``."""
    return re.sub(r"\.(conv|norm)\.(weight|bias)$", r".\2", key)


def _is_wrapper_layout(sd: Mapping[str, torch.Tensor]) -> bool:
    return "encoder.conv_in.conv.weight" in sd


def remap_vae_keys(sd: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Accept both the wrapper key names (``….conv.weight``) and plain ones (``….weight``), as ``load_cnn`` does.

    Missing ``quantizer.lfq.mask`` / ``quantize.lfq.mask`` buffers are filled from the model.
    """
    model_sd = model.state_dict()
    out = {}
    plain_to_model: dict[str, str] = {}
    for key in model_sd:
        plain_to_model.setdefault(_strip_wrapper(key), key)
    for key, value in sd.items():
        if key in model_sd:
            out[key] = value
        elif key in plain_to_model and plain_to_model[key] not in sd:
            out[plain_to_model[key]] = value
        else:
            out[key] = value  # reported as unexpected by the strict loader
    for key in ("quantizer.lfq.mask", "quantize.lfq.mask"):
        if key not in out and key in model_sd:
            out[key] = model_sd[key]
    return out


def infer_bsq_vae_config(sd: Mapping[str, torch.Tensor]) -> BSQVAEConfig:
    """Architecture of an official-layout BSQ VAE state_dict (wrapper or plain key names)."""
    if _is_wrapper_layout(sd):
        sd = {_strip_wrapper(k): v for k, v in sd.items()}
    if "encoder.conv_in.weight" not in sd or "decoder.conv_out.weight" not in sd:
        raise KeyError(
            "not an Infinity BSQ-VAE state_dict: expected encoder.conv_in.conv.weight and decoder.conv_out.conv.weight "
            f"(got keys like {sorted(sd)[:5]})"
        )
    base = sd["encoder.conv_in.weight"].shape[0]
    enc_levels = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.down\.(\d+)\.", k)))
    dec_levels = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"decoder\.up\.(\d+)\.", k)))
    enc_mult = tuple(sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] // base for i in range(enc_levels))
    dec_mult = tuple(sd[f"decoder.up.{i}.block.0.conv1.weight"].shape[0] // base for i in range(dec_levels))
    nres = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.down\.0\.block\.(\d+)\.", k)))
    downs = sum(1 for i in range(enc_levels) if f"encoder.down.{i}.downsample.conv.weight" in sd)
    return BSQVAEConfig(
        codebook_dim=sd["encoder.conv_out.weight"].shape[0],
        base_ch=base,
        encoder_ch_mult=enc_mult,
        decoder_ch_mult=dec_mult,
        num_res_blocks=nres,
        patch_size=2**downs,
        mid_attention="encoder.mid.attn_1.q.weight" in sd,
        in_channels=sd["encoder.conv_in.weight"].shape[1],
    )
