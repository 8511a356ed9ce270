"""Mismatched checkpoints are refused before any generation (issue 11, "Trustworthy numbers").

A VAR predicts indices into its VQVAE's codebook and embeds its latents; an Infinity transformer predicts the
bits of its BSQ-VAE's codes. A file that does not fit its partner, or the zoo entry it is loaded for, must be a
``CheckpointMismatchError`` (a ``UserError``) naming the file(s) and both shapes, never a study that runs on
(vocabulary one smaller) or a bare ``IndexError`` mid-run (one larger).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from var_core.errors import UserError
from var_core import zoo
from var_core.models.bsq_vae import BSQVAEConfig
from var_core.models.infinity import InfinityConfig
from var_core.models.loading import CheckpointMismatchError, check_infinity_schedule
from var_core.models.var import VAR, VARConfig
from var_core.zoo import build_infinity_pair, build_var_pair, load_fixture_files, load_model, load_var_files


def _mismatch(call, *args, **kwargs) -> str:
    with pytest.raises(CheckpointMismatchError) as err:
        call(*args, **kwargs)
    assert isinstance(err.value, UserError)
    return str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# the official fixture's files, edited
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("delta", [-1, 1])
def test_head_vocabulary_off_by_one_is_refused(fixture_dir, tmp_path, delta):
    sd = torch.load(fixture_dir / "var.pth", weights_only=True)
    V, C = sd["head.weight"].shape
    assert (V, C) == (256, 128)  # the fixture README: head.weight [256, 128], codebook [256, 16]
    if delta < 0:
        sd["head.weight"], sd["head.bias"] = sd["head.weight"][:-1], sd["head.bias"][:-1]
    else:
        sd["head.weight"] = torch.cat([sd["head.weight"], sd["head.weight"][:1]])
        sd["head.bias"] = torch.cat([sd["head.bias"], sd["head.bias"][:1]])
    torch.save(sd, tmp_path / "var.pth")
    message = _mismatch(load_var_files, tmp_path / "var.pth", fixture_dir / "vae.pth")
    assert message.startswith(f"{tmp_path / 'var.pth'}: head.weight is [{256 + delta}, 128] ")
    assert f"but {fixture_dir / 'vae.pth'}'s codebook quantize.embedding.weight is [256, 16] (256 entries)" in message

    # the zoo entry's loader refuses it too, before any model is built or any image generated
    folder = tmp_path / "fx"
    folder.mkdir()
    for path in fixture_dir.iterdir():
        (folder / path.name).symlink_to(tmp_path / "var.pth" if path.name == "var.pth" else path)
    assert "head.weight is [%d, 128]" % (256 + delta) in _mismatch(load_model, "official-tiny", weights=folder)


def test_shared_adaln_file_as_var_pth_is_refused_with_the_variant(fixture_dir, tmp_path):
    folder = tmp_path / "fx"
    folder.mkdir()
    for path in fixture_dir.iterdir():
        source = {"var.pth": "var_saln.pth", "var_saln.pth": "var.pth"}.get(path.name, path.name)
        (folder / path.name).symlink_to(fixture_dir / source)
    message = _mismatch(load_model, "official-tiny", weights=folder)
    assert message.startswith(f"{folder / 'var.pth'} does not fit zoo entry 'official-tiny'")
    assert "shared_ada_lin.1.weight" in message and "make it the shared-AdaLN VAR variant" in message
    assert "is the per-block-AdaLN variant" in message and "belongs in var_saln.pth" in message

    message = _mismatch(load_fixture_files, folder, saln=True)
    assert message.startswith(f"{folder / 'var_saln.pth'} does not fit the fixture's var_saln.pth")
    assert "make it the per-block-AdaLN VAR variant" in message and "is the shared-AdaLN variant" in message


def test_verify_reports_a_swapped_checkpoint_as_a_named_failure(fixture_dir, tmp_path, capsys):
    import hashlib

    from var_core.verify import main

    folder = tmp_path / "fx"
    folder.mkdir()
    for path in fixture_dir.iterdir():
        if path.name != "SHA256SUMS":
            (folder / path.name).write_bytes((fixture_dir / ("var_saln.pth" if path.name == "var.pth"
                                                             else path.name)).read_bytes())
    digest = hashlib.sha256((fixture_dir / "var_saln.pth").read_bytes()).hexdigest()
    lines = [ln if not ln.endswith("  var.pth") else f"{digest}  var.pth"
             for ln in (fixture_dir / "SHA256SUMS").read_text().splitlines()]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")  # a consistent manifest: only the loader can tell
    assert main([str(folder)]) == 1
    out = capsys.readouterr().out.splitlines()
    load_line = [ln for ln in out if ln.startswith("FAIL  var/load")]
    assert len(load_line) == 1 and "shared-AdaLN" in load_line[0] and "var.pth" in load_line[0]


# ---------------------------------------------------------------------------------------------------------------
# tiny random pairs (no fixture needed)
# ---------------------------------------------------------------------------------------------------------------
def _tiny_pair(tmp_path: Path, var_vocab=32, vae_vocab=32, var_z=8, vae_z=8, var_scales=(1, 2), vae_scales=(1, 2)):
    var, _ = build_var_pair(VARConfig(depth=1, embed_dim=64, num_heads=1, vocab_size=var_vocab, z_channels=var_z,
                                      num_classes=3, patch_nums=var_scales),
                            dict(vocab_size=var_vocab, z_channels=var_z, ch=32, ch_mult=(1, 2),
                                 patch_nums=var_scales), seed=1)
    _, vae = build_var_pair(VARConfig(depth=1, embed_dim=64, num_heads=1, vocab_size=vae_vocab, z_channels=vae_z,
                                      num_classes=3, patch_nums=vae_scales),
                            dict(vocab_size=vae_vocab, z_channels=vae_z, ch=32, ch_mult=(1, 2),
                                 patch_nums=vae_scales), seed=2)
    torch.save(var.state_dict(), tmp_path / "var.pth")
    torch.save(vae.state_dict(), tmp_path / "vae.pth")
    return tmp_path / "var.pth", tmp_path / "vae.pth"


def test_consistent_tiny_pair_loads(tmp_path):
    var, vae = load_var_files(*_tiny_pair(tmp_path))
    assert var.cfg.vocab_size == 32 and vae.quantize.embedding.weight.shape == (32, 8)


def test_tiny_vocabulary_mismatch_names_both_files_and_shapes(tmp_path):
    var_path, vae_path = _tiny_pair(tmp_path, var_vocab=31, vae_vocab=32)
    message = _mismatch(load_var_files, var_path, vae_path)
    assert f"{var_path}: head.weight is [31, 64] (a 31-token vocabulary)" in message
    assert f"{vae_path}'s codebook quantize.embedding.weight is [32, 8] (32 entries)" in message


def test_tiny_latent_channel_mismatch_names_both_files_and_shapes(tmp_path):
    var_path, vae_path = _tiny_pair(tmp_path, var_z=8, vae_z=16)
    message = _mismatch(load_var_files, var_path, vae_path)
    assert f"{var_path}: word_embed.weight is [64, 8] (it reads 8-channel latents)" in message
    assert f"{vae_path}'s codebook vectors have 16 channels (quantize.embedding.weight [32, 16])" in message


def test_tiny_scale_count_mismatch_names_both_files_and_shapes(tmp_path):
    var_path, vae_path = _tiny_pair(tmp_path, var_scales=(1, 2), vae_scales=(1, 2, 3))
    message = _mismatch(load_var_files, var_path, vae_path)
    assert f"{var_path} has 2 scales (lvl_embed.weight [2, 64])" in message
    assert f"{vae_path}'s quantize.ema_vocab_hit_SV is [3, 32] (3 scales)" in message


# ---------------------------------------------------------------------------------------------------------------
# official zoo entries (shapes only: meta tensors stand in for the multi-GB files)
# ---------------------------------------------------------------------------------------------------------------
def _meta_state_dicts(cfg: VARConfig, vqvae_kwargs: dict):
    with torch.device("meta"):
        var, vae = VAR(cfg), zoo._vqvae(vqvae_kwargs)
    sd = var.state_dict()
    sd["lvl_1L"] = torch.cat([torch.full((p * p,), i) for i, p in enumerate(cfg.patch_nums)]).view(1, -1)
    return sd, vae.state_dict()


def _load_entry(monkeypatch, tmp_path, entry: str, var_sd, vae_sd):
    files = {zoo.ZOO[entry].weight_file: var_sd, zoo.OFFICIAL_VAE_FILE: vae_sd}
    for name in files:  # the file names must be there (zoo.resolve_weight_files); the contents come from `files`
        (tmp_path / name).touch()
    monkeypatch.setattr(zoo, "read_state_dict", lambda path: files[Path(path).name])
    return _mismatch(load_model, entry, weights=tmp_path)


def test_d36_file_loaded_as_d16_names_the_variant_and_the_entry_to_use(monkeypatch, tmp_path):
    d36 = zoo.ZOO["var-d36"]
    var_sd, vae_sd = _meta_state_dicts(d36.var_config, d36.vqvae_kwargs)
    message = _load_entry(monkeypatch, tmp_path, "var-d16", var_sd, vae_sd)
    assert message.startswith(f"{tmp_path / 'var_d16.pth'} does not fit zoo entry 'var-d16'")
    assert "make it the shared-AdaLN VAR variant" in message and "'var-d16' is the per-block-AdaLN variant" in message
    assert "depth is 36 (blocks.0…35) but zoo entry 'var-d16' has depth=16" in message
    assert "architecture of zoo entry 'var-d36': load it by that name" in message


def test_shared_adaln_d16_names_the_variant_and_that_no_entry_fits(monkeypatch, tmp_path):
    d16 = zoo.ZOO["var-d16"]
    cfg = VARConfig(**{**d16.var_config.to_dict(), "shared_aln": True})
    var_sd, vae_sd = _meta_state_dicts(cfg, d16.vqvae_kwargs)
    message = _load_entry(monkeypatch, tmp_path, "var-d16", var_sd, vae_sd)
    assert "; " not in message.split(". ")[0]  # the variant is the only difference
    assert "shared-AdaLN VAR variant" in message and "No zoo entry has this architecture" in message


def test_official_entry_with_a_smaller_codebook_names_both_shapes(monkeypatch, tmp_path):
    d16 = zoo.ZOO["var-d16"]
    var_sd, _ = _meta_state_dicts(d16.var_config, d16.vqvae_kwargs)
    _, vae_sd = _meta_state_dicts(d16.var_config, {**d16.vqvae_kwargs, "vocab_size": 4095})
    message = _load_entry(monkeypatch, tmp_path, "var-d16", var_sd, vae_sd)
    assert "var_d16.pth: head.weight is [4096, 1024]" in message
    assert "vae_ch160v4096z32.pth's codebook quantize.embedding.weight is [4095, 32] (4095 entries)" in message


# ---------------------------------------------------------------------------------------------------------------
# Infinity: transformer bits vs the BSQ codebook, zoo entry, schedule
# ---------------------------------------------------------------------------------------------------------------
TINY = InfinityConfig(depth=2, embed_dim=64, num_heads=2, text_channels=128, text_maxlen=16, d_vae=16,
                      block_chunks=2)


def _tiny_vae(codebook_dim: int) -> BSQVAEConfig:
    return BSQVAEConfig(codebook_dim=codebook_dim, base_ch=32, encoder_ch_mult=(1, 1, 1, 1, 1),
                        decoder_ch_mult=(1, 1, 1, 1, 1), patch_size=16)


def _save_infinity(tmp_path: Path, cfg: InfinityConfig, codebook_dim: int) -> tuple[Path, Path]:
    model, _ = build_infinity_pair(cfg, _tiny_vae(16), seed=0)
    _, vae = build_infinity_pair(TINY, _tiny_vae(codebook_dim), seed=1)
    torch.save(model.state_dict(), tmp_path / "infinity.pth")
    torch.save({"vae": vae.state_dict()}, tmp_path / "vae.pth")
    return tmp_path / "infinity.pth", tmp_path / "vae.pth"


def test_infinity_bits_vs_codebook_mismatch_names_both_files(tmp_path):
    inf_path, vae_path = _save_infinity(tmp_path, TINY, codebook_dim=8)
    message = _mismatch(zoo.load_infinity_files, inf_path, vae_path, text_maxlen=16)
    assert message.startswith(f"{inf_path} reads 16 bits per token (word_embed.weight [64, 16], head.weight [32, 64])")
    assert f"{vae_path}'s BSQ codebook has codebook_dim 8" in message


def test_infinity_patchify_layout_is_named(tmp_path):
    inf_path, vae_path = _save_infinity(tmp_path, TINY, codebook_dim=4)  # 16 = 4 x 4: the 2x2 patchify layout
    message = _mismatch(zoo.load_infinity_files, inf_path, vae_path, text_maxlen=16)
    assert "codebook_dim 4" in message and "apply_spatial_patchify=True" in message


def test_infinity_file_that_is_not_the_entrys_architecture(tmp_path):
    spec = zoo.INFINITY_SPECS["infinity-tiny"]
    wrong = InfinityConfig(**{**spec.config.to_dict(), "depth": 2, "block_chunks": 2})
    model, vae = build_infinity_pair(wrong, spec.vae_config, seed=0)
    torch.save(model.state_dict(), tmp_path / "infinity.pth")
    torch.save({"vae": vae.state_dict()}, tmp_path / "vae.pth")
    message = _mismatch(load_model, "infinity-tiny", weights=tmp_path)
    assert f"{tmp_path / 'infinity.pth'} has depth=2 but zoo entry 'infinity-tiny' has depth=4" in message


def test_infinity_schedule_longer_than_the_level_embedding():
    cfg = InfinityConfig(**{**TINY.to_dict(), "num_levels": 3})
    message = _mismatch(check_infinity_schedule, cfg, [(1, 1, 1), (1, 2, 2), (1, 4, 4), (1, 6, 6)], "inf.pth")
    assert message.startswith("inf.pth: lvl_embed.weight has 3 rows (scale levels) but the schedule has 4 scales")
