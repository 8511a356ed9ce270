"""Multi-objective Optuna tuning of one method's knobs: cost (FLOPs or latency ratio) down, quality up.

``run_sweep(SweepSpec(method="nova", trials=40))`` (CLI: ``python -m studies.sweep nova --trials 40``):

1. resolves the method's preset (plus fixed ``--set`` overrides) and the search space from the knob metadata
   (:mod:`sweeps.spaces`); an unknown field, a field the method's components do not have, an unmeasurable metric
   or a malformed constraint fails here, before the model is loaded or any trial runs;
2. creates (or loads, to resume) the study in the storage — the parent creates it before any worker starts;
3. generates the baseline once and caches it in the output folder (``arms/baseline.{json,pt}``; its summary is also
   stored in the study's user attrs ``varscope.baseline``);
4. runs the trials in this process (``workers=1``) or in N worker processes on the same study, each trial evaluated
   by :class:`sweeps.evaluate.SweepEvaluator` (metrics vs the baseline, bootstrap CIs, a ``varscope.arm/1`` record
   per trial under ``arms/``), with the quality constraint set through ``trial.set_constraint``;
5. writes ``trials.csv``, ``results.json`` (spec, baseline, Pareto front, best trade-off, importances),
   ``pareto.png`` (seaborn; CIs on the front), ``pareto_optuna.png`` and ``importance_<objective>.png``
   (``optuna.visualization.matplotlib``).

Objectives: ``cost`` = ``flops_ratio`` (analytic FLOPs of what the loop computed / the baseline's; deterministic,
the default) or ``latency_ratio`` (generate() seconds / the baseline's, paired by batch with a baseline run timed right
before each trial — ``EvalSettings.paired_timing`` — so machine load cancels to first order; several workers on
few cores still slow each other down, so use one worker for latency). ``quality`` = ``psnr``,
``ssim``, ``ms_ssim``, ``token_agreement`` (vs the baseline's images / tokens from the same seeds), ``class_acc``
(testbed classifier top-1, %), ``fid_proxy`` / ``kid_proxy`` (classifier features; minimised).

Constraint: ``"class_acc>=baseline-1"`` (class accuracy within 1 point of the baseline), ``"psnr>=30"``,
``"fid_proxy<=baseline+5"``; the trial's violation (≤ 0 = feasible) goes to ``trial.set_constraint``, which both
samplers (NSGA-II's constrained domination, TPE's feasibility split) and ``study.best_trials`` honour. The *best
trade-off* is the feasible trial with the lowest cost (ties: best quality). ``constraint="auto"``: class accuracy
within 1 point when the classifier applies to the model, else no constraint.

Storage and resume
------------------
Default: a journal file ``<out>/study.journal`` (``JournalStorage(JournalFileBackend)``; several processes append
to it under a file lock). ``storage="sqlite:///x.db"`` / ``"postgresql://…"`` / ``"mysql://…"`` go to optuna's
``RDBStorage`` unchanged (a path without ``://`` is a journal file). Re-running the same command (same output
folder, study name and storage) resumes: completed trials are kept, and trials are run until ``trials`` are
COMPLETE. The study's spec is stored in its user attrs; resuming with a different method, space, objectives,
constraint or evaluation settings is an error (choose another ``--study-name`` or ``--out``).

A worker killed with SIGKILL loses at most its trial in flight, which stays RUNNING in the storage:

* Every trial records its worker (host, pid, process start time) in the user attr ``worker``; on resume and at
  every worker start, a RUNNING trial whose worker process on this host no longer exists is marked FAIL (user attr
  ``fail_reason``) and its parameters are re-queued once (``retry_of``), on every storage.
* RDB storages also run optuna's heartbeat (``heartbeat_interval=30 s``, ``grace_period=120 s``): a trial whose
  heartbeat stopped — the way to see a dead worker of another host — is marked FAIL by
  ``optuna.storages.fail_stale_trials`` and re-queued once by ``RetryHeartbeatStaleTrialCallback``. (Relying on the
  heartbeat alone left the trial of a sweep killed and resumed within the grace period RUNNING for good.)
* Journal storage has no heartbeat: a RUNNING trial without a worker record older than ``stale_after`` seconds is
  treated as dead. Trials of live workers — or of workers on other hosts — are left alone (use an RDB storage with
  heartbeats across hosts). A journal whose last line a killed worker left cut off is repaired on open
  (:func:`repair_journal`: the original kept as ``<journal>.bak-<time>``, one line logged).

``--storage`` is checked before the model loads (:func:`check_storage`): a known URL scheme, no in-memory SQLite
(nothing to resume, nothing shared between workers), an existing folder, a writable file.

No parameter set is evaluated twice in one study. Each worker start seeds its sampler with
:func:`sampler_seed` (a hash of the base ``seed``, the number of trials already in the storage and the worker
index; recorded in the study's user attrs ``varscope.sampler_seed:…``, in each trial's user attr ``sampler_seed`` and
in ``results.json`` ``sampler_seeds``), so a resumed, extended or second worker does not replay the proposals of an
earlier start. And before a trial is evaluated, the storage is checked for a COMPLETE trial — or a lower-numbered
RUNNING one — with the same parameters after rounding to the space's steps (:meth:`SweepSpace.key`): such a trial is
PRUNED (user attr ``duplicate_of``) and does not count towards ``trials``; a worker whose last
``MAX_CONSECUTIVE_DUPLICATES`` proposals were all duplicates stops (the space is exhausted). The Pareto front of the
report holds one trial per parameter set.

Dashboard: ``python -m sweeps.dashboard <out>/study.journal`` (journal) or ``python -m sweeps.dashboard
sqlite:///x.db`` (RDB), then open http://127.0.0.1:8080 — optuna-dashboard serving the study offline, with Optuna 5's
constraints honoured (the stock ``optuna-dashboard`` 0.21 shows an infeasible trial as best).

PostgreSQL (``postgresql://USER:PW@HOST/DB``; the ``[postgres]`` extra installs psycopg 3, the driver SQLAlchemy 2.1
maps the bare scheme to; psycopg2 is used when only it is installed, see :func:`rdb_url`): schema and study creation
run under a ``pg_advisory_lock``, so machines started at the same moment on an empty database all join one study
(:func:`_create_or_load`); a database error is one ``error:`` line (:func:`storage_errors`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from var_core.errors import UserError, did_you_mean

from .evaluate import METRICS, EvalSettings, SweepEvaluator, metric_value
from .spaces import SpaceError, SweepSpace, apply_overrides, build_space

__all__ = ["SweepSpec", "Constraint", "COSTS", "QUALITIES", "SAMPLERS", "prepare", "run_sweep", "run_worker",
           "make_storage", "open_study", "recover_stale_trials", "write_report", "pareto_mask", "SweepError",
           "default_out_dir", "dashboard_command", "sampler_seed", "make_sampler", "find_duplicate",
           "pareto_numbers", "sampler_seeds", "trials_frame", "best_tradeoff"]

COSTS = {"flops": "flops_ratio", "latency": "latency_ratio"}
QUALITIES = ("psnr", "ssim", "ms_ssim", "token_agreement", "class_acc", "fid_proxy", "kid_proxy")
SAMPLERS = ("nsga2", "tpe", "random")
SPEC_ATTR = "varscope.spec"
BASELINE_ATTR = "varscope.baseline"
SEED_ATTR = "varscope.sampler_seed"  # a study user attr per worker start: {SEED_ATTR}:{worker}:{trials}:{pid}@{host}
STALE_AFTER = 600.0
HEARTBEAT_INTERVAL = 30  # s, RDB storages (optuna heartbeat)
GRACE_PERIOD = 120  # s without a heartbeat before optuna fails a RUNNING trial
MAX_CONSECUTIVE_DUPLICATES = 50  # a worker stops after this many proposals in a row that were all evaluated already


class SweepError(UserError, ValueError):
    """A sweep that cannot start (bad space, metric, constraint, storage or a mismatched resume)."""


# ----- constraint -------------------------------------------------------------------------------------------
_CONSTRAINT = re.compile(r"^\s*(?P<metric>[a-z_]+)\s*(?P<op>>=|<=)\s*(?:(?P<base>baseline)\s*(?P<sign>[+-])?\s*)?"
                         r"(?P<value>[0-9]*\.?[0-9]+(?:e[+-]?\d+)?)?\s*$", re.I)


@dataclass(frozen=True)
class Constraint:
    """``metric >= threshold`` or ``metric <= threshold``; the threshold may be relative to the baseline."""

    metric: str
    op: str
    value: float
    relative: bool
    text: str

    @staticmethod
    def parse(text: str) -> "Constraint":
        m = _CONSTRAINT.match(text or "")
        if not m or (m.group("base") is None and m.group("value") is None):
            raise SweepError(f"constraint {text!r}: expected METRIC>=VALUE, METRIC<=VALUE, METRIC>=baseline-D or "
                             f"METRIC<=baseline+D (e.g. 'class_acc>=baseline-1', 'psnr>=30')")
        metric = m.group("metric").lower()
        if metric not in METRICS:
            raise SweepError(f"constraint {text!r}: unknown metric {metric!r}; metrics: {', '.join(METRICS)}")
        value = float(m.group("value") or 0.0)
        if m.group("base") and m.group("sign") == "-":
            value = -value
        return Constraint(metric, m.group("op"), value, m.group("base") is not None, text.strip())

    @property
    def key(self) -> str:
        return self.metric

    def threshold(self, baseline_summary: dict) -> float:
        if not self.relative:
            return self.value
        base = metric_value(baseline_summary, self.metric)
        if not math.isfinite(base):
            raise SweepError(f"constraint {self.text!r}: the baseline has no {self.metric} (it is measured against "
                             f"the baseline itself); give an absolute threshold")
        return base + self.value

    def violation(self, summary: dict, baseline_summary: dict) -> float:
        """≤ 0 when satisfied (``inf`` when the metric is missing)."""
        value = metric_value(summary, self.metric)
        if not math.isfinite(value):
            return math.inf
        t = self.threshold(baseline_summary)
        return (t - value) if self.op == ">=" else (value - t)


# ----- spec -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepSpec:
    method: str = "nova"
    params: tuple[str, ...] = ()  # fields / aliases / ties, optionally with ranges; () = every tunable knob
    overrides: tuple[str, ...] = ()  # fixed key=value settings of the base policy
    cost: str = "flops"
    quality: str = "psnr"
    constraint: str | None = "auto"
    sampler: str = "nsga2"
    seed: int = 0
    trials: int = 40
    population: int | None = None  # NSGA-II population (default: trials // 4, within [4, 50])
    startup_trials: int | None = None  # TPE random start-up trials (default: trials // 4, within [2, 10])
    eval: EvalSettings = field(default_factory=EvalSettings)
    out: str | None = None
    storage: str | None = None
    study_name: str | None = None
    wandb: str = "offline"
    wandb_project: str = "varscope-sweeps"
    enqueue_default: bool = True  # the preset's own values as the first trial
    timeout: float | None = None  # seconds per worker (None: until `trials` are complete)
    stale_after: float = STALE_AFTER

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(data: dict) -> "SweepSpec":
        data = dict(data)
        data["eval"] = EvalSettings(**data.get("eval", {}))
        for key in ("params", "overrides"):
            data[key] = tuple(data.get(key) or ())
        return SweepSpec(**data)

    def identity(self, space: SweepSpace, constraint: Constraint | None, model: str) -> dict:
        """What must match for a stored study to be resumed."""
        e = self.eval
        return {"method": self.method, "base_hash": space.base.config_hash(),
                "params": [p.to_dict() for p in space.params], "cost": self.cost, "quality": self.quality,
                "constraint": constraint.text if constraint else None, "model": model, "weights": e.weights,
                "samples": e.samples, "batch_size": e.batch_size, "seed": e.seed, "dtype": e.dtype,
                # set only when given, so studies stored before these options existed still resume
                **{k: getattr(e, k) for k in ("vae_weights", "cfg", "top_k", "top_p", "temperature", "prompts")
                   if getattr(e, k, None) is not None}}


def default_out_dir(spec: SweepSpec, model: str) -> Path:
    tag = f"{spec.method}_{model.replace(':', '-')}_n{spec.eval.samples}_seed{spec.eval.seed}_{spec.cost}-{spec.quality}"
    extra = " ".join(sorted(spec.params)) + "|" + " ".join(sorted(spec.overrides))
    if extra != "|":
        tag += "_" + hashlib.sha1(extra.encode()).hexdigest()[:8]
    from sweeps.evaluate import launch_tag

    tag += launch_tag(spec.eval, model)  # device and precision (empty on a CPU in fp32)
    return Path("results") / "sweeps" / tag


def default_study_name(spec: SweepSpec) -> str:
    return f"{spec.method}-{spec.cost}-{spec.quality}"


# ----- storage ----------------------------------------------------------------------------------------------
RDB_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb", "oracle", "mssql", "cockroachdb")


def storage_kind(storage: str | None) -> str:
    return "rdb" if storage and "://" in storage and not storage.startswith("journal://") else "journal"


def journal_path(storage: str | None, out_dir: Path) -> Path:
    if storage is None:
        return out_dir / "study.journal"
    return Path(storage.removeprefix("journal://")).expanduser()


def _sqlite_file(url: str) -> str | None:
    """The database file of a ``sqlite://`` URL (``None``: in memory)."""
    rest = url.split("://", 1)[1].split("?", 1)[0]
    path = rest[1:] if rest.startswith("/") else rest  # sqlite:///rel.db -> rel.db, sqlite:////abs.db -> /abs.db
    return None if path in ("", ":memory:") or path.startswith("file::memory:") else path


