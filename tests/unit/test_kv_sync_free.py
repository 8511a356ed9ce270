"""KV policies and SparseVAR's static geometry without host synchronisations (issue 27): the window slots, the
anchor grid and the previous-grid cells built on the device (values by hand and by a second implementation), the
budgets computed on both sides instead of copied over, the cache's device copy of the row lengths; the kept
positions and tokens equal those of the host-copy path written out here; the syncs counted per generation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from profilers.host_syncs import HostSyncCounter, count_generation
from var_core.accel.kv import _budget
from var_core.accel.kv._budget import dense_length, top_positions, rounded, window_slots
from var_core.accel.kv.hack import HACK, head_capacities
from var_core.accel.kv.scalekv import ScaleKV
from var_core.accel.restorers.anchors import anchor_candidates
from var_core.accel.schedules.score_threshold import first_positions
from var_core.engine import kvcache
from var_core.engine.kvcache import KVKeep

CPU = "cpu"  # an explicit device: the counter treats tensors made with device= as device tensors


def _silent(fn):
    with HostSyncCounter() as counter:
        out = fn()
    return out, counter.total


# ------------------------------------------------------------------------------------------- static geometry
def test_window_slots_are_built_on_the_device_with_the_values_of_the_host_lists():
    _budget._window_slots.cache_clear()  # memoised: a cold cache is what the first generation of a process sees
    # 8x8, 16-query window: 4x4 grid of 2x2 cells, centre offset (2 - 1) // 2 = 0 -> rows/columns 0, 2, 4, 6
    grid, syncs = _silent(lambda: window_slots(64, (8, 8), 16, CPU))
    assert syncs == 0 and grid.dtype == torch.long
    assert grid.tolist() == [r * 8 + c for r in (0, 2, 4, 6) for c in (0, 2, 4, 6)]
    # 12x16: cells of 3 x 4, offsets 1 and 1 -> rows 1, 4, 7, 10, columns 1, 5, 9, 13
    assert window_slots(192, (12, 16), 16, CPU).tolist() == [r * 16 + c for r in (1, 4, 7, 10)
                                                             for c in (1, 5, 9, 13)]
    # pruned scale (40 of 64 computed): 16 slots spaced 39/15 = 2.6 apart, rounded
    spaced, syncs = _silent(lambda: window_slots(40, (8, 8), 16, CPU))
    assert syncs == 0
    assert spaced.tolist() == [0, 3, 5, 8, 10, 13, 16, 18, 21, 23, 26, 29, 31, 34, 36, 39]
    assert window_slots(3, (1, 3), 16, CPU).tolist() == [0, 1, 2]  # fewer tokens than the window: all
    # the former implementation took unique() of the rounded linspace; k <= n slots never repeat, so it is the same
    for window in (1, 4, 9, 16, 25, 64):
        for n in range(1, 700):
            k = min(window, n)
            reference = torch.unique(torch.linspace(0, n - 1, k).round().long())
            assert torch.equal(_budget._window_slots.__wrapped__(n, (1, n + 1), window, CPU), reference), (window, n)


def test_anchor_candidates_are_built_on_the_device():
    cand, syncs = _silent(lambda: anchor_candidates((9, 9), 4, "with_last", CPU))
    assert syncs == 0
    assert cand.tolist() == [0, 4, 8, 8, 36, 40, 44, 44, 72, 76, 80, 80, 72, 76, 80, 80]
    assert anchor_candidates((10, 7), 4, "with_last", CPU).tolist() == [0, 4, 6, 28, 32, 34, 56, 60, 62, 63, 67,
                                                                        69]
    assert anchor_candidates((10, 7), 4, "multiples", CPU).tolist() == [0, 4, 28, 32, 56, 60]
    for size in range(1, 40):  # the lines by the third-party rule, written out here
        for stride in (1, 2, 3, 4, 5, 8):
            for grid in ("multiples", "with_last"):
                lines = list(range(0, size, stride))
                if grid == "with_last" and stride % size != 0:
                    lines.append(size - 1)
                expected = [r * 3 + c for r in lines for c in anchor_lines_3(stride, grid)]
                assert anchor_candidates((size, 3), stride, grid, CPU).tolist() == expected, (size, stride, grid)


def anchor_lines_3(stride, grid):
    lines = list(range(0, 3, stride))
    return lines + [2] if grid == "with_last" and stride % 3 != 0 else lines


def _first_positions_by_loop(source_hw, hw):
    """Every source cell a 'nearest' resize reaches, at its first output position, in cell order (a plain loop
    over torch's own mapping)."""
    hs, ws = source_hw
    cells = torch.arange(hs * ws, dtype=torch.float32).view(1, 1, hs, ws)
    mapped = F.interpolate(cells, size=hw, mode="nearest").flatten().long().tolist()
    first = {}
    for position, cell in enumerate(mapped):
        first.setdefault(cell, position)
    return [first[c] for c in sorted(first)]


def test_first_positions_of_an_upsampling_are_built_without_a_read():
    # 3x3 -> 4x5: rows floor(i*3/4) = 0,0,1,2 (first rows 0, 2, 3), columns floor(j*3/5) = 0,0,1,1,2 (0, 2, 4)
    first, syncs = _silent(lambda: first_positions((3, 3), (4, 5), CPU))
    assert syncs == 0
    assert first.tolist() == [0, 2, 4, 10, 12, 14, 15, 17, 19]
    # a downsampling skips cells: 4x4 -> 2x2 reaches cells 0, 2, 8, 10 (the boolean selection stays there)
    assert first_positions((4, 4), (2, 2), CPU).tolist() == [0, 1, 2, 3]
    assert _silent(lambda: first_positions((4, 4), (2, 2), CPU))[1] == 1
    for hs in range(1, 13):
        for h in range(hs, 17):
            for ws, w in ((hs, h), (1, h), (hs, hs)):
                assert first_positions((hs, ws), (h, w), CPU).tolist() == _first_positions_by_loop((hs, ws), (h, w))


# ------------------------------------------------------------------------------------------------- budgets
def test_hack_head_capacities_by_hand():
    structural = torch.tensor([[True, False, False, False], [False, False, False, False]])
    # mean 10 keys, share 3, H=4: row 0: c = 40 / (3 + 3) = 6.67 -> 7, structural 20; row 1: c = 10
    assert head_capacities(structural, 100, 10.0, 3.0).tolist() == [[20, 7, 7, 7], [10, 10, 10, 10]]
    # L = 15: the structural head keeps every key, the other 25 go to the contextual heads: 8.33 -> 9
    assert head_capacities(structural, 15, 10.0, 3.0).tolist() == [[15, 9, 9, 9], [10, 10, 10, 10]]


# ------------------------------------------------------------------------------ generations on the testbed
@pytest.fixture(scope="module")
def testbed():
    from var_core.zoo import load_model

    torch.set_num_threads(1)
    return load_model("testbed")


class _HostCopyScaleKV(ScaleKV):
    """ScaleKV's plan as it was before issue 27: capacities on the host, copied to the device; the valid mask
    from the host row lengths (a second implementation of the plumbing the sync-free path replaced)."""

    def plan_kv(self, ctx, cache, signals):
        scores, self._scores = self._scores, {}
        if ctx.is_last or not scores:
            return None
        blocks = sorted(scores)
        caps = self._capacities(ctx, blocks, torch.stack([scores[b][2].float() for b in blocks], dim=1).cpu())
        caps_dev = caps.to(scores[blocks[0]][0].device)
        out = {}
        for j, block in enumerate(blocks):
            view = cache.view(block)
            pooled, is_window, _ = scores[block]
            if view is None or pooled.shape[-1] != view.length:
                continue
            counts_host = caps[:, j].clamp(max=view.length)
            if bool((counts_host >= view.length).all()):
                continue
            R, H, L, _ = view.keys.shape
            s = rounded(pooled)
            valid = view.head_valid
            if view.row_lengths is not None:
                lengths = torch.tensor(view.row_lengths)
                in_row = (torch.arange(L).view(1, 1, L) < lengths.view(R, 1, 1)).expand(R, H, L)
                valid = in_row if valid is None else valid & in_row
            if valid is not None:
                s = s.masked_fill(~valid, float("-inf"))
            index, kept = top_positions(s, int(counts_host.max()), is_window.view(R, 1, L).expand_as(s),
                                        caps_dev[:, j].clamp(max=view.length).view(-1, 1))
            out[block] = KVKeep(index, kept)
        return out


class _HostCopyHACK(HACK):
    """HACK's plan as it was before issue 27: head classes to the host, budgets there, both copied back."""

    def plan_kv(self, ctx, cache, signals):
        stats, self._stats = self._stats, {}
        if ctx.is_last or not stats or self.config.calibrating:
            return None
        mean = self.config.budget * dense_length(ctx)
        share = self.config.structural_share
        blocks = sorted(stats)
        structural_all = torch.stack([self._structural(b, stats[b][0], stats[b][1]) for b in blocks]).cpu()
        plans = []
        for j, block in enumerate(blocks):
            view = cache.view(block)
            if view is None or stats[block][2].shape[-1] != view.length:
                continue
            R, H, L, _ = view.keys.shape
            structural = structural_all[j]
            n_s = structural.sum(1, keepdim=True).double()
            contextual_cap = H * mean / (n_s * share + (H - n_s))
            structural_cap = (contextual_cap * share).clamp(max=L)
            spread = (H * mean - n_s * structural_cap) / (H - n_s).clamp(min=1)
            contextual_cap = torch.maximum(contextual_cap, spread)
            caps = torch.where(structural, structural_cap, contextual_cap).ceil().long().clamp(1, L)
            if not bool((caps >= L).all()):
                plans.append((block, structural, caps, int(caps.max())))
        out = {}
        for block, structural, caps, m in plans:
            view = cache.view(block)
            R, H, L, _ = view.keys.shape
            valid = view.head_valid
            if view.row_lengths is not None:
                in_row = (torch.arange(L).view(1, 1, L) < torch.tensor(view.row_lengths).view(R, 1, 1)).expand(R, H, L)
                valid = in_row if valid is None else valid & in_row
            scores = torch.where(structural.unsqueeze(-1), torch.arange(L, dtype=torch.float32).expand(R, H, L),
                                 rounded(stats[block][2]))
            if valid is not None:
                scores = scores.masked_fill(~valid, float("-inf"))
            out[block] = KVKeep(*top_positions(scores, m, counts=caps))
        return out or None


def _generate_recording(adapter, policy, batch, monkeypatch):
    from var_core.engine.loop import GenerationOptions, generate

    keeps, ragged = [], []
    evict = kvcache.KVCache.evict

    def recording(self, block, keep, deferred=None):
        keeps.append((block, keep.index.clone(), None if keep.valid is None else keep.valid.clone()))
        ragged.append(self.row_lengths[block] is not None)
        return evict(self, block, keep, deferred)

    monkeypatch.setattr(kvcache.KVCache, "evict", recording)
    labels = torch.arange(batch) % adapter.cfg.num_classes
    with torch.inference_mode():
        result = generate(adapter, labels, list(range(1000, 1000 + batch)), policy=policy,
                          options=GenerationOptions(check_finite=False, decode=False))
    monkeypatch.setattr(kvcache.KVCache, "evict", evict)
    return result, keeps, ragged


@pytest.mark.parametrize("method,batch,calibrated", [("scalekv", 1, False), ("scalekv", 8, False),
                                                     ("hack", 1, False), ("hack", 8, True)])
def test_kv_policies_keep_what_the_host_copy_path_keeps(testbed, method, batch, calibrated, monkeypatch, tmp_path):
    """Rows of different budgets (ScaleKV: a drafter in one row, a refiner in another) make the cache ragged after
    the first eviction; HACK's calibrated heads keep asymmetric budgets (padding + mask). The device copy of the
    row lengths, the budgets computed on the device and the evictions must give the same positions and tokens as
    the host values copied over."""
    import json

    from var_core.accel.policy import PolicyConfig, build_policy, component_config

    knobs = {}
    if calibrated:
        path = tmp_path / "hack.json"
        table = [[h == 0 for h in range(testbed.cfg.num_heads)]] * testbed.num_blocks
        path.write_text(json.dumps({"method": "hack", "structural": table}))
        knobs["calibration"] = str(path)
    config = PolicyConfig(name=method, kv=component_config("kv", method, **knobs))
    new, new_keeps, ragged = _generate_recording(testbed, build_policy(config), batch, monkeypatch)
    reference_policy = build_policy(config)
    reference = {"scalekv": _HostCopyScaleKV, "hack": _HostCopyHACK}[method](reference_policy.kv.config)
    reference_policy.kv = reference_policy.parts["kv"] = reference
    old, old_keeps, _ = _generate_recording(testbed, reference_policy, batch, monkeypatch)
    if method == "scalekv":
        assert any(ragged)  # the row-length path was exercised
    else:
        assert any(v is not None and not bool(v.all()) for _, _, v in new_keeps) == calibrated  # padded heads
    assert len(new_keeps) == len(old_keeps) > 0
    for (b1, i1, v1), (b2, i2, v2) in zip(new_keeps, old_keeps):
        assert b1 == b2 and torch.equal(i1, i2) and (v1 is None) == (v2 is None)
        assert v1 is None or torch.equal(v1, v2)
    for t1, t2 in zip(new.tokens, old.tokens):
        assert torch.equal(t1, t2)


@pytest.mark.parametrize("batch", [1, 8])
def test_scalekv_and_hack_read_once_per_scale_for_budgets_and_once_for_eviction_checks(testbed, batch):
    """Before issue 27's KV pass: scalekv 48 / 95 syncs at batch 1 / 8, hack 26 / 26 (budgets copied back, row
    lengths copied to the device per block, window slots / unique). Now, per compressed scale (9 of 10): one read
    of the budgets and one of the eviction checks; nothing from the window, the valid mask or the eviction."""
    _budget._window_slots.cache_clear()
    for preset in ("scalekv", "hack"):
        result = count_generation(testbed, preset, batch)
        sites = result.counter.by_site()
        kv_sites = [s for s in sites if "accel/kv/" in s]
        assert sum(sites[s] for s in kv_sites) <= 9 and all("in plan_kv [cpu]" in s for s in kv_sites), sites
        assert not [s for s in sites if "kvcache.py" in s and ("in evict" in s or "_append" in s)], sites
        assert sum(sites[s] for s in sites if "in settle" in s) <= 9, sites
        assert result.total <= 20, (preset, batch, sites)


def test_calibrated_hack_copies_its_table_to_the_device_once(testbed, tmp_path):
    import json

    from var_core.accel.policy import PolicyConfig, build_policy, component_config

    H = testbed.cfg.num_heads
    path = tmp_path / "hack.json"
    path.write_text(json.dumps({"method": "hack", "structural": [[h == 0 for h in range(H)]] * testbed.num_blocks}))
    policy = build_policy(PolicyConfig(name="hack", kv=component_config("kv", "hack", calibration=str(path))))
    result = count_generation(testbed, None, 1, policy=policy)
    sites = result.counter.by_site()
    assert sum(n for s, n in sites.items() if "in _structural" in s) == 1, sites  # before: one per block and scale
    kv_sites = {s: n for s, n in sites.items() if "accel/kv/" in s and "in _structural" not in s}
    assert sum(kv_sites.values()) <= 9 and all("in plan_kv [cpu]" in s for s in kv_sites), sites


@pytest.mark.parametrize("batch", [1, 8])
def test_calibrated_hack_reads_masked_pairs_lengths_and_bytes_once_per_scale(testbed, tmp_path, batch):
    """HACK with a calibration file masks heads to budgets of different sizes: the kept query-key pairs, key
    lengths and kept bytes of every masked block were read per block (146 per generation); they are now read in
    one transfer per scale (27: the budgets, the eviction checks and that one), and the record holds plain ints
    with the values the per-block reads gave (measured at e51722e: at the last scale 299 kept keys per row and head,
    so 2B CFG rows × 256 queries × 299 pairs per block)."""
    import json

    from var_core.accel.policy import PolicyConfig, build_policy, component_config
    from var_core.engine.loop import GenerationOptions, generate
    from var_core.engine.sampling import SamplingConfig

    H = testbed.cfg.num_heads
    path = tmp_path / "hack.json"
    path.write_text(json.dumps({"method": "hack", "structural": [[h == 0 for h in range(H)]] * testbed.num_blocks}))

    def policy():
        return build_policy(PolicyConfig(name="hack", kv=component_config("kv", "hack", calibration=str(path))))
    result = count_generation(testbed, None, batch, policy=policy())
    assert result.total <= 3 * testbed.num_scales, result.counter.by_site().most_common(5)
    assert not any(" in _after_append" in s or " in nbytes" in s for s in result.counter.by_site())
    with torch.inference_mode():
        run = generate(testbed, torch.arange(batch), list(range(1000, 1000 + batch)), SamplingConfig(),
                       policy=policy(), options=GenerationOptions(decode=False))
    last = run.records[-1]
    assert all(type(v) is int for v in (*last.attention_pairs, *last.attention_lengths, last.kv_bytes_peak,
                                           last.kv_bytes))
    assert last.attention_lengths == (299,) * testbed.num_blocks
    assert last.attention_pairs == (2 * batch * 256 * 299,) * testbed.num_blocks


def test_sparsevar_lvar_reads_no_static_geometry(testbed):
    for batch in (1, 8):
        sites = count_generation(testbed, "sparsevar_lvar", batch).counter.by_site()
        assert not [s for s in sites if "anchors.py" in s or "score_threshold.py" in s], sites


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kv", ["scalekv", "hack"])
def test_kv_policies_evict_every_block_after_device_only_counts(testbed, kv, batch, monkeypatch):
    """NOVA keeps its per-block counts on the device (count_sync='bounded'): the cache holds each row's upper-bound
    length during the scale and the exact one after it, so the policy's scores are longer than the block's view.
    Every block must still be evicted, with the positions and tokens of exact shapes (count_sync='per_block');
    before, such blocks were silently skipped (24 of 48 ScaleKV evictions at batch 1). At batch 8 rows have
    different bounds and lengths; there HACK's per-head masks meet the upper lengths, the masked attention runs on
    a longer rectangle and rounds differently (1e-5 in the logits), which can flip a later NOVA selection: the
    evictions must still match position for position, the tokens bit for bit only at batch 1."""
    import dataclasses

    from var_core.accel.policy import build_policy
    from var_core.accel.presets import get_preset

    config = get_preset("nova").replace_component("kv", kv)
    assert config.count_sync == "bounded"
    bounded, bounded_keeps, _ = _generate_recording(testbed, build_policy(config), batch, monkeypatch)
    exact, exact_keeps, _ = _generate_recording(
        testbed, build_policy(dataclasses.replace(config, count_sync="per_block")), batch, monkeypatch)
    assert len(bounded_keeps) == len(exact_keeps) == {"scalekv": 48, "hack": 64}[kv]  # 8 blocks x compressed scales
    for (b1, i1, v1), (b2, i2, v2) in zip(bounded_keeps, exact_keeps):
        assert b1 == b2 and torch.equal(i1, i2) and (v1 is None) == (v2 is None)
        assert v1 is None or torch.equal(v1, v2)
    if batch == 1:
        for t1, t2 in zip(bounded.tokens, exact.tokens):
            assert torch.equal(t1, t2)
