"""The user-error convention shared by every entry point.

A :class:`UserError` is a mistake in what the user asked for (a name, a path, a value, a file): its message says
what was wrong and how to fix it, with a did-you-mean where names are involved. Entry points catch it, print it
in one or two lines and exit 2 (see :func:`studies._cli.run_cli`); anything else is a bug of ours and keeps its
traceback. The project's specific errors (checkpoint, override, sweep, sensitivity, registry) subclass it.
"""

from __future__ import annotations

import difflib
import errno
import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator


class UserError(Exception):
    """Bad input from the user: printed as ``error: <message>`` and exit status 2, never a traceback."""

    def __str__(self) -> str:  # KeyError subclasses would otherwise quote the message
        return str(self.args[0]) if self.args else ""


def did_you_mean(name: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.4) -> str:
    """`` Did you mean 'x' or 'y'?`` (with the leading space) for the closest ``choices``, or ``''``."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=n, cutoff=cutoff)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


#: what a file-system fault (not a bug of ours) means for the user, by errno: the fix that goes with it
FILE_SYSTEM_FAULTS = {
    errno.EROFS: "the file system is read-only: write somewhere writable (--out, --save-images)",
    errno.ENOSPC: "the disk is full: free space, or write to another disk (--out, --save-images)",
    errno.EDQUOT: "the disk quota is used up: free space, or write somewhere else (--out, --save-images)",
    errno.EACCES: "permission denied: choose a place you may write (--out, --save-images) or fix its permissions",
    errno.EPERM: "operation not permitted: choose a place you may write (--out, --save-images)",
    errno.EFBIG: "the file would exceed the file system's size limit: write to another file system",
}


def file_system_fault(exc: BaseException) -> str | None:
    """One line for an :class:`OSError` that is a fault of the file system (read-only, full, quota, permission),
    naming the path and the errno's reason with the fix; ``None`` for anything else (a bug keeps its traceback)."""
    if not isinstance(exc, OSError) or exc.errno not in FILE_SYSTEM_FAULTS:
        return None
    where = f"cannot write {exc.filename}" if exc.filename else "a write failed"
    reason = exc.strerror or os.strerror(exc.errno)
    return f"{where}: {reason} ({errno.errorcode.get(exc.errno, exc.errno)}); {FILE_SYSTEM_FAULTS[exc.errno]}"


def _torch_write_failure(exc: BaseException) -> bool:
    """torch.save's C++ writer reports a failed write as a RuntimeError (``inline_container.cc`` /
    ``PytorchStreamWriter failed writing file``) without the errno."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text
                                              or "file write failed" in text)


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Around a write of ``path``: a failure of the file system comes out as an :class:`OSError` that names
    ``path`` (PIL's and torch's writers often lose the name, and torch's reports a full disk as a RuntimeError),
    so the entry point can print one line (:func:`file_system_fault`)."""
    try:
        yield
    except OSError as exc:
        # no name, or a temporary file beside path: name path itself (a folder above it that failed keeps its name)
        if exc.errno is not None and (exc.filename is None or Path(exc.filename).parent == Path(path).parent):
            raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from exc
        raise
    except RuntimeError as exc:
        if not _torch_write_failure(exc):
            raise
        cause = exc.__context__ if isinstance(exc.__context__, OSError) else None
        code = cause.errno if cause is not None and cause.errno else _errno_of_place(Path(path))
        raise OSError(code, os.strerror(code), str(path)) from exc


def _errno_of_place(path: Path) -> int:
    """Why a write below ``path``'s folder failed when the writer did not say: a full disk, a read-only file
    system, or an I/O error."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        stats = os.statvfs(folder)
    except OSError:
        return errno.EIO
    if stats.f_flag & getattr(os, "ST_RDONLY", 1):
        return errno.EROFS
    if stats.f_bavail == 0 or stats.f_favail == 0:
        return errno.ENOSPC
    return errno.EIO


# ----- Ctrl-C while the modules load ----------------------------------------------------------------------------
_IMPORT_GUARD: list = []  # the SIGINT handler that was in place before guard_imports(), while a guard is on


def _exit_now(signum, frame) -> None:
    sys.stderr.write("\ninterrupted (while loading; nothing was computed).\n")
    sys.stderr.flush()
    os._exit(130)


def guard_imports() -> None:
    """Until :func:`end_import_guard`, Ctrl-C ends the process at once with status 130 and one line. While modules
    load, a KeyboardInterrupt cannot be trusted to arrive: torch's C code imports numpy and drops the exception
    (the command then runs to the end and exits 0), and an import cut in half leaves modules that fail later with
    a traceback. Nothing has been computed yet, so exiting at once loses nothing. No-op outside the main thread
    and when SIGINT is ignored (a background job)."""
    if _IMPORT_GUARD or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN or previous is None:
        return
    signal.signal(signal.SIGINT, _exit_now)
    _IMPORT_GUARD.append(previous)


def end_import_guard() -> None:
    """Give Ctrl-C back to the handler that was in place before :func:`guard_imports` (KeyboardInterrupt)."""
    if _IMPORT_GUARD and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _IMPORT_GUARD.pop())


@contextmanager
def importing() -> Iterator[None]:
    """``with importing(): import heavy_module``: :func:`guard_imports` for the block."""
    guard_imports()
    try:
        yield
    finally:
        end_import_guard()


def run_command(main: Callable[[list[str] | None], int], argv: list[str] | None = None,
                interrupted: Callable[[], str] = lambda: "") -> int:
    """Run a command-line ``main(argv)`` under the convention: a :class:`UserError` prints ``error: ...`` and
    returns 2, a file-system fault (read-only, full disk, permission: :func:`file_system_fault`) prints one
    ``error:`` line naming the path plus ``interrupted()`` (what was kept) and returns 2, Ctrl-C prints
    ``interrupted.`` plus ``interrupted()`` and returns 130, anything else is a bug of ours and keeps its
    traceback. A Ctrl-C guard left on by the module imports (:func:`guard_imports`) ends here."""
    end_import_guard()
    try:
        return int(main(argv) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        line = file_system_fault(exc)
        if line is None:
            raise
        print(f"error: {line}.{interrupted()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted.{interrupted()}", file=sys.stderr)
        return 130
