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

import torch

from ..errors import UserError

__all__ = ["SPOOL_FORMAT", "SpoolError", "write_batch", "read_batch", "finished_batches", "batch_name",
           "write_spool_key", "read_spool_key"]

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
