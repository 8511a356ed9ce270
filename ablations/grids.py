"""Sample grids whose rows carry their labels (arm names) in the image itself.

The overview grid of a study (one row per arm, same seeds in every column) and each arm's grid (baseline row, arm
row) are read as pictures, often away from ``overview_rows.txt``: a left margin holds every row's name, drawn with
Pillow's default font (no font file, no new dependency). The image area right of the margin is pixel for pixel the
unlabelled grid of :func:`var_core.eval.images.save_grid`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

__all__ = ["save_labelled_grid", "wrap_label", "LABEL_PAD"]

LABEL_PAD = 6  # pixels around the labels in the margin
BREAKS = "@=,/_.-+:"  # a long label is broken after one of these when it can be


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType: a scalable font
    except TypeError:  # older Pillow: the fixed bitmap font
        return ImageFont.load_default()


def _width(draw, text: str, font) -> int:
    left, _, right, _ = draw.textbbox((0, 0), text, font=font)
    return right - left


def wrap_label(draw, text: str, font, max_width: int, max_lines: int) -> list[str]:
    """``text`` in lines of at most ``max_width`` pixels, broken after a separator (``BREAKS``) where possible,
    else inside a word; at most ``max_lines`` lines, the last one cut with ``…`` when the text is longer."""
    lines: list[str] = []
    rest = text
    while rest and len(lines) < max_lines:
        if _width(draw, rest, font) <= max_width:
            lines.append(rest)
            rest = ""
            break
        cut = 1
        while cut < len(rest) and _width(draw, rest[:cut + 1], font) <= max_width:
            cut += 1
        soft = max((i + 1 for i, ch in enumerate(rest[:cut]) if ch in BREAKS), default=0)
        if soft > cut // 2:
            cut = soft
        lines.append(rest[:cut])
        rest = rest[cut:]
    if rest:  # did not fit: end the last line with an ellipsis
        last = lines[-1]
        while last and _width(draw, last + "…", font) > max_width:
            last = last[:-1]
        lines[-1] = last + "…"
    return lines


def save_labelled_grid(images_B3HW: torch.Tensor, path: str | Path, nrow: int, *, row_labels: Sequence[str],
                       upscale: int = 1, pad: int = 2, max_label_width: int = 240, root: str | Path | None = None
                       ) -> Path:
    """Save ``images`` as a grid of ``nrow`` columns with ``row_labels[r]`` written left of row ``r``.

    The margin is as wide as the widest label (at most ``max_label_width`` pixels; longer names wrap, see
    :func:`wrap_label`); the font size follows the row height (11-16 px). Written atomically and never through a
    symbolic link (:func:`var_core.eval.records.write_atomic`; ``root``: the results folder, no link below it)."""
    from PIL import Image, ImageDraw

    from var_core.eval.images import image_grid, to_uint8

    B, _, H, _ = images_B3HW.shape
    ncol = min(nrow, B)
    rows = (B + ncol - 1) // ncol
    if len(row_labels) != rows:
        raise ValueError(f"{len(row_labels)} row labels for a grid of {rows} rows")
    grid = Image.fromarray(to_uint8(image_grid(images_B3HW, nrow, pad).unsqueeze(0))[0].numpy())
    if upscale > 1:
        grid = grid.resize((grid.width * upscale, grid.height * upscale), Image.NEAREST)
    row_h = (H + pad) * upscale
    font = _font(max(11, min(16, row_h // 6)))
    probe = ImageDraw.Draw(grid)
    line_h = probe.textbbox((0, 0), "Ag", font=font)[3] + 2
    max_lines = max(1, (row_h - 2 * LABEL_PAD) // line_h)
    wrapped = [wrap_label(probe, str(label), font, max_label_width, max_lines) for label in row_labels]
    margin = 2 * LABEL_PAD + max((_width(probe, line, font) for lines in wrapped for line in lines), default=0)
    canvas = Image.new("RGB", (grid.width + margin, grid.height), "white")
    canvas.paste(grid, (margin, 0))
    draw = ImageDraw.Draw(canvas)
    for r, lines in enumerate(wrapped):
        top = pad * upscale + r * row_h + (H * upscale - line_h * len(lines)) // 2
        for j, line in enumerate(lines):
            draw.text((LABEL_PAD, top + j * line_h), line, fill="black", font=font)
    from var_core.eval.records import write_atomic

    return write_atomic(Path(path), lambda tmp: canvas.save(tmp, format="PNG"), root=root)