def _missing_folder(path: Path, option: str) -> SweepError:
    folder = path.parent
    existing = next((p for p in folder.parents if p.is_dir()), None)
    return SweepError(f"{option}: the folder {folder} does not exist (nearest existing folder: {existing}); create "
                      f"it first (mkdir -p {folder}) or fix the path")


def _check_writable(path: Path, option: str) -> None:
    """Open the storage file for appending (creating it, as the storage would) and its folder for the lock."""
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise SweepError(f"{option}: cannot write {path} ({exc.strerror or exc}); put the study on a writable "
                         f"disk (another --storage path or --out)") from None


def check_storage(storage: str | None) -> None:
    """Refuse a ``--storage`` that cannot hold a resumable study, before the model is loaded: an unknown URL
    scheme, an in-memory SQLite database (it vanishes with the process: nothing to resume, and worker processes
    cannot share it), a file in a folder that does not exist, or a journal file that cannot be written."""
    if storage is None:
        return
    option = f"--storage {storage}"
    if not str(storage).strip():
        raise SweepError("--storage is empty: give sqlite:///study.db, postgresql://…, a journal file path, or "
                         "leave it out for <out>/study.journal")
    if storage_kind(storage) == "rdb":
        scheme = storage.split("://", 1)[0].split("+", 1)[0].lower()
        if scheme not in RDB_SCHEMES:
            raise SweepError(f"{option}: unknown storage URL scheme {scheme!r}.{did_you_mean(scheme, RDB_SCHEMES)} "
                             f"Give sqlite:///FILE.db, postgresql://USER:PW@HOST/DB, mysql://…, or a journal file "
                             f"path (no ://)")
        if scheme in ("postgresql", "postgres"):
            rdb_url(storage)  # the driver is installed (or one error line naming the [postgres] extra)
        if scheme == "sqlite":
            file = _sqlite_file(storage)
            if file is None:
                raise SweepError(f"{option}: an in-memory SQLite database is gone when the process exits (nothing "
                                 f"to resume) and worker processes cannot share it; give a file, e.g. "
                                 f"sqlite:///study.db, or leave --storage out for <out>/study.journal")
            path = Path(file).expanduser()
            if not path.parent.is_dir():
                raise _missing_folder(path, option)
            if path.is_dir():
                raise SweepError(f"{option}: {path} is a folder; give the database file, e.g. "
                                 f"sqlite:///{path / 'study.db'}")
            _check_writable(path, option)
        return
    path = journal_path(storage, Path("."))
    if path.is_dir():
        raise SweepError(f"{option}: {path} is a folder; give the journal file, e.g. {path / 'study.journal'}")
    if not path.parent.is_dir():
        raise _missing_folder(path, option)
    _check_writable(path, option)


