"""VAR's multi-scale VQVAE (Tian et al., 2024), re-implemented in the official parameter layout.

An LDM-style convolutional autoencoder (official ``models/vqvae.py`` + ``models/basic_vae.py``, see
``specs/reference_models.md`` §1.2 and Appendix A) around :class:`MultiScaleResidualQuantizer`. With the default
arguments the module tree and parameter names equal the official ``VQVAE`` built by ``build_vae_var``, so
``vae_ch160v4096z32.pth`` (and the fixture ``vae.pth``) load with ``strict=True``:

* ``encoder``: ``conv_in``; per level ``down.{i}.block.{j}`` (``num_res_blocks`` ResnetBlocks), ``down.{i}.attn.{j}``
  (lowest level only), ``down.{i}.downsample`` (all levels but the last); ``mid.block_1/attn_1/block_2``;
  ``norm_out``, SiLU, ``conv_out`` (→ ``z_channels``).
* ``decoder``: ``conv_in`` (z → ch·mult[-1]); ``mid``; levels from lowest to highest resolution, each with
  ``num_res_blocks + 1`` ResnetBlocks ``up.{i}.block.{j}`` (+ attention at the lowest level) and ``up.{i}.upsample``
  for ``i != 0``; ``norm_out``, SiLU, ``conv_out`` (→ 3). ``up`` is indexed by level (0 = highest resolution).
* ``quant_conv`` / ``post_quant_conv``: 3x3 convs Cvae → Cvae; ``quantize``: the quantizer.

``ch_mult`` and ``norm_groups`` are configurable so that smaller testbed models (e.g. 4x downsampling) use the same
code. Images are in [-1, 1].

Official behaviour deliberately not reproduced: ``build_vae_var`` replaces ``reset_parameters`` of the conv /
linear / norm classes process-wide with a no-op (leaving the VQVAE convs uninitialised until a checkpoint loads).
Nothing here touches global state; modules get PyTorch's default initialisation.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .quant import MultiScaleResidualQuantizer

__all__ = ["AttnBlock", "Decoder", "Downsample2x", "Encoder", "ResnetBlock", "Upsample2x", "VQVAE"]


def _norm(channels: int, groups: int) -> nn.GroupNorm:
    """GroupNorm with eps 1e-6 and affine parameters (official ``Normalize``)."""
    return nn.GroupNorm(num_groups=groups, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    """``shortcut(x) + conv2(silu(norm2(conv1(silu(norm1(x))))))``; ``nin_shortcut`` is a 1x1 conv only if in != out."""

    def __init__(self, in_channels: int, out_channels: int, dropout: float = 0.0, norm_groups: int = 32):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.norm1 = _norm(in_channels, norm_groups)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.norm2 = _norm(out_channels, norm_groups)
        self.dropout = nn.Dropout(dropout) if dropout > 1e-6 else nn.Identity()
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=1, padding=0)
        else:
            self.nin_shortcut = nn.Identity()

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x_BChw)))
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.nin_shortcut(x_BChw) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all h·w positions: ``x + proj_out(attn(qkv(norm(x))))``.

    ``qkv`` is one 1x1 conv C → 3C whose output channels are [q | k | v]; the logits are ``q·k / sqrt(C)``.
    """

    def __init__(self, channels: int, norm_groups: int = 32):
        super().__init__()
        self.channels = channels
        self.norm = _norm(channels, norm_groups)
        self.qkv = nn.Conv2d(channels, 3 * channels, kernel_size=1, stride=1, padding=0)
        self.proj_out = nn.Conv2d(channels, channels, kernel_size=1, stride=1, padding=0)

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x_BChw.shape
        qkv = self.qkv(self.norm(x_BChw)).reshape(B, 3, C, H * W)
        q_BNC, k_BNC, v_BNC = (t.transpose(1, 2) for t in qkv.unbind(1))
        w_BNN = torch.bmm(q_BNC, k_BNC.transpose(1, 2)).mul(C ** -0.5).softmax(dim=-1)
        h_BCN = torch.bmm(w_BNN, v_BNC).transpose(1, 2)
        return x_BChw + self.proj_out(h_BCN.reshape(B, C, H, W))


