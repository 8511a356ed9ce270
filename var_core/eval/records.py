"""Self-describing result records: one JSON file per arm, written atomically as soon as the arm finishes.

A record holds everything needed to trust and reproduce a number (DESIGN.md, "Every result is self-describing"):
the resolved policy config and its hash, the model and weights, the sampling config, the sample set (labels,
seeds and their hash), git SHA, package versions, device, dtype, attention backend, thread count, batch size,
warm-up count, what is inside the timed region, per-batch timings, per-sample metrics and their summaries.

Resume: a run folder is re-usable. :func:`find_reusable` returns the finished record of an arm whose *key* —
policy config hash, model, weights, dtype, sampling, sample-set hash — equals the one asked for, so re-running
with the same ``--out`` computes only the missing arms. Records are written with ``tmp + os.replace``; an
interrupted arm leaves no record (its temporary file is removed on the way out), and the arms
finished before it stay intact.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import re
import subprocess
import sys
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..engine import SamplingConfig
from ..errors import UserError, writing
from .environment import attention_backend, device_name, model_dtype, sdpa_backend  # noqa: F401 - re-exported
from .lightning import TIMED_REGION, ConditionSet

__all__ = [
    "SCHEMA", "REQUIRED_KEYS", "RunConfig", "arm_slug", "environment_info", "git_info", "package_versions",
    "write_json_atomic", "read_record", "load_record", "RecordError", "find_reusable", "validate_record",
    "to_jsonable", "record_paths", "UnsafeResultsPath", "check_no_links", "make_dirs", "write_atomic",
    "refuse_links_in", "run_key_tag", "weights_fingerprint",
]

SCHEMA = "varscope.arm/1"
REQUIRED_KEYS = {
    "schema": str, "status": str, "arm": str, "family": str, "role": str, "description": str,
    "key": dict, "config_hash": str, "policy": dict, "model": dict, "sampling": dict, "samples": dict,
    "environment": dict, "timing": dict, "metrics": dict, "summary": dict, "created": str,
}
KEY_FIELDS = ("config_hash", "model", "weights", "dtype", "sampling", "samples")


def to_jsonable(value: Any) -> Any:
    """JSON-safe copy: tensors / numpy to lists, non-finite floats to ``None``, tuples to lists."""
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return to_jsonable(value.detach().cpu().tolist())
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return to_jsonable(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Path):
        return str(value)
    return str(value)


class UnsafeResultsPath(UserError):
    """A path inside a results folder that is (or passes through) a symbolic link: writing there could land
    outside the folder (a planted ``grids/overview.png -> ~/.bashrc``), so nothing is written through it."""


def check_no_links(path: str | Path, root: str | Path | None = None) -> Path:
    """``path`` when neither it nor any folder between ``root`` (exclusive: the results folder the user named may
    itself be a link) and it is a symbolic link; else :class:`UnsafeResultsPath` naming the link. ``root`` None:
    only ``path`` and its parent folder are checked. A ``path`` outside ``root`` is checked as if root were None."""
    path = Path(path)
    parts: list[Path] = []
    rel = None
    if root is not None:
        try:
            rel = path.relative_to(Path(root))
        except ValueError:
            rel = None
    if rel is not None:
        current = Path(root)
        for part in rel.parts:
            current = current / part
            parts.append(current)
    else:
        parts = [path.parent, path]
    for candidate in parts:
        if candidate.is_symlink():
            raise UnsafeResultsPath(
                f"{candidate} is a symbolic link (to {os.readlink(candidate)}): varscope never writes through a "
                f"link inside a results folder (it could overwrite a file elsewhere); remove the link "
                f"(rm {candidate}) and re-run")
    return path


def make_dirs(folder: str | Path, root: str | Path | None = None) -> Path:
    """``mkdir -p folder`` that refuses (:class:`UnsafeResultsPath`) a symbolic link on the way below ``root``."""
    folder = Path(folder)
    check_no_links(folder, root)
    folder.mkdir(parents=True, exist_ok=True)
    return check_no_links(folder, root)  # a link planted while the folders were made


def write_atomic(path: str | Path, write: Callable[[Path], None], *, root: str | Path | None = None) -> Path:
    """The one way files are written into a results folder: ``write(tmp)`` fills a fresh temporary file (created
    exclusively, so a planted link at its name is never followed) beside ``path``, which then replaces ``path``
    with ``os.replace`` (never half-written; an interruption leaves the previous file, or none, and no temporary).
    Refuses (:class:`UnsafeResultsPath`) when ``path`` or a folder between ``root`` and it is a symbolic link."""
    path = Path(path)
    check_no_links(path, root)
    with writing(path):  # a read-only or full file system: an OSError naming path (the writers lose the name)
        make_dirs(path.parent, root)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        # O_EXCL: fails on any existing entry, a (dangling) link included; mode 0o666 & ~umask like an ordinary file
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0), 0o666))
        try:
            write(tmp)
            check_no_links(path, root)
            os.replace(tmp, path)  # replaces a directory entry: a link created meanwhile is replaced, not followed
        except BaseException:  # Ctrl-C or a full disk mid-write: the previous file (or none) stays, no temporary
            tmp.unlink(missing_ok=True)
            raise
    return path


def write_json_atomic(path: str | Path, data: Any, *, root: str | Path | None = None) -> Path:
    """Write JSON to ``path`` with :func:`write_atomic` (temporary file, fsync, ``os.replace``; no links)."""
    def write(tmp: Path) -> None:
        with open(tmp, "w") as handle:
            json.dump(to_jsonable(data), handle, indent=1, allow_nan=False)
            handle.flush()
            os.fsync(handle.fileno())

    return write_atomic(path, write, root=root)


RESULTS_OWN_LINKS = ("wandb",)  # subfolders whose inside is another program's (W&B keeps a latest-run link)


def refuse_links_in(folder: str | Path) -> None:
    """Refuse (:class:`UnsafeResultsPath`, naming the first one) a results folder holding a symbolic link anywhere
    inside it (``folder`` itself may be one): the plots, grids, tables and image exports written into it must never
    land elsewhere. The inside of ``wandb/`` (W&B's own ``latest-run`` link) is not looked at."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs + files):
            path = Path(top) / name
            if path.is_symlink():
                check_no_links(path, folder)
        if Path(top) == folder:
            dirs[:] = [d for d in dirs if d not in RESULTS_OWN_LINKS]


_SAFE = r"[^A-Za-z0-9._=+-]+"


def _legacy_slug(name: str) -> str:
    return re.sub(_SAFE, "_", name).strip("_") or "arm"


def arm_slug(name: str) -> str:
    """A file-name-safe version of an arm name, distinct for distinct names: a name with characters outside
    ``[A-Za-z0-9._=+-]`` gets those replaced by ``_`` and a short hash of the whole name appended (``no-linkage†``
    and ``no-linkage‡`` were both ``no-linkage`` before, so one arm's record replaced the other's)."""
    legacy = _legacy_slug(name)
    if legacy == name:
        return name
    return f"{legacy}-{hashlib.sha256(name.encode('utf-8')).hexdigest()[:8]}"


def record_paths(out_dir: str | Path, arm: str) -> tuple[Path, Path]:
    """``(json record, tensor file)`` of an arm inside a run folder. A folder written before slugs were made
    distinct keeps its records under the old slug; they are found there when the record there names this arm."""
    folder, slug = Path(out_dir) / "arms", arm_slug(arm)
    paths = folder / f"{slug}.json", folder / f"{slug}.pt"  # not with_suffix: slugs may contain dots
    legacy = _legacy_slug(arm)
    if legacy != slug and not paths[0].exists() and (folder / f"{legacy}.json").is_file():
        try:
            named = json.loads((folder / f"{legacy}.json").read_text()).get("arm")
        except (OSError, ValueError, AttributeError):
            named = None
        if named == arm:
            return folder / f"{legacy}.json", folder / f"{legacy}.pt"
    return paths


# ----- provenance ------------------------------------------------------------------------------------------
def git_info(root: str | Path | None = None) -> dict:
    """Commit SHA and whether the work tree has uncommitted changes (read-only git calls)."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    info = {"sha": None, "dirty": None}
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if sha.returncode == 0:
            info["sha"] = sha.stdout.strip()
            status = subprocess.run(["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain",
                                     "--untracked-files=no"], capture_output=True, text=True, timeout=20)
            if status.returncode == 0:
                info["dirty"] = bool(status.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def package_versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in ("torch", "lightning", "torchmetrics", "numpy", "scipy", "pandas", "wandb", "seaborn", "matplotlib"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


PROCESS_FIELDS = ("device", "device_name", "dtype", "attention_backend", "threads", "interop_threads", "precision",
                  "matmul_precision", "autocast_dtype")


def environment_info(adapter: Any, *, accelerator: str, devices: Any, strategy: str, processes: list[dict] | None
                     = None, num_nodes: int = 1, launch: dict | None = None) -> dict:
    """Provenance of one measurement. ``processes``: what each generating process reported it ran on
    (``var_core.eval.lightning.process_environment``); the top-level device, device name, dtype, attention backend
    and threads are then those of global rank 0 — what ran, not where the caller's copy of the model sits now
    (after Lightning's ``predict`` that used to be the CPU). Without ``processes``: this process and ``adapter``."""
    device = getattr(adapter, "device", torch.device("cpu"))
    here = {"device": str(device), "device_name": device_name(device), "dtype": model_dtype(adapter),
            "attention_backend": attention_backend(adapter), "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads()}
    from ..engine.precision import declared_precision

    # --precision as the last generate() ran it (var_core.engine.precision), else as the adapter declares it
    ran = getattr(adapter, "precision_ran", None) or declared_precision(getattr(adapter, "precision", None))
    here.update({k: ran.get(k) for k in ("precision", "matmul_precision", "autocast_dtype")})
    processes = list(processes or [])
    first = min(processes, key=lambda p: p.get("rank", 0)) if processes else {}
    ran = {k: first[k] if first.get(k) is not None else here[k] for k in PROCESS_FIELDS}
    out = {"git": git_info(), "packages": package_versions(), **ran, "accelerator": accelerator,
           "devices": devices, "num_nodes": num_nodes, "strategy": strategy, "processes": processes,
           "hostname": first.get("hostname") or platform.node()}
    if processes:
        out["devices_used"] = sorted({f"{p.get('hostname', '?')}:{p.get('device')}" for p in processes})
    if launch is not None:
        out["launch"] = launch
    return out


# ----- run config ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    """One arm of a study: what to generate (policy, model, sampling, samples) and how to measure it."""

    arm: str
    family: str
    policy: Any  # var_core.accel.PolicyConfig
    model: str
    weights: str | None
    sampling: SamplingConfig
    conditions: ConditionSet
    batch_size: int = 16
    warmup: int = 1
    role: str = "arm"  # "baseline" (the reference every other arm is compared with) or "arm"
    description: str = ""
    plain_loop: bool = False  # run the bare engine loop (no policy object): the baseline's timing reference
    dtype: str = "float32"
    accelerator: str = "cpu"
    devices: Any = 1
    strategy: str = "auto"
    num_nodes: int = 1
    vae_weights: str | None = None  # --vae-weights (official checkpoints): part of the key when given
    text_encoder: str | None = None  # --text-encoder (text-to-image models): part of the key when given
    precision: str | None = None  # --precision (var_core.engine.precision): part of the key unless fp32
    size: dict | None = None  # --resolution / --aspect ({"resolution": "1M", "aspect": 0.5}): in the key when given

    @property
    def config_hash(self) -> str:
        return self.policy.config_hash()

    def sampling_dict(self) -> dict:
        s = self.sampling
        out = {"cfg": s.cfg, "top_k": s.top_k, "top_p": s.top_p, "temperature": s.temperature}
        # a family's own sampling settings (HART: diffusion steps, more_smooth, ...) are recorded with the others
        out.update({f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in out})
        return out

    def key(self) -> dict:
        """What must match for a stored record to be reused (timing settings deliberately excluded)."""
        key = {
            "config_hash": self.config_hash + ("+plain" if self.plain_loop else ""),
            "model": self.model, "weights": str(Path(self.weights).resolve()) if self.weights else None,
            "dtype": self.dtype, "sampling": self.sampling_dict(), "samples": self.conditions.content_hash(),
        }
        # where and in which precision it ran change the outputs: a GPU run never reuses a CPU record, nor the
        # reverse (only when not the CPU / fp32, so the keys of earlier CPU fp32 records stay as they were)
        if str(self.accelerator) in ("gpu", "cuda"):
            key["device"] = "cuda"
        if self.precision not in (None, "fp32"):
            key["precision"] = self.precision
        if self.size:  # another resolution / aspect is another scale schedule (only when given: old keys unchanged)
            key["size"] = dict(self.size)
        for name in ("vae_weights", "text_encoder"):  # only when given: the keys of other records stay as they were
            value = getattr(self, name)
            if value:
                key[name] = str(Path(value).expanduser().resolve())
        given = {name: getattr(self, name) for name in ("weights", "vae_weights", "text_encoder")
                 if getattr(self, name)}
        if given:  # other checkpoints at the same paths are other weights: their records are not reused
            key["weights_fingerprint"] = {name: weights_fingerprint(value) for name, value in given.items()}
        from ..plugins import loaded_plugins

        plugins = loaded_plugins()
        if plugins:  # outside code (var_core.plugins): an edited plugin file is another run (only when loaded)
            key["plugins"] = sorted(f"{p['name']}={p['version'] or ''}:{p['sha256']}" for p in plugins)
        return key


FINGERPRINT_BYTES = 1 << 20
_FILE_DIGESTS: dict[tuple, str] = {}


def weights_fingerprint(path: str | Path) -> str | None:
    """A cheap content fingerprint of a checkpoint file or folder (every regular file below it): sha256 over each
    file's relative name, size, first and last MiB. Another checkpoint written to the same path changes it, reading
    a multi-GB checkpoint whole does not happen; None when the path does not exist. Per-file digests are cached by
    (path, size, mtime) within a process."""
    import hashlib

    root = Path(path).expanduser()
    if not root.exists():
        return None
    files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
    digest = hashlib.sha256()
    for f in files:
        stat = f.stat()
        cache_key = (str(f.resolve()), stat.st_size, stat.st_mtime_ns)
        if cache_key not in _FILE_DIGESTS:
            part = hashlib.sha256(str(stat.st_size).encode())
            with open(f, "rb") as handle:
                part.update(handle.read(FINGERPRINT_BYTES))
                if stat.st_size > FINGERPRINT_BYTES:
                    handle.seek(max(FINGERPRINT_BYTES, stat.st_size - FINGERPRINT_BYTES))
                    part.update(handle.read(FINGERPRINT_BYTES))
            _FILE_DIGESTS[cache_key] = part.hexdigest()
        digest.update(f"{'' if f == root else f.relative_to(root)}\0{_FILE_DIGESTS[cache_key]}\0".encode())
    return digest.hexdigest()[:16]


def new_record(config: RunConfig) -> dict:
    """The skeleton of a record (filled by the runner, then written with :func:`write_json_atomic`)."""
    return {
        "schema": SCHEMA, "status": "running", "arm": config.arm, "family": config.family, "role": config.role,
        "description": config.description, "key": config.key(), "config_hash": config.config_hash,
        "policy": config.policy.to_dict(), "plain_loop": config.plain_loop,
        "model": {"name": config.model, "weights": config.weights, "dtype": config.dtype},
        "sampling": config.sampling_dict(), "samples": config.conditions.to_dict(),
        "environment": {}, "timing": {"batch_size": config.batch_size, "warmup_generations": config.warmup,
                                      "timed_region": TIMED_REGION},
        "metrics": {}, "summary": {}, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "plugins": _plugins(),  # each plugin module loaded (var_core.plugins): name, source, version, sha256
    }


def _plugins() -> list[dict]:
    from ..plugins import loaded_plugins

    return loaded_plugins()


def run_key_tag(record: dict) -> str:
    """A readable folder name for the configuration a record was made with (what all arms of one study share:
    its key less the policy's config hash), e.g. ``n4_seed1_3fa9c2d1``: samples, base seed, then a hash of the
    model, weights, dtype, sampling and sample set. Records of one earlier study share one tag."""
    import hashlib

    key = {k: v for k, v in (record.get("key") or {}).items() if k != "config_hash"}
    digest = hashlib.sha1(json.dumps(to_jsonable(key), sort_keys=True).encode()).hexdigest()[:8]
    samples = record.get("samples") or {}
    return arm_slug(f"n{samples.get('n', '?')}_seed{samples.get('base_seed', '?')}_{digest}")


# ----- reading / resuming ----------------------------------------------------------------------------------
def validate_record(record: dict) -> None:
    """Raise ``ValueError`` naming every missing or mistyped top-level field."""
    problems = []
    for key, kind in REQUIRED_KEYS.items():
        if key not in record:
            problems.append(f"missing {key!r}")
        elif not isinstance(record[key], kind):
            problems.append(f"{key!r} is {type(record[key]).__name__}, expected {kind.__name__}")
    if record.get("schema") not in (None, SCHEMA) and "schema" in record:
        problems.append(f"schema {record['schema']!r} is not {SCHEMA!r}")
    if isinstance(record.get("key"), dict):
        missing = [k for k in KEY_FIELDS if k not in record["key"]]
        if missing:
            problems.append(f"key lacks {missing}")
    if problems:
        raise ValueError("invalid record: " + "; ".join(problems))


class RecordError(ValueError):
    """A record file that exists but cannot be used: not JSON, or not a valid record (``path`` and ``reason``)."""

    def __init__(self, path: str | Path, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"cannot read {self.path}: {reason}")


def load_record(path: str | Path) -> dict | None:
    """The record in ``path`` (finished or not), ``None`` when there is no such file; :class:`RecordError` when the
    file is there but is not JSON (truncated, damaged) or not a valid record. JSON holds no code."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(path, f"{type(exc).__name__}: {exc}") from None
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise RecordError(path, f"not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise RecordError(path, f"not a record (top level is {type(record).__name__})")
    try:
        validate_record(record)
    except ValueError as exc:
        raise RecordError(path, str(exc)) from None
    return record


def read_record(path: str | Path) -> dict | None:
    """A finished, valid record, or ``None`` (missing, unreadable, invalid or unfinished)."""
    try:
        record = load_record(path)
    except RecordError:
        return None
    return record if record is not None and record.get("status") == "complete" else None


def find_reusable(out_dir: str | Path, config: RunConfig, *, need_tensors: bool = False) -> dict | None:
    """The finished record of ``config`` in ``out_dir`` (same key), or ``None``.

    Looks at the arm's own file first, then at every record of the folder (an arm may have been renamed).
    ``need_tensors``: also require the arm's tensor file (the baseline's images are needed by later arms).
    """
    key = to_jsonable(config.key())
    own_json, own_pt = record_paths(out_dir, config.arm)
    candidates = [own_json] + sorted(p for p in (Path(out_dir) / "arms").glob("*.json") if p != own_json)
    for path in candidates:
        record = read_record(path)
        if record is None or record.get("key") != key:
            continue
        if need_tensors and not path.with_name(path.name[: -len(".json")] + ".pt").is_file():
            continue
        return record
    return None
