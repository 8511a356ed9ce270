"""``python -m var_core.verify``: the fixture's SHA256SUMS is its manifest, so a verify run cannot pass while
checking less than the fixture holds (issue 11, "Trustworthy numbers").

Expected check counts are derived here from the fixture's own golden files and their keys (the fixture READMEs'
tables), not from the verifier's helpers.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from var_core.verify import main

REPO = Path(__file__).resolve().parents[2]
INFINITY_DIR = Path(os.environ.get("VARSCOPE_INFINITY_FIXTURE",
                                   REPO.parent / "shared" / "fixtures" / "official_infinity_tiny"))
needs_infinity = pytest.mark.skipif(not (INFINITY_DIR / "infinity.pth").is_file(),
                                    reason=f"official Infinity fixture not found at {INFINITY_DIR}")


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def _listed(folder: Path) -> list[str]:
    return [line.split()[1].lstrip("*") for line in (folder / "SHA256SUMS").read_text().splitlines() if line.strip()]


def _clone(src: Path, dst: Path, copy: tuple[str, ...] = ()) -> Path:
    """``dst`` with a copy of every file of ``src`` (verify refuses listed files that are links leading out of the
    folder; ``copy`` is kept for the callers that name the files they edit)."""
    for path in src.rglob("*"):
        if path.is_dir():
            continue
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    return dst


def _rehash(folder: Path, name: str) -> None:
    """Update ``name``'s line in SHA256SUMS (appending it if absent), so that only the content is under test."""
    digest = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    manifest = folder / "SHA256SUMS"
    lines = [line for line in manifest.read_text().splitlines() if line.strip() and line.split()[1] != name]
    manifest.unlink()  # it may be a symlink to the read-only original
    manifest.write_text("\n".join(lines + [f"{digest}  {name}"]) + "\n")


def _run(capsys, *argv) -> tuple[int, list[str], str]:
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out.strip().splitlines(), captured.err


def _line(lines: list[str], status: str, name: str) -> str:
    hits = [ln for ln in lines if ln.split()[:2] == [status, name]]
    assert len(hits) == 1, f"expected one {status} line for {name}, got {hits}:\n" + "\n".join(lines)
    return hits[0]


def _var_expected(folder: Path) -> tuple[int, int]:
    """(passed, skipped) for a complete VAR fixture, from its golden list and the keys each golden holds."""
    passed, skipped = 2, 0  # manifest/sha256 and manifest/coverage
    for name in _listed(folder):
        if not name.startswith("golden_"):
            continue
        keys = set(torch.load(folder / name, weights_only=True))
        if name == "golden_vqvae.pt":
            passed += len(keys & {"f_encoded", "idx_Bl", "f_hat_per_scale", "recon"})
        elif name.endswith("_teacher_forcing.pt"):
            passed += 1 + len(keys & {"logits_BLV", "block_outputs"})  # + the input built from golden_vqvae
        elif "_ar_greedy_" in name:
            passed += len(keys & {"raw_logits", "cfg_logits", "idx_Bl", "f_hat", "image"})
        elif "_ar_sampled_rng_" in name:
            passed += 1  # optional, and our sampler reproduces the official stream on this fixture
        elif "_ar_smooth_" in name:
            skipped += 1  # gumbel "more_smooth" is not implemented
        else:
            raise AssertionError(f"unexpected golden {name} in the VAR fixture")
    return passed, skipped


def _infinity_expected(folder: Path) -> int:
    passed = 2
    for name in _listed(folder):
        if not name.startswith("golden_"):
            continue
        g = torch.load(folder / name, weights_only=True)
        keys = set(g)
        if name == "golden_vae.pt":
            passed += len(keys & {"raw_features", "bit_indices", "quantized_sum", "var_input", "recon",
                                  "summed_codes_from_bits"})
        elif name == "golden_teacher_forcing.pt":
            passed += len(keys & {"x_BLC_wo_prefix", "gt_bits_BLd", "text_norm_out", "cond_BD", "ca_kv",
                                  "cond_BD_or_gss", "block0_input", "block_outputs", "logits_BLV",
                                  "bit_ce_per_token", "loss"})
        elif name.startswith("golden_ar_") and int(g["args"]["top_k"]) == 1:
            passed += len(keys & {"bits", "cfg_logits", "raw_logits", "next_input", "codes", "summed_codes",
                                  "summed_codes_last", "img_float", "img_uint8_bgr", "block_outputs"})
        elif name.startswith("golden_ar_"):
            passed += 1  # RNG-dependent: bits only
        else:
            raise AssertionError(f"unexpected golden {name} in the Infinity fixture")
    return passed


# ---------------------------------------------------------------------------------------------------------------
# complete fixtures
# ---------------------------------------------------------------------------------------------------------------
def test_complete_var_fixture_counts_every_golden(fixture_dir, capsys):
    passed, skipped = _var_expected(fixture_dir)
    rc, lines, _ = _run(capsys, fixture_dir)
    assert rc == 0
    assert lines[-1] == f"verify: {passed} passed, 0 failed, {skipped} skipped"
    goldens = [n for n in _listed(fixture_dir) if n.startswith("golden_")]
    assert _line(lines, "PASS", "manifest/coverage").endswith(f"{len(goldens)}/{len(goldens)} goldens checked "
                                                              f"(SHA256SUMS)")
    listed = len(_listed(fixture_dir))
    assert f"{listed}/{listed} listed files" in _line(lines, "PASS", "manifest/sha256")


@needs_infinity
def test_complete_infinity_fixture_counts_every_golden(capsys):
    rc, lines, _ = _run(capsys, INFINITY_DIR)
    assert rc == 0
    assert lines[-1] == f"verify: {_infinity_expected(INFINITY_DIR)} passed, 0 failed"


