"""Infinity: official fixture fidelity, key layout, schedules, RoPE at kept positions, and the engine contracts
(determinism, batch = single, pruning, guidance drop, scale skip) on ``random:infinity-tiny``.

Fixture: ``shared/fixtures/official_infinity_tiny`` (see its README), or the folder in
``$VARSCOPE_INFINITY_FIXTURE``; the fixture tests skip when it is absent.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from var_core.engine import GenerationOptions, GuidanceMode, Policy, SamplingConfig, ScalePlan, generate
from var_core.engine.adapters.infinity_adapter import InfinityAdapter, InfinityConditions
from var_core.models.bsq_vae import BSQVAE, BSQVAEConfig, patchify_latent, unpatchify_bits
from var_core.models.infinity import (INFINITY_2B, INFINITY_8B, Infinity, InfinityConfig, apply_rope,
                                      randomize_infinity_, rope_reference_hw, rope_tables, scale_schedule)
from var_core.models.loading import CheckpointError, load_strict
from var_core.models.text_encoder import RandomTextEncoder, T5TextEncoder, TextTokens
from var_core.zoo import load_model

REPO = Path(__file__).resolve().parents[2]
FIXTURE_DIR = Path(os.environ.get("VARSCOPE_INFINITY_FIXTURE",
                                  REPO.parent / "shared" / "fixtures" / "official_infinity_tiny"))
needs_fixture = pytest.mark.skipif(
    not (FIXTURE_DIR / "infinity.pth").is_file(),
    reason=f"official Infinity fixture not found at {FIXTURE_DIR} (set VARSCOPE_INFINITY_FIXTURE)",
)
PROMPTS = ["a red cat on a sofa", "two dogs", "a lighthouse at dusk, oil painting"]
SAMPLED = SamplingConfig(cfg=3.0, top_k=900, top_p=0.97, temperature=1.0)


@pytest.fixture(scope="module")
def tiny() -> InfinityAdapter:
    return load_model("random:infinity-tiny")


def _gen(adapter, prompts, seeds, sampling=SAMPLED, policy=None, decode=True):
    return generate(adapter, list(prompts), seeds=seeds, sampling=sampling, policy=policy,
                    options=GenerationOptions(decode=decode))


# ---------------------------------------------------------------------------------------------------------------
# the official fixture
# ---------------------------------------------------------------------------------------------------------------
@needs_fixture
def test_fixture_verify_all_checks_pass():
    from var_core.verify.infinity import verify_infinity_fixture

    checks = verify_infinity_fixture(FIXTURE_DIR)
    failed = [c.line() for c in checks if c.passed is False]
    assert not failed, "\n".join(failed)
    names = {c.name for c in checks if c.passed}
    for run in ("ar_greedy_cfg3_tau1", "ar_greedy_cfg3_tau0.5", "ar_greedy_cfg1_tau1", "ar_greedy_cfg1_tau0.5",
                "ar_greedy_cfg3_tau1_negprompt", "ar_greedy_cfg3_tau1_cfglayer-1"):
        assert f"{run}/bits" in names and f"{run}/cfg_logits" in names
    assert {"vae/bit_indices", "vae/recon", "teacher_forcing/logits", "teacher_forcing/block_outputs",
            "ar_greedy_cfg3_tau1/block_outputs", "ar_greedy_cfg3_tau1/img_float"} <= names


@needs_fixture
def test_official_infinity_tiny_zoo_entry_accepts_prompts():
    adapter = load_model("official-infinity-tiny", weights=FIXTURE_DIR)
    assert adapter.scale_hw[-1] == (16, 16) and adapter.num_blocks == 2
    result = _gen(adapter, ["a prompt"], seeds=[0], decode=False)
    assert result.tokens[-1].shape == (1, 256, 32)


# ---------------------------------------------------------------------------------------------------------------
# architecture, key layout, loading
# ---------------------------------------------------------------------------------------------------------------
def _official_key_pattern(cfg: InfinityConfig) -> dict[str, tuple[int, ...]]:
    """The official key names and shapes (specs/reference_models.md §2.6), written out independently."""
    C, Ct5, d, F_ = cfg.embed_dim, cfg.text_channels, cfg.d_vae, cfg.ffn_hidden
    H, Hp = cfg.num_heads, cfg.text_pool_heads
    keys = {
        "cfg_uncond": (cfg.text_maxlen, Ct5), "pos_start": (1, 1, C), "text_norm.weight": (Ct5,),
        "text_proj_for_sos.ca.mat_q": (1, Hp, C // Hp), "text_proj_for_sos.ca.v_bias": (C,),
        "text_proj_for_sos.ca.zero_k_bias": (C,), "text_proj_for_sos.ca.mat_kv.weight": (2 * C, Ct5),
        "text_proj_for_sos.ca.proj.weight": (C, C), "text_proj_for_sos.ca.proj.bias": (C,),
        "text_proj_for_ca.0.weight": (C, Ct5), "text_proj_for_ca.0.bias": (C,),
        "text_proj_for_ca.2.weight": (C, C), "text_proj_for_ca.2.bias": (C,),
        "lvl_embed.weight": (15, C), "word_embed.weight": (C, d), "word_embed.bias": (C,),
        "shared_ada_lin.1.weight": (6 * C, C), "shared_ada_lin.1.bias": (6 * C,),
        "head_nm.ada_lin.1.weight": (2 * C, C), "head_nm.ada_lin.1.bias": (2 * C,),
        "head.weight": (2 * d, C), "head.bias": (2 * d,),
    }
    per = cfg.depth // cfg.block_chunks
    for k in range(cfg.block_chunks):
        for j in range(per):
            p = f"block_chunks.{k}.module.{j}."
            keys.update({
                p + "ada_gss": (1, 1, 6, C), p + "sa.scale_mul_1H11": (1, H, 1, 1), p + "sa.q_bias": (C,),
                p + "sa.v_bias": (C,), p + "sa.zero_k_bias": (C,), p + "sa.mat_qkv.weight": (3 * C, C),
                p + "sa.proj.weight": (C, C), p + "sa.proj.bias": (C,), p + "ca.v_bias": (C,),
                p + "ca.zero_k_bias": (C,), p + "ca.mat_q.weight": (C, C), p + "ca.mat_q.bias": (C,),
                p + "ca.mat_kv.weight": (2 * C, C), p + "ca.proj.weight": (C, C), p + "ca.proj.bias": (C,),
                p + "ffn.fc1.weight": (F_, C), p + "ffn.fc1.bias": (F_,), p + "ffn.fc2.weight": (C, F_),
                p + "ffn.fc2.bias": (C,), p + "ca_norm.weight": (C,), p + "ca_norm.bias": (C,),
            })
    return keys


def test_random_tiny_key_layout_matches_official_pattern(tiny):
    sd = tiny.model.state_dict()
    expected = _official_key_pattern(tiny.cfg)
    assert set(sd) == set(expected)
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    assert len(sd) == 21 * tiny.cfg.depth + 22


@pytest.mark.parametrize("cfg,entries,params", [(INFINITY_2B, 694, 2.2046e9), (INFINITY_8B, 862, 8.376e9)])
def test_architecture_true_sizes(cfg, entries, params):
    with torch.device("meta"):
        model = Infinity(cfg)
    sd = model.state_dict()
    assert len(sd) == entries
    assert {k: tuple(v.shape) for k, v in sd.items()} == _official_key_pattern(cfg)
    assert abs(sum(p.numel() for p in model.parameters()) - params) / params < 1e-4


def test_random_tiny_loads_strictly_and_roundtrips_through_files(tiny, tmp_path):
    fresh = Infinity(tiny.cfg)
    load_strict(fresh, tiny.model.state_dict(), "Infinity", "memory")
    torch.save(tiny.model.state_dict(), tmp_path / "infinity.pth")
    torch.save({"vae": tiny.vae.state_dict()}, tmp_path / "vae.pth")
    loaded = load_model("infinity-tiny", weights=tmp_path)
    a = _gen(tiny, PROMPTS[:1], [5], decode=False)
    b = _gen(loaded, PROMPTS[:1], [5], decode=False)
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))


def test_sharded_transformer_directory_loads(tiny, tmp_path):
    import json

    from safetensors.torch import save_file

    from var_core.zoo import load_infinity_files

    sd = {k: v.contiguous() for k, v in tiny.model.state_dict().items() if not k.endswith("zero_k_bias")}
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    folder = tmp_path / "weights"
    folder.mkdir()
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(folder / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.save({"vae": tiny.vae.state_dict()}, tmp_path / "vae.pth")
    model, vae = load_infinity_files(folder, tmp_path / "vae.pth", text_maxlen=tiny.cfg.text_maxlen)
    assert model.cfg == tiny.cfg and vae.cfg == tiny.vae.cfg
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), tiny.model.state_dict().values()))


def test_missing_weights_errors_name_the_files(tmp_path):
    with pytest.raises(CheckpointError, match="infinity_2b_reg.pth"):
        load_model("infinity-2b")
    with pytest.raises(CheckpointError, match="infinity_vae_d56_f8_14_patchify.pth"):
        load_model("infinity-8b", weights=tmp_path)


def test_t5_directory_errors_list_expected_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        T5TextEncoder(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="spiece.model"):
        T5TextEncoder(tmp_path)


def test_t5_wrapper_with_a_tiny_local_t5(tmp_path):
    pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
                   relative_attention_num_buckets=8)
    T5EncoderModel(cfg).save_pretrained(tmp_path)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: 3 + i for i, w in enumerate("a red cat two dogs".split())}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(tmp_path)
    encoder = T5TextEncoder(tmp_path)
    text = encoder.encode(["a red cat", "two dogs"])
    assert text.lens.tolist() == [4, 3] and text.features.shape == (2, 4, 16)
    alone = encoder.encode(["two dogs"])
    assert torch.allclose(text.features[1, :3], alone.features[0], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# schedules, RoPE, tokenizer pieces
# ---------------------------------------------------------------------------------------------------------------
def test_scale_schedules():
    totals = {"0.06M": 521, "0.25M": 2521, "0.60M": 6425, "1M": 10521}
    for pn, total in totals.items():
        assert sum(h * w for h, w in scale_schedule(pn, 1.0)) == total
    assert scale_schedule("1M", 1.333)[-1] == (72, 54)
    assert scale_schedule("1M", 0.75)[2] == (3, 4)  # the transposed template
    assert scale_schedule("1M", 1.3)[-1] == (72, 54)  # nearest template
    assert rope_reference_hw(scale_schedule("0.25M", 1.0)) == (64, 64)
    assert rope_reference_hw(scale_schedule("0.06M", 2.0)) == (90, 45)


def test_rope_gathered_at_kept_positions_equals_dense_rows():
    torch.manual_seed(0)
    sched = scale_schedule("0.06M", 1.0)
    cos, sin = rope_tables(sched, rope_reference_hw(sched), 32)
    x = torch.randn(2, 2, 256, 32)
    start = sum(h * w for h, w in sched[:-1])
    dense = apply_rope(x, cos[start:start + 256], sin[start:start + 256])
    keep = torch.stack([torch.randperm(256)[:100].sort().values for _ in range(2)])
    kept_x = torch.gather(x, 2, keep[:, None, :, None].expand(2, 2, 100, 32))
    kept = apply_rope(kept_x, cos[start + keep].unsqueeze(1), sin[start + keep].unsqueeze(1))
    assert torch.equal(kept, torch.gather(dense, 2, keep[:, None, :, None].expand(2, 2, 100, 32)))


def test_patchify_roundtrip_and_bits_to_codes():
    bits = torch.randint(0, 2, (2, 3, 5, 4 * 7))
    assert torch.equal(patchify_latent(unpatchify_bits(bits).permute(0, 3, 1, 2)).permute(0, 2, 3, 1), bits)
    vae = BSQVAE(BSQVAEConfig(codebook_dim=7, base_ch=32, encoder_ch_mult=(1, 1), decoder_ch_mult=(1, 1),
                              patch_size=2))
    codes = vae.bits_to_codes(torch.randint(0, 2, (2, 1, 3, 3, 7)))
    assert codes.shape == (2, 7, 1, 3, 3)
    assert torch.allclose(codes.abs(), torch.full_like(codes, 1 / math.sqrt(7)))


def test_random_text_encoder_is_deterministic_and_batch_independent():
    enc = RandomTextEncoder(out_dim=64, seed=3)
    a = enc.encode(PROMPTS)
    b = RandomTextEncoder(out_dim=64, seed=3).encode(PROMPTS[1:2])
    assert a.lens.tolist() == [7, 3, 8]
    assert torch.equal(a.features[1, :3], b.features[0])
    packed = a.to_packed()
    assert torch.equal(TextTokens.from_official(packed).features, a.features)


# ---------------------------------------------------------------------------------------------------------------
# the engine contracts on random:infinity-tiny
# ---------------------------------------------------------------------------------------------------------------
def test_generation_is_deterministic(tiny):
    a = _gen(tiny, PROMPTS, [1, 2, 3])
    b = _gen(tiny, PROMPTS, [1, 2, 3])
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))
    assert torch.equal(a.images, b.images)
    assert a.images.shape == (3, 3, 128, 128) and 0 <= float(a.images.min()) and float(a.images.max()) <= 1
    assert a.tokens[-1].shape == (3, 64, tiny.bits_per_token)
    assert a.records[-1].raw_logits_RNV.shape[0] == 6  # cond + uncond rows


def test_sample_alone_equals_sample_in_batch(tiny):
    batch = _gen(tiny, PROMPTS, [11, 12, 13])
    alone = _gen(tiny, PROMPTS[1:2], [12])
    assert all(torch.equal(x[1:2], y) for x, y in zip(batch.tokens, alone.tokens))
    assert torch.allclose(batch.images[1:2], alone.images, atol=1e-4)


def test_cfg_one_has_no_unconditional_rows(tiny):
    result = _gen(tiny, PROMPTS[:2], [0, 1], sampling=SamplingConfig(cfg=1.0, top_k=1, top_p=0.0), decode=False)
    assert result.records[0].guidance is GuidanceMode.NONE
    assert result.records[0].raw_logits_RNV.shape[0] == 2


def test_greedy_tau_does_not_change_bits_and_scales_logits(tiny):
    greedy = dict(cfg=3.0, top_k=1, top_p=0.0)
    a = _gen(tiny, PROMPTS[:1], [0], sampling=SamplingConfig(temperature=1.0, **greedy), decode=False)
    b = _gen(tiny, PROMPTS[:1], [0], sampling=SamplingConfig(temperature=0.5, **greedy), decode=False)
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))
    assert torch.allclose(2 * a.records[-1].guided_logits_BNV, b.records[-1].guided_logits_BNV, atol=1e-5)


def test_negative_prompt_and_cfg_insertion_layer(tiny):
    base = _gen(tiny, PROMPTS[:2], [0, 1], decode=False)
    neg = generate(tiny, InfinityConditions(PROMPTS[:2], negative="blurry"), seeds=[0, 1], sampling=SAMPLED,
                   options=GenerationOptions(decode=False))
    assert not all(torch.equal(x, y) for x, y in zip(base.tokens, neg.tokens))
    layered = tiny.with_schedule(tiny.scale_hw)
    layered.cfg_insertion_layer = -1
    result = _gen(layered, PROMPTS[:2], [0, 1], decode=False)
    assert result.records[-1].guided_logits_BNV.shape[0] == 2
    assert torch.isfinite(result.records[-1].guided_logits_BNV).all()


class _PruneHalfOfLastScale(Policy):
    name = "test/prune-half-last"

    def plan_scale(self, ctx):
        return ScalePlan(prune=ctx.is_last)

    def plan_block(self, ctx, block, branch, x_RNC):
        R, N, _ = x_RNC.shape
        gen = torch.Generator().manual_seed(100 * block + len(branch))
        return torch.stack([torch.randperm(N, generator=gen)[: N // 2].sort().values for _ in range(R)])


class _DropUncondMidway(Policy):
    name = "test/drop-uncond"

    def plan_scale(self, ctx):
        return ScalePlan(guidance=GuidanceMode.COND_ONLY) if ctx.scale_index == 2 else ScalePlan()


class _SkipLast(Policy):
    name = "test/skip-last"

    def plan_scale(self, ctx):
        return ScalePlan(skip=ctx.is_last)


def test_pruning_half_of_last_scale_runs(tiny):
    dense = _gen(tiny, PROMPTS[:2], [0, 1])
    pruned = _gen(tiny, PROMPTS[:2], [0, 1], policy=_PruneHalfOfLastScale())
    n_last = tiny.scale_hw[-1][0] * tiny.scale_hw[-1][1]
    assert pruned.records[-1].kept_tokens == tuple((n_last // 2,) * 3 for _ in range(tiny.num_blocks))
    assert all(torch.equal(x, y) for x, y in zip(dense.tokens[:-1], pruned.tokens[:-1]))
    assert torch.isfinite(pruned.images).all() and pruned.images.shape == dense.images.shape


def test_dropping_uncond_rows_midway_runs(tiny):
    result = _gen(tiny, PROMPTS[:2], [0, 1], policy=_DropUncondMidway())
    assert [r.guidance for r in result.records[:3]] == [GuidanceMode.BOTH, GuidanceMode.BOTH, GuidanceMode.COND_ONLY]
    assert result.records[-1].raw_logits_RNV.shape[0] == 2
    assert torch.isfinite(result.images).all()


def test_skipping_the_last_scale(tiny):
    full = _gen(tiny, PROMPTS[:1], [4])
    skipped = _gen(tiny, PROMPTS[:1], [4], policy=_SkipLast())
    assert skipped.records[-1].skipped and skipped.tokens[-1] is None
    assert all(torch.equal(x, y) for x, y in zip(full.tokens[:-1], skipped.tokens[:-1]))
    assert skipped.images.shape == full.images.shape and not torch.equal(skipped.images, full.images)


def test_patchify_model_generates():
    cfg = InfinityConfig(depth=2, embed_dim=64, num_heads=2, text_channels=128, text_maxlen=16, d_vae=4 * 6,
                         block_chunks=2, apply_spatial_patchify=True)
    vae = BSQVAE(BSQVAEConfig(codebook_dim=6, base_ch=32, encoder_ch_mult=(1, 1, 1), decoder_ch_mult=(1, 1, 1),
                              patch_size=4))
    adapter = InfinityAdapter(randomize_infinity_(Infinity(cfg), 1), vae, RandomTextEncoder(out_dim=128, max_length=16),
                              num_scales=4)
    assert adapter.vae_schedule[-1] == (1, 12, 12) and adapter.image_hw == (48, 48)
    result = _gen(adapter, PROMPTS[:2], [0, 1])
    assert result.tokens[-1].shape == (2, 36, 24)
    assert result.latent.shape == (2, 6, 1, 12, 12) and result.images.shape == (2, 3, 48, 48)


def test_pre_encoded_text_equals_prompts(tiny):
    text = tiny.encode_prompts(PROMPTS[:2])
    a = _gen(tiny, PROMPTS[:2], [0, 1], decode=False)
    b = generate(tiny, text, seeds=[0, 1], sampling=SAMPLED, options=GenerationOptions(decode=False))
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))