class Downsample2x(nn.Module):
    """Zero pad (left 0, right 1, top 0, bottom 1), then a stride-2 3x3 conv without padding."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=2, padding=0)

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x_BChw, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample2x(nn.Module):
    """Nearest-neighbour x2, then a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size=3, stride=1, padding=1)

    def forward(self, x_BChw: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x_BChw, scale_factor=2, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``block`` (ModuleList), ``attn`` (ModuleList, may be empty), optional resampler."""

    def __init__(self, blocks: list[nn.Module], attns: list[nn.Module]):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        self.attn = nn.ModuleList(attns)

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        for j, block in enumerate(self.block):
            h = block(h)
            if len(self.attn):
                h = self.attn[j](h)
        return h


class _Mid(nn.Module):
    def __init__(self, channels: int, dropout: float, norm_groups: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, dropout, norm_groups)
        self.attn_1 = AttnBlock(channels, norm_groups)
        self.block_2 = ResnetBlock(channels, channels, dropout, norm_groups)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(h)))


class Encoder(nn.Module):
    """Image ``[B, 3, H, W]`` → features ``[B, z_channels, H/f, W/f]`` with ``f = 2**(len(ch_mult)-1)``."""

    def __init__(
        self,
        ch: int,
        ch_mult: Sequence[int],
        num_res_blocks: int,
        z_channels: int,
        attn_at_lowest: bool = True,
        dropout: float = 0.0,
        norm_groups: int = 32,
        in_channels: int = 3,
    ):
        super().__init__()
        n_levels = len(ch_mult)
        self.conv_in = nn.Conv2d(in_channels, ch, kernel_size=3, stride=1, padding=1)
        in_mult = (1,) + tuple(ch_mult)
        self.down = nn.ModuleList()
        block_out = ch
        for i in range(n_levels):
            block_in, block_out = ch * in_mult[i], ch * ch_mult[i]
            blocks, attns = [], []
            for _ in range(num_res_blocks):
                blocks.append(ResnetBlock(block_in, block_out, dropout, norm_groups))
                block_in = block_out
                if attn_at_lowest and i == n_levels - 1:
                    attns.append(AttnBlock(block_out, norm_groups))
            level = _Level(blocks, attns)
            if i != n_levels - 1:
                level.downsample = Downsample2x(block_out)
            self.down.append(level)
        self.mid = _Mid(block_out, dropout, norm_groups)
        self.norm_out = _norm(block_out, norm_groups)
        self.conv_out = nn.Conv2d(block_out, z_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(img_B3HW)
        for i, level in enumerate(self.down):
            h = level.run_blocks(h)
            if i != len(self.down) - 1:
                h = level.downsample(h)
        h = self.mid(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    """Features ``[B, z_channels, h, w]`` → image ``[B, 3, h·f, w·f]`` (not clamped)."""

    def __init__(
        self,
        ch: int,
        ch_mult: Sequence[int],
        num_res_blocks: int,
        z_channels: int,
        attn_at_lowest: bool = True,
        dropout: float = 0.0,
        norm_groups: int = 32,
        out_channels: int = 3,
    ):
        super().__init__()
        n_levels = len(ch_mult)
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, kernel_size=3, stride=1, padding=1)
        self.mid = _Mid(block_in, dropout, norm_groups)
        levels: list[nn.Module] = [nn.Identity()] * n_levels
        for i in reversed(range(n_levels)):
            block_out = ch * ch_mult[i]
            blocks, attns = [], []
            for _ in range(num_res_blocks + 1):
                blocks.append(ResnetBlock(block_in, block_out, dropout, norm_groups))
                block_in = block_out
                if attn_at_lowest and i == n_levels - 1:
                    attns.append(AttnBlock(block_out, norm_groups))
            level = _Level(blocks, attns)
            if i != 0:
                level.upsample = Upsample2x(block_out)
            levels[i] = level
        self.up = nn.ModuleList(levels)  # indexed by level, run from the last to the first
        self.norm_out = _norm(block_in, norm_groups)
        self.conv_out = nn.Conv2d(block_in, out_channels, kernel_size=3, stride=1, padding=1)

    def forward(self, z_BChw: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z_BChw))
        for i in reversed(range(len(self.up))):
            h = self.up[i].run_blocks(h)
            if i != 0:
                h = self.up[i].upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VQVAE(nn.Module):
    """VAR's VQVAE: ``encoder`` → ``quant_conv`` → multi-scale ``quantize`` → ``post_quant_conv`` → ``decoder``.

    Official defaults (ch=160, ch_mult=(1,1,2,2,4), V=4096, Cvae=32, 10 scales) reproduce the layout of
    ``vae_ch160v4096z32.pth``. The latent side is ``patch_nums[-1]``, so images are
    ``patch_nums[-1] * downsample_factor`` pixels wide.
    """

    def __init__(
        self,
        vocab_size: int = 4096,
        z_channels: int = 32,
        ch: int = 160,
        ch_mult: Sequence[int] = (1, 1, 2, 2, 4),
        num_res_blocks: int = 2,
        attn_at_lowest: bool = True,
        patch_nums: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16),
        share_quant_resi: int = 4,
        quant_resi: float = 0.5,
        beta: float = 0.25,
        dropout: float = 0.0,
        norm_groups: int = 32,
    ):
        super().__init__()
        ch_mult = tuple(int(m) for m in ch_mult)
        patch_nums = tuple(int(p) for p in patch_nums)
        for c in {ch} | {ch * m for m in ch_mult}:
            if c % norm_groups:
                raise ValueError(f"channel count {c} is not a multiple of norm_groups={norm_groups}")
        self.config: dict[str, Any] = dict(
            vocab_size=int(vocab_size),
            z_channels=int(z_channels),
            ch=int(ch),
            ch_mult=list(ch_mult),
            num_res_blocks=int(num_res_blocks),
            attn_at_lowest=bool(attn_at_lowest),
            patch_nums=list(patch_nums),
            share_quant_resi=int(share_quant_resi),
            quant_resi=float(quant_resi),
            beta=float(beta),
            dropout=float(dropout),
            norm_groups=int(norm_groups),
        )
        self.vocab_size = int(vocab_size)
        self.z_channels = int(z_channels)
        self.patch_nums = patch_nums
        arch = dict(
            ch=ch, ch_mult=ch_mult, num_res_blocks=num_res_blocks, z_channels=z_channels,
            attn_at_lowest=attn_at_lowest, dropout=dropout, norm_groups=norm_groups,
        )
        # Registration order matches the official state_dict order.
        self.encoder = Encoder(**arch)
        self.decoder = Decoder(**arch)
        self.quantize = MultiScaleResidualQuantizer(
            vocab_size, z_channels, patch_nums, share_quant_resi=share_quant_resi, quant_resi=quant_resi, beta=beta
        )
        self.quant_conv = nn.Conv2d(z_channels, z_channels, kernel_size=3, stride=1, padding=1)
        self.post_quant_conv = nn.Conv2d(z_channels, z_channels, kernel_size=3, stride=1, padding=1)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "VQVAE":
        """Build from a :attr:`config` dict (e.g. one saved next to a testbed checkpoint)."""
        return cls(**config)

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.config["ch_mult"]) - 1)

    @property
    def image_size(self) -> int:
        """Side of the images whose latent is ``patch_nums[-1]`` wide."""
        return self.patch_nums[-1] * self.downsample_factor

    def encode_features(self, img_B3HW: torch.Tensor) -> torch.Tensor:
        """``quant_conv(encoder(img))``: the continuous features ``f_BChw`` that the quantizer sees."""
        return self.quant_conv(self.encoder(img_B3HW))

    def img_to_idx_list(self, img_B3HW: torch.Tensor) -> list[torch.Tensor]:
        """Token maps per scale, each ``[B, pn*pn]`` int64 (official ``img_to_idxBl``)."""
        return self.quantize.f_to_idx_list(self.encode_features(img_B3HW))

    def fhat_to_img(self, f_hat_BChw: torch.Tensor) -> torch.Tensor:
        """``decoder(post_quant_conv(f_hat)).clamp(-1, 1)`` (official ``fhat_to_img``)."""
        return self.decoder(self.post_quant_conv(f_hat_BChw)).clamp(-1, 1)

    def idx_list_to_img(self, idx_list: Sequence[torch.Tensor]) -> torch.Tensor:
        """Decode token maps of all scales into an image in [-1, 1] (official ``idxBl_to_img(..., last_one=True)``)."""
        return self.fhat_to_img(self.quantize.idx_list_to_fhat(idx_list))

    def forward(self, img_B3HW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Training pass: ``(recon, vq_loss, stats)``. ``recon`` is **not** clamped (as in the official forward),
        gradients reach the encoder through the straight-through estimator."""
        f_hat_st, vq_loss, stats = self.quantize(self.encode_features(img_B3HW))
        return self.decoder(self.post_quant_conv(f_hat_st)), vq_loss, stats
