"""Generated images as files, in the layouts external evaluators read (``--save-images [DIR]``).

``export_images(root, arm, images_u8, conditions)`` writes one arm's images under ``<root>/images/<arm>/``, where
``root`` is the results folder (or ``DIR`` of ``--save-images DIR``) and ``<arm>`` the arm name made file-safe
(:func:`var_core.eval.records.arm_slug`)::

    images/<arm>/geneval/<index:05d>/metadata.jsonl       text-to-image: the prompt's GenEval line (prompt, tag,
                                                          include, ...): what GenEval's evaluate_images.py reads
    images/<arm>/geneval/<index:05d>/samples/<k:04d>.png  the k-th image of that prompt
    images/<arm>/flat/<sample:05d>.png                    every image in one folder (clean-fid, pytorch-fid)
    images/<arm>/samples.npz                              class-conditional: arr_0 uint8 [N, H, W, 3] (the ADM /
                                                          guided-diffusion evaluator), arr_1 int64 [N] the labels
    images/<arm>/samples.jsonl                            one line per image: sample index, files, seed, label /
                                                          prompt, tag, category

``<index>`` is the prompt's position in its prompt file (GenEval numbers its folders by the line of
``evaluation_metadata.jsonl``) and ``k`` the repeat of that prompt (sample ``i`` uses prompt ``i mod P``, repeat
``i // P``: :meth:`~var_core.eval.lightning.ConditionSet.from_prompts`). ``<sample>`` is the sample index of the
study, the same in every arm, so an arm's flat folder pairs file by file with the baseline's. The GenEval folder
(``images/<arm>/geneval/``) holds only the prompt folders, the flat folder only PNGs, as those tools expect. Point
GenEval at ``images/<arm>/geneval``, clean-fid / pytorch-fid at ``images/<arm>/flat``, the ADM evaluator at
``images/<arm>/samples.npz``.

Files are written to a temporary name and renamed, so an interrupted export leaves whole files; a re-export
(resumed study) overwrites them. Nothing is written through a symbolic link below ``root`` (a planted
``images/<arm> -> elsewhere`` is refused with a ``UserError`` naming it: :func:`var_core.eval.records.write_atomic`).
PNGs are written with Pillow (lossless, 8-bit RGB).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..errors import UserError
from .records import arm_slug, write_atomic

__all__ = ["LAYOUTS", "export_images", "images_dir", "default_layouts"]

LAYOUTS = ("geneval", "flat", "npz")


def images_dir(root: str | Path, arm: str) -> Path:
    """``<root>/images/<arm slug>``."""
    return Path(root) / "images" / arm_slug(arm)


def default_layouts(text_to_image: bool) -> tuple[str, ...]:
    """GenEval + flat for text-to-image models, flat + npz for class-conditional ones."""
    return ("geneval", "flat") if text_to_image else ("flat", "npz")


def _png(array_hw3: np.ndarray, path: Path, root: Path) -> None:
    from PIL import Image

    write_atomic(path, lambda tmp: Image.fromarray(array_hw3).save(tmp, format="PNG"), root=root)


def _text(content: str, path: Path, root: Path) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(content, encoding="utf-8"), root=root)


def _as_nhwc_u8(images) -> np.ndarray:
    if isinstance(images, torch.Tensor):
        t = images.detach().cpu()
        if t.dtype != torch.uint8:
            t = t.float().clamp(0, 1).mul(255).round().to(torch.uint8)  # [0, 1] floats, as GenerationRun.images
        array = t.numpy()
    else:
        array = np.asarray(images)
        if array.dtype != np.uint8:
            raise UserError(f"images must be uint8 (or float tensors in [0, 1]), got {array.dtype}")
    if array.ndim != 4 or array.shape[1] != 3:
        raise ValueError(f"images must be [N, 3, H, W], got {tuple(array.shape)}")
    return np.ascontiguousarray(array.transpose(0, 2, 3, 1))


class _RowsHWC:
    """``[N, H, W, 3]`` rows of stored samples, each read when asked for (the batch file is cached by the view)."""

    def __init__(self, images):
        self.images = images
        n, c, h, w = images.shape
        if c != 3:
            raise ValueError(f"images must be [N, 3, H, W], got {tuple(images.shape)}")
        self.shape = (n, h, w, 3)

    def __getitem__(self, row: int) -> np.ndarray:
        return np.ascontiguousarray(self.images[row].numpy().transpose(1, 2, 0))


def _write_npz_streaming(path: Path, images, labels: np.ndarray) -> None:
    """What ``np.savez(path, arr_0=images as [N, H, W, 3], arr_1=labels)`` writes, one batch of images at a time
    (``np.load`` reads it back alike)."""
    import zipfile

    n, h, w, _ = _RowsHWC(images).shape
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        with archive.open("arr_0.npy", "w", force_zip64=True) as handle:
            np.lib.format.write_array_header_1_0(handle, {"descr": np.dtype(np.uint8).str, "fortran_order": False,
                                                          "shape": (n, h, w, 3)})
            for part in images.batches():
                handle.write(np.ascontiguousarray(part.numpy().transpose(0, 2, 3, 1)).tobytes())
        with archive.open("arr_1.npy", "w") as handle:
            np.lib.format.write_array(handle, np.asarray(labels))


def export_images(root: str | Path, arm: str, images, conditions, *, indices: Sequence[int] | None = None,
                  layouts: Sequence[str] | None = None, prompt_metadata: Callable[[int], Mapping] | None = None,
                  seeds: Sequence[int] | None = None) -> dict[str, Any]:
    """Write ``images`` (``[N, 3, H, W]`` uint8, or floats in [0, 1]) of one arm in ``layouts``.

    ``conditions``: the study's :class:`~var_core.eval.lightning.ConditionSet`; ``indices`` the sample index of
    each image (default ``0..N-1``). ``layouts``: among :data:`LAYOUTS` (default :func:`default_layouts`: GenEval
    needs prompts, so it is left out for class-conditional sets; npz is left out for text-to-image ones).
    ``prompt_metadata(prompt_id)``: the GenEval line of a prompt (default: ``prompt`` / ``tag`` / ``category``; a
    :class:`~var_core.eval.prompts.PromptSet` gives its file's own line with
    :meth:`~var_core.eval.prompts.PromptSet.geneval_metadata`). Returns the folder, the layouts written and
    their paths, and the image count. ``seeds``: the seed of each image when it was not drawn from the
    condition set's own rule (benchmarks seed sample ``i`` with ``seed + i``), recorded in ``samples.jsonl``."""
    lazy = hasattr(images, "batches")  # an arm's stored samples (var_core.eval.store.SpoolImages): row by row
    if lazy:
        array = _RowsHWC(images)
    else:
        array = _as_nhwc_u8(images)
    n = array.shape[0]
    indices = list(range(n)) if indices is None else [int(i) for i in indices]
    if len(indices) != n:
        raise ValueError(f"{len(indices)} indices for {n} images")
    text = conditions.prompts is not None
    layouts = tuple(layouts) if layouts is not None else default_layouts(text)
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown image layout(s) {unknown}; layouts: {', '.join(LAYOUTS)}")
    if "geneval" in layouts and not text:
        raise UserError("the GenEval layout needs prompts (a text-to-image model with --prompts); class-conditional "
                        "images are written flat and as samples.npz")
    folder = images_dir(root, arm)
    out: dict[str, Any] = {"folder": str(folder), "images": n, "layouts": list(layouts)}
    lines = []
    if text:
        ids = conditions.prompt_ids if conditions.prompt_ids is not None else conditions.labels
        repeats = _repeats(ids)
    rule_seeds = conditions.seeds if seeds is None else None
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} images")
    for row, i in enumerate(indices):
        entry: dict[str, Any] = {"index": i, "seed": int(seeds[row]) if seeds is not None else rule_seeds[i]}
        if text:
            pid = int(ids[i])
            entry.update(prompt=conditions.prompts[i], prompt_id=pid, repeat=repeats[i],
                         tag=conditions.tags[i] if conditions.tags is not None else None,
                         category=conditions.categories[i] if conditions.categories is not None else None)
        else:
            entry["label"] = int(conditions.labels[i])
        if "flat" in layouts:
            path = folder / "flat" / f"{i:05d}.png"
            _png(array[row], path, root)
            entry["flat"] = str(path.relative_to(folder))
        if "geneval" in layouts:
            sub = folder / "geneval" / f"{entry['prompt_id']:05d}"
            path = sub / "samples" / f"{entry['repeat']:04d}.png"
            _png(array[row], path, root)
            entry["geneval"] = str(path.relative_to(folder))
        lines.append(entry)
    if "geneval" in layouts:
        written = sorted({e["prompt_id"] for e in lines})
        for pid in written:
            meta = dict(prompt_metadata(pid)) if prompt_metadata is not None else _metadata_from(conditions, pid)
            _text(json.dumps(meta, ensure_ascii=False) + "\n", folder / "geneval" / f"{pid:05d}" / "metadata.jsonl",
                  root)
        out["geneval"] = str(folder / "geneval")
        out["prompts"] = len(written)
    if "flat" in layouts:
        out["flat"] = str(folder / "flat")
    if "npz" in layouts:
        labels = np.asarray([int(conditions.labels[i]) for i in indices], dtype=np.int64)
        path = folder / "samples.npz"

        def write_npz(tmp: Path) -> None:
            if lazy:  # np.savez's layout (stored zip of .npy members), arr_0 written batch by batch
                _write_npz_streaming(tmp, images, labels)
                return
            with open(tmp, "wb") as handle:  # a file handle: np.savez would append ".npz" to a bare name
                np.savez(handle, arr_0=array, arr_1=labels)

        write_atomic(path, write_npz, root=root)
        out["npz"] = str(path)
    _text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in lines), folder / "samples.jsonl", root)
    out["index"] = str(folder / "samples.jsonl")
    return out


def _repeats(ids: Sequence[int]) -> list[int]:
    """Per sample: how many earlier samples used the same prompt (its repeat number ``k``)."""
    seen: dict[int, int] = {}
    out = []
    for pid in ids:
        out.append(seen.get(pid, 0))
        seen[pid] = out[-1] + 1
    return out


def _metadata_from(conditions, pid: int) -> dict:
    ids = conditions.prompt_ids if conditions.prompt_ids is not None else conditions.labels
    i = list(ids).index(pid)
    meta: dict[str, Any] = {"prompt": conditions.prompts[i]}
    if conditions.tags is not None and conditions.tags[i] is not None:
        meta["tag"] = conditions.tags[i]
    if conditions.categories is not None and conditions.categories[i] is not None:
        meta["category"] = conditions.categories[i]
    return meta
