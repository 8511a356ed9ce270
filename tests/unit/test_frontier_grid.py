"""Frontier grids (var_core/accel/cost_knobs.py, sweeps/frontier.py): declared points apply, the published point is
the preset's own setting, the grid selection and the records -> paired arrays conversion by hand."""

from __future__ import annotations

import numpy as np
import pytest

from sweeps.frontier import default_levels, frame_points, select_grid
from var_core.accel.cost_knobs import COST_KNOBS, cost_knobs, point_label
from var_core.accel.presets import get_preset
from var_core.errors import UserError


def _get(policy, path):
    obj = policy
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("method", sorted(COST_KNOBS))
def test_published_point_is_the_presets_setting_and_every_point_applies(method):
    from sweeps.spaces import apply_values

    knobs = COST_KNOBS[method]
    base = get_preset(method)
    assert tuple(_get(base, f) for f in knobs.fields) == knobs.published
    hashes = set()
    for values in knobs.candidates():
        policy = apply_values(base, dict(zip(knobs.fields, values)))
        assert tuple(_get(policy, f) for f in knobs.fields) == values
        hashes.add(policy.config_hash())
    assert len(hashes) == len(knobs.candidates())  # no two grid points run the same config


def test_cost_knobs_errors_and_labels():
    with pytest.raises(UserError, match="Did you mean 'nova'"):
        cost_knobs("novaa")
    with pytest.raises(UserError, match="stagevar on Infinity"):
        cost_knobs("stagevar", "infinity")
    assert cost_knobs("fastvar", "infinity").published == ((0.4, 0.5, 1.0, 1.0),)
    assert point_label(("activation.t_est", "schedule.tau"), (5, 0.8)) == "t_est=5,tau=0.8"
    assert point_label(("schedule.ratios",), ((0.5, 0.5, 0.5),)) == "ratios=0.5x3"
    assert point_label(("schedule.ratios",), ((0.4, 0.5),)) == "ratios=(0.4,0.5)"


def test_select_grid_by_hand():
    # targets 0.3, 0.6, 0.9: nearest 0.3 (index 1), 0.55 (index 2), 0.9 (index 0); returned by cost
    assert select_grid([0.9, 0.3, 0.55, 0.7, 0.45], 0.3, 0.9, 3) == [1, 2, 0]
    # two targets nearest to the same candidate: the second takes the nearest unused one
    assert select_grid([0.3, 0.32, 0.9], 0.3, 0.34, 3) == [0, 1, 2]


def test_default_levels_inside_the_range():
    assert default_levels(0.4, 0.7, "flops_ratio") == (0.45, 0.55, 0.65)
    assert default_levels(1.2, 1.8, "speedup") == (1.3, 1.5, 1.7)


def _record(index, flops, seconds, per_sample, reference=None, size=2):
    batches = [{"first_index": i, "size": size, "flops": f, "seconds": s}
               for i, f, s in zip(range(0, len(index), size), flops, seconds)]
    rec = {"metrics": {"index": index, "per_sample": per_sample}, "timing": {"batches": batches}}
    if reference is not None:
        rec["timing"]["reference_batches"] = [{"first_index": i, "size": size, "seconds": s}
                                              for i, s in zip(range(0, len(index), size), reference)]
    return rec


def test_frame_points_shares_pairing_and_missing_samples():
    base = _record([0, 1, 2, 3], [40, 80], [4.0, 8.0], {"ssim": [1, 1, 1, 1], "class_correct": [1, 0, 1, 1]})
    arm = _record([0, 1, 2, 3], [10, 40], [1.0, 4.0], {"ssim": [0.9, None, 0.7, 0.6], "class_correct": [1, 1, 0, 1]},
                  reference=[2.0, 6.0])
    points = [{"method": "m", "label": "x", "published": True, "record": arm}]
    frames, n = frame_points(points, base, "ssim", "flops_ratio")
    p = frames["m"][0]
    assert n == 3  # sample 1 has no SSIM: left out
    np.testing.assert_allclose(p.quality, [0.9, 0.7, 0.6])
    np.testing.assert_allclose(p.arm_cost, [5, 20, 20])  # batch FLOPs / batch size
    np.testing.assert_allclose(p.base_cost, [20, 40, 40])
    # speedup pairs the arm with its own reference run (2.0 and 6.0 s per batch), not the cached baseline
    frames, _ = frame_points(points, base, "class_acc_delta", "speedup")
    p = frames["m"][0]
    np.testing.assert_allclose(p.quality, [0.0, 100.0, -100.0, 0.0])
    np.testing.assert_allclose(p.base_cost, [1.0, 1.0, 3.0, 3.0])
    np.testing.assert_allclose(p.arm_cost, [0.5, 0.5, 2.0, 2.0])


@pytest.mark.parametrize("argv, message", [
    (["frontier", "--methods", "nova"], "give at least two"),
    (["frontier", "--methods", "nova", "fastvra"], "Did you mean 'fastvar'"),
    (["frontier", "--metrics", "ssmi"], "Did you mean 'ssim'"),
    (["frontier", "--cost-range", "0.8", "0.4"], "0 < LO < HI"),
    (["claims", "novva"], "Did you mean 'nova'"),
])
def test_cli_user_errors_before_anything_loads(argv, message, capsys):
    from studies.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]


def test_frame_points_reads_runner_records_flops_per_image():
    """Records of the ablation runner (the ``frontier`` family) keep FLOPs per image, not per batch."""
    base = _record([0, 1], [None], [2.0], {"ssim": [1, 1]})
    arm = _record([0, 1], [None], [1.0], {"ssim": [0.8, 0.9]})
    base["timing"]["flops_per_image"], arm["timing"]["flops_per_image"] = 100.0, 25.0
    frames, _ = frame_points([{"method": "m", "label": "x", "published": False, "record": arm}], base, "ssim",
                             "flops_ratio")
    np.testing.assert_allclose(frames["m"][0].arm_cost, [25.0, 25.0])
    np.testing.assert_allclose(frames["m"][0].base_cost, [100.0, 100.0])


def test_frame_points_memory_axis_is_the_ratio_of_summed_batch_peaks():
    base = _record([0, 1, 2, 3], [1, 1], [1.0, 1.0], {"ssim": [1, 1, 1, 1]})
    arm = _record([0, 1, 2, 3], [1, 1], [1.0, 1.0], {"ssim": [0.9, 0.9, 0.9, 0.9]})
    for rec, peaks in ((base, (100, 300)), (arm, (50, 250))):
        for batch, peak in zip(rec["timing"]["batches"], peaks):
            batch["peak_memory_bytes"] = peak
    from sweeps.frontier_stats import point_cost

    frames, _ = frame_points([{"method": "m", "label": "x", "published": False, "record": arm}], base, "ssim",
                             "memory_ratio")
    p = frames["m"][0]
    assert point_cost(p.arm_cost, p.base_cost, "memory_ratio") == pytest.approx((50 + 250) / (100 + 300))
