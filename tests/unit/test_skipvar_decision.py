"""SkipVAR as released (fakerone-li/SkipVAR): the shipped decision models, the features, the per-sample decision in
a generation, and the pickle reader that never executes a file."""

from __future__ import annotations

import json
import math
import pickle
from importlib import resources

import pytest
import torch

from var_core.accel.safe_joblib import UnsafePickleError, read_estimator
from var_core.accel.skip.skipvar_decision import high_frequency_share, skipvar_features, sobel_magnitude
from var_core.accel.skipvar_models import SHIPPED, load_models


def _shipped_json(name: str) -> dict:
    return json.loads(resources.files("var_core").joinpath("data", "skipvar", f"{name}.json").read_text())


def _predict_by_hand(part: dict, x: list[float]) -> int:
    """scikit-learn's predict written out with plain floats (a second implementation)."""
    z = [(xi - m) / s for xi, m, s in zip(x, part["mean"], part["scale"])]
    scores = [sum(c * zi for c, zi in zip(row, z)) + b for row, b in zip(part["coef"], part["intercept"])]
    if len(scores) == 1:
        return part["classes"][1] if scores[0] > 0 else part["classes"][0]
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    return part["classes"][best]


def test_shipped_numbers_are_the_released_pickles():
    """Values read off the released pickles with ``pickletools`` (by hand, not through varscope's reader)."""
    data = _shipped_json("decision_model_ssim_84")
    assert data["skip"]["mean"] == pytest.approx([0.11532139, 0.48923249], abs=1e-8)
    assert data["skip"]["scale"] == pytest.approx([0.05764772, 0.07561758], abs=1e-8)
    assert data["skip"]["coef"][0] == pytest.approx([1.92427258, 1.72384011], abs=1e-8)
    assert data["skip"]["intercept"] == pytest.approx([-0.89096672, 0.7389153, 0.80683477, -0.65478334], abs=1e-8)
    assert data["skip"]["classes"] == [0, 1, 2, 3]
    assert data["uncond"]["classes"] == [1, 2, 3]  # the 0.84 uncond model never answers "keep guidance"
    assert data["uncond"]["mean"] == pytest.approx([0.17937917, 0.57361334], abs=1e-8)
    assert len(_shipped_json("decision_model_ssim_84_diff_only")["skip"]["mean"]) == 1


def test_decision_at_the_scaler_means_is_the_argmax_of_the_intercepts():
    # z = 0: the scores are the intercepts; skip: [-0.891, 0.739, 0.807, -0.655] -> c = 2; uncond:
    # [-2.848, 0.456, 2.392] -> u = 3
    models = load_models("decision_model_ssim_84")
    assert models.skip.predict(torch.tensor([list(models.skip.mean)])).tolist() == [2]
    assert models.uncond.predict(torch.tensor([list(models.uncond.mean)])).tolist() == [3]


@pytest.mark.parametrize("name", SHIPPED)
def test_decisions_equal_the_logistic_models_on_hand_made_features(name):
    data = _shipped_json(name)
    models = load_models(name)
    generator = torch.Generator().manual_seed(0)
    n = len(data["skip"]["mean"])
    mean = torch.tensor(data["skip"]["mean"], dtype=torch.float64)
    spread = torch.tensor(data["skip"]["scale"], dtype=torch.float64)
    features = mean + 3 * spread * (2 * torch.rand(300, n, generator=generator, dtype=torch.float64) - 1)
    want_c = [_predict_by_hand(data["skip"], row) for row in features.tolist()]
    want_u = [_predict_by_hand(data["uncond"], row) for row in features.tolist()]
    assert models.skip.predict(features).tolist() == want_c
    assert models.uncond.predict(features).tolist() == want_u
    assert len(set(want_c)) >= 3  # the grid crosses the decision boundaries


