"""The generation loop: fixture fidelity, hook-slot contracts, batching, determinism, pruning, bad inputs."""

from __future__ import annotations

import shutil

import pytest
import torch

from var_core.engine import (GenerationOptions, GuidanceMode, NonFiniteLogitsError, Policy, SamplingConfig,
                             ScalePlan, generate)
from var_core.engine.reference_loop import reference_generate
from var_core.models.loading import CheckpointError, CheckpointMismatchError
from var_core.zoo import load_model, load_var_files

SAMPLED = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)


def test_fixture_verify_all_checks_pass(fixture_dir):
    from var_core.verify import verify_var_fixture

    checks = verify_var_fixture(fixture_dir)
    failed = [c.line() for c in checks if c.passed is False]
    assert not failed, "\n".join(failed)
    names = {c.name for c in checks if c.passed}
    for variant in ("var", "var_saln"):
        for cfg in ("1", "1.5"):
            assert f"{variant}/greedy_cfg{cfg}/tokens" in names
            assert f"{variant}/greedy_cfg{cfg}/image" in names
        assert f"{variant}/teacher_forcing/logits" in names
        assert f"{variant}/teacher_forcing/block_outputs" in names
    assert {"vqvae/idx_Bl", "vqvae/recon"} <= names


def test_verify_cli_exit_status(fixture_dir, tmp_path, capsys):
    from var_core.verify import main

    assert main([str(fixture_dir)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verify: ")
    broken = tmp_path / "broken"
    shutil.copytree(fixture_dir, broken)
    g = torch.load(broken / "golden_var_ar_greedy_cfg1.5.pt", weights_only=True)
    g["idx_Bl"][-1] = (g["idx_Bl"][-1] + 1) % 256
    torch.save(g, broken / "golden_var_ar_greedy_cfg1.5.pt")
    assert main([str(broken)]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("verify: ") and not last.endswith(" 0 failed")


class _NoOp(Policy):
    """Implements every slot but decides nothing (asks for no observation)."""


class _ObserveEverything(Policy):
    """Declares every observation and checks that the loop provides it."""

    def __init__(self):
        self.seen = {"attention": 0, "lens": 0, "block": 0, "branch": 0, "logits": 0}

    def start(self, info):
        self.seen = {k: 0 for k in self.seen}

    def plan_scale(self, ctx):
        blocks = frozenset(range(ctx.num_blocks))
        return ScalePlan(attention_blocks=blocks, lens_blocks=blocks, observe_blocks=True, observe_branches=True)

    def observe_attention(self, ctx, block, probs, keep):
        assert torch.allclose(probs.probs().sum(-1), torch.ones(()), atol=1e-5)
        self.seen["attention"] += 1

    def observe_lens(self, ctx, block, logits):
        self.seen["lens"] += 1

    def observe_block(self, ctx, block, x_in, x_out):
        self.seen["block"] += 1

    def observe_branch(self, ctx, block, branch, out):
        self.seen["branch"] += 1

    def observe_logits(self, ctx, logits):
        self.seen["logits"] += 1


def test_noop_policy_is_bit_identical(tiny_adapter):
    labels = torch.tensor([3, 7])
    plain = generate(tiny_adapter, labels, seeds=[5, 6], sampling=SAMPLED)
    noop = generate(tiny_adapter, labels, seeds=[5, 6], sampling=SAMPLED, policy=_NoOp())
    observed_policy = _ObserveEverything()
    observed = generate(tiny_adapter, labels, seeds=[5, 6], sampling=SAMPLED, policy=observed_policy)
    assert torch.equal(plain.images, noop.images)
    assert all(torch.equal(a, b) for a, b in zip(plain.tokens, noop.tokens))
    # eager attention on every block changes the kernel, not the tokens
    assert all(torch.equal(a, b) for a, b in zip(plain.tokens, observed.tokens))
    K, D = tiny_adapter.num_scales, tiny_adapter.num_blocks
    assert observed_policy.seen == {"attention": K * D, "lens": K * D, "block": K * D, "branch": 2 * K * D,
                                    "logits": K}


def test_engine_matches_reference_loop(tiny_adapter):
    labels = torch.tensor([1, 4, 9])
    gens = [torch.Generator().manual_seed(s) for s in (11, 12, 13)]
    reference = reference_generate(tiny_adapter.var, tiny_adapter.vae, labels, SAMPLED, gens)
    ours = generate(tiny_adapter, labels, seeds=[11, 12, 13], sampling=SAMPLED)
    assert torch.allclose(reference, ours.images, atol=1e-5)


def test_single_equals_batch_and_repeatable(tiny_adapter):
    labels = torch.tensor([2, 5, 8, 0])
    seeds = [21, 22, 23, 24]
    batch = generate(tiny_adapter, labels, seeds=seeds, sampling=SAMPLED)
    again = generate(tiny_adapter, labels, seeds=seeds, sampling=SAMPLED)
    assert torch.equal(batch.images, again.images)
    for b in range(4):
        alone = generate(tiny_adapter, labels[b:b + 1], seeds=[seeds[b]], sampling=SAMPLED)
        for si in range(tiny_adapter.num_scales):
            assert torch.equal(alone.tokens[si][0], batch.tokens[si][b])
        # tokens are identical; the VQVAE decoder's conv reductions differ by batch size at ~1e-5
        assert torch.allclose(alone.images[0], batch.images[b], atol=2e-4)


class _PruneLastScaleHalf(Policy):
    """Keeps the first half of the tokens (by position) at the last scale, in every branch."""

    def plan_scale(self, ctx):
        return ScalePlan(prune=ctx.is_last)

    def plan_block(self, ctx, block, branch, x):
        n = ctx.num_tokens // 2
        return torch.arange(n).expand(x.shape[0], n)


def _block_linear_flops(adapter, rows, tokens):
    C = adapter.cfg.embed_dim
    per_token = 2 * C * 3 * C + 2 * C * C + 2 * C * adapter.cfg.mlp_hidden * 2
    return rows * tokens * per_token * adapter.num_blocks


def _attention_flops(adapter, rows, queries, keys):
    # QK^T + PV over all heads: 4 * rows * queries * keys * (heads * head_dim = C), per block
    return 4 * rows * queries * keys * adapter.cfg.embed_dim * adapter.num_blocks


def test_pruning_half_the_last_scale_halves_its_flops(tiny_adapter):
    # flop_counter_mode also counts CPU fused attention; registering it here keeps the count independent of
    # whether another test already registered the formula (the registry is process-wide)
    from profilers.flops import flop_counter_mode

    labels = torch.tensor([3, 7])
    counts = {}
    for name, policy in (("dense", None), ("pruned", _PruneLastScaleHalf())):
        with flop_counter_mode() as counter:
            result = generate(tiny_adapter, labels, seeds=[1, 2], sampling=SAMPLED, policy=policy)
        counts[name] = counter.get_total_flops()
        last = result.records[-1]
        N = tiny_adapter.scale_hw[-1][0] ** 2
        expected = N if policy is None else N // 2
        assert all(c == expected for branches in last.kept_tokens for c in branches)
    N = tiny_adapter.scale_hw[-1][0] ** 2
    saved = counts["dense"] - counts["pruned"]
    L = sum(h * w for h, w in tiny_adapter.scale_hw)
    expected_saving = _block_linear_flops(tiny_adapter, rows=4, tokens=N // 2) + (
        _attention_flops(tiny_adapter, rows=4, queries=N, keys=L)
        - _attention_flops(tiny_adapter, rows=4, queries=N // 2, keys=L - N // 2))
    assert saved == pytest.approx(expected_saving, rel=0.02)


def test_guidance_row_drop_and_stop(tiny_adapter):
    class DropAndStop(Policy):
        def plan_scale(self, ctx):
            if ctx.scale_index == ctx.num_scales - 1:
                return ScalePlan(stop=True)
            if ctx.scale_index == 3:
                return ScalePlan(guidance=GuidanceMode.COND_ONLY)
            return ScalePlan()

    result = generate(tiny_adapter, torch.tensor([3, 7]), seeds=[1, 2], sampling=SAMPLED, policy=DropAndStop())
    assert result.stopped_at == tiny_adapter.num_scales - 1
    assert [r.guidance for r in result.records] == [GuidanceMode.BOTH] * 3 + [GuidanceMode.COND_ONLY] * 3
    assert result.records[-1].raw_logits_RNV.shape[0] == 2  # rows halved
    assert result.images.shape == (2, 3, 128, 128) and torch.isfinite(result.images).all()

    class BackToBoth(Policy):
        def plan_scale(self, ctx):
            return ScalePlan(guidance=GuidanceMode.COND_ONLY if ctx.scale_index == 1 else GuidanceMode.BOTH)

    with pytest.raises(ValueError, match="cannot switch guidance"):
        generate(tiny_adapter, torch.tensor([3]), seeds=[1], sampling=SAMPLED, policy=BackToBoth())


def test_skipped_scale_leaves_no_tokens(tiny_adapter):
    class SkipFour(Policy):
        def plan_scale(self, ctx):
            return ScalePlan(skip=ctx.scale_index == 4)

    result = generate(tiny_adapter, torch.tensor([3]), seeds=[1], sampling=SAMPLED, policy=SkipFour())
    assert result.records[4].skipped and result.records[4].tokens_BN is None
    assert result.records[5].tokens_BN is not None


def test_kv_cache_released_after_exception(tiny_adapter):
    caches = []
    original = type(tiny_adapter).kv_cache

    def spy(self):
        cache = original(self)
        caches.append(cache)
        return cache

    class Boom(Policy):
        def plan_scale(self, ctx):
            if ctx.scale_index == 2:
                raise RuntimeError("boom")
            return ScalePlan()

    type(tiny_adapter).kv_cache = spy
    try:
        with pytest.raises(RuntimeError, match="boom"):
            generate(tiny_adapter, torch.tensor([3]), seeds=[1], sampling=SAMPLED, policy=Boom())
    finally:
        type(tiny_adapter).kv_cache = original
    assert caches and caches[0].keys == [] and not caches[0]._open
    with pytest.raises(RuntimeError, match="outside"):
        caches[0].append(0, torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1))


def test_non_finite_logits_name_the_scale(fixture_dir):
    adapter = load_model("official-tiny", weights=fixture_dir)
    with torch.no_grad():
        adapter.var.lvl_embed.weight[4].fill_(float("nan"))
    with pytest.raises(NonFiniteLogitsError, match="scale 4"):
        generate(adapter, torch.tensor([3]), seeds=[1], sampling=SAMPLED)


def test_missing_checkpoint_message(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found.*nothing is downloaded"):
        load_var_files(tmp_path / "var_d16.pth", tmp_path / "vae.pth")
    with pytest.raises(CheckpointError, match="needs local weights"):
        load_model("var-d16")


def test_wrong_keys_message(fixture_dir, tmp_path):
    sd = torch.load(fixture_dir / "var.pth", weights_only=True)
    sd["blocks.0.attn.extra_thing"] = torch.zeros(3)
    del sd["blocks.1.ffn.fc2.bias"]
    sd["head.bias"] = torch.zeros(7)
    torch.save(sd, tmp_path / "var.pth")
    with pytest.raises(CheckpointMismatchError) as err:
        load_var_files(tmp_path / "var.pth", fixture_dir / "vae.pth", patch_nums=(1, 2, 3, 4, 5, 6, 8))
    message = str(err.value)
    assert "missing keys (1): blocks.1.ffn.fc2.bias" in message
    assert "unexpected keys (1): blocks.0.attn.extra_thing" in message
    assert "('head.bias', (7,), (256,))" in message


def test_inconsistent_patch_nums_message(fixture_dir):
    with pytest.raises(CheckpointMismatchError, match="patch_nums .* inconsistent.*155"):
        load_var_files(fixture_dir / "var.pth", fixture_dir / "vae.pth", patch_nums=(1, 2, 3, 4, 5, 6, 9))


def test_unknown_model_did_you_mean():
    with pytest.raises(ValueError, match="Did you mean .*'var-d16'"):
        load_model("var-d6")


def test_config_inferred_from_keys(fixture_dir):
    var, vae = load_var_files(fixture_dir / "var_saln.pth", fixture_dir / "vae.pth")
    assert var.cfg.shared_aln and var.cfg.depth == 2 and var.cfg.patch_nums == (1, 2, 3, 4, 5, 6, 8)
    assert var.cfg.vocab_size == 256 and var.cfg.num_classes == 10 and var.cfg.num_heads == 2


def test_safetensors_roundtrip(fixture_dir, tmp_path):
    from safetensors.torch import save_file

    sd = torch.load(fixture_dir / "var.pth", weights_only=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "var.safetensors")
    var, _ = load_var_files(tmp_path / "var.safetensors", fixture_dir / "vae.pth")
    assert torch.equal(var.head.weight, sd["head.weight"])


def test_no_global_side_effects():
    reset = (torch.nn.Linear.reset_parameters, torch.nn.Conv2d.reset_parameters, torch.nn.LayerNorm.reset_parameters)
    state = torch.random.get_rng_state()
    from var_core.zoo import build_var_pair
    from var_core.models.var import VARConfig

    build_var_pair(VARConfig(depth=1, embed_dim=64, num_heads=1, vocab_size=32, z_channels=8, num_classes=3,
                             patch_nums=(1, 2)), dict(vocab_size=32, z_channels=8, ch=32, ch_mult=(1, 2),
                                                      patch_nums=(1, 2)), seed=3)
    assert reset == (torch.nn.Linear.reset_parameters, torch.nn.Conv2d.reset_parameters,
                     torch.nn.LayerNorm.reset_parameters)
    assert torch.equal(state, torch.random.get_rng_state())


def test_zoo_specs():
    from var_core.zoo import ZOO

    assert ZOO["var-d16"].var_config.total_tokens == 680 and ZOO["var-d16"].var_config.embed_dim == 1024
    assert ZOO["var-d36"].var_config.shared_aln and ZOO["var-d36"].var_config.total_tokens == 2240
    assert ZOO["var-d30"].var_config.num_heads == 30


def test_lens_probe_mixes_cfg_rows_before_the_head(tiny_adapter):
    """Guided lens logits from mixed head features equal the mixture of both halves' full logits."""
    from var_core.engine import LensProbe

    captured = {}

    class Capture(Policy):
        def plan_scale(self, ctx):
            return ScalePlan(lens_blocks=frozenset({0}) if ctx.scale_index == 3 else frozenset())

        def observe_lens(self, ctx, block, lens):
            captured["probe"], captured["B"] = lens, ctx.batch_size

    generate(tiny_adapter, torch.tensor([1, 6]), seeds=[3, 4], sampling=SAMPLED, policy=Capture())
    probe, B = captured["probe"], captured["B"]
    assert probe.both_halves and probe.rows == 2 * B
    wc, wu = torch.tensor([2.5, 1.0]), torch.tensor([-1.5, 0.0])
    mixed = probe.mixed_logits(wc, wu)  # computed before the full logits: the feature path
    cond = probe.cond_logits()
    full = probe.logits()
    expected = wc.view(B, 1, 1) * full[:B] + wu.view(B, 1, 1) * full[B:]
    assert mixed.shape == expected.shape and torch.allclose(mixed, expected, atol=1e-4)
    assert torch.allclose(cond, full[:B], atol=1e-5)
    fallback = LensProbe.of_logits(full, B)  # no head parts: combines the full logits
    assert torch.allclose(fallback.mixed_logits(wc, wu), expected)


class _RaggedLastScale(Policy):
    """Sample 0 keeps a quarter of the last scale, sample 1 keeps all of it (padding = the first kept index)."""

    def plan_scale(self, ctx):
        return ScalePlan(prune=ctx.is_last)

    def plan_block(self, ctx, block, branch, x):
        from var_core.accel.policy import top_tokens

        R, N = x.shape[0], ctx.num_tokens
        scores = torch.arange(N, dtype=torch.float32).flip(0).expand(R, N)
        B = ctx.batch_size
        counts = torch.tensor([N // 4, N] * (R // B))[:R] if B == 2 else torch.full((R,), N // 4)
        return top_tokens(scores, counts, int(counts.max()))


def test_ragged_rows_are_packed_exactly_and_counted(tiny_adapter, monkeypatch):
    """Per-token work of a ragged selection runs on the valid tokens only: same tokens as the padded path,
    and the analytic FLOPs (packed linear ops, padded attention) equal FlopCounterMode's count."""
    from profilers.flops import count_flops, flop_counter_mode
    from var_core.engine.packing import RowPacking

    labels, seeds = torch.tensor([3, 7]), [1, 2]
    with flop_counter_mode() as counter:
        packed = generate(tiny_adapter, labels, seeds=seeds, sampling=SAMPLED, policy=_RaggedLastScale(),
                          options=GenerationOptions(decode=False))
    last = packed.records[-1]
    N = last.hw[0] * last.hw[1]
    rows = 4  # 2 samples x (cond, uncond)
    assert all(total == 2 * (N // 4 + N) for branches in last.packed_tokens for total in branches)
    assert count_flops(tiny_adapter, packed).total == counter.get_total_flops()
    monkeypatch.setattr(type(tiny_adapter), "row_packing", lambda self, keep, valid: None)
    padded = generate(tiny_adapter, labels, seeds=seeds, sampling=SAMPLED, policy=_RaggedLastScale())
    assert not padded.records[-1].packed_tokens
    assert all(torch.equal(a, b) for a, b in zip(packed.tokens, padded.tokens))
    assert torch.equal(packed.latent, padded.latent)
    assert rows * N > 2 * (N // 4 + N)  # the packed path did less per-token work than the padded one

    keep = torch.tensor([[0, 2, 5], [1, 3, 1]])  # row 1 keeps 2 tokens and repeats its FIRST kept index
    valid = torch.tensor([[True, True, True], [True, True, False]])
    packing = RowPacking(keep, valid)
    x = torch.arange(6, dtype=torch.float32).view(2, 3, 1)
    assert packing.total == 5 and packing.pack(x).flatten().tolist() == [0, 1, 2, 3, 4]
    assert packing.apply(lambda t: t * 10, x).flatten().tolist() == [0, 10, 20, 30, 40, 30]
