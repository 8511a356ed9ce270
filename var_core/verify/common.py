"""What every fixture verifier shares: check lines, tolerance helpers, and the fixture's manifest.

A fixture folder's ``SHA256SUMS`` is its manifest (``sha256sum`` format, ``<hex>  <relative path>``). With a
manifest, :class:`Fixture` makes three promises that a verifier alone cannot:

* every listed file exists and has its listed hash (one ``FAIL manifest/<file>`` line per file that does not);
* every listed ``golden_*.pt`` is read by some check (a listed golden that no check consumes is ``FAIL ... not
  checked``, so an unknown or misspelt golden cannot be ignored in silence);
* the goldens a verifier iterates over are the listed ones, so a deleted golden is a failure, not a smaller total.

A folder without a manifest is refused (:class:`ManifestError`, exit 2) unless ``partial=True`` (``--partial``):
then the presence and hash checks are reported as ``SKIP`` and the run is labelled ``PARTIAL``; goldens found on
disk are still all required to be checked.

A manifest proves **completeness, not authenticity**: it shows that the folder holds every file it lists, unchanged
since the manifest was written, but whoever edits the files can rewrite ``SHA256SUMS`` to match. The passing
``manifest/sha256`` line therefore prints the manifest's own sha256, to compare with a copy from a trusted source
(the fixture's producer, the README of the shared folder). A listed file that is a symbolic link leading out of the
folder (or that lies below such a link) is refused (:class:`ManifestError`, exit 2): the hashes would then vouch
for a file elsewhere, which anyone able to write there could swap.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError

MANIFEST = "SHA256SUMS"
GOLDEN_GLOB = "golden_*.pt"
_MANIFEST_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


class ManifestError(UserError):
    """A fixture folder has no usable ``SHA256SUMS`` manifest."""


class FixtureFileError(UserError):
    """A fixture file exists but cannot be read."""


# ---------------------------------------------------------------------------------------------------------------
# check lines
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Check:
    """One line of a verification report.

    ``passed``: True (PASS), False (FAIL) or None (not counted either way: ``SKIP`` when ``skipped`` is set,
    otherwise ``INFO``, an optional check whose mismatch is only reported). ``detail`` replaces the
    ``max_dev=… tol=…`` columns with free text (reasons for failures and skips).
    """

    name: str
    passed: bool | None  # None: optional check, reported only
    deviation: float | str = ""
    tolerance: float | str = ""
    skipped: bool = False
    detail: str | None = None
    note: str = ""  # appended in brackets (e.g. which scales a golden records)

    @property
    def status(self) -> str:
        if self.skipped:
            return "SKIP"
        return {True: "PASS", False: "FAIL", None: "INFO"}[self.passed]

    def line(self) -> str:
        note = f"  [{self.note}]" if self.note else ""
        if self.detail is not None:
            return f"{self.status}  {self.name:<48s} {self.detail}{note}"
        dev = f"{self.deviation:.3g}" if isinstance(self.deviation, float) else self.deviation
        tol = f"{self.tolerance:.3g}" if isinstance(self.tolerance, float) else self.tolerance
        return f"{self.status}  {self.name:<48s} max_dev={dev:<10s} tol={tol}{note}"


def skip(name: str, why: str) -> Check:
    return Check(name, None, skipped=True, detail=why)


def fail(name: str, why: str) -> Check:
    return Check(name, False, detail=why)


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message with newlines folded."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def guard(checks: list[Check], tag: str, body) -> None:
    """Run one golden's checks; an unreadable file becomes one FAIL line naming it."""
    try:
        body()
    except FixtureFileError as exc:
        checks.append(fail(tag, one_line(exc)))


def summary_line(checks: list[Check]) -> str:
    """``verify: N passed, M failed`` (``, K skipped`` when some checks were skipped or only reported)."""
    passed = sum(c.passed is True for c in checks)
    failed = sum(c.passed is False for c in checks)
    skipped = sum(c.passed is None for c in checks)
    return f"verify: {passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else "")


