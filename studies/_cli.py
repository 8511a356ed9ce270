"""How every ``python -m studies.X`` ends: user errors in one line with exit 2, Ctrl-C with exit 130.

``run_cli(main)`` wraps a ``main(argv) -> int``. A :class:`var_core.errors.UserError` (or argparse's own exit) prints
``error: ...`` and exits 2 without a traceback; ``KeyboardInterrupt`` prints what was kept (the results folder the
entry point registered through :func:`note_results_folder`) and exits 130; any other exception is ours and keeps
its traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from var_core.errors import UserError, run_command

_RESULTS_FOLDERS: list[Path] = []


def note_results_folder(path: str | Path) -> None:
    """Register the folder whose finished work survives an interruption (named in the Ctrl-C message)."""
    path = Path(path)
    if path not in _RESULTS_FOLDERS:
        _RESULTS_FOLDERS.append(path)


def fail(message: str) -> UserError:
    """A :class:`UserError` to ``raise`` from argument checks: ``raise fail("--samples must be >= 1")``."""
    return UserError(message)


def run_cli(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` under the user-error convention and return its exit status (Ctrl-C names the results
    folders registered with :func:`note_results_folder`)."""

    _RESULTS_FOLDERS.clear()  # only this command's folders (tests run several commands in one process)

    def kept() -> str:
        folders = ", ".join(str(p) for p in _RESULTS_FOLDERS if p.is_dir())  # a folder never made holds nothing
        return f" Finished work is kept in {folders}; re-run the same command to resume." if folders else ""

    return run_command(main, argv, kept)
