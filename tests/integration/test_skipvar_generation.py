"""SkipVAR's per-sample decision inside a generation: each sample ends exactly as the fixed plan its decision names,
alone and inside a batch. A tiny random Infinity on the first 7 scales of the 1024 schedule, the decision taken
after scale 3 from 2x2-grid previews (the released 9 / 4 of 13 scales cost minutes here; the rule is the same:
c stops before scale K - c, u drops the unconditional rows from K - u)."""

from __future__ import annotations

import json

import pytest
import torch

from var_core.accel.policy import PolicyConfig, build_policy, component_config
from var_core.engine import GuidanceMode, generate
from var_core.engine.sampling import SamplingConfig
from var_core.zoo import load_model

PROMPTS = ["a cat", "a dog", "a cow", "a pig"]  # one length: no text padding differs between batch and alone
SEEDS = [0, 1, 2, 3]
K, DECISION, PREVIEW = 7, 3, 1
SAMPLING = SamplingConfig(cfg=3.0, top_k=900, top_p=0.97, temperature=0.5)


@pytest.fixture(scope="module")
def adapter():
    torch.set_num_threads(1)
    return load_model("random:infinity-tiny", num_scales=K)


def _run(adapter, config, indices):
    policy = build_policy(config)
    result = generate(adapter, [PROMPTS[i] for i in indices], seeds=[SEEDS[i] for i in indices],
                      sampling=SAMPLING, policy=policy)
    return result, policy.signals.extras.get("skipvar")


def _threshold_model(tmp_path, f1_values):
    """Decision models that split the samples by HF_Diff: the highest stops 3 scales early (c = 3), the lowest
    drops the unconditional rows on the last 2 scales (u = 2), the others run in full."""
    ordered = sorted(f1_values)
    high = (ordered[-1] + ordered[-2]) / 2
    low = (ordered[0] + ordered[1]) / 2
    data = {
        "name": "threshold_test",
        "skip": dict(mean=[0.0, 0.0], scale=[1.0, 1.0], coef=[[1000.0, 0.0]], intercept=[-1000.0 * high],
                     classes=[0, 3]),
        "uncond": dict(mean=[0.0, 0.0], scale=[1.0, 1.0], coef=[[-1000.0, 0.0]], intercept=[1000.0 * low],
                       classes=[0, 2]),
    }
    path = tmp_path / "threshold.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_each_sample_ends_as_the_fixed_plan_its_decision_names(adapter, tmp_path):
    released = PolicyConfig(name="skipvar", skip=component_config("skip", "skipvar_decision", decision_scale=DECISION,
                                                                   preview_scale=PREVIEW),
                            guidance=component_config("guidance", "skipvar_uncond"))
    _, probe = _run(adapter, released, range(4))
    f1 = probe["features_B2"][:, 0].tolist()
    assert probe["model"] == "decision_model_ssim_84" and all(v > 0 for v in f1)
    config = PolicyConfig(name="skipvar", skip=component_config("skip", "skipvar_decision",
                                                                 model=_threshold_model(tmp_path, f1),
                                                                 decision_scale=DECISION, preview_scale=PREVIEW),
                          guidance=component_config("guidance", "skipvar_uncond"))
    stops, cond_only = max(range(4), key=lambda i: f1[i]), min(range(4), key=lambda i: f1[i])

    batch, decision = _run(adapter, config, range(4))
    assert decision["c_B"].tolist() == [3 if i == stops else 0 for i in range(4)]
    assert decision["u_B"].tolist() == [-1 if i == stops else (2 if i == cond_only else 0) for i in range(4)]
    assert batch.stopped_at is None  # the others run on; the stopped sample's latent is frozen

    plans = {  # independent fixed plans: what each decision means on a 13-scale schedule
        stops: PolicyConfig(name="c3", skip=component_config("skip", "skip_last", count=3)),
        cond_only: PolicyConfig(name="u2", guidance=component_config("guidance", "stop_at", start_scale=-2)),
    }
    for i in range(4):
        alone, _ = _run(adapter, config, [i])
        fixed, _ = _run(adapter, plans.get(i, PolicyConfig(name="baseline")), [i])
        ran = [r for r in alone.records if not r.skipped]
        for mine, batched in zip(ran, batch.records):  # the scales that entered this sample's latent
            assert torch.equal(mine.tokens_BN[0], batched.tokens_BN[i]), f"sample {i}, scale {mine.scale_index}"
        # the image of its frozen latent; the decoder's conv reductions differ by batch size at ~1e-5
        assert torch.allclose(alone.images[0], batch.images[i], atol=2e-4), f"sample {i}: batch != single"
        assert torch.equal(alone.images[0], fixed.images[0]), f"sample {i}: not its fixed plan"
        if i == stops:
            assert alone.stopped_at == K - 3 and len([r for r in alone.records if not r.skipped]) == K - 3
        else:
            assert alone.stopped_at is None
        guidance = [r.guidance for r in alone.records]
        if i == cond_only:
            assert guidance[K - 3] is GuidanceMode.BOTH and guidance[K - 2:] == [GuidanceMode.COND_ONLY] * 2
        elif i != stops:
            assert set(guidance) == {GuidanceMode.BOTH}
