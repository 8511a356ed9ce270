"""Image grids for sample sheets (PNG via Pillow, which matplotlib already depends on)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from ..errors import writing


def to_uint8(images_B3HW: torch.Tensor) -> torch.Tensor:
    """[0, 1] float images → uint8 HWC batch."""
    return images_B3HW.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()


def image_grid(images_B3HW: torch.Tensor, nrow: int = 8, pad: int = 2) -> torch.Tensor:
    """Tile ``[B, 3, H, W]`` images into one ``[3, H', W']`` grid with white padding."""
    B, C, H, W = images_B3HW.shape
    ncol = min(nrow, B)
    nrows = (B + ncol - 1) // ncol
    grid = torch.ones(C, nrows * (H + pad) + pad, ncol * (W + pad) + pad)
    for i in range(B):
        r, c = divmod(i, ncol)
        top, left = pad + r * (H + pad), pad + c * (W + pad)
        grid[:, top:top + H, left:left + W] = images_B3HW[i].detach().float().cpu().clamp(0, 1)
    return grid


def save_grid(images_B3HW: torch.Tensor, path: str | Path, nrow: int = 8, upscale: int = 1) -> Path:
    from PIL import Image

    grid = image_grid(images_B3HW, nrow)
    array = to_uint8(grid.unsqueeze(0))[0].numpy()
    image = Image.fromarray(array)
    if upscale > 1:
        image = image.resize((image.width * upscale, image.height * upscale), Image.NEAREST)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:  # a temporary file then a rename: a full disk never leaves half a PNG at path
        with writing(path):  # ... and its OSError names path (PIL's write loses the name)
            path.parent.mkdir(parents=True, exist_ok=True)
            image.save(tmp, format=Image.registered_extensions().get(path.suffix.lower(), "PNG"))
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # on a read-only file system even this fails: keep the first error
            tmp.unlink(missing_ok=True)
        raise
    return path
