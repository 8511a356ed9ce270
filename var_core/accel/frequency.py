"""High-frequency energy of a spatial map, per token, and spatial resizing of score maps.

Every extractor takes a ``[B, C, h, w]`` map (a residual / latent / feature map) and returns a per-token energy
``[B, h, w]`` (summed over channels, computed independently per sample):

* :func:`haar_energy` — LD-Pruning's LHEP (specs/methods.md §3.1, RECONSTRUCTED): one-level orthonormal Haar DWT
  after replicate-padding to even size, ``E = Σ_c LH² + HL² + HH²`` on the ``⌈h/2⌉ × ⌈w/2⌉`` grid, local average
  over a ``window × window`` neighbourhood (stride 1, average over the in-bounds cells only), then each token takes
  the value of the Haar cell it lies in (nearest ×2 upsampling, cropped to ``(h, w)``).
* :func:`fft_energy` — energy of the high-pass part of the map: frequencies at a distance greater than
  ``radius · min(h, w) / 2`` from DC (SkipVAR's FFT feature, §7) are kept, the rest zeroed, and the per-token
  energy is ``Σ_c |IFFT(high-passed)|²``.
* :func:`laplacian_energy` — ``Σ_c (∇² x)²`` with the 5-point Laplacian, replicate padding.
* :func:`sobel_energy` — ``Σ_c (G_x² + G_y²)`` with the 3×3 Sobel kernels, replicate padding.

For the non-Haar extractors the same local average (``window``) is applied on the token grid (``window=1``: none).

:func:`resize_map` resizes ``[R, h, w]`` score maps between scale grids (the interpolation modes used across
the methods: ``nearest``, ``bilinear``, ``bicubic``, ``area``, and ``trilinear`` — Infinity's latent resize,
which on a single-frame map equals ``bilinear`` with ``align_corners=False``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXTRACTORS = ("haar", "fft", "laplacian", "sobel")
RESIZE_MODES = ("nearest", "bilinear", "bicubic", "area", "trilinear")


def resize_map(map_Rhw: torch.Tensor, hw: tuple[int, int], mode: str) -> torch.Tensor:
    """Resize ``[R, h, w]`` (or ``[R, C, h, w]``) to ``hw`` with one of :data:`RESIZE_MODES` (float32 out)."""
    squeeze = map_Rhw.dim() == 3
    x = map_Rhw.float().unsqueeze(1) if squeeze else map_Rhw.float()
    if tuple(x.shape[-2:]) == tuple(hw):
        out = x
    elif mode == "trilinear":
        out = F.interpolate(x.unsqueeze(2), size=(1, *hw), mode="trilinear", align_corners=False).squeeze(2)
    elif mode in ("bilinear", "bicubic"):
        out = F.interpolate(x, size=hw, mode=mode, align_corners=False)
    elif mode in ("nearest", "area"):
        out = F.interpolate(x, size=hw, mode=mode)
    else:
        raise ValueError(f"unknown resize mode {mode!r}; choose one of {RESIZE_MODES}")
    return out.squeeze(1) if squeeze else out


def local_average(energy_Bhw: torch.Tensor, window: int) -> torch.Tensor:
    """Mean over the ``window × window`` neighbourhood of each cell (stride 1; borders average in-bounds cells)."""
    if window <= 1:
        return energy_Bhw
    if window % 2 == 0:
        raise ValueError(f"the aggregation window must be odd (got {window})")
    return F.avg_pool2d(energy_Bhw.unsqueeze(1), window, stride=1, padding=window // 2,
                        count_include_pad=False).squeeze(1)


def haar_subbands(x_BChw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-level orthonormal Haar DWT (replicate-padded to even size): ``LL, LH, HL, HH`` each ``[B, C, h/2, w/2]``.

    With ``a=X[2i,2j], b=X[2i,2j+1], c=X[2i+1,2j], e=X[2i+1,2j+1]``: ``LL=(a+b+c+e)/2``, ``LH=(a−b+c−e)/2``,
    ``HL=(a+b−c−e)/2``, ``HH=(a−b−c+e)/2`` (specs/methods.md §3.1).
    """
    x = x_BChw.float()
    h, w = x.shape[-2:]
    pad_h, pad_w = h % 2, w % 2
    if pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h), mode="replicate")
    a, b = x[..., 0::2, 0::2], x[..., 0::2, 1::2]
    c, e = x[..., 1::2, 0::2], x[..., 1::2, 1::2]
    return (a + b + c + e) / 2, (a - b + c - e) / 2, (a + b - c - e) / 2, (a - b - c + e) / 2