# ---------------------------------------------------------------------------------------------------------------
# what the manifest guards
# ---------------------------------------------------------------------------------------------------------------
def test_removed_golden_fails_and_is_named(fixture_dir, tmp_path, capsys):
    folder = _clone(fixture_dir, tmp_path / "fx")
    (folder / "golden_var_ar_greedy_cfg1.0.pt").unlink()
    rc, lines, _ = _run(capsys, folder)
    assert rc == 1
    assert "missing" in _line(lines, "FAIL", "manifest/golden_var_ar_greedy_cfg1.0.pt")
    assert lines[-1].startswith("verify: ") and ", 1 failed" in lines[-1]
    assert not any(ln.startswith("PASS  var/greedy_cfg1/") for ln in lines)


def test_tampered_byte_fails_and_is_named(fixture_dir, tmp_path, capsys):
    folder = _clone(fixture_dir, tmp_path / "fx", copy=("var_saln.pth",))
    data = bytearray((folder / "var_saln.pth").read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, somewhere in the weights
    (folder / "var_saln.pth").write_bytes(bytes(data))
    rc, lines, _ = _run(capsys, folder)
    assert rc == 1
    assert "sha256 mismatch" in _line(lines, "FAIL", "manifest/var_saln.pth")
    assert not any(ln.startswith("FAIL") and "manifest/" in ln and "var_saln.pth" not in ln for ln in lines)


def test_no_manifest_is_refused_unless_partial(fixture_dir, tmp_path, capsys):
    folder = _clone(fixture_dir, tmp_path / "fx")
    (folder / "SHA256SUMS").unlink()
    for name in _listed(fixture_dir):
        if name.startswith("golden_") and name != "golden_vqvae.pt":
            (folder / name).unlink()  # the case: only weights and one golden
    rc, lines, err = _run(capsys, folder)
    assert rc == 2 and lines == []
    assert err.startswith("error: ") and "SHA256SUMS" in err and "--partial" in err

    rc, lines, _ = _run(capsys, folder, "--partial")
    assert rc == 0
    assert "PARTIAL" in _line(lines, "SKIP", "manifest/sha256")
    assert any(ln.startswith("verify: PARTIAL") and "sha256" in ln and "coverage" in ln for ln in lines)
    assert lines[-1] == "verify: 5 passed, 0 failed, 1 skipped"  # 4 VQVAE checks + coverage of the one golden


def test_listed_golden_that_no_check_reads_fails(fixture_dir, tmp_path, capsys):
    folder = _clone(fixture_dir, tmp_path / "fx")
    (folder / "golden_var_ar_greedy_cfg2.0.pt").write_bytes((fixture_dir / "golden_vqvae.pt").read_bytes())
    (folder / "golden_unknown_kind.pt").write_bytes((fixture_dir / "golden_vqvae.pt").read_bytes())
    _rehash(folder, "golden_unknown_kind.pt")
    rc, lines, _ = _run(capsys, folder)
    assert rc == 1
    assert "not checked" in _line(lines, "FAIL", "manifest/golden_unknown_kind.pt")
    # a golden on disk that the manifest does not list is reported, not trusted
    assert "not listed" in _line(lines, "SKIP", "manifest/golden_var_ar_greedy_cfg2.0.pt")
    assert [ln.split()[1] for ln in lines if ln.startswith("FAIL")] == ["manifest/golden_unknown_kind.pt"]


def test_corrupt_file_and_missing_required_key_are_one_line_failures(fixture_dir, tmp_path, capsys):
    folder = _clone(fixture_dir, tmp_path / "fx", copy=("golden_var_ar_greedy_cfg1.5.pt",
                                                        "golden_var_saln_teacher_forcing.pt"))
    truncated = (folder / "golden_var_ar_greedy_cfg1.5.pt").read_bytes()[:5000]
    (folder / "golden_var_ar_greedy_cfg1.5.pt").write_bytes(truncated)
    _rehash(folder, "golden_var_ar_greedy_cfg1.5.pt")
    tf = torch.load(folder / "golden_var_saln_teacher_forcing.pt", weights_only=True)
    del tf["x_BLCv_wo_first_l"]
    torch.save(tf, folder / "golden_var_saln_teacher_forcing.pt")
    _rehash(folder, "golden_var_saln_teacher_forcing.pt")
    rc, lines, _ = _run(capsys, folder)
    assert rc == 1
    failures = [ln for ln in lines if ln.startswith("FAIL")]
    assert len(failures) == 2, failures
    assert "golden_var_ar_greedy_cfg1.5.pt: unreadable" in failures[0]
    assert "golden_var_saln_teacher_forcing.pt lacks required key(s) ['x_BLCv_wo_first_l']" in failures[1]
    assert "\n" not in "".join(failures)


@needs_infinity
def test_optional_key_left_out_is_skipped_not_a_crash(tmp_path, capsys):
    folder = _clone(INFINITY_DIR, tmp_path / "fx", copy=("golden_teacher_forcing.pt",))
    tf = torch.load(folder / "golden_teacher_forcing.pt", weights_only=True)
    del tf["block0_input"]
    torch.save(tf, folder / "golden_teacher_forcing.pt")
    _rehash(folder, "golden_teacher_forcing.pt")
    rc, lines, _ = _run(capsys, folder)
    assert rc == 0
    assert "block0_input" in _line(lines, "SKIP", "teacher_forcing/block0_input")
    assert lines[-1] == f"verify: {_infinity_expected(folder)} passed, 0 failed, 1 skipped"