def _journal_op(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _salvage(line: bytes) -> bytes | None:
    """The whole journal operation at the end of a line that starts with a cut one (a worker killed mid-write,
    then another append on the same line), or ``None``."""
    j = line.find(b"{", 1)
    while j > 0:
        if _journal_op(line[j:]):
            return line[j:]
        j = line.find(b"{", j + 1)
    return None


def _tail_is_whole(path: Path) -> bool:
    """The journal ends with a newline and its last line is a JSON object (read from the end: cheap)."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size == 0:
            return True
        f.seek(size - 1)
        if f.read(1) != b"\n":
            return False
        pos, block, tail = size - 1, 1 << 16, b""
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            tail = f.read(pos - start) + tail
            i = tail.rfind(b"\n")
            if i >= 0:
                return _journal_op(tail[i + 1:])
            pos = start
        return _journal_op(tail)


def repair_journal(path: Path, log: Callable[[str], None] = print, *, full: bool = False) -> Path | None:
    """Set aside what a worker killed mid-write left in a journal; returns the backup of the original, or ``None``.

    Optuna's journal reader skips a last line without its newline, but the next append lands on that line and turns
    it into one no reader can parse, so the study could not be reopened. The cut line is removed (a line that a
    later append completed keeps that later operation), under the journal's own lock so that a live writer is never
    mistaken for a cut line; the original is first copied whole to ``<name>.bak-<time>`` and one line logged. What
    the cut line recorded (at most one operation of the dead worker) is lost; that worker's trial is recovered as
    any killed trial (:func:`recover_stale_trials`). ``full``: every line is checked, not only the last (after
    optuna failed to read the file); a line in the middle that is not an operation and holds none is refused.
    """
    import shutil

    from optuna.storages.journal import JournalFileSymlinkLock
    from optuna.storages.journal._file import get_lock_file

    if not path.is_file() or (not full and _tail_is_whole(path)):
        return None
    with get_lock_file(JournalFileSymlinkLock(str(path))):
        data = path.read_bytes()
        *lines, cut = data.split(b"\n")  # `cut`: what follows the last newline (b"" when the file ends with one)
        removed, fixed = len(cut), []
        for n, line in enumerate(lines, 1):
            if (full or n == len(lines)) and line.strip() and not _journal_op(line):
                whole = _salvage(line)
                if whole is None and n < len(lines):
                    raise SweepError(f"{path}:{n} is not an Optuna journal line (cut or overwritten); the study "
                                     f"cannot be read past it. Restore the file from a backup, or start another "
                                     f"study (--out / --storage)")
                removed += len(line) + 1 if whole is None else len(line) - len(whole)
                if whole is None:
                    continue
                line = whole
            fixed.append(line)
        if not removed:
            return None
        backup = path.with_name(f"{path.name}.bak-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copy2(path, backup)
        tmp = path.with_name(path.name + ".repair")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in fixed))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    log(f"note: {path} ended in a line cut off while it was written (a worker killed?): {removed} bytes set aside "
        f"and the study reopened; the original file is kept as {backup}")
    return backup


def make_storage(storage: str | None, out_dir: Path, log: Callable[[str], None] = print):
    """A journal file under ``out_dir`` by default; ``…://`` URLs go to optuna's RDBStorage (with heartbeats)."""
    if storage_kind(storage) == "rdb":
        return _rdb_storage(storage)
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = journal_path(storage, out_dir)
    try:
        if storage is None:
            path.parent.mkdir(parents=True, exist_ok=True)
        repair_journal(path, log)
        try:
            return JournalStorage(JournalFileBackend(str(path)))
        except ValueError:  # JSONDecodeError / "Invalid log format." while replaying: a cut line in the middle
            if repair_journal(path, log, full=True) is None:
                raise
            return JournalStorage(JournalFileBackend(str(path)))
    except SweepError:
        raise
    except OSError as exc:
        raise SweepError(f"cannot open the Optuna journal {path} ({exc.strerror or exc}); put the study on a "
                         f"writable disk (another --storage path or --out)") from None
    except ValueError as exc:
        raise SweepError(f"cannot read the Optuna journal {path} ({exc}); restore it from a backup, or start "
                         f"another study (--out / --storage)") from None


# PostgreSQL drivers SQLAlchemy knows, by the module each one imports: SQLAlchemy 2.1 maps a bare postgresql:// to
# psycopg (3), 2.0 to psycopg2; the [postgres] extra installs psycopg[binary]
_PG_DRIVERS = {"psycopg": "psycopg", "psycopg2": "psycopg2", "pg8000": "pg8000", "asyncpg": "asyncpg"}
PG_EXTRA_HINT = "pip install 'varscope[postgres]' (psycopg 3) or pip install psycopg2-binary"
# pg_advisory_lock key held while a process creates the schema and the study (any int8; "varscope" in ASCII)
_PG_LOCK_KEY = int.from_bytes(b"varscope", "big") & 0x7FFFFFFFFFFFFFFF
LOCK_TIMEOUT_S = 120


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def rdb_url(url: str) -> str:
    """The SQLAlchemy URL for ``url``: ``postgres://`` spelled ``postgresql://``, and a bare ``postgresql://`` sent to
    an installed driver (psycopg 3, else psycopg2) when the one SQLAlchemy would pick is missing. A URL naming a
    driver that is not installed, or no PostgreSQL driver at all, is one error naming the ``[postgres]`` extra."""
    scheme, rest = url.split("://", 1)
    base, _, driver = scheme.partition("+")
    if base.lower() not in ("postgresql", "postgres"):
        return url
    base = "postgresql"
    if driver:
        module = _PG_DRIVERS.get(driver.lower(), driver)
        if not _importable(module):
            raise SweepError(f"--storage {url}: the PostgreSQL driver {driver!r} is not installed; {PG_EXTRA_HINT}, "
                             f"or drop '+{driver}' to use the installed one")
        return f"{base}+{driver}://{rest}"
    from sqlalchemy.engine import make_url

    default = make_url(f"{base}://{rest}").get_dialect().driver
    for name in (default, "psycopg", "psycopg2"):
        if _importable(_PG_DRIVERS.get(name, name)):
            return f"{base}://{rest}" if name == default else f"{base}+{name}://{rest}"
    raise SweepError(f"--storage {url}: no PostgreSQL driver is installed; {PG_EXTRA_HINT}")


def _one_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


class _creation_lock:
    """Serialise schema and study creation across processes and machines on a PostgreSQL storage
    (``pg_advisory_lock``): two workers started together on an empty database otherwise both run Optuna's
    ``CREATE TABLE`` / alembic stamping and one fails with an IntegrityError (optuna#1092). Other URLs: no lock
    (SQLite: the parent creates the study before its workers start; see :func:`_create_or_load`'s retries)."""

    def __init__(self, url: str):
        self.url, self.conn, self.engine = url, None, None

    def __enter__(self):
        if not self.url.split("://", 1)[0].lower().startswith("postgres"):
            return self
        import sqlalchemy

        self.engine = sqlalchemy.create_engine(rdb_url(self.url), poolclass=sqlalchemy.pool.NullPool)
        try:
            self.conn = self.engine.connect()
            self.conn.execute(sqlalchemy.text(f"SET lock_timeout = '{LOCK_TIMEOUT_S}s'"))
            self.conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK_KEY})
        except sqlalchemy.exc.SQLAlchemyError as exc:
            self.__exit__()
            raise SweepError(f"--storage {self.url}: cannot open the database ({_one_line(exc)})") from None
        return self

    def __exit__(self, *exc_info):
        if self.conn is not None:
            try:
                import sqlalchemy

                self.conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
            except Exception:  # noqa: BLE001 - closing the session releases the lock anyway
                pass
            self.conn.close()
            self.conn = None
        if self.engine is not None:
            self.engine.dispose()
            self.engine = None
        return False


