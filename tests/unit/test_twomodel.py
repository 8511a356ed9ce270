"""The second-model seam (engine.switch) and CoDe on the testbeds (issue 29): the drafter ``testbed`` (depth 8) hands
over to the refiner ``testbed-small`` (depth 4); the two share one VQVAE file.

Pinned: switching at scale 0 is the refiner alone and past the last scale the drafter alone (bitwise); a refiner
that prefills from scales it did not generate continues exactly as if it had generated them (a switch between two
copies of one model equals that model alone, at every scale, bitwise); the refiner's logits after the hand-over
equal its teacher-forced forward pass (one block-causal pass over the tokens, the model's training path, CoDe's
prefill); CoDe's FLOPs equal a hand sum over both models' widths, depths and token counts; a refiner on another
tokenizer is one ``error:`` line and exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from var_core.engine import SamplingConfig, generate
from var_core.engine.switch import ModelSwitch, TokenizerMismatchError, check_shared_tokenizer

REPO = Path(__file__).resolve().parents[2]
SAMPLING = SamplingConfig(cfg=1.5, top_k=50, top_p=0.9)
LABELS = torch.tensor([1, 6])
SEEDS = [3, 4]


@pytest.fixture(scope="module")
def pair():
    from var_core.zoo import load_model

    torch.set_num_threads(1)
    return load_model("testbed"), load_model("testbed-small")


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens)) and torch.equal(a.images, b.images)


def test_the_testbeds_share_one_vqvae_file_and_schedule(pair):
    from var_core.zoo import read_testbed_card, testbed_folder

    cards = [read_testbed_card(testbed_folder(n)) for n in ("testbed", "testbed-small")]
    files = [(testbed_folder(n) / c.get("vqvae_file", "vqvae.safetensors")).resolve() for n, c in
             zip(("testbed", "testbed-small"), cards)]
    assert files[0] == files[1]
    drafter, refiner = pair
    assert drafter.tokenizer_fingerprint() == refiner.tokenizer_fingerprint()
    assert drafter.scale_hw == refiner.scale_hw and (drafter.num_blocks, refiner.num_blocks) == (8, 4)


def test_switch_at_zero_is_the_refiner_alone_and_past_the_end_the_drafter_alone(pair):
    drafter, refiner = pair
    alone_r = generate(refiner, LABELS, SEEDS, SAMPLING)
    alone_d = generate(drafter, LABELS, SEEDS, SAMPLING)
    assert _same(generate(drafter, LABELS, SEEDS, SAMPLING, switch=ModelSwitch(refiner, 0)), alone_r)
    past = generate(drafter, LABELS, SEEDS, SAMPLING, switch=ModelSwitch(refiner, drafter.num_scales))
    assert _same(past, alone_d) and past.refiner is None and past.prefill == ()
    assert not _same(alone_r, alone_d)  # the two models do differ: the equalities above are not vacuous


def test_a_prefilled_cache_continues_exactly_as_the_models_own(pair):
    """Two copies of the refiner: scales < N on copy A, then copy B prefills its cache from A's scales and goes on.
    Whatever N, the result is copy A alone, bit for bit — B's prefilled cache (and latent) is the one it would have
    built generating those tokens itself."""
    from var_core.zoo import load_model

    _, refiner = pair
    copy = load_model("testbed-small")
    alone = generate(refiner, LABELS, SEEDS, SAMPLING)
    for at in (1, 4, 8, refiner.num_scales - 1):
        switched = generate(refiner, LABELS, SEEDS, SAMPLING, switch=ModelSwitch(copy, at))
        assert _same(switched, alone), at
        assert [r.scale_index for r in switched.prefill] == list(range(at))
        assert all(r.teacher_forced and len(r.kept_tokens) == copy.num_blocks for r in switched.prefill)


def test_the_refiner_after_the_hand_over_computes_its_teacher_forced_logits(pair):
    """A second implementation of the prefill: the refiner's training forward pass over all the generated tokens in
    one block-causal pass (CoDe's code prefills this way). Its logits at every scale the refiner generated equal the
    ones the switched generation computed; the drafter's scales equal the drafter's teacher-forced logits."""
    drafter, refiner = pair
    at = 6
    result = generate(drafter, LABELS, SEEDS, SAMPLING, switch=ModelSwitch(refiner, at))
    quantize = drafter.vae.quantize
    var_input = quantize.idx_list_to_var_input([t for t in result.tokens])
    B = LABELS.shape[0]
    rows = torch.cat((LABELS, torch.full_like(LABELS, drafter.var.null_class)))
    with torch.no_grad():
        tf = {name: model.var(rows, var_input.repeat(2, 1, 1)) for name, model in (("d", drafter), ("r", refiner))}
    start = 0
    for record in result.records:
        n = record.hw[0] * record.hw[1]
        want = tf["d" if record.scale_index < at else "r"][:, start:start + n]
        assert torch.allclose(record.raw_logits_RNV, want, atol=2e-4, rtol=1e-4), record.scale_index
        start += n
    assert B == 2 and start == drafter.total_tokens


def _hand_flops(adapter, scales, guidance_rows: int, samples: int, prefill: bool, kv_start: int) -> int:
    """FLOPs of ``adapter`` over ``scales`` worked from its widths, depth and token counts: embedding (scale > 0),
    per block QKV / scores / PV / projection / MLP (keys = every token so far), the head with its AdaLN, and the
    quantizer's Phi conv on the full latent where that scale's Phi is a conv; a prefill pass has no head and no
    latent update."""
    cfg, q = adapter.cfg, adapter.vae.quantize
    C, Hm, V, Cv, D = cfg.embed_dim, cfg.mlp_hidden, cfg.vocab_size, cfg.z_channels, cfg.depth
    P = cfg.patch_nums[-1]
    R, total, keys = guidance_rows, 0, kv_start
    for si in scales:
        n = cfg.patch_nums[si] ** 2
        keys += n
        total += 2 * samples * n * Cv * C if si > 0 else 0
        per_block = 2 * R * n * (3 * C * C + C * C + 2 * C * Hm) + 2 * 2 * R * n * keys * C
        total += D * per_block
        if not prefill:
            total += 2 * R * C * 2 * C + 2 * R * n * C * V
            if isinstance(q.quant_resi[q.phi_index(si)], torch.nn.Conv2d):
                total += 2 * samples * P * P * Cv * Cv * 9
    return total


def test_code_flops_ratio_is_the_hand_sum_of_both_models(pair):
    from ablations.probes import ProfilerProbe
    from var_core.accel.presets import get_preset
    from var_core.eval.twomodel import model_switch_for

    drafter, refiner = pair
    config = get_preset("code")
    switch = model_switch_for(config, drafter)
    assert switch.adapter is not drafter and switch.adapter.model_name == "testbed-small" and switch.at_scale == 8
    B, R = 2, 4
    probe = ProfilerProbe(timer=False, memory=False)
    base = generate(drafter, LABELS, SEEDS, SAMPLING)
    code = generate(drafter, LABELS, SEEDS, SAMPLING, switch=switch)
    flops_base = probe.after_batch(base, adapter=drafter, policy=None, batch_size=B, seconds=0.0)["flops"]
    flops_code = probe.after_batch(code, adapter=drafter, policy=None, batch_size=B, seconds=0.0)["flops"]
    K, N = drafter.num_scales, switch.at_scale
    cond = {m: 2 * R * m.cfg.embed_dim * 6 * m.cfg.embed_dim * m.cfg.depth for m in (drafter, refiner)}  # AdaLN
    hand_base = cond[drafter] + _hand_flops(drafter, range(K), R, B, False, 0)
    prefix = sum(p * p for p in drafter.cfg.patch_nums[:N])
    hand_code = (cond[drafter] + _hand_flops(drafter, range(N), R, B, False, 0)
                 + cond[refiner] + _hand_flops(refiner, range(N), R, B, True, 0)
                 + _hand_flops(refiner, range(N, K), R, B, False, prefix))
    assert (flops_base, flops_code) == (hand_base, hand_code)
    assert flops_code / flops_base == hand_code / hand_base < 0.6


def test_a_refiner_on_another_tokenizer_is_refused_naming_both(pair):
    from var_core.zoo import load_model

    drafter, _ = pair
    other = load_model("random:testbed-small")  # same architecture, its own (random) VQVAE
    with pytest.raises(TokenizerMismatchError, match=r"testbed and random:testbed-small do not share a tokenizer"):
        check_shared_tokenizer(drafter, other)
    with pytest.raises(TokenizerMismatchError):
        generate(drafter, LABELS, SEEDS, SAMPLING, switch=ModelSwitch(other, 4))


def test_cli_refiner_on_another_tokenizer_is_one_error_line_and_exit_2(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "studies.cli", "ablate", "method", "--model", "testbed", "--arms",
                           "baseline,code", "--set", "refiner=random:testbed-small", "--samples", "2", "--threads",
                           "1", "--wandb", "disabled", "--out", str(tmp_path / "out")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "testbed and random:testbed-small do not share a tokenizer" in errors[0]
    assert "--set refiner=" in errors[0]


@pytest.mark.parametrize("name", ["code", "stepvar"])
def test_new_presets_give_a_sample_the_same_result_alone_and_in_a_batch(pair, name):
    from var_core.accel.policy import build_policy
    from var_core.accel.presets import get_preset
    from var_core.eval.twomodel import model_switch_for

    drafter, _ = pair
    config = get_preset(name)
    labels, seeds = torch.tensor([2, 7, 5]), [21, 22, 23]
    switch = model_switch_for(config, drafter)
    batch = generate(drafter, labels, seeds, SAMPLING, policy=build_policy(config), switch=switch)
    pruned = sum(c < r.hw[0] * r.hw[1] for r in batch.records for block in r.kept_tokens for c in block)
    assert (switch is not None) if name == "code" else pruned > 0  # the preset does act on the testbed
    for b in (0, 2):
        alone = generate(drafter, labels[b:b + 1], seeds[b:b + 1], SAMPLING, policy=build_policy(config),
                         switch=switch)
        for a_tok, b_tok in zip(alone.tokens, batch.tokens):
            assert torch.equal(a_tok[0], b_tok[b]), (name, b)
        assert torch.allclose(alone.images[0], batch.images[b], atol=2e-4)


def test_code_memory_counts_both_models_weights_and_the_refiners_cache(pair):
    """The analytic memory of a switched generation: both models' parameters resident, the drafter's scales on its
    width and depth, then the refiner's cache holding the prefilled scales plus its own (K and V, fp32, every CFG
    row), worked by hand from the two configurations."""
    from profilers.memory import two_model_memory

    drafter, refiner = pair
    at, B, R = 6, 2, 4
    result = generate(drafter, LABELS, SEEDS, SAMPLING, switch=ModelSwitch(refiner, at))
    report = two_model_memory(drafter, result, B)
    params = sum(p.numel() * p.element_size() for m in (drafter.var, drafter.vae, refiner.var, refiner.vae)
                 for p in list(m.parameters()) + list(m.buffers()))
    assert report.weight_bytes == params
    K = drafter.num_scales
    assert [s.scale for s in report.scales] == list(range(at)) + list(range(at)) + list(range(at, K))
    tokens = [p * p for p in drafter.cfg.patch_nums]
    for cfg, entry, upto in ((drafter.cfg, report.scales[at - 1], at), (refiner.cfg, report.scales[-1], K)):
        assert entry.kv_cache_bytes == 2 * cfg.depth * R * sum(tokens[:upto]) * cfg.embed_dim * 4


def test_ls_lists_the_new_presets_and_scorer(capsys):
    from studies.cli import main as varscope

    assert varscope(["ls", "presets"]) == 0
    listed = capsys.readouterr().out
    assert "\n  code\n" in listed and "\n  stepvar\n" in listed
    assert varscope(["ls", "components"]) == 0
    assert "structure_texture" in capsys.readouterr().out


@pytest.mark.slow  # two validations of the whole method family (about 30 s each on a shared 2-core VM)
def test_validate_builds_the_new_presets_and_code_is_not_for_a_model_without_its_refiner():
    from ablations.validate import validate_families

    report = validate_families(["method"], model="testbed", samples=1, lightning=False, threads=1,
                               log=lambda line: None)
    checked = {arm for family, arm, _ in report.checked}
    assert {"code", "stepvar"} <= checked and not report.errors, report.errors
    # on a model without a refiner that shares its tokenizer, CoDe is not for the model (not a failure)
    report = validate_families(["method"], model="random:testbed", samples=1, lightning=False, threads=1,
                               log=lambda line: None)
    unfit = {arm: why for family, arm, why in report.not_for_model}
    assert "stepvar" in {arm for _, arm, _ in report.checked} and "code" in unfit
    assert "do not share a tokenizer" in unfit["code"]


@pytest.mark.parametrize("name, restorer", [("nova", "residual_reuse"), ("stagevar", "previous_output")])
def test_a_method_that_reuses_hidden_states_is_refused_before_a_switch_to_another_width(pair, name, restorer):
    """NOVA's residual reuse and StageVAR's previous outputs keep hidden states (width 256 on the drafter) that the
    refiner (width 128) cannot take: without the pre-flight the generation fails mid-way on a shape error."""
    import dataclasses

    from var_core.accel.presets import get_preset
    from var_core.eval.twomodel import TwoModelConfigError, model_switch_for

    drafter, _ = pair
    config = dataclasses.replace(get_preset(name), refiner="testbed-small", switch_scale=8)
    with pytest.raises(TwoModelConfigError, match=rf"restorer '{restorer}' reuses hidden states .* width 256 .* 128"):
        model_switch_for(config, drafter)
    ok = dataclasses.replace(get_preset("stepvar"), refiner="testbed-small", switch_scale=8)
    assert model_switch_for(ok, drafter).at_scale == 8  # a restorer that fills from the current scale runs
