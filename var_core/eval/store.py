"""Per-batch sample spool of a generation run: samples reach disk batch by batch, as they are generated (issue 26).

A spool folder holds one pair of files per finished batch, named by the batch's first sample index:

* ``batch_<first>.safetensors``: ``images_u8`` ``[B, 3, H, W]`` uint8, ``tokens.<s>`` ``[B, ...]`` per scale that
  kept tokens, ``entropy`` ``[B, scales]`` float, ``labels`` / ``seeds`` int64 (safetensors: no pickled code runs);
* ``batch_<first>.json``: the sample indices, activation scales and the batch's measurements (seconds, kept
  tokens, history, probe data), written last: a batch counts as finished only when its JSON exists.

Both are written atomically (temporary file, fsync, rename), so a process killed at any point leaves finished
batches and no partial file. A run restarted on the same spool skips the finished batches
(:func:`finished_batches`) and generates only the rest; since a batch is a fixed run of sample indices and every
sample has its own seed, the merged samples are those an uninterrupted run produces. ``key.json`` names the
configuration the spool belongs to (the caller compares it before resuming).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError

__all__ = ["SPOOL_FORMAT", "SpoolError", "write_batch", "read_batch", "finished_batches", "batch_name",
           "write_spool_key", "read_spool_key", "SpoolImages", "SpoolTokens", "read_spool",
           "samples_folder", "SAMPLES_SUFFIX"]

SPOOL_FORMAT = "varscope.batch/1"
KEY_FILE = "key.json"


class SpoolError(UserError):
    """A batch file of a spool that cannot be read (names the file)."""

    def __init__(self, path: str | Path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"cannot read {self.path}: {reason}; delete its folder {self.path.parent} to regenerate "
                         f"the arm from its first batch")


def batch_name(first: int) -> str:
    return f"batch_{int(first):09d}"


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _plain(value):
    """JSON-safe copy (tensors / numpy to lists, non-finite floats to ``None``; anything else its ``str``)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _plain(value.detach().cpu().tolist())
    if hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy arrays and scalars
        return _plain(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def _json_text(data) -> str:
    return json.dumps(_plain(data), sort_keys=True)


def write_batch(folder: str | Path, out: dict, environment: dict | None = None) -> Path:
    """Write one ``GenerationModule.predict_step`` output into ``folder`` (tensors first, then the JSON)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    indices = [int(i) for i in out["indices"]]
    name = batch_name(indices[0])
    tensors = {"labels": torch.as_tensor(out["labels"], dtype=torch.long),
               "seeds": torch.as_tensor(out["seeds"], dtype=torch.long),
               "entropy": out["entropy"].detach().cpu().float().contiguous()}
    if out.get("images_u8") is not None:
        tensors["images_u8"] = out["images_u8"].contiguous()
    num_scales = max((len(row) for row in out["tokens"]), default=0)
    for s in range(num_scales):
        column = [row[s] if s < len(row) else None for row in out["tokens"]]
        if all(t is not None for t in column):
            tensors[f"tokens.{s}"] = torch.stack([t.detach().cpu() for t in column]).contiguous()
    _atomic(folder / f"{name}.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    meta = {"format": SPOOL_FORMAT, "indices": indices, "num_scales": num_scales,
            "activation_scale": out["activation_scale"], "batch": out["batch"], "environment": environment}
    _atomic(folder / f"{name}.json", lambda tmp: tmp.write_text(_json_text(meta)))
    return folder / f"{name}.json"


def read_batch(folder: str | Path, name: str) -> dict:
    """A batch written by :func:`write_batch` as a ``predict_step``-like output (tokens per sample and scale).

    Raises :class:`SpoolError` naming the file when it is damaged or not a batch of this format."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    meta_path, data_path = folder / f"{name}.json", folder / f"{name}.safetensors"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise SpoolError(meta_path, f"{type(exc).__name__}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != SPOOL_FORMAT:
        raise SpoolError(meta_path, f"not a batch of format {SPOOL_FORMAT}")
    try:
        data = load_file(str(data_path))
    except (OSError, SafetensorError, ValueError) as exc:
        raise SpoolError(data_path, f"{type(exc).__name__}: {exc}") from None
    n = len(meta["indices"])
    for key in ("labels", "seeds", "entropy"):
        if key not in data or data[key].shape[0] != n:
            raise SpoolError(data_path, f"{key!r} missing or not {n} rows")
    images = data.get("images_u8")
    if images is not None and (images.dtype != torch.uint8 or images.dim() != 4 or images.shape[0] != n):
        raise SpoolError(data_path, f"images_u8 must be uint8 [{n}, 3, H, W]")
    columns = [data.get(f"tokens.{s}") for s in range(int(meta.get("num_scales") or 0))]
    tokens = [[None if c is None else c[j] for c in columns] for j in range(n)]
    return {"indices": meta["indices"], "labels": data["labels"].tolist(), "seeds": data["seeds"].tolist(),
            "images_u8": images, "tokens": tokens, "entropy": data["entropy"],
            "activation_scale": meta.get("activation_scale"), "batch": meta["batch"],
            "environment": meta.get("environment")}


def finished_batches(folder: str | Path) -> list[str]:
    """Names of the finished batches in ``folder`` (their JSON exists), in sample order."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name[:-len(".json")] for p in folder.glob("batch_*.json")
                  if (folder / (p.name[:-len(".json")] + ".safetensors")).is_file())


def first_index(name: str) -> int:
    return int(name.split("_", 1)[1])


def write_spool_key(folder: str | Path, key) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic(folder / KEY_FILE, lambda tmp: tmp.write_text(_json_text(key)))


def read_spool_key(folder: str | Path):
    try:
        return json.loads((Path(folder) / KEY_FILE).read_text())
    except (OSError, ValueError):
        return None


# ----- a finished spool as an arm's stored samples (issue 26): read batch file by batch file ----------------
SAMPLES_SUFFIX = ".samples"  # arms/<slug>.samples/: the finished spool an arm's index file (.pt) names


def _tensor(path: Path, key: str):
    """One tensor of a batch file (``None`` when it has no such key); only that tensor is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(key) if key in handle.keys() else None
    except (OSError, SafetensorError, ValueError) as exc:
        raise SpoolError(path, f"{type(exc).__name__}: {exc}") from None


def _tensors(path: Path, keys: list[str]) -> list:
    """Several tensors of one batch file, read in one opening (``None`` for a key it does not have)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            have = set(handle.keys())
            return [handle.get_tensor(k) if k in have else None for k in keys]
    except (OSError, SafetensorError, ValueError) as exc:
        raise SpoolError(path, f"{type(exc).__name__}: {exc}") from None


class _Layout:
    """Where each sample of a spool lives: its batch files in sample order and, per batch, the rows kept (a
    sample index seen in an earlier batch, a DDP pad, is left out, as the in-memory merge does)."""

    def __init__(self, folder: Path, names: list[str], rows: list[list[int]]):
        self.folder, self.names, self.rows = Path(folder), names, rows
        self.starts = [0]
        for r in rows:
            self.starts.append(self.starts[-1] + len(r))
        self._cached: tuple[tuple[int, str], Any] | None = None
        self.num_scales: list[int] = [0] * len(names)

    def __len__(self) -> int:
        return self.starts[-1]

    def load(self, b: int, key: str):
        """``key`` of batch ``b``, its kept rows only; the last one read is kept (metrics read a batch twice)."""
        if self._cached is not None and self._cached[0] == (b, key):
            return self._cached[1]
        path = self.folder / f"{self.names[b]}.safetensors"
        if key == "tokens":
            columns = _tensors(path, [f"tokens.{s}" for s in range(self.num_scales[b])])
            value = [None if c is None else c[self.rows[b]] for c in columns]
        else:
            value = _tensor(path, key)
            if value is None:
                raise SpoolError(path, f"{key!r} missing")
            value = value[self.rows[b]] if len(self.rows[b]) != value.shape[0] else value
        self._cached = ((b, key), value)
        return value

    def spans(self, start: int, stop: int):
        """``(batch, first row, last row)`` of the batches that hold positions ``[start, stop)``."""
        for b in range(len(self.names)):
            lo, hi = self.starts[b], self.starts[b + 1]
            if hi <= start or lo >= stop:
                continue
            yield b, max(start, lo) - lo, min(stop, hi) - lo


class SpoolImages:
    """The ``[n, 3, H, W]`` uint8 images of a spool, read one batch file at a time: ``len``, ``shape``,
    ``images[i]``, ``images[a:b]`` (a tensor of those rows only) and iteration behave as on the whole tensor,
    so the metrics (which read chunks of :func:`~var_core.eval.metrics.chunk_of` images) never hold an arm."""

    dtype = torch.uint8
    device = torch.device("cpu")
    ndim = 4

    def __init__(self, layout: _Layout, chw: tuple[int, int, int]):
        self.layout = layout
        self.shape = torch.Size([len(layout), *chw])

    def __len__(self) -> int:
        return self.shape[0]

    def dim(self) -> int:
        return 4

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, int):
            i = key + n if key < 0 else key
            if not 0 <= i < n:
                raise IndexError(f"index {key} out of range for {n} images")
            return self[i:i + 1][0]
        if not isinstance(key, slice):
            raise TypeError(f"stored images take an int or a slice, not {type(key).__name__}")
        start, stop, step = key.indices(n)
        if step != 1:
            return torch.stack([self[i] for i in range(start, stop, step)]) if start != stop else \
                torch.empty(0, *self.shape[1:], dtype=torch.uint8)
        parts = [self.layout.load(b, "images_u8")[lo:hi] for b, lo, hi in self.layout.spans(start, stop)]
        if not parts:
            return torch.empty(0, *self.shape[1:], dtype=torch.uint8)
        return parts[0].clone() if len(parts) == 1 else torch.cat(parts)

    def __iter__(self):
        for images in self.batches():
            yield from images

    def __getattr__(self, name: str):
        """Any other tensor method (``.float()``, ``.permute``, ``.numpy()``...) on all images at once: a fallback
        for readers written for the one-file format, which holds the whole arm in memory (varscope's own code only
        slices)."""
        if name.startswith("_") or name in ("layout", "shape"):
            raise AttributeError(name)
        return getattr(self[:], name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """``torch.equal(images, other)`` and other torch functions: on all images at once (as ``__getattr__``)."""
        whole = lambda v: v[:] if isinstance(v, SpoolImages) else v  # noqa: E731
        return func(*[whole(a) for a in args], **{k: whole(v) for k, v in (kwargs or {}).items()})

    def batches(self):
        """The images batch file by batch file (each ``[b, 3, H, W]``)."""
        for b in range(len(self.layout.names)):
            yield self.layout.load(b, "images_u8")


class SpoolTokens:
    """Per sample, the list of its per-scale token tensors (``None``: not kept), read one batch file at a time."""

    def __init__(self, layout: _Layout):
        self.layout = layout

    def __len__(self) -> int:
        return len(self.layout)

    def __iter__(self):
        for b in range(len(self.layout.names)):
            columns = self.layout.load(b, "tokens")
            for j in range(len(self.layout.rows[b])):
                yield [None if c is None else c[j] for c in columns]

    def __getitem__(self, i: int):
        n = len(self)
        i = i + n if i < 0 else i
        for b, lo, _ in self.layout.spans(i, i + 1):
            return [None if c is None else c[lo] for c in self.layout.load(b, "tokens")]
        raise IndexError(f"sample {i} out of range for {n}")


def read_spool(folder: str | Path) -> dict:
    """What a finished spool holds besides its images and tokens — sample indices, labels, seeds, entropy,
    activation scales and per-batch measurements, each read without its images — plus lazy ``images_u8``
    (:class:`SpoolImages`) and ``tokens`` (:class:`SpoolTokens`) views. Memory O(samples) only for these
    per-sample numbers (a few hundred bytes each), never for images or tokens."""
    folder = Path(folder)
    names = finished_batches(folder)
    seen: set[int] = set()
    kept_names, rows, num_scales = [], [], []
    indices, labels, seeds, entropies, activation, batches, environments = [], [], [], [], [], [], []
    chw = None
    for name in names:
        meta_path, data_path = folder / f"{name}.json", folder / f"{name}.safetensors"
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as exc:
            raise SpoolError(meta_path, f"{type(exc).__name__}: {exc}") from None
        if not isinstance(meta, dict) or meta.get("format") != SPOOL_FORMAT or not meta.get("indices"):
            raise SpoolError(meta_path, f"not a batch of format {SPOOL_FORMAT}")
        batch_indices = [int(i) for i in meta["indices"]]
        keep = [j for j, i in enumerate(batch_indices) if i not in seen]
        seen.update(batch_indices)
        batches.append(meta["batch"])
        environments.append(meta.get("environment"))
        if not keep:
            continue
        columns = {}
        for key in ("labels", "seeds", "entropy"):
            value = _tensor(data_path, key)
            if value is None or value.shape[0] != len(batch_indices):
                raise SpoolError(data_path, f"{key!r} missing or not {len(batch_indices)} rows")
            columns[key] = value[keep]
        kept_names.append(name)
        rows.append(keep)
        num_scales.append(int(meta.get("num_scales") or 0))
        indices += [batch_indices[j] for j in keep]
        labels.append(columns["labels"])
        seeds += [int(s) for s in columns["seeds"].tolist()]
        entropies.append(columns["entropy"])
        acts = meta.get("activation_scale")
        activation += [acts[j] if acts is not None else None for j in keep]
        if chw is None:
            from safetensors import safe_open

            with safe_open(str(data_path), framework="pt") as handle:
                if "images_u8" in handle.keys():
                    chw = tuple(handle.get_slice("images_u8").get_shape()[1:])
    if indices != sorted(indices):
        raise SpoolError(folder, "its batches do not hold consecutive runs of sample indices")
    layout = _Layout(folder, kept_names, rows)
    layout.num_scales = num_scales
    width = max((e.shape[1] for e in entropies), default=0)
    entropy = torch.full((len(indices), width), float("nan"))
    row = 0
    for e in entropies:
        entropy[row:row + e.shape[0], :e.shape[1]] = e
        row += e.shape[0]
    batches.sort(key=lambda b: (b["indices"][0] if b.get("indices") else -1))
    return {"indices": indices, "labels": torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long),
            "seeds": seeds, "entropy": entropy.double().numpy(), "activation_scale": activation,
            "batches": batches, "environments": environments,
            "images_u8": SpoolImages(layout, chw) if chw is not None else None, "tokens": SpoolTokens(layout)}


def samples_folder(index_file: str | Path) -> Path:
    """``arms/<slug>.samples/`` beside an arm's index file ``arms/<slug>.pt``."""
    index_file = Path(index_file)
    stem = index_file.name[:-len(".pt")] if index_file.name.endswith(".pt") else index_file.name
    return index_file.with_name(stem + SAMPLES_SUFFIX)
