"""``python -m studies.ablate method --model random:hart-tiny`` end to end: every method preset runs on HART
through the one loop (FLOPs counted with the HART formulas, diffusion head included), and an arm whose setting
cannot run on this schedule stops the study before anything runs, in one error line. Small: 2 samples per arm,
batch 2, no interleaved re-timing."""

from __future__ import annotations

import json
import os

os.environ.setdefault("WANDB_MODE", "disabled")

from ablations.runner import StudyOptions, run_study  # noqa: E402
import pytest  # noqa: E402

from ablations.overrides import OverrideError  # noqa: E402
from var_core.accel.presets import OTHER_READINGS, PRESETS  # noqa: E402
from var_core.eval import records as rec  # noqa: E402

SMALL = dict(model="random:hart-tiny", samples=2, batch_size=2, warmup=0, progress=False, seed=3, threads=1,
             timing_rounds=0, wandb="disabled", plots=False, grid_samples=2)


def test_method_family_on_hart_tiny(tmp_path):
    # ToProVAR's representative scale s_rep = 9 does not exist in hart-tiny's 7 scales: refused before anything runs
    out = tmp_path / "method"
    logs: list[str] = []
    with pytest.raises(OverrideError, match=r"s_rep=9.*7 scales"):
        run_study(StudyOptions(family="method", out=str(tmp_path / "refused"), overrides=("schedule.s_rep=9",),
                               **SMALL), log=logs.append)
    assert not list((tmp_path / "refused").glob("arms/*.json"))  # nothing was generated
    result = run_study(StudyOptions(family="method", out=str(out), overrides=("schedule.s_rep=5",), **SMALL),
                       log=logs.append)
    ran = set(result.computed) | set(result.reused)  # an arm whose resolved config equals another's is reused
    # refused on HART with the reason: CoDe's refiner is a VAR testbed, SparVAR's patterns do not cover HART's
    # text-context prefix of the KV cache
    assert {a.name for a in result.unavailable} == {"code", "sparvar"}
    assert "context" in next(a.error for a in result.unavailable if a.name == "sparvar")
    assert {"baseline"} | (set(PRESETS) - set(OTHER_READINGS) - {"baseline", "code", "sparvar"}) <= ran
    manifest = json.loads((out / "study.json").read_text())
    assert manifest["status"] == "complete"
    records = {r["arm"]: r for r in (rec.read_record(p) for p in sorted((out / "arms").glob("*.json")))}
    base = records["baseline"]
    assert base["model"]["family"] == "hart" and base["model"]["num_scales"] == 7
    assert base["sampling"]["cfg"] == 4.5 and base["sampling"]["diffusion_steps"] == 0  # 0: the checkpoint's 8
    assert base["sampling"]["more_smooth"] is True and base["sampling"]["official_top_k"] is True
    flops = {name: r["timing"]["flops_per_image"] for name, r in records.items()}
    assert all(v and v > 0 for v in flops.values()), flops
    # pruning presets compute less than the baseline; the diffusion head is charged to every arm
    for name in ("ldpruning", "stagevar", "skipvar"):
        assert flops[name] < flops["baseline"], name
    by_component = base["timing"]["flops_by_component_per_image"]
    assert by_component["diffusion"] > 0 and by_component["attn"] > 0
    assert base["timing"]["memory_source"] == "analytic" and base["timing"]["peak_memory_bytes"] > 0