def _rdb_storage(url: str):
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # heartbeat and the retry callback are "experimental" in optuna
        try:
            with _creation_lock(url):
                return RDBStorage(rdb_url(url), heartbeat_interval=HEARTBEAT_INTERVAL, grace_period=GRACE_PERIOD,
                                  heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1))
        except SweepError:
            raise
        except ImportError as exc:
            raise SweepError(f"--storage {url}: the database driver is not installed ({exc}); install it (e.g. "
                             f"{PG_EXTRA_HINT} for postgresql://, pymysql for mysql+pymysql://)") from None
        except Exception as exc:  # noqa: BLE001 - sqlalchemy's OperationalError / ArgumentError: a bad URL or server
            raise SweepError(f"--storage {url}: cannot open the database ({_one_line(exc)})") from None


def _create_or_load(storage, url: str | None, **kwargs):
    """``optuna.create_study(load_if_exists=True)`` that several processes may call at the same moment: under the
    PostgreSQL advisory lock, and retried on the IntegrityError of a concurrent creation elsewhere."""
    import optuna
    import sqlalchemy

    for attempt in range(5):
        try:
            with _creation_lock(url or ""):
                return optuna.create_study(storage=storage, load_if_exists=True, **kwargs)
        except sqlalchemy.exc.IntegrityError:
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


def storage_errors(storage: str | None):
    """Context: a database error while the study runs (server gone, connection lost) is one SweepError line."""
    import contextlib

    @contextlib.contextmanager
    def guard():
        try:
            yield
        except SweepError:
            raise
        except Exception as exc:  # noqa: BLE001 - only sqlalchemy's errors are converted
            if type(exc).__module__.split(".")[0] not in ("sqlalchemy", "psycopg", "psycopg2"):
                raise
            raise SweepError(f"the study storage {storage} failed ({_one_line(exc)}); check the database server, "
                             f"then re-run the same command to resume") from None

    return guard()


def storage_label(spec: SweepSpec, out_dir: Path) -> str:
    """The study's storage as a user gives it: the RDB URL or the journal file."""
    return spec.storage if storage_kind(spec.storage) == "rdb" else str(journal_path(spec.storage, out_dir))


def dashboard_command(spec: SweepSpec, out_dir: Path) -> str:
    """optuna-dashboard with Optuna 5's constraints honoured (:mod:`sweeps.dashboard`; the stock 0.21 app shows an
    infeasible trial as best)."""
    return f"python -m sweeps.dashboard {storage_label(spec, out_dir)}"


def sampler_seed(base_seed: int | None, trials_in_storage: int, worker_index: int) -> int | None:
    """The sampler seed of one worker start: a hash of (base seed, trials already in the storage, worker index).

    Re-seeding identically on every start made a resumed or extended study (``--trials 2`` then ``--trials 4``)
    or a second worker on the same study replay the first start's proposals, evaluating the same parameters twice.
    ``None`` (no base seed) stays ``None`` (optuna seeds from the OS).
    """
    if base_seed is None:
        return None
    digest = hashlib.sha256(f"varscope-sampler:{int(base_seed)}:{int(trials_in_storage)}:{int(worker_index)}"
                            .encode()).digest()
    return int.from_bytes(digest[:4], "big")