def _max_dev(a, b) -> float:
    a, b = torch.as_tensor(a).detach().float(), torch.as_tensor(b).detach().float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max()) if a.numel() else 0.0


def _close(name, ours, golden, tol) -> Check:
    if isinstance(golden, (list, tuple)):
        devs = [_max_dev(o, g) for o, g in zip(ours, golden)]
        dev = max(devs, default=0.0) if len(ours) == len(golden) else float("inf")
    else:
        dev = _max_dev(ours, golden)
    return Check(name, dev <= tol, dev, tol)


def recorded_scales(name: str, ours, golden, first: int = 0) -> tuple[int, str] | Check:
    """How many leading entries of a per-scale golden list to compare, and the note that says so.

    A golden may record a per-scale key (``block_outputs``, logits, tokens …) for the first scales only: those are
    compared with ours, and the check says how many (``4 of 10 scales recorded (scales 0-3)``; no note when the
    golden records every scale). A golden that records no scale, or more scales than ours produced, is a FAIL
    check. ``first``: the scale of entry 0 (1 for next-scale inputs, which start at scale 1)."""
    if not isinstance(golden, (list, tuple)):
        return fail(name, f"expected a per-scale list in the golden, got {type(golden).__name__}")
    n_golden, n_ours = len(golden), len(ours)
    if n_golden == 0:
        return fail(name, "the golden records no scale (an empty per-scale list)")
    if n_golden > n_ours:
        return fail(name, f"the golden records {n_golden} scales, ours produced {n_ours}")
    if n_golden == n_ours:
        return n_golden, ""
    last = first + n_golden - 1
    where = f"scale {first}" if n_golden == 1 else f"scales {first}-{last}"
    return n_golden, f"{n_golden} of {n_ours} scales recorded ({where})"


def _nested_dev(ours, golden) -> float:
    """Max deviation of nested lists of tensors (inf on a structure or shape mismatch)."""
    if isinstance(golden, (list, tuple)):
        if not isinstance(ours, (list, tuple)) or len(ours) != len(golden):
            return float("inf")
        return max((_nested_dev(o, g) for o, g in zip(ours, golden)), default=0.0)
    return _max_dev(ours, golden)


def close_scales(name, ours, golden, tol, first: int = 0) -> Check:
    """:func:`_close` per scale, over the scales the golden records (see :func:`recorded_scales`); an entry may
    itself be a list (e.g. one tensor per block)."""
    window = recorded_scales(name, ours, golden, first)
    if isinstance(window, Check):
        return window
    k, note = window
    dev = max((_nested_dev(o, g) for o, g in zip(list(ours)[:k], list(golden)[:k])), default=0.0)
    return Check(name, dev <= tol, dev, tol, note=note)


def identical_scales(name, ours, golden, optional=False, first: int = 0) -> Check:
    """:func:`_identical` per scale, over the scales the golden records (see :func:`recorded_scales`)."""
    window = recorded_scales(name, ours, golden, first)
    if isinstance(window, Check):  # a malformed golden, even for an optional check
        return window
    k, note = window
    check = _identical(name, list(ours)[:k], list(golden)[:k], optional=optional)
    check.note = note
    return check


def equal_scales(name, ours: list, golden, what: str, same=lambda a, b: a == b) -> Check:
    """Per-scale values (settings such as the sampler's top-k) equal over the scales the golden records."""
    window = recorded_scales(name, ours, golden)
    if isinstance(window, Check):
        return window
    k, note = window
    ok = all(same(o, g) for o, g in zip(list(ours)[:k], list(golden)[:k]))
    detail = f"{what} {list(golden)}" if ok else f"{what}: ours {list(ours)[:k]} vs {list(golden)}"
    return Check(name, ok, detail=detail, note=note)


def _identical(name, ours, golden, optional=False) -> Check:
    ours, golden = list(ours), list(golden)
    mismatches = sum(int((o != g).sum()) if o.shape == g.shape else g.numel() for o, g in zip(ours, golden))
    mismatches += abs(len(ours) - len(golden))
    total = sum(g.numel() for g in golden)
    ok = mismatches == 0
    return Check(name, ok if not optional else (None if not ok else True), f"{mismatches}/{total} differ", "exact")


