"""A golden that records some per-scale lists for the first scales only: verify compares the scales it holds,
says how many, and fails only on a real difference (or on a golden that records no scale or more scales than the
model produced).

Each family test copies the official fixture's model files and a few goldens into a temporary folder, truncates
every per-scale list of those goldens to a prefix (files written with ``torch.save``, read back by verify with
``weights_only=True`` as it reads the originals), writes a fresh manifest and runs the verifier: everything passes
and the truncated checks carry the note; then one recorded value is perturbed and that check fails.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

from var_core.verify.common import close_scales, equal_scales, identical_scales, recorded_scales

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _subset(src: Path, dst: Path, names: list[str], goldens: dict[str, dict]) -> Path:
    """``names`` (files or folders) copied from ``src``, the edited ``goldens`` saved, a manifest of it all."""
    dst.mkdir(parents=True)
    for name in names:
        (shutil.copytree if (src / name).is_dir() else shutil.copy)(src / name, dst / name)
    for name, golden in goldens.items():
        torch.save(golden, dst / name)
    files = sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file())
    (dst / "SHA256SUMS").write_text("".join(f"{_sha256(dst / f)}  {f}\n" for f in files))
    return dst


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)  # no pickled code runs (as verify loads it)


def _truncate(golden: dict, keys: dict[str, int]) -> dict:
    out = dict(golden)
    for key, k in keys.items():
        out[key] = list(golden[key])[:k]
    return out


def _by_name(checks) -> dict:
    return {c.name: c for c in checks}


def _assert_all_pass(checks) -> None:
    failed = [c.line() for c in checks if c.passed is False]
    assert not failed, "\n".join(failed)


# ---------------------------------------------------------------------------------------------------------------
# the rule, on hand-made lists
# ---------------------------------------------------------------------------------------------------------------
def test_recorded_prefix_rule_hand_worked():
    ours = [torch.full((2, 3), float(s)) for s in range(5)]  # 5 scales produced
    golden = [torch.full((2, 3), float(s)) for s in range(3)]  # scales 0-2 recorded
    check = close_scales("x", ours, golden, 1e-6)
    assert check.passed is True and check.deviation == 0.0 and check.note == "3 of 5 scales recorded (scales 0-2)"
    assert "[3 of 5 scales recorded (scales 0-2)]" in check.line()
    golden[2] = golden[2] + 0.5  # a real difference at a recorded scale
    assert close_scales("x", ours, golden, 1e-6).passed is False
    assert close_scales("x", ours, golden, 1e-6).deviation == 0.5
    assert close_scales("x", ours, ours, 0.0).note == ""  # everything recorded: no note
    assert close_scales("x", ours, [], 1.0).passed is False  # no scale recorded
    assert close_scales("x", ours, ours + [ours[0]], 1.0).passed is False  # more scales than ours produced
    assert recorded_scales("x", ours[1:], ours[1:2], first=1) == (1, "1 of 4 scales recorded (scale 1)")
    nested = [[torch.zeros(2), torch.ones(2)] for _ in range(4)]  # per scale, one tensor per block
    assert close_scales("x", nested, nested[:2], 0.0).passed is True
    assert close_scales("x", nested, [[torch.zeros(2)]], 0.0).passed is False  # a block missing is a difference
    tokens = [torch.tensor([[1, 2]]), torch.tensor([[3, 4]]), torch.tensor([[5, 6]])]
    check = identical_scales("t", tokens, [torch.tensor([[1, 2]]), torch.tensor([[3, 9]])])
    assert check.passed is False and check.deviation == "1/4 differ"
    assert identical_scales("t", tokens, tokens[:2]).passed is True
    assert equal_scales("k", [600, 600, 300], [600, 600], "top-k").passed is True
    assert equal_scales("k", [600, 600, 300], [600, 300], "top-k").passed is False


# ---------------------------------------------------------------------------------------------------------------
# every family through the verifier
# ---------------------------------------------------------------------------------------------------------------
VAR = FIXTURES / "official_var_tiny"
INF = FIXTURES / "official_infinity_tiny"
HART = Path(os.environ.get("VARSCOPE_HART_FIXTURE", FIXTURES / "official_hart_tiny"))


@pytest.mark.skipif(not (VAR / "var.pth").is_file(), reason=f"{VAR} not found")
def test_var_golden_with_a_prefix_of_scales(tmp_path):
    from var_core.verify import verify_var_fixture

    ar = _truncate(_load(VAR / "golden_var_ar_greedy_cfg1.5.pt"),
                   {"raw_logits": 3, "cfg_logits": 3, "idx_Bl": 3, "f_hat": 3})
    vq = _truncate(_load(VAR / "golden_vqvae.pt"), {"idx_Bl": 4, "f_hat_per_scale": 4})
    names = ["config.json", "var.pth", "vae.pth"]
    checks = verify_var_fixture(_subset(VAR, tmp_path / "ok", names, {"golden_var_ar_greedy_cfg1.5.pt": ar,
                                                                        "golden_vqvae.pt": vq}))
    _assert_all_pass(checks)
    by = _by_name(checks)
    for key in ("raw_logits", "cfg_logits", "tokens", "f_hat"):
        assert by[f"var/greedy_cfg1.5/{key}"].passed is True
        assert by[f"var/greedy_cfg1.5/{key}"].note == "3 of 7 scales recorded (scales 0-2)", key
    assert by["vqvae/idx_Bl"].note == by["vqvae/f_hat_per_scale"].note == "4 of 7 scales recorded (scales 0-3)"
    ar["cfg_logits"][2] = ar["cfg_logits"][2].clone()
    ar["cfg_logits"][2][0, 0, 5] += 0.01
    checks = verify_var_fixture(_subset(VAR, tmp_path / "bad", names, {"golden_var_ar_greedy_cfg1.5.pt": ar}))
    assert [c.name for c in checks if c.passed is False] == ["var/greedy_cfg1.5/cfg_logits"]


@pytest.mark.skipif(not (INF / "infinity.pth").is_file(), reason=f"{INF} not found")
def test_infinity_golden_with_a_prefix_of_scales(tmp_path):
    from var_core.verify import verify_infinity_fixture

    name = "golden_ar_greedy_cfg3_tau1.pt"
    ar = _truncate(_load(INF / name), {"bits": 4, "cfg_logits": 4, "raw_logits": 4, "codes": 4, "summed_codes": 4,
                                       "next_input": 3, "block_outputs": 4})
    vae = _truncate(_load(INF / "golden_vae.pt"), {"bit_indices": 5, "var_input": 2})
    names = ["config.json", "infinity.pth", "vae.pth", "inputs.pt"]
    checks = verify_infinity_fixture(_subset(INF, tmp_path / "ok", names, {name: ar, "golden_vae.pt": vae}))
    _assert_all_pass(checks)
    by = _by_name(checks)
    tag = "ar_greedy_cfg3_tau1"
    for key in ("bits", "cfg_logits", "raw_logits", "codes", "summed_codes", "block_outputs"):
        assert by[f"{tag}/{key}"].passed is True and by[f"{tag}/{key}"].note == "4 of 7 scales recorded (scales 0-3)"
    assert by[f"{tag}/next_input"].note == "3 of 6 scales recorded (scales 1-3)"
    assert by["vae/bit_indices"].note == "5 of 7 scales recorded (scales 0-4)"
    assert by["vae/var_input"].note == "2 of 6 scales recorded (scales 1-2)"
    assert by["vae/summed_codes_from_bits"].skipped  # its input, the golden's bits, lacks scales 5-6
    ar["block_outputs"][3] = [x.clone() for x in ar["block_outputs"][3]]
    ar["block_outputs"][3][1][0, 0, 0] += 0.01
    checks = verify_infinity_fixture(_subset(INF, tmp_path / "bad", names, {name: ar}))
    assert [c.name for c in checks if c.passed is False] == [f"{tag}/block_outputs"]


@pytest.mark.skipif(not (HART / "llm" / "config.json").is_file(), reason=f"{HART} not found")
def test_hart_golden_with_a_prefix_of_scales(tmp_path):
    from var_core.verify import verify_hart_fixture

    name = "golden_ar_greedy_cfg4.5.pt"
    ar = _truncate(_load(HART / name), {"idx_Bl": 4, "raw_logits": 4, "block0_input": 4, "block_outputs": 4,
                                        "f_hat": 3, "next_input": 3, "h_BChw": 3, "sampler_top_k": 4,
                                        "sampler_top_p": 4, "min_top1_top2_gap_per_scale": 4})
    vae = _truncate(_load(HART / "golden_vae.pt"), {"idx_Bl": 5, "f_hat_var_per_scale": 5, "next_inputs": 2,
                                                    "vq_min_margin_per_scale": 5})
    names = ["config.json", "inputs.pt", "llm", "tokenizer"]
    checks = verify_hart_fixture(_subset(HART, tmp_path / "ok", names, {name: ar, "golden_vae.pt": vae}))
    _assert_all_pass(checks)
    by = _by_name(checks)
    tag = "llm/greedy_cfg4.5"
    for key in ("tokens", "raw_logits", "block0_input", "block_outputs", "sampler_top_k", "sampler_top_p",
                "min_top1_top2_gap_per_scale"):
        assert by[f"{tag}/{key}"].passed is True and by[f"{tag}/{key}"].note == "4 of 8 scales recorded (scales 0-3)"
    assert by[f"{tag}/f_hat"].note == by[f"{tag}/h_BChw"].note == "3 of 7 scales recorded (scales 0-2)"
    assert by[f"{tag}/next_input"].note == "3 of 7 scales recorded (scales 1-3)"
    for key in ("idx_Bl", "f_hat_var_per_scale", "vq_min_margin_per_scale"):
        assert by[f"vae/{key}"].note == "5 of 8 scales recorded (scales 0-4)", key
    assert by["vae/next_inputs"].note == "2 of 7 scales recorded (scales 1-2)"
    for key in ("image", "final_f_hat", "residual_tokens", "diffusion_out"):  # the whole run is still checked
        assert by[f"{tag}/{key}"].passed is True
    ar["block_outputs"][2] = [x.clone() for x in ar["block_outputs"][2]]
    ar["block_outputs"][2][1][3, 0, 0] += 0.01  # an unconditional row of block 1 at scale 2
    checks = verify_hart_fixture(_subset(HART, tmp_path / "bad", names, {name: ar}))
    assert [c.name for c in checks if c.passed is False] == [f"{tag}/block_outputs"]
    # a golden recording more scales than the model produces, or none, still fails
    extra = dict(ar, block_outputs=list(_load(HART / name)["block_outputs"]) * 2, raw_logits=[])
    checks = verify_hart_fixture(_subset(HART, tmp_path / "odd", names, {name: extra}))
    assert sorted(c.name for c in checks if c.passed is False) == [f"{tag}/block_outputs", f"{tag}/raw_logits"]
