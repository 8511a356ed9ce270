"""Our VQVAE / multi-scale quantizer against the golden outputs of the official VAR code.

Fixture: ``shared/fixtures/official_var_tiny`` (see its README), or the directory in ``VARSCOPE_VAR_FIXTURE``.
Tolerances follow the README (tokens exact, features 1e-4, images 2e-4), so the thread count does not matter.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from var_core.models.quant import (
    MEASURED_PHI_TABLES_K4,
    MultiScaleResidualQuantizer,
    _tick_argmin_table,
    phi_index_table,
)
from var_core.models.vqvae import VQVAE

FIXTURE_DIR = Path(
    os.environ.get(
        "VARSCOPE_VAR_FIXTURE",
        Path(__file__).resolve().parents[2].parent / "shared/fixtures/official_var_tiny",
    )
)
needs_fixture = pytest.mark.skipif(
    not (FIXTURE_DIR / "vae.pth").is_file(),
    reason=f"official VAR fixture not found at {FIXTURE_DIR} (set VARSCOPE_VAR_FIXTURE)",
)


def _fixture_vqvae() -> VQVAE:
    cfg = json.loads((FIXTURE_DIR / "config.json").read_text())["build_vae_var_kwargs"]
    return VQVAE(
        vocab_size=cfg["V"],
        z_channels=cfg["Cvae"],
        ch=cfg["ch"],
        patch_nums=tuple(cfg["patch_nums"]),
        share_quant_resi=cfg["share_quant_resi"],
    )


def _load(name: str):
    return torch.load(FIXTURE_DIR / name, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def vae_sd() -> dict:
    return _load("vae.pth")


@pytest.fixture(scope="module")
def vae(vae_sd) -> VQVAE:
    model = _fixture_vqvae()
    model.load_state_dict(vae_sd, strict=True)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def golden() -> dict:
    return _load("golden_vqvae.pt")


# ----------------------------------------------------------------------------- official goldens
@needs_fixture
def test_state_dict_layout_matches_official(vae_sd):
    model = _fixture_vqvae()
    ours = model.state_dict()
    assert list(ours) == list(vae_sd)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in vae_sd.items()}


@needs_fixture
def test_encoder_tokens_fhat_and_recon(vae, golden):
    with torch.no_grad():
        f_BChw = vae.encode_features(golden["image"])
        torch.testing.assert_close(f_BChw, golden["f_encoded"], atol=1e-4, rtol=0)

        idx_list = vae.img_to_idx_list(golden["image"])
        assert len(idx_list) == len(golden["idx_Bl"])
        for ours, ref in zip(idx_list, golden["idx_Bl"]):
            assert ours.dtype == torch.int64
            assert torch.equal(ours, ref)

        fhat_list = vae.quantize.f_to_fhat_list(golden["f_encoded"])
        assert len(fhat_list) == len(golden["f_hat_per_scale"])
        for ours, ref in zip(fhat_list, golden["f_hat_per_scale"]):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)

        torch.testing.assert_close(vae.fhat_to_img(fhat_list[-1]), golden["recon"], atol=2e-4, rtol=0)
        torch.testing.assert_close(vae.idx_list_to_img(golden["idx_Bl"]), golden["recon"], atol=2e-4, rtol=0)


@needs_fixture
def test_teacher_forcing_input(vae, golden):
    ref = _load("golden_var_teacher_forcing.pt")["x_BLCv_wo_first_l"]
    with torch.no_grad():
        x_BLCv = vae.quantize.idx_list_to_var_input(golden["idx_Bl"])
    assert x_BLCv.shape == ref.shape == (2, sum(p * p for p in vae.patch_nums) - 1, vae.z_channels)
    torch.testing.assert_close(x_BLCv, ref, atol=1e-4, rtol=0)


@needs_fixture
def test_next_autoregressive_input_matches_official_fhat(vae):
    ar = _load("golden_var_ar_greedy_cfg1.0.pt")
    q = vae.quantize
    full = vae.patch_nums[-1]
    f_hat = torch.zeros(2, vae.z_channels, full, full)
    with torch.no_grad():
        for si, pn in enumerate(vae.patch_nums):
            before = f_hat.clone()
            f_hat_new, nxt = q.next_autoregressive_input(si, f_hat, q.embed_idx(ar["idx_Bl"][si], pn))
            assert torch.equal(f_hat, before), "next_autoregressive_input must not change f_hat in place"
            torch.testing.assert_close(f_hat_new, ar["f_hat"][si], atol=1e-4, rtol=0)
            if si == len(vae.patch_nums) - 1:
                assert nxt is None
            else:
                nxt_pn = vae.patch_nums[si + 1]
                assert nxt.shape == (2, vae.z_channels, nxt_pn, nxt_pn)
            f_hat = f_hat_new
        img = vae.fhat_to_img(f_hat).add(1).mul(0.5)
    torch.testing.assert_close(img, ar["image"], atol=2e-4, rtol=0)


# ----------------------------------------------------------------------------- Phi tables
def test_phi_tables():
    assert phi_index_table(7, 4) == (0, 0, 1, 2, 2, 3, 3)
    assert phi_index_table(10, 4) == (0, 0, 1, 1, 1, 2, 2, 3, 3, 3)
    assert phi_index_table(14, 4) == (0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3)
    # The float64 computation reproduces every measured table (ties included).
    for num_scales, table in MEASURED_PHI_TABLES_K4.items():
        assert _tick_argmin_table(num_scales, 4) == table
    assert phi_index_table(10, 0) == tuple(range(10))
    assert phi_index_table(10, 1) == (0,) * 10
    assert phi_index_table(1, 4) == (0,)
    q = MultiScaleResidualQuantizer(16, 4, (1, 2, 3, 4, 5, 6, 8))
    assert [q.phi_index(si) for si in range(7)] == [0, 0, 1, 2, 2, 3, 3]


@needs_fixture
def test_fixture_config_phi_table(vae):
    cfg = json.loads((FIXTURE_DIR / "config.json").read_text())
    assert list(vae.quantize.phi_table) == cfg["derived"]["phi_index_per_scale"]


def test_phi_key_layouts_follow_official_sharing_modes():
    def phi_keys(share):
        q = MultiScaleResidualQuantizer(8, 4, (1, 2, 4), share_quant_resi=share)
        return sorted(k for k in q.state_dict() if k.startswith("quant_resi."))

    assert phi_keys(0) == sorted(f"quant_resi.{i}.{p}" for i in range(3) for p in ("weight", "bias"))
    assert phi_keys(1) == ["quant_resi.qresi.bias", "quant_resi.qresi.weight"]
    assert phi_keys(4) == sorted(f"quant_resi.qresi_ls.{i}.{p}" for i in range(4) for p in ("weight", "bias"))


def test_phi_formula():
    torch.manual_seed(0)
    q = MultiScaleResidualQuantizer(8, 4, (1, 2, 4), share_quant_resi=1, quant_resi=0.5)
    h = torch.randn(2, 4, 4, 4)
    conv = q.quant_resi.qresi
    torch.testing.assert_close(q.phi(1, h), 0.5 * h + 0.5 * nn.functional.conv2d(h, conv.weight, conv.bias, padding=1))


# ----------------------------------------------------------------------------- loading
@needs_fixture
def test_load_with_different_scale_count_keeps_own_ema_buffer(vae_sd):
    sd = dict(vae_sd)
    sd["quantize.ema_vocab_hit_SV"] = torch.full((10, 256), 7.0)  # e.g. a 10-scale checkpoint
    model = _fixture_vqvae()
    own = model.quantize.ema_vocab_hit_SV.clone()
    model.load_state_dict(sd, strict=True)
    assert torch.equal(model.quantize.ema_vocab_hit_SV, own)
    assert sd["quantize.ema_vocab_hit_SV"].shape == (10, 256), "the caller's dict must not be modified"
    torch.testing.assert_close(model.quantize.embedding.weight, vae_sd["quantize.embedding.weight"], atol=0, rtol=0)

    # The 7-scale fixture also loads into a 5-scale schedule with the same last scale.
    other = VQVAE(vocab_size=256, z_channels=16, ch=32, patch_nums=(1, 2, 4, 6, 8))
    other.load_state_dict(vae_sd, strict=True)
    assert other.quantize.ema_vocab_hit_SV.shape == (5, 256)

    # Same scale count: the checkpoint buffer is loaded.
    same = _fixture_vqvae()
    sd7 = dict(vae_sd)
    sd7["quantize.ema_vocab_hit_SV"] = torch.full((7, 256), 3.0)
    same.load_state_dict(sd7, strict=True)
    assert torch.equal(same.quantize.ema_vocab_hit_SV, torch.full((7, 256), 3.0))


def test_official_default_layout_size():
    with torch.device("meta"):
        model = VQVAE()
    sd = model.state_dict()
    assert len(sd) == 324
    assert sum(v.numel() for v in sd.values()) == 108_989_315
    assert sd["quantize.ema_vocab_hit_SV"].shape == (10, 4096)
    assert model.downsample_factor == 16 and model.image_size == 256


# ----------------------------------------------------------------------------- training support
def _tiny_vqvae() -> VQVAE:
    return VQVAE(
        vocab_size=32, z_channels=8, ch=32, ch_mult=(1, 2), num_res_blocks=1,
        patch_nums=(1, 2, 4), norm_groups=8,
    )


def test_training_forward_smoke():
    torch.manual_seed(0)
    model = _tiny_vqvae().train()
    assert model.downsample_factor == 2 and model.image_size == 8
    assert VQVAE.from_config(model.config).config == model.config
    img = torch.rand(3, 3, 8, 8) * 2 - 1
    recon, vq_loss, stats = model(img)
    assert recon.shape == img.shape
    loss = nn.functional.mse_loss(recon, img) + vq_loss
    assert torch.isfinite(loss)
    loss.backward()
    for name in ("encoder.conv_in.weight", "decoder.conv_out.weight", "quantize.embedding.weight",
                 "quantize.quant_resi.qresi_ls.0.weight", "quant_conv.weight", "post_quant_conv.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert stats["hits_SV"].shape == (3, 32)
    assert stats["hits_SV"].sum(1).tolist() == [3.0 * p * p for p in (1, 2, 4)]
    assert model.quantize.ema_vocab_hit_SV.sum() > 0  # EMA updated in training mode

    # The straight-through output has the value of the quantized f_hat.
    with torch.no_grad():
        f = model.encode_features(img)
        f_st, _, _ = model.quantize(f)
        torch.testing.assert_close(f_st, model.quantize.f_to_fhat_list(f)[-1], atol=1e-5, rtol=0)


def test_restart_dead_codes_deterministic():
    def run():
        torch.manual_seed(0)
        q = MultiScaleResidualQuantizer(16, 4, (1, 2, 4))
        q.ema_vocab_hit_SV[:, :4] = 5.0
        f = torch.randn(2, 4, 4, 4)
        n = q.restart_dead_codes(f, min_usage=1.0, generator=torch.Generator().manual_seed(1))
        return n, q, f

    n1, q1, f = run()
    n2, q2, _ = run()
    assert n1 == n2 == 12
    assert torch.equal(q1.embedding.weight, q2.embedding.weight)
    feats = f.permute(0, 2, 3, 1).reshape(-1, 4)
    for v in q1.embedding.weight[4:]:
        assert (feats == v).all(dim=1).any()
    assert (q1.ema_vocab_hit_SV[:, 4:] > 0).all()


def test_constructing_leaves_global_reset_parameters_untouched():
    before = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Conv2d, nn.GroupNorm, nn.Embedding, nn.LayerNorm)}
    _tiny_vqvae()
    MultiScaleResidualQuantizer(8, 4, (1, 2))
    for cls, fn in before.items():
        assert cls.reset_parameters is fn, cls
