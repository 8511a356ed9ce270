"""Folders laid out like the official downloads (the file names, tiny tensors inside) resolve for every family:
VAR, Infinity-2B (both VAE spellings), Infinity-8B (sharded folder), Hugging Face cache folders, flan-T5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from var_core import zoo
from var_core.models.loading import CheckpointError, CheckpointMismatchError, shard_files
from var_core.models.text_encoder import resolve_t5_directory
from var_core.models.loading import read_sharded_state_dict
from var_core.zoo import find_t5_directory, load_model, resolve_weight_files

TINY = {"x": torch.zeros(2)}


@pytest.fixture(autouse=True)
def _no_real_hub_cache(tmp_path, monkeypatch):
    """Keep this machine's Hugging Face cache and $VARSCOPE_T5_DIR out of every test."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub-cache"))
    monkeypatch.delenv("VARSCOPE_T5_DIR", raising=False)


def _files(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        torch.save(TINY, folder / name)
    return folder


def _shards(folder: Path, total: int = 2, index: bool = True, skip: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in range(1, total + 1):
        name = f"model-{i:05d}-of-{total:05d}.safetensors"
        weight_map[f"block{i}.weight"] = name
        if i != skip:
            save_file({f"block{i}.weight": torch.full((2,), float(i))}, str(folder / name))
    if index:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# ----- VAR ------------------------------------------------------------------------------------------------------
def test_var_download_folder_resolves_every_depth(tmp_path):
    names = [f"var_d{d}.pth" for d in (16, 20, 24, 30, 36)]
    folder = _files(tmp_path / "var", *names, "vae_ch160v4096z32.pth")
    for depth, name in zip((16, 20, 24, 30, 36), names):
        files = resolve_weight_files(f"var-d{depth}", folder)
        assert files.transformer == folder / name and files.vae == folder / "vae_ch160v4096z32.pth"
        assert not files.sharded
    # the transformer file itself: the VAE is found beside it
    assert resolve_weight_files("var-d20", folder / "var_d20.pth").vae == folder / "vae_ch160v4096z32.pth"


def test_var_resolution_then_the_content_check_is_the_next_error(tmp_path):
    folder = _files(tmp_path, "var_d16.pth", "vae_ch160v4096z32.pth")
    with pytest.raises(CheckpointMismatchError, match="var_d16.pth: not a VAR transformer state_dict"):
        load_model("var-d16", weights=folder)


def test_missing_var_vae_names_the_folder_and_the_name(tmp_path):
    folder = _files(tmp_path / "dl", "var_d16.pth")
    with pytest.raises(CheckpointError) as info:
        resolve_weight_files("var-d16", folder)
    message = str(info.value)
    assert f"VAE weights: searched {folder} for vae_ch160v4096z32.pth" in message
    assert "transformer weights" not in message  # the transformer was found
    assert "Found there: var_d16.pth" in message and "--vae-weights" in message


# ----- Infinity-2B: both spellings of the VAE -----------------------------------------------------------------
@pytest.mark.parametrize("vae_name", ["infinity_vae_d32_reg.pth", "infinity_vae_d32reg.pth"])
def test_infinity_2b_accepts_both_vae_spellings(tmp_path, vae_name):
    folder = _files(tmp_path, "infinity_2b_reg.pth", vae_name)
    files = resolve_weight_files("infinity-2b", folder)
    assert files.transformer == folder / "infinity_2b_reg.pth" and files.vae == folder / vae_name


def test_infinity_2b_with_both_spellings_takes_the_repository_one(tmp_path):
    folder = _files(tmp_path, "infinity_2b_reg.pth", "infinity_vae_d32reg.pth", "infinity_vae_d32_reg.pth")
    assert resolve_weight_files("infinity-2b", folder).vae.name == "infinity_vae_d32_reg.pth"


def test_missing_infinity_2b_vae_lists_every_accepted_name(tmp_path):
    folder = _files(tmp_path, "infinity_2b_reg.pth", "infinity_vae_d32.pth")
    with pytest.raises(CheckpointError) as info:
        resolve_weight_files("infinity-2b", folder)
    message = str(info.value)
    assert f"searched {folder} for infinity_vae_d32_reg.pth or infinity_vae_d32reg.pth" in message
    assert "did you mean 'infinity_vae_d32.pth'" in message


def test_vae_weights_elsewhere_as_file_or_folder(tmp_path):
    folder = _files(tmp_path / "models", "infinity_2b_reg.pth")
    vae_folder = _files(tmp_path / "vae", "infinity_vae_d32reg.pth")
    assert resolve_weight_files("infinity-2b", folder, vae_folder).vae == vae_folder / "infinity_vae_d32reg.pth"
    assert resolve_weight_files("infinity-2b", folder, vae_folder / "infinity_vae_d32reg.pth").vae == \
        vae_folder / "infinity_vae_d32reg.pth"


def test_infinity_2b_full_load_reaches_the_content_check(tmp_path):
    folder = _files(tmp_path, "infinity_2b_reg.pth", "infinity_vae_d32reg.pth")
    t5 = folder / "flan-t5-xl"
    t5.mkdir()
    for name in ("config.json", "model.safetensors", "spiece.model"):
        (t5 / name).write_text("{}")
    # names found (T5 included, checked before any large file is read); the next error is the VAE's content
    with pytest.raises(CheckpointError, match="infinity_vae_d32reg.pth") as info:
        load_model("infinity-2b", weights=folder)
    assert "not found" not in str(info.value)


# ----- Infinity-8B: the sharded folder ------------------------------------------------------------------------
def test_infinity_8b_sharded_folder(tmp_path):
    _shards(tmp_path / "infinity_8b_weights", total=3)
    _files(tmp_path, "infinity_vae_d56_f8_14_patchify.pth")
    files = resolve_weight_files("infinity-8b", tmp_path)
    assert files.sharded and files.transformer == tmp_path / "infinity_8b_weights"
    assert files.vae == tmp_path / "infinity_vae_d56_f8_14_patchify.pth"
    # --weights pointing at the shard folder itself: the VAE is looked for beside it
    assert resolve_weight_files("infinity-8b", tmp_path / "infinity_8b_weights").vae == files.vae
    merged = read_sharded_state_dict(files.transformer)
    assert {k: v.tolist() for k, v in merged.items()} == {"block1.weight": [1.0, 1.0], "block2.weight": [2.0, 2.0],
                                                          "block3.weight": [3.0, 3.0]}


def test_incomplete_shards_are_named_before_anything_is_read(tmp_path):
    _shards(tmp_path / "infinity_8b_weights", total=3, skip=2)
    _files(tmp_path, "infinity_vae_d56_f8_14_patchify.pth")
    with pytest.raises(CheckpointError, match=r"1 are missing \(model-00002-of-00003.safetensors\)"):
        resolve_weight_files("infinity-8b", tmp_path)
    no_index = _shards(tmp_path / "bare", total=4, index=False, skip=3)
    with pytest.raises(CheckpointError, match=r"1 of 4 shards are missing \(model-00003-of-00004.safetensors\)"):
        shard_files(no_index)
    complete = _shards(tmp_path / "bare2", total=2, index=False)
    assert [p.name for p in shard_files(complete)] == ["model-00001-of-00002.safetensors",
                                                      "model-00002-of-00002.safetensors"]


def test_missing_8b_names_the_shard_folder_and_the_vae(tmp_path):
    with pytest.raises(CheckpointError) as info:
        resolve_weight_files("infinity-8b", tmp_path)
    message = str(info.value)
    assert f"searched {tmp_path} for infinity_8b_weights/" in message and "model.safetensors.index.json" in message
    assert "infinity_vae_d56_f8_14_patchify.pth" in message


# ----- Hugging Face cache folders -----------------------------------------------------------------------------
def _cache_repo(root: Path, repo: str, snapshots: dict[str, tuple[str, ...]], main: str | None) -> Path:
    folder = root / ("models--" + repo.replace("/", "--"))
    for commit, names in snapshots.items():
        _files(folder / "snapshots" / commit, *names)
    if main is not None:
        (folder / "refs").mkdir(parents=True)
        (folder / "refs" / "main").write_text(main + "\n")
    return folder


def test_model_weights_from_a_hugging_face_cache_folder(tmp_path):
    repo = _cache_repo(tmp_path, "FoundationVision/Infinity",
                       {"0a1b": ("infinity_2b_reg.pth", "infinity_vae_d32reg.pth")}, main="0a1b")
    files = resolve_weight_files("infinity-2b", repo)
    assert files.transformer == repo / "snapshots" / "0a1b" / "infinity_2b_reg.pth"


def _t5_files(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "spiece.model", "tokenizer_config.json"):
        (folder / name).write_text("{}")
    return folder


def test_flan_t5_cache_snapshot_named_by_refs_main(tmp_path):
    repo = tmp_path / "hub" / "models--google--flan-t5-xl"
    old, new = _t5_files(repo / "snapshots" / "old"), _t5_files(repo / "snapshots" / "7d6315d")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("7d6315d")
    assert resolve_t5_directory(repo) == new  # the cache folder
    assert resolve_t5_directory(tmp_path / "hub") == new  # the hub cache root holding it
    assert resolve_t5_directory(new) == new  # the snapshot itself
    (repo / "refs" / "main").unlink()
    import os

    os.utime(old, (1, 1))  # without refs/main: the most recently modified snapshot
    assert resolve_t5_directory(repo) == new


def test_flan_t5_found_beside_the_weights_or_in_the_hub_cache(tmp_path, monkeypatch):
    weights = _files(tmp_path / "dl", "infinity_2b_reg.pth")
    snap = _t5_files(weights / "models--google--flan-t5-xl" / "snapshots" / "abc")
    assert find_t5_directory("infinity-2b", None, weights) == snap
    assert find_t5_directory("infinity-2b", None, weights / "infinity_2b_reg.pth") == snap  # a weights file
    hub_snap = _t5_files(tmp_path / "hub" / "models--google--flan-t5-xl" / "snapshots" / "def")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert find_t5_directory("infinity-2b", None, tmp_path / "elsewhere") == hub_snap
    assert find_t5_directory("infinity-2b", tmp_path / "hub" / "models--google--flan-t5-xl", None) == hub_snap


def test_flan_t5_missing_names_every_folder_searched(tmp_path):
    weights = _files(tmp_path / "dl", "infinity_2b_reg.pth")
    partial = weights / "flan-t5-xl"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    with pytest.raises(CheckpointError) as info:
        find_t5_directory("infinity-2b", None, weights)
    message = str(info.value)
    assert f"{weights / 'models--google--flan-t5-xl'} (absent)" in message
    assert "is missing model weights" in message and "tokenizer" in message and "--text-encoder" in message


def test_t5_encoder_loads_from_a_cache_folder(tmp_path):
    """End to end with a tiny T5 written by transformers (skipped where the [infinity] extra is not installed)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from var_core.models.text_encoder import T5TextEncoder

    snap = tmp_path / "models--google--flan-t5-xl" / "snapshots" / "abc"
    cfg = transformers.T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    torch.manual_seed(0)
    transformers.T5EncoderModel(cfg).save_pretrained(snap)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3, "red": 4, "kite": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(snap)
    encoder = T5TextEncoder(tmp_path / "models--google--flan-t5-xl")
    assert encoder.path == snap and encoder.out_dim == 8
    tokens = encoder.encode(["a red kite", "kite"])
    assert tokens.lens.tolist() == [3, 1] and tuple(tokens.features.shape) == (2, 3, 8)


def test_accepted_names_table():
    assert zoo.accepted_file_names("infinity-2b") == (("infinity_2b_reg.pth",),
                                                      ("infinity_vae_d32_reg.pth", "infinity_vae_d32reg.pth"))
    assert zoo.accepted_file_names("random:var-d36") == (("var_d36.pth",), ("vae_ch160v4096z32.pth",))
    assert zoo.accepted_file_names("infinity-8b") == (("infinity_8b_weights",),
                                                      ("infinity_vae_d56_f8_14_patchify.pth",))