def _to_tokens(cell_Bhw: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """Each token takes its Haar cell's value (token ``(i, j)`` lies in cell ``(i // 2, j // 2)``)."""
    return cell_Bhw.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)[..., : hw[0], : hw[1]]


def haar_energy(x_BChw: torch.Tensor, window: int = 3) -> torch.Tensor:
    """LHEP per-token high-frequency energy ``[B, h, w]`` (see the module docstring)."""
    _, lh, hl, hh = haar_subbands(x_BChw)
    cell = (lh.square() + hl.square() + hh.square()).sum(1)
    return _to_tokens(local_average(cell, window), tuple(x_BChw.shape[-2:]))


def fft_energy(x_BChw: torch.Tensor, window: int = 1, radius: float = 0.4) -> torch.Tensor:
    """Per-token energy of the part of the map at spatial frequencies beyond ``radius · min(h, w) / 2``."""
    x = x_BChw.float()
    h, w = x.shape[-2:]
    fy = torch.fft.fftfreq(h, device=x.device) * h  # integer frequency indices, DC at 0
    fx = torch.fft.fftfreq(w, device=x.device) * w
    dist = torch.sqrt(fy.view(-1, 1).square() + fx.view(1, -1).square())
    high = dist > radius * min(h, w) / 2
    spectrum = torch.fft.fft2(x) * high
    high_passed = torch.fft.ifft2(spectrum).real
    return local_average(high_passed.square().sum(1), window)


def _conv_energy(x_BChw: torch.Tensor, kernels_K33: torch.Tensor) -> torch.Tensor:
    x = x_BChw.float()
    B, C, h, w = x.shape
    padded = F.pad(x.reshape(B * C, 1, h, w), (1, 1, 1, 1), mode="replicate")
    responses = F.conv2d(padded, kernels_K33.to(x.device).unsqueeze(1))  # [B*C, K, h, w]
    return responses.square().sum(1).view(B, C, h, w).sum(1)


_LAPLACIAN = torch.tensor([[[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]]])
_SOBEL = torch.tensor([[[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]],
                       [[-1.0, -2.0, -1.0], [0.0, 0.0, 0.0], [1.0, 2.0, 1.0]]])


def laplacian_energy(x_BChw: torch.Tensor, window: int = 1) -> torch.Tensor:
    return local_average(_conv_energy(x_BChw, _LAPLACIAN), window)


def sobel_energy(x_BChw: torch.Tensor, window: int = 1) -> torch.Tensor:
    return local_average(_conv_energy(x_BChw, _SOBEL), window)


def high_frequency_energy(x_BChw: torch.Tensor, extractor: str, window: int = 3, radius: float = 0.4
                          ) -> torch.Tensor:
    """Dispatch to one of :data:`EXTRACTORS`; ``[B, h, w]`` per-token energy."""
    if extractor == "haar":
        return haar_energy(x_BChw, window)
    if extractor == "fft":
        return fft_energy(x_BChw, window, radius)
    if extractor == "laplacian":
        return laplacian_energy(x_BChw, window)
    if extractor == "sobel":
        return sobel_energy(x_BChw, window)
    raise ValueError(f"unknown high-frequency extractor {extractor!r}; choose one of {EXTRACTORS}")


__all__ = ["EXTRACTORS", "RESIZE_MODES", "fft_energy", "haar_energy", "haar_subbands", "high_frequency_energy",
           "laplacian_energy", "local_average", "resize_map", "sobel_energy"]
