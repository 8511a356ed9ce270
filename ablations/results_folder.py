"""The results folder: its format and its guarantees, in one place (issue 26).

* one study at a time: :func:`results_lock` (``study.lock``, taken over from a dead holder);
* nothing unreadable is used or lost: a damaged record or tensor file is moved aside as ``<name>.corrupt`` with one
  line naming it (:func:`_quarantine`, :func:`_check_record_file`, :func:`_load_verified`); tensor files are read
  with ``torch.load(weights_only=True)`` and batch files with safetensors, so nothing in them runs;
* reuse: a finished arm is reused only when its record key matches and it was measured against the current
  baseline (:func:`baseline_identity`, :func:`_stale_against_baseline`);
* nothing finished is deleted: records of another configuration go to ``superseded/<tag>/``
  (:func:`_set_aside`) and come back when that configuration is run again (:func:`_restore_kept`);
* writes are atomic and refuse symlinks (:func:`var_core.eval.records.write_atomic`);
* the per-arm sample spool, below.

The per-arm sample spool: where an arm's batches go while it is generated.

``arms/<slug>.partial/`` (:mod:`var_core.eval.store`) receives each finished batch as it finishes, so a study
holds one batch at a time while generating, and a study killed in the middle of an arm resumes at the arm's next
unfinished batch: the finished ones are read back, not generated again, and the records equal an uninterrupted
run's. The spool's ``key.json`` is the arm's record key; a spool of another configuration (other samples,
sampling, batch size, policy ...) is never resumed: it is removed and the arm starts from its first batch. Once
the arm's record and tensor file are written, its spool is removed.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Callable

from var_core.errors import UserError
from var_core.eval import records as rec
from var_core.eval.lightning import GenerationRun, ResultFileError
from var_core.eval.store import (SpoolError, finished_batches, first_index, read_spool_key, samples_folder,
                                 write_spool_key)

__all__ = ["spool_path", "open_spool", "close_spool"]


def spool_path(out_dir: str | Path, arm: str) -> Path:
    return Path(out_dir) / "arms" / f"{rec.arm_slug(arm)}.partial"


def open_spool(out_dir: str | Path, arm: str, key, batches_total: int, log: Callable[[str], None]
               ) -> tuple[Path, list[int]]:
    """The arm's spool folder, ready for generation, and the first indices of its finished batches (resumed)."""
    folder = spool_path(out_dir, arm)
    rec.check_no_links(folder, out_dir)
    key = rec.to_jsonable(key)
    finished = samples_folder(rec.record_paths(out_dir, arm)[1])
    if not folder.exists() and finished.is_dir() and not finished.is_symlink() \
            and read_spool_key(finished) == key:
        # killed after the samples folder was named and before the record was written: its batches are finished
        os.replace(finished, folder)
    if folder.is_dir():
        stored = read_spool_key(folder)
        done = finished_batches(folder)
        if stored == key and done:
            log(f"    resuming inside the arm: {len(done)} of {batches_total} batches were finished by an earlier "
                f"run (read back from {folder.name}/, not generated again)")
            return folder, [first_index(n) for n in done]
        if stored != key and done:
            log(f"note: {folder.name}/ holds {len(done)} unfinished batches of another configuration: removed, "
                f"the arm starts from its first batch")
        shutil.rmtree(folder)
    rec.make_dirs(folder, out_dir)
    write_spool_key(folder, key)
    return folder, []


def close_spool(out_dir: str | Path, arm: str) -> None:
    """Remove the arm's spool once its record and tensor file are written."""
    folder = spool_path(out_dir, arm)
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)


# ----- the results folder: lock, unreadable files, baseline identity ---------------------------------------
LOCK_NAME = "study.lock"


class ResultsFolderBusy(UserError):
    """Another study holds the results folder's lock."""


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of process ``pid`` (clock ticks since boot; tells a reused pid apart), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]  # field 22 of stat; fields 1-2 end at the last ')'
    except (OSError, IndexError):
        return None


def _lock_info() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "proc_start": _proc_start(os.getpid()),
            "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv) if sys.argv else None}


