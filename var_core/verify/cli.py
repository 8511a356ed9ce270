"""``python -m var_core.verify FIXTURE_DIR``: detect the fixture's family and run its checks.

One line per check, then ``verify: N passed, M failed[, K skipped]``; exit 0 only when nothing failed, 2 for a
user error (no manifest without ``--partial``, no fixture, an unreadable config).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..errors import UserError, run_command
from .common import Fixture, read_config, summary_line


def detect_family(folder: Path) -> str:
    """``"var"``, ``"infinity"`` or ``"hart"`` from a fixture folder's config.json and weight files."""
    folder = Path(folder)
    config = read_config(folder)
    if "build_vae_var_kwargs" in config:
        return "var"
    if (folder / "infinity.pth").exists() or "infinity_ctor_kwargs" in config:
        return "infinity"
    from .hart import detect as is_hart

    if is_hart(folder, config):
        return "hart"
    raise UserError(f"{folder}/config.json is neither a VAR fixture (build_vae_var_kwargs), an Infinity one "
                    f"(infinity_ctor_kwargs / infinity.pth) nor a HART one (llm_config / llm/config.json); verify "
                    f"supports the formats of shared/fixtures/official_var_tiny, official_infinity_tiny and "
                    f"official_hart_tiny")


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are user errors: one ``error:`` line and exit 2 (not a usage block)."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")


def _threads(text: str) -> int:
    """``--threads``: a whole number >= 1 (torch refuses 0 and negative counts with a traceback)."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _run(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m var_core.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("fixture_dir", type=Path, help="folder in the format of shared/fixtures/official_var_tiny, "
                                                       "official_infinity_tiny or official_hart_tiny")
    parser.add_argument("--partial", action="store_true",
                        help="accept a folder without SHA256SUMS: check only the files present (marked PARTIAL)")
    parser.add_argument("--threads", type=_threads, default=None, help="torch threads (default: leave as is)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.fixture_dir
    family = detect_family(folder)
    fx = Fixture(folder, partial=args.partial)
    if family == "var":
        from .var import verify_var_fixture

        checks = verify_var_fixture(fx)
    elif family == "hart":
        from .hart import verify_hart_fixture

        checks = verify_hart_fixture(fx)
    else:
        from .infinity import verify_infinity_fixture

        checks = verify_infinity_fixture(fx)
    for check in checks:
        print(check.line())
    notice = fx.notice()
    if notice:
        print(notice)
    print(summary_line(checks))
    return 1 if any(c.passed is False for c in checks) else 0


def main(argv: list[str] | None = None) -> int:
    """The command line: user errors (no manifest, no fixture, unreadable config) print one line, exit 2."""
    return run_command(_run, argv)
