"""HART: official fixture fidelity (teacher forcing, greedy runs at both cfg values, the AdaLN variant, seeded runs in
the official RNG order, diffusion head, tokenizer), the 0.7B layout, hand-worked rules, and the engine contracts on
``random:hart-tiny`` (determinism, batch = single, guidance layouts, the diffusion step, every component).

Fixture: ``shared/fixtures/official_hart_tiny`` (see its README), or the folder in ``$VARSCOPE_HART_FIXTURE``; the
fixture tests skip when it is absent.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch

from var_core.engine import GenerationOptions, GuidanceMode, SamplingConfig, generate
from var_core.engine.adapters.hart_adapter import HARTAdapter, HARTSamplingConfig
from var_core.models.hart import HART_0P7B, HARTTransformer, apply_rope, image_positions, image_rope
from var_core.models.hart_diffusion import respaced_timesteps
from var_core.models.hart_text import HARTContext
from var_core.models.hart_tokenizer import HARTTokenizer, HARTTokenizerConfig
from var_core.models.loading import CheckpointMismatchError
from var_core.zoo import load_model

REPO = Path(__file__).resolve().parents[2]
FIXTURE_DIR = Path(os.environ.get("VARSCOPE_HART_FIXTURE", REPO.parent / "shared" / "fixtures" / "official_hart_tiny"))
needs_fixture = pytest.mark.skipif(
    not (FIXTURE_DIR / "llm" / "config.json").is_file(),
    reason=f"official HART fixture not found at {FIXTURE_DIR} (set VARSCOPE_HART_FIXTURE)")
GREEDY = HARTSamplingConfig(cfg=4.5, top_k=600, top_p=1e-4, more_smooth=False)


@pytest.fixture(scope="module")
def tiny() -> HARTAdapter:
    return load_model("random:hart-tiny")


def _fixture_inputs():
    inp = torch.load(FIXTURE_DIR / "inputs.pt", weights_only=True)
    return HARTContext(inp["context_tensor"], inp["context_mask"], inp["context_position_ids"])


# ---------------------------------------------------------------------------------------------------------------
# the official fixture
# ---------------------------------------------------------------------------------------------------------------
@needs_fixture
def test_fixture_verify_every_check_passes():
    from var_core.verify.hart import verify_hart_fixture

    checks = verify_hart_fixture(FIXTURE_DIR)
    failed = [c.line() for c in checks if c.passed is False]
    assert not failed, "\n".join(failed)
    passed = {c.name for c in checks if c.passed}
    for name in ("llm/teacher_forcing/logits", "llm_aln/teacher_forcing/logits", "llm/greedy_cfg4.5/tokens",
                 "llm/greedy_cfg1/tokens", "llm_aln/greedy_cfg4.5/tokens", "llm/greedy_cfg4.5/raw_logits",
                 "llm/greedy_cfg4.5/residual_tokens", "llm/greedy_cfg4.5/diffusion_noise_steps",
                 "llm/rng_cfg4.5_topp0.9_seed42/optional/tokens", "llm/rng_default_cfg4.5_smooth_seed1/optional/tokens",
                 "diffusion/run0_cfg2.5/out", "diffusion/run1_cfg1.0/out", "vae/recon_hart_full", "manifest/coverage",
                 "llm/derived_cfg0/global_rng_state_after_run",
                 "llm/derived_cfg0/diffusion_noise_steps (guided: 2·B·N rows)",
                 "llm/derived_cfg0/residual_tokens (= guided head at guidance 0, conditional half)"):
        assert name in passed, name


@needs_fixture
def test_verify_cli_recognises_a_hart_fixture():
    from var_core.verify import detect_family

    assert detect_family(FIXTURE_DIR) == "hart"


@needs_fixture
def test_greedy_run_through_the_loop_matches_the_golden():
    """The KV-cached loop in the official RNG order: tokens exact; latent (with the diffusion residual) and image
    close to the official run. On the fixture's own machine with 1 thread this is bit-identical; the diffusion
    head's sampling loop amplifies fp32 GEMM rounding, so on a CPU whose MKL takes another kernel path (AVX-512
    vs AVX2) the residual and the latent deviate by up to 7.9e-5 (measured on an Intel Xeon VM against goldens
    made on AMD EPYC): 2e-4 for what lies downstream of the diffusion head, 1e-4 for images (the README's)."""
    adapter = load_model("official-hart-tiny")
    golden = torch.load(FIXTURE_DIR / "golden_ar_greedy_cfg4.5.pt", weights_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)  # the diffusion noise comes from the global generator, as in the official code
        result = generate(adapter, _fixture_inputs(), sampling=GREEDY,
                          shared_generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(result.tokens, golden["idx_Bl"]))
    assert float((result.latent - golden["final_f_hat"]).abs().max()) <= 2e-4
    assert float((result.images - golden["image"]).abs().max()) <= 1e-4
    # the discrete-only image (official final_stage=1) differs by exactly the diffusion residual
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        plain = generate(adapter, _fixture_inputs(), sampling=dataclasses.replace(GREEDY, diffusion=False),
                         shared_generator=torch.Generator().manual_seed(0))
    residual = golden["residual_tokens"].transpose(1, 2).reshape(2, -1, 12, 12)
    assert torch.allclose(result.latent - plain.latent, residual, atol=2e-4)
    assert float(residual.abs().max()) > 1e-2  # the residual is not negligible next to that tolerance


@needs_fixture
def test_fixture_adaln_variant_loads_with_its_own_pooling():
    adapter = load_model("official-hart-tiny", variant="llm_aln")
    cfg = adapter.cfg
    assert (cfg.disable_aln, cfg.sep_aln_pooling_mode, cfg.attn_l2_norm, cfg.use_context_norm) == (False, "avg", False,
                                                                                                  True)
    assert cfg.attn_scale == pytest.approx(0.25 / 8)  # 0.25/√64, not 1/√64
    assert adapter.model.blocks[0].ada_lin[1].weight.shape == (768, 128)


@needs_fixture
def test_fixture_checkpoint_layout_and_consistency_checks(tmp_path):
    """lvl_1L is checked against config.json's schedule (a mismatch names both); disc.* entries are ignored."""
    import shutil

    from var_core.zoo import hart_folders, load_hart_files

    for sub in ("llm", "tokenizer"):
        shutil.copytree(FIXTURE_DIR / sub, tmp_path / sub)
    sd = torch.load(tmp_path / "tokenizer" / "pytorch_model.bin", weights_only=True)
    sd["disc.main.0.weight"] = torch.zeros(4, 3, 4, 4)
    torch.save(sd, tmp_path / "tokenizer" / "pytorch_model.bin")
    model, tok, info = load_hart_files(*hart_folders(tmp_path))
    assert info["disc_entries_ignored"] == 1
    config = json.loads((tmp_path / "llm" / "config.json").read_text())
    config["patch_nums"] = [1, 2, 3, 4, 5, 6, 9, 12]  # same count of scales, other token counts
    (tmp_path / "llm" / "config.json").write_text(json.dumps(config))
    config_tok = json.loads((tmp_path / "tokenizer" / "config.json").read_text())
    config_tok["v_patch_nums"] = config["patch_nums"]
    (tmp_path / "tokenizer" / "config.json").write_text(json.dumps(config_tok))
    with pytest.raises(CheckpointMismatchError, match="lvl_1L"):
        load_hart_files(*hart_folders(tmp_path))


# ---------------------------------------------------------------------------------------------------------------
# the 0.7B layout and hand-worked rules
# ---------------------------------------------------------------------------------------------------------------
def test_0p7b_parameter_counts_match_the_spec():
    """specs/hart.md §8.2/§8.3 (counted by instantiating the official model): 729,663,552 transformer parameters,
    28,317,696 per block, a 36,585,536-parameter diffusion head; the tokenizer's vae.* holds 109,005,699 numbers."""
    with torch.device("meta"):
        model = HARTTransformer(HART_0P7B)
        tok = HARTTokenizer(HARTTokenizerConfig())
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(model) == 729_663_552
    assert count(model.blocks[0]) == 28_317_696
    assert count(model.diffloss) == 36_585_536
    assert sum(t.numel() for t in list(tok.vae.parameters()) + list(tok.vae.buffers())) == 109_005_699
    assert HART_0P7B.mlp_hidden == 4096 and HART_0P7B.total_tokens == 9451


def test_0p7b_schedule_rules():
    """specs/hart.md §2.3: top-k 600 while si < 7 else 300; t/cfg = si/13 with the last scale at 12/13; Phi table."""
    with torch.device("meta"):
        adapter = HARTAdapter(HARTTransformer(HART_0P7B), HARTTokenizer(HARTTokenizerConfig()))
    sampling = adapter.default_sampling
    assert [adapter.top_k_at(si, sampling) for si in range(14)] == [600] * 7 + [300] * 7
    assert [adapter.guidance_ratio(si) for si in (0, 1, 12, 13)] == [0, 1 / 13, 12 / 13, 12 / 13]
    assert adapter.tokenizer.quantize.phi_table == (0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3)
    assert adapter.kv_cache().max_len == 300 + 9451 - 1 == 9750
    assert respaced_timesteps(8) == [0, 143, 285, 428, 571, 714, 856, 999]


def test_image_positions_round_like_each_official_path():
    """(r/pn)·pn_N in inference and r·(pn_N/pn) in training: for pn = 7, pn_N = 12 they differ by one float32
    ulp at r = 1 (1.7142858505 vs 1.7142857313), which the fixture's goldens resolve bit for bit."""
    infer = image_positions((7, 12), "inference")[0][1]  # columns of the first row: c·12/7
    train = image_positions((7, 12), "training")[0][1]
    assert infer[1].item() == 1.7142858505249023 and train[1].item() == 1.7142857313156128
    assert torch.equal(image_positions((3, 12))[0][1], torch.tensor([0.0, 4.0, 8.0]).repeat(3))  # columns


def test_2d_rope_layout_row_row_col_col():
    """hd = 8: g = (1, 10000^-0.5); a token at (row 2, col 3) with offset 1 gets angles [3g, 3g, 4g, 4g]."""
    cos, sin = image_rope(torch.tensor([2.0]), torch.tensor([3.0]), torch.tensor([1]), 8)
    g = torch.tensor([1.0, 0.01])
    angles = torch.cat([3 * g, 3 * g, 4 * g, 4 * g])
    assert torch.allclose(cos.flatten(), angles.cos()) and torch.allclose(sin.flatten(), angles.sin())
    x = torch.arange(8.0).view(1, 1, 1, 8)
    out = apply_rope(x, cos, sin).flatten()
    # channel 0 mixes with channel 4 at the row angle, channel 4 with channel 0 at the column angle
    assert out[0].item() == pytest.approx(0 * math.cos(3) - 4 * math.sin(3), abs=1e-5)
    assert out[4].item() == pytest.approx(4 * math.cos(4) + 0 * math.sin(4), abs=1e-5)


def test_0p7b_entry_checks_its_inferred_assumptions_before_reading_weights(tmp_path):
    """A config.json that disagrees with an inferred 0.7B field is refused, naming the field and the evidence,
    before any weight file is read (there is none here)."""
    (tmp_path / "llm").mkdir()
    (tmp_path / "tokenizer").mkdir()
    llm = {"model_type": "hart_transformer_t2i", "context_token": 300, "context_dim": 1536, "depth": 20,
           "embed_dim": 1536, "num_heads": 24, "patch_nums": list(HART_0P7B.patch_nums), "attn_type": "llama",
           "mlp_type": "llama", "disable_aln": True, "num_sampling_steps": "8"}
    (tmp_path / "llm" / "config.json").write_text(json.dumps(llm))
    (tmp_path / "tokenizer" / "config.json").write_text(json.dumps({"model_type": "hart_autoencoder_with_disc"}))
    with pytest.raises(CheckpointMismatchError, match=r"depth=20 but zoo entry 'hart-0.7b' assumes 24 \(inferred"):
        load_model("hart-0.7b", weights=tmp_path, text_encoder=False)
    llm["depth"], llm["attn_type"] = 24, "gpt2"
    (tmp_path / "llm" / "config.json").write_text(json.dumps(llm))
    with pytest.raises(CheckpointMismatchError, match="attn_type='gpt2' is not supported"):
        load_model("hart-0.7b", weights=tmp_path, text_encoder=False)


# ---------------------------------------------------------------------------------------------------------------
# the engine on random:hart-tiny
# ---------------------------------------------------------------------------------------------------------------
def test_tiny_determinism_and_batch_single(tiny):
    sampling = tiny.default_sampling  # official settings: cfg 4.5, 600/300 top-k, more_smooth, 8 diffusion steps
    batch = generate(tiny, [3, 5, 8], seeds=[11, 12, 13], sampling=sampling)
    again = generate(tiny, [3, 5, 8], seeds=[11, 12, 13], sampling=sampling)
    alone = generate(tiny, [5], seeds=[12], sampling=sampling)
    assert torch.equal(batch.images, again.images)
    assert all(torch.equal(t[1:2], a) for t, a in zip(batch.tokens, alone.tokens))
    assert float((batch.images[1:2] - alone.images).abs().max()) < 1 / 255
    assert batch.images.shape == (3, 3, 128, 128) and tiny.image_size == 128


def test_tiny_kv_cache_holds_the_context(tiny, monkeypatch):
    """Scale 0 runs every context token (the loop sees the last one): block 0's cache grows to ctx, then by pn²
    per scale, ending with ctx + L − 1 keys."""
    from var_core.engine.kvcache import KVCache

    lengths, append = [], KVCache.append

    def recording_append(self, block, k, v, valid=None):
        out = append(self, block, k, v, valid)
        if block == 0:
            lengths.append(self.lengths[0])
        return out

    monkeypatch.setattr(KVCache, "append", recording_append)
    generate(tiny, [1], seeds=[0], sampling=GREEDY, options=GenerationOptions(decode=False))
    ctx, pns = tiny.cfg.context_token, tiny.cfg.patch_nums
    assert lengths == [ctx + sum(p * p for p in pns[1:si + 1]) for si in range(len(pns))]
    assert lengths[-1] == ctx + tiny.total_tokens - 1


def test_tiny_guidance_layouts_and_the_diffusion_step(tiny):
    """cfg = 0 needs no unconditional rows; without the diffusion head the latent is the discrete HART f_hat;
    with it the latent differs by the residual; the sampling settings are recorded with the others."""
    from var_core.eval.records import RunConfig

    assert tiny.initial_guidance(SamplingConfig(cfg=0.0)) is GuidanceMode.COND_ONLY
    plain = generate(tiny, [2, 4], seeds=[1, 2], sampling=dataclasses.replace(GREEDY, diffusion=False),
                     options=GenerationOptions(decode=False))
    full = generate(tiny, [2, 4], seeds=[1, 2], sampling=GREEDY, options=GenerationOptions(decode=False))
    assert all(torch.equal(a, b) for a, b in zip(plain.tokens, full.tokens))
    assert torch.allclose(plain.latent, tiny.tokenizer.idx_to_fhat(plain.tokens), atol=1e-6)
    assert float((full.latent - plain.latent).abs().mean()) > 1e-3
    config = RunConfig(arm="a", family="f", policy=None, model="random:hart-tiny", weights=None, sampling=GREEDY,
                       conditions=None)
    assert config.sampling_dict()["diffusion_steps"] == 0 and config.sampling_dict()["more_smooth"] is False


def test_every_preset_and_component_runs_on_hart_or_says_why_not(tiny):
    """Every preset and every registered component (in a simple always-pruning harness) either runs on HART with
    finite images, or is refused by check_model before generating."""
    from var_core.accel import REGISTRIES, PolicyConfig, build_policy, component_config
    from var_core.accel.presets import PRESETS, get_preset
    from var_core.engine.loop import generation_info

    configs = {f"preset={n}": get_preset(n) for n in PRESETS}
    base = PolicyConfig(name="harness", scorer=component_config("scorer", "random"),
                        activation=component_config("activation", "fixed", start_scale=-2),
                        schedule=component_config("schedule", "fixed_table", ratios=(0.5, 0.5)))
    for kind, registry in REGISTRIES.items():
        for name, _ in registry:
            configs[f"{kind}={name}"] = dataclasses.replace(base, **{kind: component_config(kind, name)})
    sampling = dataclasses.replace(tiny.default_sampling, diffusion_steps=2)
    refused = {}
    for label, config in configs.items():
        policy = build_policy(config)
        try:
            policy.check_model(generation_info(tiny, 2, GuidanceMode.BOTH, sampling=sampling))
        except ValueError as exc:
            refused[label] = str(exc)
            continue
        result = generate(tiny, [0, 1], seeds=[5, 6], sampling=sampling, policy=policy)
        assert bool(torch.isfinite(result.images).all()), label
    assert all(refused.values()), refused
    # the one preset HART refuses: SparVAR's patterns do not cover the text-context prefix of HART's KV cache
    assert {k for k in refused if k.startswith("preset=")} == {"preset=sparvar"}, refused
    assert "text-context" in refused["preset=sparvar"]


def test_fastvar_resolves_to_the_released_hart_setting():
    from var_core.accel.presets import REFERENCE_MODELS, get_preset, resolve_config
    from var_core.models.hart import FASTVAR_HART_SETTING

    resolved = resolve_config(get_preset("fastvar"), REFERENCE_MODELS["hart"][1])
    assert tuple(resolved.schedule.widths) == FASTVAR_HART_SETTING["widths"]
    assert tuple(resolved.schedule.ratios) == FASTVAR_HART_SETTING["removal_ratios"]
    assert resolved.restorer.cache_scale == 11  # the 36×36 scale of the 14-scale schedule
    assert resolved.granularity == "branch" and resolved.exempt_first_blocks == 0


def test_qwen2_encoder_cuts_the_system_prompt_and_keeps_the_padding():
    """Qwen2TextEncoder on a tiny random Qwen2 (transformers): the prompt positions of a forward over
    [system ; prompt], mask = ids != pad, position ids = cumsum(mask) − 1 (the system prompt excluded)."""
    transformers = pytest.importorskip("transformers")
    from var_core.models.hart_text import Qwen2TextEncoder

    cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen2Model(cfg).eval()

    class Tokenizer:  # right padding with id 0; words → ids 5, 6, ...
        pad_token_id = 0

        def __call__(self, text, padding=None, max_length=None, truncation=None, return_tensors=None):
            rows = [text] if isinstance(text, str) else list(text)
            ids = [[5 + i for i, _ in enumerate(r.split())] for r in rows]
            if padding == "max_length":
                ids = [(r + [0] * max_length)[:max_length] for r in ids]
            t = torch.tensor(ids)
            return {"input_ids": t, "attention_mask": (t != 0).long()}

    enc = Qwen2TextEncoder.from_parts(model, Tokenizer(), max_length=6, system_prompt="be nice")
    ctx = enc.encode(["a b c", "a"])
    assert ctx.features.shape == (2, 6, 32)
    assert ctx.mask.tolist() == [[True] * 3 + [False] * 3, [True] + [False] * 5]
    assert ctx.position_ids.tolist() == [[0, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0]]
    ids = torch.tensor([[5, 6, 5, 6, 7, 0, 0, 0]])
    with torch.no_grad():
        direct = model(input_ids=ids, attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]]),
                       output_hidden_states=True).hidden_states[-1][:, 2:]
    assert torch.allclose(ctx.features[0], direct[0], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# FLOPs and memory (profilers)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["baseline", "ldpruning", "skipvar"])
def test_flops_equal_flop_counter_mode(tiny, preset):
    """The analytic HART counter (context prefix at scale 0, SwiGLU, soft codes, diffusion head) against
    FlopCounterMode on the same generation: exact, dense, pruned (ragged, packed) and with guidance dropped."""
    from profilers.flops import count_flops, measure_flops
    from var_core.accel import build_policy
    from var_core.accel.presets import get_preset

    context = tiny.encode_prompts(["a red cat", "two dogs"])  # encoded outside the counted region
    out = {}

    def run():
        out["r"] = generate(tiny, context, seeds=[3, 4], sampling=tiny.default_sampling,
                            policy=build_policy(get_preset(preset)), options=GenerationOptions(decode=False))

    measured, _ = measure_flops(run)
    report = count_flops(tiny, out["r"], batch_size=2)
    assert report.total == measured
    assert report.total_for(["diffusion"]) > 0


def test_0p7b_flops_hand_worked():
    """HART-0.7B, batch 1 with CFG (2 rows): the last scale's QKᵀ + PV is 4·n·L·C per row and block with n = 4096
    queries over L = 300 + 9451 − 1 keys; scale 0 runs the 300 context tokens; the diffusion head runs 8 steps on
    2·4096 rows of the 1024-wide MLP."""
    from profilers.flops import count_record_flops, dense_records, hart_arch

    arch = hart_arch(HART_0P7B)
    frame = count_record_flops(arch, dense_records(arch.scale_hw), 1).frame()
    last = frame[(frame.scale == 13) & (frame.component == "attn") & frame.op.isin(["scores", "pv"])]
    assert int(last.flops.sum()) == 4 * 4096 * 9750 * 1536 * 24 * 2
    qkv0 = frame[(frame.scale == 0) & (frame.component == "attn") & (frame.op == "qkv")]
    assert int(qkv0.flops.sum()) == 2 * 300 * 1536 * 3 * 1536 * 24 * 2
    diffusion = frame[frame.component == "diffusion"]
    n, W = 2 * 4096, 1024
    per_step = 2 * n * (256 * W + W * W + 1536 * W + 32 * W + 6 * (3 * W * W + 2 * W * W) + 2 * W * W + W * 64)
    assert int(diffusion.flops.sum()) == 8 * per_step + 2 * n * 32 * 1536


def test_memory_reports_the_context_cache_and_the_parts(tiny):
    from profilers.memory import analytic_memory

    result = generate(tiny, [1, 2], seeds=[0, 1], sampling=GREEDY, options=GenerationOptions(decode=False))
    report = analytic_memory(tiny, result.records, 2)
    cfg = tiny.cfg
    length = cfg.context_token + cfg.total_tokens - 1
    assert report.scales[-1].kv_reserved_bytes == 2 * 4 * length * cfg.embed_dim * 4 * cfg.depth  # 4 rows, fp32
    assert report.scales[-1].kv_cache_bytes == report.scales[-1].kv_reserved_bytes  # full at the end
    parts = report.components
    diffusion = sum(p.numel() * 4 for p in tiny.model.diffloss.parameters())
    assert parts["diffusion_weight_bytes"] == diffusion
    assert parts["transformer_weight_bytes"] + diffusion == sum(
        t.numel() * 4 for t in list(tiny.model.parameters()) + list(tiny.model.buffers()))
    assert parts["diffusion_activation_bytes"] > 0 and report.weight_bytes == sum(
        v for k, v in parts.items() if k.endswith("weight_bytes"))