def make_sampler(spec: SweepSpec, worker_index: int = 0, trials_in_storage: int = 0, *, seed: Any = "derive"):
    """The spec's sampler, seeded with ``seed`` (default: :func:`sampler_seed` of the worker start)."""
    import optuna

    if seed == "derive":
        seed = sampler_seed(spec.seed, trials_in_storage, worker_index)
    if spec.sampler == "nsga2":
        pop = spec.population or max(4, min(50, spec.trials // 4))
        return optuna.samplers.NSGAIISampler(population_size=pop, seed=seed)
    if spec.sampler == "tpe":
        startup = spec.startup_trials or max(2, min(10, spec.trials // 4))
        return optuna.samplers.TPESampler(n_startup_trials=startup, seed=seed, multivariate=True,
                                          constant_liar=True)
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise SweepError(f"unknown sampler {spec.sampler!r}; choose one of {', '.join(SAMPLERS)}")


# ----- preparation (everything that can fail before a trial) ------------------------------------------------
@dataclass
class Prepared:
    spec: SweepSpec
    space: SweepSpace
    constraint: Constraint | None
    cost_metric: str
    evaluator: SweepEvaluator
    out_dir: Path
    study_name: str
    warnings: list[str]


def _check_spec(spec: SweepSpec) -> tuple[SweepSpace, Constraint | None]:
    from var_core.accel.presets import get_preset

    if spec.cost not in COSTS:
        raise SweepError(f"unknown cost {spec.cost!r}; choose one of {', '.join(COSTS)}")
    if spec.quality not in QUALITIES:
        raise SweepError(f"unknown quality metric {spec.quality!r}; choose one of {', '.join(QUALITIES)}")
    if spec.sampler not in SAMPLERS:
        raise SweepError(f"unknown sampler {spec.sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if spec.wandb not in ("offline", "online", "disabled"):
        raise SweepError(f"--wandb must be offline, online or disabled, got {spec.wandb!r}")
    if spec.trials < 1:
        raise SweepError(f"--trials must be >= 1, got {spec.trials}")
    try:
        base = get_preset(spec.method)
    except KeyError as exc:
        raise SweepError(exc.args[0]) from None
    try:
        base = apply_overrides(base, spec.overrides)
        space = build_space(base, spec.params)
    except SpaceError as exc:
        raise SweepError(str(exc)) from None
    constraint = None
    if spec.constraint and spec.constraint != "auto":
        constraint = Constraint.parse(spec.constraint)
    check_storage(spec.storage)
    return space, constraint


def prepare(spec: SweepSpec, log: Callable[[str], None] = print, evaluator: SweepEvaluator | None = None
            ) -> Prepared:
    """Validate the sweep, load the model and decide the output folder (no study, no trial yet)."""
    space, constraint = _check_spec(spec)
    if evaluator is None:
        from ablations.runner import resolve_model

        model, _, _ = resolve_model(spec.eval.model, spec.eval.weights)
        out_dir = Path(spec.out) if spec.out else default_out_dir(spec, model)
        evaluator = SweepEvaluator(spec.eval, out_dir, log=log, family=f"sweep-{spec.method}")
    out_dir = evaluator.out_dir
    for metric in (COSTS[spec.cost], spec.quality):
        reason = evaluator.available(metric)
        if reason:
            raise SweepError(f"{metric} cannot be measured here: {reason}")
    if spec.constraint == "auto":
        if evaluator.available("class_acc") is None:
            constraint = Constraint.parse("class_acc>=baseline-1")
    if constraint is not None:
        reason = evaluator.available(constraint.metric)
        if reason:
            raise SweepError(f"constraint {constraint.text!r}: {constraint.metric} cannot be measured here: {reason}")
        if constraint.relative and METRICS[constraint.metric].name in ("psnr", "ssim", "ms_ssim", "token_agreement",
                                                                        "fid_proxy", "kid_proxy"):
            raise SweepError(f"constraint {constraint.text!r}: {constraint.metric} is measured against the baseline "
                             f"(the baseline has none); give an absolute threshold, e.g. '{constraint.metric}"
                             f"{constraint.op}30'")
    warnings = []
    unread = evaluator.unread_fields(space.base, [path for p in space.params for path in p.paths])
    for path in unread:
        warnings.append(f"{path} was not read by any component in a 2-sample probe generation of the base policy "
                        f"(it may only matter once other knobs change — or the sweep tunes nothing through it)")
    for note in evaluator.notes + warnings:
        log(f"note: {note}")
    return Prepared(spec, space, constraint, COSTS[spec.cost], evaluator, out_dir,
                    spec.study_name or default_study_name(spec), warnings)


# ----- study ------------------------------------------------------------------------------------------------
def directions(spec: SweepSpec) -> list[str]:
    return [METRICS[COSTS[spec.cost]].direction, METRICS[spec.quality].direction]


def open_study(prep: Prepared, *, create: bool, worker_index: int = 0, log: Callable[[str], None] | None = None):
    import optuna

    storage = make_storage(prep.spec.storage, prep.out_dir, log=log or prep.evaluator.log)
    sampler = make_sampler(prep.spec, worker_index)
    identity = prep.spec.identity(prep.space, prep.constraint, prep.evaluator.model)
    if create:
        study = _create_or_load(storage, prep.spec.storage if storage_kind(prep.spec.storage) == "rdb" else None,
                                study_name=prep.study_name, sampler=sampler, directions=directions(prep.spec))
    else:
        study = optuna.load_study(study_name=prep.study_name, storage=storage, sampler=sampler)
    stored = study.user_attrs.get(SPEC_ATTR)
    if stored is None:
        if not create:
            raise SweepError(f"study {prep.study_name!r} has no varscope spec (not created by studies.sweep)")
        study.set_user_attr(SPEC_ATTR, identity)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experimental-API warning
            study.set_metric_names([COSTS[prep.spec.cost], prep.spec.quality])
    elif json.loads(json.dumps(stored)) != json.loads(json.dumps(identity, default=str)):
        diff = [k for k in identity if json.dumps(stored.get(k), default=str) != json.dumps(identity[k], default=str)]
        raise SweepError(f"study {prep.study_name!r} in {storage_label(prep.spec, prep.out_dir)} "
                         f"was created with a different {', '.join(diff)}; resume it with the same settings, or "
                         f"start another study with --study-name or --out")
    return study


def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def worker_info() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_ticks": _start_ticks(pid), "started": time.time()}


def _alive(info: dict) -> bool:
    pid = int(info.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    ticks = _start_ticks(pid)
    return info.get("start_ticks") is None or ticks is None or ticks == info["start_ticks"]


def recover_stale_trials(study, spec: SweepSpec, space: SweepSpace | None = None, log: Callable[[str], None] = print
                         ) -> list[int]:
    """Mark RUNNING trials of dead workers FAIL and re-queue their parameters once; returns the trial numbers.

    Every storage: a trial whose worker (user attr ``worker``: host, pid, process start) ran on this host and is
    gone. RDB storages also: a trial whose heartbeat is older than the grace period (optuna's
    ``fail_stale_trials``; its retry callback re-queues it) — the only way to see a dead worker of another host,
    but it takes ``GRACE_PERIOD`` seconds, so a sweep killed and resumed sooner relied on it and left the trial
    RUNNING for good. Journal storages (no heartbeat): a trial without a worker record older than ``stale_after``.
    """
    import optuna
    from optuna.trial import TrialState

    failed = []
    rdb = storage_kind(spec.storage) == "rdb"
    if rdb:
        before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "experimental" since optuna 2.9
            optuna.storages.fail_stale_trials(study)
        after = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        failed = sorted(before - after)
        if failed:
            log(f"resume: heartbeat expired for trial(s) {failed}: marked FAIL (re-queued by optuna's retry callback)")
    storage = study._storage
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        info = trial.user_attrs.get("worker")
        if info is not None:
            if info.get("host") != host or _alive(info):
                continue
            reason = f"worker {info.get('host')}:{info.get('pid')} is gone (killed?)"
        elif rdb:
            continue  # the heartbeat decides
        else:
            started = trial.datetime_start.timestamp() if trial.datetime_start else time.time()
            if time.time() - started < spec.stale_after:
                continue
            reason = f"no worker record and started more than {spec.stale_after:.0f} s ago"
        try:
            storage.set_trial_user_attr(trial._trial_id, "fail_reason", reason)
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        except Exception:  # noqa: BLE001 - another process finished or failed it first
            continue
        failed.append(trial.number)
        # an enqueued trial killed before it read its parameters holds them only as fixed_params
        params = dict(trial.params) or dict(trial.system_attrs.get("fixed_params") or {})
        requeue = space is not None and bool(params) and set(params) == set(space.names()) and space.in_space(params)
        if requeue:
            study.enqueue_trial(params, user_attrs={"retry_of": trial.number})
        log(f"resume: trial {trial.number} was RUNNING but {reason}: marked FAIL"
            + (", parameters re-queued" if requeue else ""))
    return failed


def _count(study, states) -> int:
    return len(study.get_trials(deepcopy=False, states=states))


def find_duplicate(study, space: SweepSpace, number: int, params: dict):
    """The trial that already evaluated (COMPLETE) or is evaluating (RUNNING, lower number) the parameter set
    ``params`` (compared after rounding to the space's steps, :meth:`SweepSpace.key`), or ``None``.

    Of two RUNNING trials with the same parameters only the lower-numbered one goes on, so two workers that draw
    the same set at the same moment evaluate it once.
    """
    from optuna.trial import TrialState

    key = space.key(params)
    running = None
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)):
        if t.number == number or space.key(t.params) != key:
            continue
        if t.state == TrialState.COMPLETE:
            return t
        if t.number < number and (running is None or t.number < running.number):
            running = t
    return running


# ----- the objective ----------------------------------------------------------------------------------------
def _wandb_env(out_dir: Path) -> None:
    root = out_dir / "wandb"
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_X_DISABLE_STATS", "true")
    for var, sub in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                     ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):
        os.environ.setdefault(var, str(root / sub) if sub else str(out_dir))


def _log_trial_wandb(prep: Prepared, trial_number: int, params: dict, metrics: dict, values: Sequence[float],
                     constraint: float | None) -> str | None:
    if prep.spec.wandb == "disabled":
        return None
    _wandb_env(prep.out_dir)
    import wandb

    config = {"method": prep.spec.method, "trial": trial_number, "params": params, "study": prep.study_name,
              "cost": prep.cost_metric, "quality": prep.spec.quality, "constraint": prep.constraint.text
              if prep.constraint else None, "model": prep.evaluator.model, "samples": prep.spec.eval.samples}
    run = wandb.init(mode=prep.spec.wandb, dir=str(prep.out_dir), project=prep.spec.wandb_project,
                     group=prep.study_name, job_type="sweep-trial", name=f"{prep.study_name}-trial-{trial_number}",
                     config=config, settings=wandb.Settings(silent=True, x_disable_stats=True))
    try:
        payload = {f"metrics/{k}": v for k, v in metrics.items() if v is not None and math.isfinite(v)}
        payload.update({f"params/{k}": v for k, v in params.items() if isinstance(v, (int, float))})
        payload["objective/cost"], payload["objective/quality"] = values
        if constraint is not None and math.isfinite(constraint):
            payload["constraint_violation"] = constraint
        run.log(payload)
        run_dir = str(Path(run.dir).parent) if getattr(run, "dir", None) else None
    finally:
        run.finish()
    return run_dir


def make_objective(prep: Prepared, baseline: dict, log: Callable[[str], None] = print, seed: int | None = None):
    import optuna

    spec = prep.spec

    def objective(trial) -> tuple[float, float]:
        trial.set_user_attr("worker", worker_info())
        trial.set_user_attr("sampler_seed", seed)
        params = prep.space.suggest(trial)
        twin = find_duplicate(trial.study, prep.space, trial.number, params)
        if twin is not None:  # never evaluate one parameter set twice in a study
            trial.set_user_attr("duplicate_of", twin.number)
            how = "evaluated" if twin.state.name == "COMPLETE" else "being evaluated"
            log(f"trial {trial.number}: {_fmt_params(params)} were {how} by trial {twin.number}: pruned, not "
                f"evaluated again")
            raise optuna.TrialPruned(f"duplicate of trial {twin.number}")
        name = f"trial-{trial.number:04d}"
        policy = prep.space.apply(params, name=f"{spec.method}/{name}")
        t0 = time.perf_counter()
        record = prep.evaluator.evaluate(name, policy, description=f"{spec.method} with {params}",
                                         extra={"sweep": {"study": prep.study_name, "trial": trial.number,
                                                          "params": params}})
        summary = record["summary"]
        cost = metric_value(summary, prep.cost_metric)
        quality = metric_value(summary, spec.quality)
        metrics = {k: metric_value(summary, k) for k in METRICS}
        trial.set_user_attr("metrics", {k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        trial.set_user_attr("ci", {k: [summary[k].get("low"), summary[k].get("high"), summary[k].get("n")]
                                   for k in (prep.cost_metric, spec.quality) if k in summary})
        trial.set_user_attr("config_hash", record["config_hash"])
        trial.set_user_attr("record", str(Path("arms") / f"{name}.json"))
        if record.get("reused_from"):
            trial.set_user_attr("reused_from", record["reused_from"])
        violation = None
        if prep.constraint is not None:
            violation = prep.constraint.violation(summary, baseline)
            trial.set_constraint(prep.constraint.key, violation if math.isfinite(violation) else 1e9)
        run_dir = _log_trial_wandb(prep, trial.number, params, metrics, (cost, quality), violation)
        if run_dir:
            trial.set_user_attr("wandb_dir", run_dir)
        log(f"trial {trial.number}: {_fmt_params(params)} -> {prep.cost_metric} {cost:.3f}, {spec.quality} "
            f"{quality:.3f}" + (f", {prep.constraint.metric} violation {violation:+.3f}" if violation is not None
                                else "") + f" ({time.perf_counter() - t0:.1f} s)")
        return cost, quality

    return objective


def _fmt_params(params: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


# ----- workers ----------------------------------------------------------------------------------------------
def process_sampler_seed(base_seed: int, trials_in_storage: int, worker_index: int, host: str, pid: int) -> int:
    """A sampler seed of this process alone (hash of the :func:`sampler_seed` inputs plus host and pid)."""
    text = f"varscope-sampler:{int(base_seed)}:{int(trials_in_storage)}:{int(worker_index)}:{host}:{int(pid)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def claim_sampler_seed(study, spec: SweepSpec, trials_in_storage: int, worker_index: int) -> int | None:
    """The sampler seed of one worker start: :func:`sampler_seed` of ``worker_index``, unless another process's
    start uses that seed too; then one of this process alone (:func:`process_sampler_seed`).

    Workers on several machines sharing one RDB storage number themselves from 0 on every machine, and machines
    started together see the same number of trials, hence the same seed: their samplers would propose the same
    parameters in lockstep, every proposal but one pruned as a duplicate until the others stop. Each start writes
    its claim (study user attr ``varscope.sampler_seed:<worker>:<trials>:<pid>@<host>``: seed, host, pid, start),
    then reads every claim; seeing a live claim of another process on the same seed, it marks its own
    ``superseded`` and takes its own seed. Writing before reading makes two racing starts see each other (one of
    them, or both, move on, never neither). One machine (``--workers N``: distinct indices, distinct seeds) is
    unaffected."""
    host, pid, started = socket.gethostname(), os.getpid(), time.time()
    seed = sampler_seed(spec.seed, trials_in_storage, worker_index)
    key = f"{SEED_ATTR}:{worker_index}:{trials_in_storage}:{pid}@{host}"  # pids repeat across machines
    mine = {"seed": seed, "base_seed": spec.seed, "trials_in_storage": trials_in_storage, "worker": worker_index,
            "host": host, "pid": pid, "started": started, "sampler": spec.sampler}
    study.set_user_attr(key, mine)
    if seed is None:  # optuna seeds from the OS: nothing is shared
        return None
    rivals = [v for k, v in study.user_attrs.items() if k.startswith(SEED_ATTR + ":") and isinstance(v, dict)
              and v.get("seed") == seed and not v.get("superseded") and (v.get("host"), v.get("pid")) != (host, pid)]
    if not rivals:
        return seed
    study.set_user_attr(key, dict(mine, superseded=True))
    own = process_sampler_seed(spec.seed, trials_in_storage, worker_index, host, pid)
    study.set_user_attr(key + ":own", dict(mine, seed=own, shared_seed_of=[f"{v.get('host')}:{v.get('pid')}"
                                                                           for v in rivals]))
    return own


def run_worker(prep: Prepared, worker_index: int = 0, log: Callable[[str], None] = print) -> int:
    """Run trials of the (existing) study until it holds ``trials`` COMPLETE trials; returns trials run here."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study(prep, create=False, worker_index=worker_index)
    recover_stale_trials(study, prep.spec, prep.space, log=log)
    baseline = prep.evaluator.baseline()
    target = prep.spec.trials
    if _count(study, (TrialState.COMPLETE,)) >= target:
        log(f"worker {worker_index}: the study already has {target} complete trials")
        return 0
    in_storage = len(study.get_trials(deepcopy=False))
    seed = claim_sampler_seed(study, prep.spec, in_storage, worker_index)
    study.sampler = make_sampler(prep.spec, worker_index, in_storage, seed=seed)
    shared = seed != sampler_seed(prep.spec.seed, in_storage, worker_index)
    log(f"worker {worker_index}: {prep.spec.sampler} sampler seed {seed} (base seed {prep.spec.seed}, "
        f"{in_storage} trials in the storage" + ("; another process (another machine?) holds this worker "
                                                 "index's seed, so this one is its own" if shared else "") + ")")
    ran = {"n": 0, "failed": 0, "duplicates": 0}

    def stop_when_done(study, trial) -> None:
        ran["n"] += 1
        if trial.state == TrialState.PRUNED and "duplicate_of" in trial.user_attrs:
            ran["duplicates"] += 1
            if ran["duplicates"] >= MAX_CONSECUTIVE_DUPLICATES:
                log(f"worker {worker_index}: the last {ran['duplicates']} proposals were all evaluated already "
                    f"(is the space exhausted?); stopping")
                study.stop()
        else:
            ran["duplicates"] = 0
        if trial.state == TrialState.FAIL:
            ran["failed"] += 1
            if ran["failed"] > max(3, target // 2):
                log(f"worker {worker_index}: {ran['failed']} failed trials; stopping")
                study.stop()
        if _count(study, (TrialState.COMPLETE,)) >= target:
            study.stop()

    study.optimize(make_objective(prep, baseline, log, seed=seed), n_trials=None, timeout=prep.spec.timeout,
                   callbacks=[stop_when_done], gc_after_trial=True, show_progress_bar=False)
    return ran["n"]


def run_sweep(spec: SweepSpec, workers: int = 1, log: Callable[[str], None] = print,
              prep: Prepared | None = None) -> dict:
    """Prepare, create the study, cache the baseline, run the workers, write the report; returns the results.
    A database error on the way (server down, connection lost) is a :class:`SweepError` line, not a traceback."""
    with storage_errors(spec.storage):
        return _run_sweep(spec, workers, log, prep)


def _run_sweep(spec: SweepSpec, workers: int, log: Callable[[str], None], prep: Prepared | None) -> dict:
    from optuna.trial import TrialState

    started = time.perf_counter()
    prep = prep or prepare(spec, log=log)
    out_dir = prep.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    study = open_study(prep, create=True)
    recover_stale_trials(study, spec, prep.space, log=log)
    baseline = prep.evaluator.baseline()
    study.set_user_attr(BASELINE_ATTR, {k: metric_value(baseline, k) for k in METRICS
                                        if math.isfinite(metric_value(baseline, k))})
    if spec.enqueue_default and not study.get_trials(deepcopy=False) and prep.space.in_space(prep.space.defaults()):
        study.enqueue_trial(prep.space.defaults(), user_attrs={"preset_default": True})
    complete = _count(study, (TrialState.COMPLETE,))
    log(f"study {prep.study_name!r}: {complete}/{spec.trials} complete trials; {spec.sampler} sampler; "
        f"objectives {prep.cost_metric} ↓, {spec.quality} {'↑' if METRICS[spec.quality].direction == 'maximize' else '↓'}"
        + (f"; constraint {prep.constraint.text}" if prep.constraint else "") + f"; storage "
        f"{storage_label(spec, out_dir)}")
    log(f"space: {', '.join(p.display for p in prep.space.params)}")
    spec_path = out_dir / "sweep_spec.json"
    from var_core.eval.records import write_json_atomic

    write_json_atomic(spec_path, {"spec": dataclasses.replace(spec, out=str(out_dir), study_name=prep.study_name)
                                  .to_dict()})
    if complete < spec.trials:
        if workers <= 1:
            run_worker(prep, 0, log=log)
        else:
            _spawn_workers(spec_path, workers, spec, log)
    result = write_report(prep, log=log)
    result["seconds"] = time.perf_counter() - started
    return result


def _spawn_workers(spec_path: Path, workers: int, spec: SweepSpec, log) -> None:
    threads = spec.eval.threads or max(1, (os.cpu_count() or 1) // workers)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    procs = []
    for i in range(workers):
        cmd = [sys.executable, "-m", "sweeps.optuna_study", "worker", str(spec_path), "--index", str(i),
               "--threads", str(threads)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=os.getcwd()))
        log(f"worker {i}: pid {procs[-1].pid}")
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        raise
    bad = [(i, c) for i, c in enumerate(codes) if c != 0]
    if bad:
        log(f"warning: worker(s) exited with {bad}; re-run the same command to resume")


# ----- report -----------------------------------------------------------------------------------------------
def pareto_mask(values: np.ndarray, directions_: Sequence[str]) -> np.ndarray:
    """Boolean mask of the non-dominated rows of ``values`` ``[n, k]`` under the given directions."""
    v = np.asarray(values, dtype=float).copy()
    for j, d in enumerate(directions_):
        if d == "maximize":
            v[:, j] = -v[:, j]
    n = len(v)
    mask = np.ones(n, dtype=bool)
    for i in range(n):
        dominated = np.all(v <= v[i], axis=1) & np.any(v < v[i], axis=1)
        if dominated.any():
            mask[i] = False
    return mask


def pareto_numbers(study, space: SweepSpace) -> set[int]:
    """Numbers of the Pareto-optimal trials (optuna's ``best_trials``: feasible first), one per parameter set —
    the lowest-numbered trial of each (a study written before duplicates were pruned may hold a set twice)."""
    seen: dict[tuple, int] = {}
    for t in sorted(study.best_trials, key=lambda t: t.number):
        seen.setdefault(space.key(t.params), t.number)
    return set(seen.values())


def sampler_seeds(study) -> list[dict]:
    """The sampler seeds recorded by every worker start of the study, oldest first (seeds a start gave up to an
    earlier start of another process, see :func:`claim_sampler_seed`, are left out)."""
    attrs = study.user_attrs
    found = [v for k, v in attrs.items() if k.startswith(SEED_ATTR + ":") and isinstance(v, dict)
             and not v.get("superseded")]
    return sorted(found, key=lambda v: (v.get("started") or 0, v.get("worker") or 0))


def trials_frame(study, prep: Prepared):
    import pandas as pd
    from optuna.trial import TrialState

    rows = []
    cost, quality = prep.cost_metric, prep.spec.quality
    best_numbers = pareto_numbers(study, prep.space)
    for t in study.get_trials(deepcopy=False):
        row: dict[str, Any] = {"number": t.number, "state": t.state.name,
                               "duration_s": t.duration.total_seconds() if t.duration else None}
        for p in prep.space.params:
            row[f"param:{p.name}"] = t.params.get(p.name)
        values = t.values if t.state == TrialState.COMPLETE and t.values else [math.nan, math.nan]
        row[cost], row[quality] = values
        ci = t.user_attrs.get("ci", {})
        for key in (cost, quality):
            lo, hi, _ = (ci.get(key) or [None, None, None])
            row[f"{key}_low"], row[f"{key}_high"] = lo, hi
        for k, v in (t.user_attrs.get("metrics") or {}).items():
            if k not in (cost, quality):
                row[k] = v
        cons = t.constraints
        row["constraint"] = next(iter(cons.values())) if cons else None
        row["feasible"] = (all(c <= 0 for c in cons.values()) if cons else True) if t.state == TrialState.COMPLETE \
            else None
        row["pareto"] = t.number in best_numbers
        row["config_hash"] = t.user_attrs.get("config_hash")
        row["worker"] = (lambda w: f"{w.get('host')}:{w.get('pid')}" if w else None)(t.user_attrs.get("worker"))
        row["sampler_seed"] = t.user_attrs.get("sampler_seed")
        row["duplicate_of"] = t.user_attrs.get("duplicate_of")
        row["record"] = t.user_attrs.get("record")
        row["note"] = t.user_attrs.get("fail_reason") or (f"retry of {t.user_attrs['retry_of']}"
                                                          if "retry_of" in t.user_attrs else
                                                          (f"duplicate of {t.user_attrs['duplicate_of']}"
                                                           if "duplicate_of" in t.user_attrs else
                                                           ("preset default" if t.user_attrs.get("preset_default")
                                                            else None)))
        rows.append(row)
    return pd.DataFrame(rows)


def best_tradeoff(frame, prep: Prepared) -> dict | None:
    """The feasible complete trial with the lowest cost (ties: best quality)."""
    done = frame[(frame["state"] == "COMPLETE") & (frame["feasible"] == True)]  # noqa: E712
    done = done[np.isfinite(done[prep.cost_metric].astype(float)) & np.isfinite(done[prep.spec.quality].astype(float))]
    if done.empty:
        return None
    q_sign = -1 if METRICS[prep.spec.quality].direction == "maximize" else 1
    c_sign = 1 if METRICS[prep.cost_metric].direction == "minimize" else -1
    order = sorted(done.index, key=lambda i: (c_sign * done.at[i, prep.cost_metric],
                                              q_sign * done.at[i, prep.spec.quality]))
    row = done.loc[order[0]]
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _plot_pareto(frame, prep: Prepared, baseline: dict, best: dict | None, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    cost, quality = prep.cost_metric, prep.spec.quality
    done = frame[frame["state"] == "COMPLETE"].copy()
    done["status"] = np.where(done["feasible"] == True, "feasible", "infeasible")  # noqa: E712
    sns.set_theme(style="whitegrid", context="notebook")
    fig, ax = plt.subplots(figsize=(7.2, 5.0))
    present = [s for s in ("feasible", "infeasible") if (done["status"] == s).any()]
    sns.scatterplot(data=done, x=cost, y=quality, hue="status", style="status", ax=ax, s=45, alpha=0.75,
                    palette={"feasible": "#4C72B0", "infeasible": "#C44E52"}, hue_order=present,
                    style_order=present)
    front = done[done["pareto"] == True].sort_values(cost)  # noqa: E712
    if not front.empty:
        ax.step(front[cost], front[quality], where="post", color="#DD8452", lw=1.6, label="Pareto front")
        xerr = np.array([front[cost] - front[f"{cost}_low"].astype(float),
                         front[f"{cost}_high"].astype(float) - front[cost]])
        yerr = np.array([front[quality] - front[f"{quality}_low"].astype(float),
                         front[f"{quality}_high"].astype(float) - front[quality]])
        ax.errorbar(front[cost], front[quality], xerr=np.nan_to_num(np.abs(xerr)),
                    yerr=np.nan_to_num(np.abs(yerr)), fmt="none", ecolor="#DD8452", alpha=0.6, lw=1,
                    label="95 % CI (front)")
    default = done[done["note"] == "preset default"]
    if not default.empty:
        ax.scatter(default[cost], default[quality], marker="D", s=70, facecolor="none", edgecolor="black",
                   label=f"{prep.spec.method} preset default", zorder=5)
    if best is not None:
        ax.scatter([best[cost]], [best[quality]], marker="*", s=260, color="gold", edgecolor="black", zorder=6,
                   label=f"best trade-off (trial {best['number']})")
    base_q = metric_value(baseline, quality)
    if math.isfinite(base_q) and quality in ("class_acc",):
        ax.axhline(base_q, color="grey", ls=":", lw=1)
        ax.scatter([1.0], [base_q], marker="s", color="grey", label="baseline", zorder=5)
    if prep.constraint is not None and prep.constraint.metric == quality:
        ax.axhline(prep.constraint.threshold(baseline), color="#C44E52", ls="--", lw=1,
                   label=f"constraint {prep.constraint.text}")
    ax.set_xlabel(METRICS[cost].label + " ↓")
    ax.set_ylabel(METRICS[quality].label + (" ↑" if METRICS[quality].direction == "maximize" else " ↓"))
    title = f"{prep.spec.method}: {len(done)} trials, {prep.spec.sampler}"
    if prep.constraint is not None:
        title += f", constraint {prep.constraint.text}"
    ax.set_title(title, fontsize=11)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _optuna_plots(study, prep: Prepared, out_dir: Path) -> tuple[dict[str, str], dict[str, dict], dict[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as ovm

    plots, importances, errors = {}, {}, {}
    names = [prep.cost_metric, prep.spec.quality]
    try:
        ax = ovm.plot_pareto_front(study, target_names=names)
        path = out_dir / "pareto_optuna.png"
        ax.figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(ax.figure)
        plots["pareto_optuna"] = str(path)
    except Exception as exc:  # noqa: BLE001
        errors["pareto_optuna"] = f"{type(exc).__name__}: {exc}"
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    for i, name in enumerate(names):
        if len(prep.space.params) < 2 or len(complete) < 2:
            errors[f"importance_{name}"] = "needs at least 2 parameters and 2 complete trials"
            continue
        target = (lambda t, i=i: t.values[i])
        try:
            importances[name] = {k: float(v) for k, v in optuna.importance.get_param_importances(
                study, target=target).items()}
            ax = ovm.plot_param_importances(study, target=target, target_name=name)
            path = out_dir / f"importance_{name}.png"
            ax.figure.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(ax.figure)
            plots[f"importance_{name}"] = str(path)
        except Exception as exc:  # noqa: BLE001 - e.g. every trial has the same value
            errors[f"importance_{name}"] = f"{type(exc).__name__}: {exc}"
    return plots, importances, errors


def write_report(prep: Prepared, log: Callable[[str], None] = print) -> dict:
    """CSV, JSON and plots of the study as it stands (works on a partial or resumed study too)."""
    import warnings

    from var_core.eval.records import write_json_atomic

    study = open_study(prep, create=False)
    out_dir = prep.out_dir
    baseline = prep.evaluator.baseline()
    frame = trials_frame(study, prep)
    csv_path = out_dir / "trials.csv"
    frame.to_csv(csv_path, index=False)
    best = best_tradeoff(frame, prep) if not frame.empty else None
    plots: dict[str, str] = {}
    errors: dict[str, str] = {}
    importances: dict[str, dict] = {}
    if not frame.empty and (frame["state"] == "COMPLETE").any():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plots["pareto"] = str(_plot_pareto(frame, prep, baseline, best, out_dir / "pareto.png"))
            p, importances, errors = _optuna_plots(study, prep, out_dir)
            plots.update(p)
    pareto = frame[frame["pareto"] == True] if not frame.empty else frame  # noqa: E712
    result = {
        "schema": "varscope.sweep/1", "study": prep.study_name, "storage": storage_label(prep.spec, out_dir),
        "dashboard": dashboard_command(prep.spec, out_dir),
        "spec": dataclasses.replace(prep.spec, out=str(out_dir)).to_dict(), "space": prep.space.to_dict(),
        "objectives": {"cost": {"metric": prep.cost_metric, "direction": METRICS[prep.cost_metric].direction},
                       "quality": {"metric": prep.spec.quality, "direction": METRICS[prep.spec.quality].direction}},
        "constraint": None if prep.constraint is None else {
            "text": prep.constraint.text, "metric": prep.constraint.metric,
            "threshold": prep.constraint.threshold(baseline)},
        "evaluation": prep.evaluator.describe(), "warnings": prep.warnings,
        "baseline": {k: v for k, v in baseline["summary"].items()}, "baseline_record": "arms/baseline.json",
        "counts": frame["state"].value_counts().to_dict() if not frame.empty else {},
        "sampler_seeds": sampler_seeds(study),
        "pareto_front": pareto.to_dict(orient="records"), "best_tradeoff": best, "importances": importances,
        "plots": plots, "plot_errors": errors, "trials_csv": str(csv_path),
        "environment": baseline.get("environment", {}),
    }
    write_json_atomic(out_dir / "results.json", result)
    return result


# ----- worker entry point -----------------------------------------------------------------------------------
def _worker_main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m sweeps.optuna_study worker",
                                     description="one worker process of a sweep (started by studies.sweep)")
    parser.add_argument("command", choices=("worker",))
    parser.add_argument("spec", help="the sweep_spec.json the parent wrote")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    data = json.loads(Path(args.spec).read_text())["spec"]
    spec = SweepSpec.from_dict(data)
    if args.threads:
        spec = dataclasses.replace(spec, eval=dataclasses.replace(spec.eval, threads=args.threads))
    tag = f"[worker {args.index} pid {os.getpid()}]"

    def log(message: str) -> None:
        print(f"{tag} {message}", flush=True)

    # the output folder and study exist (the parent created them); the identity check compares settings, so the
    # thread count (not part of it) may differ per worker
    try:
        with storage_errors(spec.storage):
            prep = prepare(spec, log=lambda m: None)
            prep.evaluator.log = log
            run_worker(prep, args.index, log=log)
    except SweepError as exc:
        print(f"error: {tag} {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main())
