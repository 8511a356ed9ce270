"""ScaleKV, HACK and the recency window on the KV-cache seam (issue 29): the kept positions against a second
implementation written here, budgets by hand, bytes and FLOPs measured on the testbed, the CLI surfaces."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from var_core.accel.kv.scalekv import ScaleKV
from var_core.engine.kvcache import KVCache


def _probe(q, keys, current_Rn, scale):
    return SimpleNamespace(q=q, kv=SimpleNamespace(keys=keys, bias=None, current_Rn=current_Rn), scale=scale,
                           flops=0)


def _ctx(num_blocks=1, hw=(8, 8), offset=20):
    return SimpleNamespace(is_last=False, token_offset=offset, num_tokens=hw[0] * hw[1], hw=hw,
                           num_blocks=num_blocks, history=())


def _scalekv_by_hand(q, keys, scale, window_slots, current_start, capacity, kernel=5):
    """ScaleKV's selection written out per row and head: window keys + top (capacity - window) pooled scores."""
    R, H, _, _ = q.shape
    L = keys.shape[2]
    out = []
    for r in range(R):
        heads = []
        for h in range(H):
            window_keys = {current_start + s for s in window_slots}
            summed = []
            for j in range(L):
                if j in window_keys:
                    summed.append(-math.inf)
                else:
                    summed.append(sum(float(q[r, h, s] @ keys[r, h, j]) * scale for s in window_slots))
            pooled = [max(summed[max(0, j - kernel // 2):j + kernel // 2 + 1]) for j in range(L)]
            pooled = [(-math.inf if j in window_keys else v) for j, v in enumerate(pooled)]
            ranked = sorted((j for j in range(L) if j not in window_keys), key=lambda j: (-pooled[j], j))
            heads.append(sorted(window_keys | set(ranked[:capacity - len(window_keys)])))
        out.append(heads)
    return torch.tensor(out)


def test_scalekv_keeps_what_a_second_implementation_keeps():
    torch.manual_seed(0)
    R, H, d, prefix, hw = 2, 2, 4, 20, (8, 8)
    n = hw[0] * hw[1]
    keys = torch.randn(R, H, prefix + n, d)
    q = torch.randn(R, H, n, d)
    # the 4x4 grid of an 8x8 map: cells of 2, centre offset (2 - 1) // 2 = 0 -> rows and columns 0, 2, 4, 6
    slots = [r * 8 + c for r in (0, 2, 4, 6) for c in (0, 2, 4, 6)]
    policy = ScaleKV(ScaleKV.Config(budget=0.25, selection="uniform"))
    policy.start(None, None)
    ctx = _ctx()
    current = torch.arange(prefix, prefix + n).expand(R, n)
    with KVCache(num_blocks=1, max_len=200) as cache:
        cache.append(0, keys, keys)
        policy.observe_attention(ctx, 0, _probe(q, keys, current, 0.5), None, None)
        keep = policy.plan_kv(ctx, cache, None)
    capacity = max(16, math.ceil(0.25 * (prefix + n)))  # 21
    expected = _scalekv_by_hand(q, keys, 0.5, slots, prefix, capacity)
    assert (keep[0].valid is None or bool(keep[0].valid.all())) and torch.equal(keep[0].index, expected)


def test_scalekv_drafters_are_the_least_selective_blocks_with_the_larger_budget():
    """Four blocks; block 2's queries are zero (uniform attention: the lowest selectivity index) -> the drafter.
    budget 10 % of 84 keys = 8.4; c = 4·8.4 / (1 + 3·0.25) = 19.2 -> 20 keys; refiners 0.25·c = 4.8 -> the
    16-key window."""
    torch.manual_seed(1)
    R, H, d, prefix, n = 1, 2, 4, 20, 64
    policy = ScaleKV(ScaleKV.Config(budget=0.1))
    policy.start(None, None)
    ctx = _ctx(num_blocks=4)
    current = torch.arange(prefix, prefix + n).expand(R, n)
    with KVCache(num_blocks=4, max_len=200) as cache:
        for block in range(4):
            keys = torch.randn(R, H, prefix + n, d) * 4
            q = torch.zeros(R, H, n, d) if block == 2 else torch.randn(R, H, n, d) * 4
            cache.append(block, keys, keys)
            policy.observe_attention(ctx, block, _probe(q, keys, current, 1.0), None, None)
        keep = policy.plan_kv(ctx, cache, None)
    assert [keep[b].index.shape[-1] for b in range(4)] == [16, 16, 20, 16]


@pytest.fixture(scope="module")
def testbed():
    from var_core.zoo import load_model

    torch.set_num_threads(1)
    return load_model("testbed")


def _run(adapter, config):
    from var_core.accel.policy import build_policy
    from var_core.engine import GenerationOptions, generate

    return generate(adapter, torch.tensor([1, 4]), seeds=[7, 8], policy=build_policy(config),
                    options=GenerationOptions(decode=False))


def test_kv_bytes_at_10_percent_are_at_most_15_percent_of_the_baseline(testbed):
    from ablations.probes import kv_cache_bytes
    from var_core.accel.presets import get_preset

    base = _run(testbed, get_preset("baseline"))
    C, blocks = testbed.cfg.embed_dim, testbed.num_blocks
    # by hand: after the second-to-last scale every block holds every token of scales 0..K-2, for 2B = 4 CFG rows,
    # K and V, fp32 -> per image
    carried = sum(h * w for h, w in testbed.scale_hw[:-1])
    assert kv_cache_bytes(base.records, 2)["kv_bytes_per_image"] == 4 * blocks * carried * C * 2 * 4 / 2
    for name in ("scalekv", "hack"):
        arm = _run(testbed, get_preset(name))
        ratio = kv_cache_bytes(arm.records, 2)["kv_bytes_per_image"] / kv_cache_bytes(base.records, 2)[
            "kv_bytes_per_image"]
        assert ratio <= 0.15, (name, ratio)


def test_flops_counter_sees_the_kept_keys_of_a_recency_window(testbed):
    """keep_recent at 50 %: after scale k each block keeps ceil(0.5 · tokens of scales 0..k); scale k's attention
    reads those plus its own N_k keys. Attention FLOPs (QK^T and PV) by hand: 4 · rows · N_k · keys · C."""
    from profilers.flops import count_flops
    from var_core.accel.policy import PolicyConfig, component_config

    result = _run(testbed, PolicyConfig(name="recent", kv=component_config("kv", "keep_recent", budget=0.5)))
    C, rows = testbed.cfg.embed_dim, 4
    expected, kept, dense = 0, 0, 0
    for h, w in testbed.scale_hw:
        N = h * w
        expected += 4 * rows * N * (kept + N) * C * testbed.num_blocks
        dense += N
        kept = math.ceil(0.5 * dense)
    frame = count_flops(testbed, result, batch_size=2).frame()
    attention = frame[(frame.component == "attn") & frame.op.isin(["scores", "pv"])].flops.sum()
    assert attention == expected
    # the bytes model (profilers.memory.op_bytes) streams kv_len keys: the kept ones, block by block
    scores = frame[(frame.component == "attn") & (frame.op == "scores")]
    kept, dense = 0, 0
    for si, (h, w) in enumerate(testbed.scale_hw):
        assert set(scores[scores.scale == si].kv_len) == {kept + h * w}, si
        dense += h * w
        kept = math.ceil(0.5 * dense)


def test_hack_realises_asymmetric_budgets_by_padding_and_mask(testbed):
    """HACK with a calibration file naming head 0 of every block structural: it keeps structural_share (3) times
    what each contextual head keeps, so the stored (padded) bytes exceed the kept ones."""
    import tempfile
    from pathlib import Path

    from var_core.accel.policy import PolicyConfig, component_config

    H = testbed.cfg.num_heads
    table = [[h == 0 for h in range(H)] for _ in range(testbed.num_blocks)]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hack.json"
        path.write_text(json.dumps({"method": "hack", "structural": table}))
        result = _run(testbed, PolicyConfig(name="hack", kv=component_config("kv", "hack", calibration=str(path))))
    record = result.records[-2]
    assert record.kv_bytes_stored > record.kv_bytes
    # per row: contextual cap c with 1·3c + (H-1)·c = H·mean -> the structural head stores 3c, the others c
    dense = sum(h * w for h, w in testbed.scale_hw[:-1])
    c = H * 0.1 * dense / (3 + H - 1)
    per_entry = 2 * 4 * testbed.cfg.embed_dim // H
    caps = [math.ceil(3 * c)] + [math.ceil(c)] * (H - 1)
    assert record.kv_bytes == 4 * testbed.num_blocks * sum(caps) * per_entry
    assert record.kv_bytes_stored == 4 * testbed.num_blocks * H * max(caps) * per_entry


def test_ls_lists_the_kv_components_and_presets(capsys):
    from studies.ablate import cmd_ls

    cmd_ls("presets")
    out = capsys.readouterr().out
    assert "scalekv" in out and "hack" in out
    cmd_ls("components")
    out = capsys.readouterr().out
    for name in ("keep_all", "keep_recent", "scalekv", "hack"):
        assert name in out


def test_kv_family_builds_every_arm_with_one_composed_arm():
    from ablations.base import build_arms

    arms = build_arms("kv")
    assert all(a.ok for a in arms), [(a.name, a.error) for a in arms if not a.ok]
    names = {a.name for a in arms}
    for method in ("keep_recent", "scalekv", "hack"):
        assert {f"{method}@{b}%" for b in (100, 50, 25, 10)} <= names
    composed = next(a for a in arms if a.name == "fastvar+scalekv")
    assert composed.config.kv.component_name == "scalekv" and composed.config.scorer.component_name != "random"


def test_calibrate_hack_writes_the_file_the_component_reads(testbed, tmp_path):
    from studies.calibrate import main
    from var_core.accel.policy import PolicyConfig, component_config

    assert main(["hack", "--samples", "2", "--batch-size", "2", "--threads", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "hack_calibration.json").read_text())
    assert data["method"] == "hack" and len(data["structural"]) == testbed.num_blocks
    assert all(len(heads) == testbed.cfg.num_heads for heads in data["structural"])
    for flags, recency, concentration in zip(data["structural"], data["recency"], data["concentration"]):
        assert flags == [r > c for r, c in zip(recency, concentration)]
    config = PolicyConfig(name="hack", kv=component_config("kv", "hack", calibration=str(tmp_path /
                                                                                        "hack_calibration.json")))
    assert _run(testbed, config).records[-2].kv_bytes is not None


def test_hack_without_its_calibration_file_is_a_user_error(testbed, tmp_path):
    from var_core.accel.policy import PolicyConfig, component_config
    from var_core.errors import UserError

    config = PolicyConfig(name="hack", kv=component_config("kv", "hack", calibration=str(tmp_path / "none.json")))
    with pytest.raises(UserError, match="varscope calibrate hack"):
        _run(testbed, config)


def test_ablate_validate_builds_and_runs_every_kv_arm(fixture_dir):
    from ablations.validate import validate_families

    report = validate_families(["kv"], model="official-tiny", weights=fixture_dir, threads=1)
    assert report.ok, report.errors
    arms = {arm for family, arm, _ in report.checked if family == "kv"}
    assert {"scalekv@10%", "hack@10%", "keep_recent@10%", "fastvar+scalekv"} <= arms and len(arms) == 16


@pytest.mark.parametrize("pruning,kv", [("baseline", "scalekv"), ("baseline", "hack"), ("ldpruning", "scalekv"),
                                        ("nova", "hack")])
def test_kv_presets_batch_equals_single(testbed, pruning, kv):
    """A sample's tokens do not depend on its batch: the KV presets alone and on top of ragged token pruning
    (LD-Pruning's and NOVA's per-sample counts: packed rows of different lengths before the eviction)."""
    from var_core.accel.policy import build_policy
    from var_core.accel.presets import get_preset
    from var_core.engine import GenerationOptions, generate

    config = get_preset(pruning).replace_component("kv", kv)  # the preset's 10 % budget is the component default
    labels, seeds = torch.tensor([2, 5, 7]), [31, 32, 33]
    options = GenerationOptions(decode=False)
    batch = generate(testbed, labels, seeds=seeds, policy=build_policy(config), options=options)
    assert batch.records[-2].kv_bytes < batch.records[-2].kv_bytes_peak  # something was evicted
    for b in range(3):
        alone = generate(testbed, labels[b:b + 1], seeds=[seeds[b]], policy=build_policy(config), options=options)
        for si, (a, t) in enumerate(zip(alone.tokens, batch.tokens)):
            assert torch.equal(a[0], t[b]), (b, si)
