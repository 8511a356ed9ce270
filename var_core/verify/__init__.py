"""``python -m var_core.verify FIXTURE_DIR``: check our models against golden outputs of the official code.

Accepts any folder in the format of ``shared/fixtures/official_var_tiny`` (config.json + weights + golden
files), whatever its scales, vocabulary, depth and batch, Infinity folders in the format of
``shared/fixtures/official_infinity_tiny`` (see :mod:`.infinity`) and HART folders in the format of
``shared/fixtures/official_hart_tiny`` (see :mod:`.hart`). Prints one line per check with the maximum
deviation and the tolerance, ends with ``verify: N passed, M failed`` (``, K skipped`` when some checks were
skipped) and exits 0 only when nothing failed.

The folder's ``SHA256SUMS`` is its manifest (see :mod:`.common`): every listed file must be there with its
hash, and every listed golden must be read by a check. A folder without one is refused (exit 2) unless
``--partial`` is given; the output then says PARTIAL and which manifest checks were skipped. A golden that lacks
an optional key gives a ``SKIP`` line; a missing required key or an unreadable file gives one ``FAIL`` line
naming the file. A golden may record a per-scale list (tokens, logits, ``block_outputs`` …) for its first scales
only: those scales are compared and the line says how many (``[4 of 10 scales recorded (scales 0-3)]``); a list
with no scale, or with more scales than the model produced, fails. RNG-dependent goldens are optional: a
mismatch there is reported as ``INFO``, not a failure, because our per-sample sampler may consume randomness
differently from the official single-generator one.

Layout: :mod:`.common` (manifest, fixture files, check lines), one module per family (:mod:`.var`,
:mod:`.infinity`, :mod:`.hart`) and :mod:`.cli` (``python -m var_core.verify``).
"""

from __future__ import annotations

from .cli import detect_family, main
from .common import Check, Fixture
from .hart import verify_hart_fixture
from .infinity import verify_infinity_fixture
from .var import TOL_IMAGE, TOL_LOGITS, verify_var_fixture

__all__ = ["Check", "Fixture", "TOL_IMAGE", "TOL_LOGITS", "detect_family", "main", "verify_hart_fixture",
           "verify_infinity_fixture", "verify_var_fixture"]
