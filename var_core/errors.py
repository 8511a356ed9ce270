"""The user-error convention shared by every entry point.

A :class:`UserError` is a mistake in what the user asked for (a name, a path, a value, a file): its message says
what was wrong and how to fix it, with a did-you-mean where names are involved. Entry points catch it, print it
in one or two lines and exit 2 (see :func:`studies._cli.run_cli`); anything else is a bug of ours and keeps its
traceback. The project's specific errors (checkpoint, override, sweep, sensitivity, registry) subclass it.
"""

from __future__ import annotations

import difflib
import sys
from typing import Callable, Iterable


class UserError(Exception):
    """Bad input from the user: printed as ``error: <message>`` and exit status 2, never a traceback."""

    def __str__(self) -> str:  # KeyError subclasses would otherwise quote the message
        return str(self.args[0]) if self.args else ""


def did_you_mean(name: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.4) -> str:
    """`` Did you mean 'x' or 'y'?`` (with the leading space) for the closest ``choices``, or ``''``."""
    close = difflib.get_close_matches(str(name), [str(c) for c in choices], n=n, cutoff=cutoff)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def run_command(main: Callable[[list[str] | None], int], argv: list[str] | None = None,
                interrupted: Callable[[], str] = lambda: "") -> int:
    """Run a command-line ``main(argv)`` under the convention: a :class:`UserError` prints ``error: ...`` and
    returns 2, Ctrl-C prints ``interrupted.`` plus ``interrupted()`` (what was kept) and returns 130, anything else
    is a bug of ours and keeps its traceback."""
    try:
        return int(main(argv) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted.{interrupted()}", file=sys.stderr)
        return 130