# ---------------------------------------------------------------------------------------------------------------
# the manifest
# ---------------------------------------------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict[str, str] | None:
    """``{relative path: sha256}`` from ``folder/SHA256SUMS``, or None when the folder has none."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise FixtureFileError(f"{path}: cannot be read ({one_line(exc)})") from exc
    entries: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _MANIFEST_LINE.match(line)
        if not m:
            raise ManifestError(f"{path} line {number} is not '<64 hex digits>  <file name>': {raw!r}. Regenerate "
                                f"it with `sha256sum FILES > {MANIFEST}` inside the fixture folder")
        name = m.group(2).strip()
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ManifestError(f"{path} line {number} names {name!r}: entries must be paths inside the folder")
        entries[name] = m.group(1).lower()
    if not entries:
        raise ManifestError(f"{path} lists no files; regenerate it with `sha256sum FILES > {MANIFEST}`")
    return entries


def read_config(folder: Path) -> dict:
    """A fixture folder's ``config.json``; a missing or malformed one is a :class:`UserError` naming it."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UserError(f"{folder} has no config.json; is it a fixture folder (in the format of "
                        f"shared/fixtures/official_var_tiny or official_infinity_tiny)?")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FixtureFileError(f"{path}: not readable JSON ({one_line(exc)})") from exc
    if not isinstance(config, dict):
        raise FixtureFileError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Fixture:
    """A fixture folder read through its manifest; records which goldens the checks consumed."""

    def __init__(self, folder: str | Path, partial: bool = False):
        self.folder = Path(folder)
        self.partial = bool(partial)
        if not self.folder.is_dir():
            raise UserError(f"fixture folder not found: {self.folder}")
        self.manifest = read_manifest(self.folder)
        if self.manifest is None and not self.partial:
            raise ManifestError(
                f"{self.folder} has no {MANIFEST}: without its manifest, verify cannot tell a complete fixture "
                f"from one with files missing. Restore {MANIFEST} (the fixture's list of sha256 sums), or pass "
                f"--partial to check only the files that are there (the output is then marked PARTIAL)"
            )
        self.consumed: set[str] = set()
        self._refuse_links_out()

    def _refuse_links_out(self) -> None:
        """:class:`ManifestError` naming the first listed file (every file, in a partial run) whose path leads out
        of the folder through a symbolic link: verify reads only the fixture's own files."""
        root = self.folder.resolve()
        for name in self.listed():
            path = self.folder / name
            if not (path.exists() or path.is_symlink()):
                continue  # a missing file is the manifest check's FAIL line
            target = path.resolve()
            if target == root or root in target.parents:
                continue
            link = next((p for p in [path, *path.parents] if p.is_symlink()), path)
            where = MANIFEST if self.manifest is not None else "the folder (PARTIAL)"
            raise ManifestError(
                f"{path} (listed in {where}) leads out of the fixture folder: {link} is a symbolic link to "
                f"{os.readlink(link) if link.is_symlink() else target}. verify reads only files inside the folder "
                f"(a manifest vouches for completeness, not for files elsewhere); copy the file in "
                f"(cp --remove-destination {target} {path}) and re-run")

    # ----- what the folder holds ---------------------------------------------------------------------------
    def listed(self) -> list[str]:
        """The files the checks may rely on: the manifest's, or (partial) every file in the folder."""
        if self.manifest is not None:
            return sorted(self.manifest)
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file())

    def goldens(self, pattern: str = GOLDEN_GLOB) -> list[str]:
        """Golden file names matching ``pattern`` (manifest order-independent, sorted)."""
        return sorted(n for n in self.listed() if "/" not in n and fnmatch.fnmatchcase(n, pattern)
                      and fnmatch.fnmatchcase(n, GOLDEN_GLOB))

    def has(self, name: str) -> bool:
        """Listed in the manifest (the file may still be missing: that is a manifest failure), or on disk."""
        if self.manifest is not None:
            return name in self.manifest
        return (self.folder / name).is_file()

    def exists(self, name: str) -> bool:
        return (self.folder / name).is_file()

    def path(self, name: str) -> Path:
        return self.folder / name

    def config(self) -> dict:
        return read_config(self.folder)

    def load(self, name: str):
        """``torch.load`` a fixture file (weights only) and mark it consumed; None when the file is missing
        (reported by the manifest check). An unreadable file raises :class:`FixtureFileError` naming it."""
        self.consumed.add(name)
        path = self.folder / name
        if not path.is_file():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised as one line naming the file
            raise FixtureFileError(f"{name}: unreadable ({one_line(exc)})") from exc

    def consume(self, name: str) -> None:
        """Mark a golden as handled by a check that does not read it (a deliberate skip)."""
        self.consumed.add(name)

    # ----- the manifest's own checks -----------------------------------------------------------------------
    def integrity_checks(self) -> list[Check]:
        """Presence and sha256 of every listed file (``SKIP`` lines in a partial run)."""
        if self.manifest is None:
            return [skip("manifest/sha256", f"PARTIAL: no {MANIFEST}, so file presence and hashes were not "
                                            f"checked")]
        checks = []
        for name, expected in sorted(self.manifest.items()):
            path = self.folder / name
            if not path.is_file():
                checks.append(fail(f"manifest/{name}", f"missing: {name} is listed in {MANIFEST} but is not in "
                                                       f"{self.folder}"))
                continue
            try:
                actual = sha256_of(path)
            except OSError as exc:
                checks.append(fail(f"manifest/{name}", f"unreadable: {one_line(exc)}"))
                continue
            if actual != expected:
                checks.append(fail(f"manifest/{name}", f"sha256 mismatch: {name} is {actual[:16]}…, {MANIFEST} "
                                                       f"lists {expected[:16]}… (changed or corrupt file)"))
        if not checks:
            own = sha256_of(self.folder / MANIFEST)
            checks.append(Check("manifest/sha256", True, detail=f"{len(self.manifest)}/{len(self.manifest)} listed "
                                                                f"files present with their sha256 (completeness, "
                                                                f"not authenticity: compare {MANIFEST} sha256 "
                                                                f"{own[:16]}… with a trusted copy)"))
        for name in sorted(p.name for p in self.folder.glob(GOLDEN_GLOB)):
            if name not in self.manifest:
                checks.append(skip(f"manifest/{name}", f"not listed in {MANIFEST}, so not checked (add its sha256 "
                                                       f"line to check it)"))
        return checks

    def coverage_checks(self) -> list[Check]:
        """Every golden the checks may rely on was consumed by some check."""
        goldens = self.goldens()
        unchecked = [g for g in goldens if g not in self.consumed]
        where = MANIFEST if self.manifest is not None else f"{self.folder} (PARTIAL: goldens found on disk)"
        checks = [fail(f"manifest/{g}", f"not checked: no check of this verifier reads {g} (listed in {where}); "
                                        f"a misspelt or unknown golden, or one for a model file that is absent")
                  for g in unchecked]
        if not unchecked:
            checks.append(Check("manifest/coverage", True, detail=f"{len(goldens)}/{len(goldens)} goldens "
                                                                  f"checked ({where})"))
        return checks

    def notice(self) -> str | None:
        """The line that labels a partial run."""
        if self.manifest is not None:
            return None
        return (f"verify: PARTIAL run (--partial): {self.folder} has no {MANIFEST}; skipped manifest checks: "
                f"file presence, sha256 hashes, coverage of listed goldens (only goldens on disk were required)")


def require_keys(golden: dict, name: str, tag: str, keys: tuple[str, ...]) -> Check | None:
    """A FAIL naming the file and the missing keys, or None when ``golden`` has all of ``keys``."""
    if not isinstance(golden, dict):
        return fail(tag, f"{name} does not hold a dict of tensors (got {type(golden).__name__})")
    missing = [k for k in keys if k not in golden]
    if missing:
        return fail(tag, f"{name} lacks required key(s) {missing}; it holds {sorted(golden)}")
    return None


def absent(name: str, key: str) -> str:
    return f"key {key!r} is not in {name} (optional)"