def test_sobel_and_high_frequency_features_by_hand():
    ones, zeros = torch.ones(1, 1, 8, 8), torch.zeros(1, 1, 8, 8)
    # all-ones image, zero padding: corners |(-3, -3)| = √18, the other 24 border pixels 4, the interior 0
    magnitude = sobel_magnitude(ones)
    assert magnitude[0, 0, 0, 0].item() == pytest.approx(math.sqrt(18))
    assert magnitude[0, 0, 0, 3].item() == pytest.approx(4.0)
    assert magnitude[0, 0, 3, 3].item() == 0.0
    hf_diff = (4 * math.sqrt(18) + 24 * 4) / 64
    features = skipvar_features(torch.ones(1, 3, 8, 8), torch.zeros(1, 3, 8, 8))
    assert features[0, 0].item() == pytest.approx(hf_diff, rel=1e-6)
    assert features[0, 1].item() == pytest.approx(0.0, abs=1e-7)  # a constant image: DC only, inside the disc
    # a ±1 checkerboard: all its amplitude at the Nyquist corner (distance √32 > radius int(0.4·8/2) = 1)
    checker = (torch.arange(8).view(8, 1) + torch.arange(8).view(1, 8)) % 2 * 2.0 - 1
    assert high_frequency_share(checker.view(1, 1, 8, 8)).item() == pytest.approx(1.0, abs=1e-6)
    # 1 + checkerboard: amplitude 64 at DC (inside the disc) and 64 at the corner (outside): share 1/2
    assert high_frequency_share((1 + checker).view(1, 1, 8, 8)).item() == pytest.approx(0.5, abs=1e-6)
    assert high_frequency_share(zeros + 0.5).item() == pytest.approx(0.0, abs=1e-7)


def test_features_are_per_sample_inside_a_batch():
    generator = torch.Generator().manual_seed(1)
    new, old = torch.rand(3, 3, 16, 16, generator=generator), torch.rand(3, 3, 16, 16, generator=generator)
    batch = skipvar_features(new, old)
    for i in range(3):
        assert torch.allclose(batch[i], skipvar_features(new[i:i + 1], old[i:i + 1])[0], rtol=1e-6, atol=1e-7)


def test_preset_is_the_decision_on_infinity_and_the_static_rule_elsewhere():
    from var_core.accel.presets import REFERENCE_MODELS, get_preset, resolve_config

    on_infinity = resolve_config(get_preset("skipvar"), REFERENCE_MODELS["infinity"][1])
    assert on_infinity.skip.component_name == "skipvar_decision"
    assert on_infinity.guidance.component_name == "skipvar_uncond"
    assert on_infinity.skip.model == "decision_model_ssim_84"
    for family in ("var", "hart"):
        static = resolve_config(get_preset("skipvar"), REFERENCE_MODELS[family][1])
        assert static.skip.component_name == "none"
        assert (static.guidance.component_name, static.guidance.start_scale) == ("stop_at", -3)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "skip_model_scaler.pkl"
    path.write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafePickleError, match="system"):
        read_estimator(path)
    assert not marker.exists()


def test_the_converter_refuses_a_folder_with_a_payload_and_exits_2(tmp_path, capsys):
    from var_core.accel.skipvar_models import main

    marker = tmp_path / "ran"
    for name in ("skip_model_scaler.pkl", "skip_model_Logistic_Regression.pkl", "uncond_model_scaler.pkl",
                 "uncond_model_Logistic_Regression.pkl"):
        (tmp_path / name).write_bytes(pickle.dumps(_Payload(marker)))
    assert main([str(tmp_path), str(tmp_path / "out.json")]) == 2
    assert capsys.readouterr().err.startswith("error:")
    assert not marker.exists() and not (tmp_path / "out.json").exists()


def test_unknown_model_name_suggests_the_near_one():
    with pytest.raises(ValueError, match="did you mean 'decision_model_ssim_86'"):
        load_models("decision_model_ssim_86x")


def test_branch_flops_order_on_infinity_2b():
    """The docs' per-branch FLOPs-ideal (profilers.skipvar_flops): more scales left out or more scales without the
    unconditional rows must cost less, and leaving a scale out must save more than dropping its unconditional rows
    (an inverted ratio or swapped branch fails)."""
    from profilers.flops import infinity_arch
    from profilers.plan_flops import ideal_speedup
    from profilers.skipvar_flops import branch_config
    from var_core.models.infinity import scale_schedule
    from var_core.zoo import INFINITY_SPECS

    spec = INFINITY_SPECS["infinity-2b"]
    arch = infinity_arch(spec.config, scale_schedule(spec.pn, 1.0, spec.num_scales), text_len=64)
    speed = {(c, u): ideal_speedup(branch_config(c, u), arch)[0]
             for c, u in [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (3, 0)]}
    assert speed[(0, 0)] == pytest.approx(1.0)
    assert 1.0 < speed[(0, 1)] < speed[(0, 2)] < speed[(0, 3)] < 2.0  # at most half of the last scales' rows
    assert speed[(0, 3)] < speed[(1, 0)] < speed[(2, 0)] < speed[(3, 0)]
    for k in (1, 2, 3):
        assert speed[(k, 0)] > speed[(0, k)]