def _lock_holder_alive(info: dict) -> bool | None:
    """True / False for a holder on this host; None when it runs on another host (cannot be checked)."""
    if info.get("host") != socket.gethostname():
        return None
    pid = int(info["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    started = info.get("proc_start")
    now = _proc_start(pid)
    return not (started is not None and now is not None and now != started)  # a reused pid is another process


def _is_ddp_child() -> bool:
    """A non-zero rank of a distributed launch (Lightning's ``ddp`` launcher, torchrun, SLURM ``srun``): global
    rank 0 holds the lock for the whole study. (``run_study`` sends the other ranks of its own launch past the lock
    altogether; this guards other callers.)"""
    if any(os.environ.get(var, "0") not in ("", "0") for var in ("LOCAL_RANK", "RANK", "NODE_RANK")):
        return True
    from var_core.eval.distributed import launched_env

    launched = launched_env()
    return launched is not None and launched.rank != 0


def _read_lock(path: Path) -> dict | None:
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ResultsFolderBusy(f"the lock file {path} cannot be read ({type(exc).__name__}: {exc}); if no study "
                                f"is running on {path.parent}, delete it and re-run") from None
    if not isinstance(info, dict) or not isinstance(info.get("pid"), int):
        raise ResultsFolderBusy(f"the lock file {path} does not name a process; if no study is running on "
                                f"{path.parent}, delete it and re-run")
    return info


def _describe(info: dict) -> str:
    return (f"pid {info.get('pid')} on host {info.get('host')} (started {info.get('started')}"
            + (f", command: {info['command']}" if info.get("command") else "") + ")")


@contextlib.contextmanager
def results_lock(out_dir: str | Path, log: Callable[[str], None] = print):
    """Hold ``<out_dir>/study.lock`` while the block runs, so two studies never work in one folder at once.

    The lock file (JSON: pid, host, process start time, start date, command) is created atomically (written
    aside, then hard-linked into place). Held by a live process → :class:`ResultsFolderBusy` naming it; left by a
    process of this host that is gone → taken over with a note through ``log``. Non-zero ranks of a distributed
    launch, children of the holder and nested calls in the holding process do not take it (the launching process
    holds it for them). Yields the lock path (None when it was not taken here)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_NAME
    if _is_ddp_child():
        yield None
        return
    me = _lock_info()
    taken = False
    for _ in range(5):
        tmp = out_dir / f".{LOCK_NAME}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(me))
        try:
            os.link(tmp, path)  # atomic: fails when a lock exists, and the lock is never seen half-written
            taken = True
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        if taken:
            break
        other = _read_lock(path)
        if other is None:
            continue  # released meanwhile: try again
        same_host = other.get("host") == me["host"]
        if same_host and other["pid"] == os.getpid() and other.get("proc_start") == me["proc_start"]:
            yield None  # nested: this process holds it already
            return
        parent = os.getppid()
        if same_host and other["pid"] == parent and other.get("proc_start") in (None, _proc_start(parent)):
            # a child process of the study holding it (e.g. a DDP worker); the start time rules out a reused pid
            # (an orphaned process's parent is pid 1, which a stale lock may name too)
            yield None
            return
        alive = _lock_holder_alive(other)
        if alive is None:
            raise ResultsFolderBusy(
                f"{out_dir} is in use by another study: {_describe(other)}. Wait for it to finish or use another "
                f"--out; if that process is gone, delete {path} and re-run")
        if alive:
            raise ResultsFolderBusy(
                f"{out_dir} is in use by another study: {_describe(other)}. Wait for it to finish (or stop it: "
                f"kill {other['pid']}) or use another --out; re-running the same command afterwards resumes")
        stale = out_dir / f".{LOCK_NAME}.stale.{os.getpid()}"
        try:
            os.replace(path, stale)
        except FileNotFoundError:
            continue
        try:
            moved = _read_lock(stale)
            if moved is not None and moved != other:
                # another process took the stale lock over in between and its fresh lock was moved here: put it
                # back (unless yet another exists) and look again
                with contextlib.suppress(FileExistsError):
                    os.link(stale, path)
                continue
        finally:
            stale.unlink(missing_ok=True)
        log(f"note: took over the lock of {out_dir}: it was left by {_describe(other)}, which is no longer "
            f"running")
    if not taken:
        raise ResultsFolderBusy(f"could not take the lock {path} (other processes keep creating it); make sure only "
                                f"one study uses {out_dir} and re-run")
    try:
        yield path
    finally:
        with contextlib.suppress(OSError, ResultsFolderBusy):
            info = _read_lock(path)
            if info is not None and info.get("pid") == me["pid"] and info.get("started") == me["started"]:
                path.unlink()


def _quarantine(path: Path, reason: str, what: str, log: Callable[[str], None]) -> Path:
    """Move an unreadable file aside (``<name>.corrupt``, numbered if taken) and say so in one line."""
    target = path.with_name(path.name + ".corrupt")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt{n}")
        n += 1
    os.replace(path, target)
    samples = samples_folder(path) if path.name.endswith(".pt") else None
    if samples is not None and samples.is_dir() and not samples.is_symlink():  # an index's samples go with it
        os.replace(samples, target.with_name(target.name.replace(".pt.corrupt", ".samples.corrupt", 1)))
    log(f"warning: cannot read {path}: {reason}; moved it to {target.name} and {what}")
    return target


def baseline_identity(base_record: dict, base_run: GenerationRun) -> str:
    """Identifies one measurement of the baseline: its record's key, creation time and batch timings, and the
    hash of its samples. Every arm's record keeps the identity of the baseline it was compared with; a recomputed
    baseline has a new identity (new timings), so arms measured against the old one are recomputed on resume."""
    payload = {"key": base_record.get("key"), "created": base_record.get("created"),
               "batches": (base_record.get("timing") or {}).get("batches"), "samples": base_run.content_hash()}
    text = json.dumps(rec.to_jsonable(payload), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stale_against_baseline(found: dict, base_record: dict, identity: str) -> str | None:
    """Why ``found`` (an arm's record) was not measured against this baseline, or None when it was."""
    stored = (found.get("baseline") or {}).get("identity")
    if stored is not None:
        return None if stored == identity else f"it was measured against another baseline ({stored}, now {identity})"
    # records written before the identity was kept: measured against this baseline only if created after it
    if str(found.get("created", "")) >= str(base_record.get("created", "")):
        return None
    return "it is older than the baseline it would be compared with (the baseline was recomputed since)"


def _load_verified(out_dir: Path, found: dict, log: Callable[[str], None]) -> tuple[dict | None, GenerationRun | None]:
    """``found`` and its tensors (None when the arm has no tensor file); ``(None, None)`` when the tensor file
    cannot be read or does not match the record: it is moved aside and the arm is to be recomputed."""
    pt = rec.record_paths(out_dir, found["arm"])[1]
    if not pt.is_file():
        return found, None
    try:
        run = GenerationRun.load(pt)
        stored = (found.get("tensors") or {}).get("sha256")
        actual = run.content_hash() if stored is not None else None  # reads a samples folder batch by batch
    except ResultFileError as exc:
        _quarantine(pt, exc.reason, f"recompute arm {found['arm']!r}", log)
        return None, None
    except SpoolError as exc:  # a batch file of the samples folder is damaged
        _quarantine(pt, f"its samples folder cannot be read ({exc.path.name}: {exc.reason})",
                    f"recompute arm {found['arm']!r}", log)
        return None, None
    if stored is not None and actual != stored:
        _quarantine(pt, f"its samples (hash {actual}) are not those of its record (hash {stored})",
                    f"recompute arm {found['arm']!r}", log)
        return None, None
    return found, run


def _check_record_file(json_path: Path, log: Callable[[str], None]) -> None:
    """Move an arm's record aside when it exists but cannot be read (damaged / not a record)."""
    try:
        rec.load_record(json_path)
    except rec.RecordError as exc:
        _quarantine(json_path, exc.reason, f"recompute arm {json_path.name[:-len('.json')]!r}", log)


# ----- finished work of another configuration is kept ------------------------------------------------------
SUPERSEDED_DIR = "superseded"
KEPT_BESIDE = ("study.json", "table.md", "table.csv", "timing_interleaved.json")  # copied once per kept set


def _key_changes(old: dict, new: dict) -> str:
    """What differs between two record keys, in words (``samples 2 -> 3``, ``cfg 1.5 -> 3.0``, ``dtype ...``)."""
    parts = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if name == "sampling" and isinstance(a, dict) and isinstance(b, dict):
            parts += [f"{k} {a.get(k)} -> {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif name == "samples":
            parts.append(f"sample set {a} -> {b}")
        elif name == "config_hash":
            parts.append(f"policy config {a} -> {b}")
        else:
            parts.append(f"{name} {a} -> {b}")
    return ", ".join(parts) or "same configuration"


def _set_aside(out_dir: Path, items: list[tuple[str, dict]], why: str, log: Callable[[str], None],
               image_root: Path | None = None) -> list[Path]:
    """Move the finished files of arms about to be recomputed — record, tensors, grid and (inside the results
    folder) exported images — to ``<out>/superseded/<configuration tag>/`` (same layout; the tag is
    :func:`~var_core.eval.records.run_key_tag` of the record, numbered ``_2``, ``_3`` ... when that set already holds
    the arm) and copy the folder's study.json / table / interleaved timing beside them once. Nothing is deleted;
    one line says what moved where and why. Returns the folders used."""
    used: dict[Path, list[str]] = {}
    root = Path(out_dir)
    for name, old in items:
        slug = rec.arm_slug(name)
        json_path, pt_path = rec.record_paths(root, name)
        tag = rec.run_key_tag(old)
        target, n = root / SUPERSEDED_DIR / tag, 2
        while (target / "arms" / json_path.name).exists() or (target / "arms" / pt_path.name).exists():
            target, n = root / SUPERSEDED_DIR / f"{tag}_{n}", n + 1
        moves = [(json_path, target / "arms" / json_path.name), (pt_path, target / "arms" / pt_path.name),
                 (samples_folder(pt_path), target / "arms" / samples_folder(pt_path).name),
                 (root / "grids" / f"{slug}.png", target / "grids" / f"{slug}.png")]
        if image_root is not None and Path(image_root).resolve() == root.resolve():
            moves.append((root / "images" / slug, target / "images" / slug))
        if target not in used:
            for kept in KEPT_BESIDE:
                if (root / kept).is_file() and not (root / kept).is_symlink() and not (target / kept).exists():
                    rec.make_dirs(target, root)
                    shutil.copy2(root / kept, target / kept)
        for src, dst in moves:
            if src.exists() and not src.is_symlink():
                rec.make_dirs(dst.parent, root)
                os.replace(src, dst)
        used.setdefault(target, []).append(name)
    for target, names in used.items():
        log(f"note: kept the finished record(s) of {', '.join(names)} ({why}): moved to "
            f"{target}/ (nothing deleted)")
    return list(used)


def _restore_kept(out_dir: Path, keys: dict[str, Any], log: Callable[[str], None],
                  image_root: Path | None = None) -> list[str]:
    """Arms of this study with no record in ``arms/`` whose finished record of this very configuration (same key)
    was set aside in ``superseded/`` by an earlier run (with its tensors): moved back, so going back to an earlier
    configuration reuses its work instead of recomputing it. One line says what came back from where."""
    root = Path(out_dir)
    kept = root / SUPERSEDED_DIR
    if not kept.is_dir():
        return []
    back: dict[Path, list[str]] = {}
    for name, key in keys.items():
        json_path, pt_path = rec.record_paths(root, name)
        if json_path.exists() or pt_path.exists():
            continue
        for folder in sorted(p for p in kept.iterdir() if p.is_dir() and not p.is_symlink()):
            old_json, old_pt = folder / "arms" / json_path.name, folder / "arms" / pt_path.name
            record = rec.read_record(old_json) if not old_json.is_symlink() else None
            if record is None or record.get("key") != key or not old_pt.is_file() or old_pt.is_symlink():
                continue
            slug = rec.arm_slug(name)
            moves = [(samples_folder(old_pt), samples_folder(pt_path)), (old_pt, pt_path), (old_json, json_path),
                     (folder / "grids" / f"{slug}.png", root / "grids" / f"{slug}.png")]
            if image_root is not None and Path(image_root).resolve() == root.resolve():
                moves.append((folder / "images" / slug, root / "images" / slug))
            for src, dst in moves:
                if src.exists() and not src.is_symlink() and not dst.exists():
                    rec.make_dirs(dst.parent, root)
                    os.replace(src, dst)
            back.setdefault(folder, []).append(name)
            break
    for folder, names in back.items():
        log(f"note: the finished record(s) of {', '.join(names)} for this configuration were kept in {folder}/ by "
            f"an earlier run: moved back and reused")
    return [n for names in back.values() for n in names]
