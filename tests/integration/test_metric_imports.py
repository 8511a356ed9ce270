"""The text-conditioned metrics and the benchmark imports through a real ablation on random:infinity-tiny.

One small study (a GenEval-format prompt file, 2 images per prompt, baseline + one arm, exported with
``--save-images``) is run with tiny random CLIP / ImageReward / HPSv2.1 models saved in their official layouts.
Then a GenEval result file is written in GenEval's documented format for the exported images and imported; the
per-task accuracies and the overall are checked against hand-worked values, as is a DPG-Bench CSV.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")

import tiny_scorers as ts  # noqa: E402  (tests/ is on sys.path through tests/conftest.py)
from var_core.errors import UserError  # noqa: E402

TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
PROMPTS = [  # GenEval's evaluation_metadata.jsonl lines (our own prompts): prompt 0 and 6 share a task
    {"tag": "single_object", "include": [{"class": "cat", "count": 1}], "prompt": "a photo of a cat"},
    {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}],
     "prompt": "a photo of a cat and a dog"},
    {"tag": "counting", "include": [{"class": "car", "count": 3}], "prompt": "a photo of three cars"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
    {"tag": "position", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1,
                                                                   "position": ["left of", 0]}],
     "prompt": "a photo of a dog left of a cat"},
    {"tag": "color_attr", "include": [{"class": "cat", "count": 1, "color": "blue"},
                                      {"class": "car", "count": 1, "color": "green"}],
     "prompt": "a photo of a blue cat and a green car"},
    {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": "a photo of a dog"},
]
REPEATS = 2
# correct[arm][prompt] = (image 0, image 1): what our fake GenEval judged
CORRECT = {
    "baseline": [(True, True), (True, False), (False, False), (True, True), (False, True), (False, False),
                 (True, False)],
    "arm": [(True, False), (False, False), (False, False), (True, True), (False, False), (True, False),
            (True, True)],
}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    from ablations.runner import StudyOptions, run_study

    root = tmp_path_factory.mktemp("metric_study")
    ts.make_clip_folder(root / "clip", aligned=True)
    ts.make_image_reward(root / "ir")
    ts.make_hps(root / "hps")
    prompt_file = root / "evaluation_metadata.jsonl"
    prompt_file.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    options = StudyOptions(family="method", model="random:infinity-tiny", samples=len(PROMPTS) * REPEATS,
                           batch_size=len(PROMPTS) * REPEATS, warmup=0, progress=False, seed=0, threads=1,
                           wandb="disabled", plots=False, timing_rounds=0, arms=("ldpruning",),
                           out=str(root / "run"), prompts=str(prompt_file), save_images=True,
                           clip_weights=str(root / "clip"), image_reward_weights=str(root / "ir"),
                           hps_weights=str(root / "hps"))
    result = run_study(options, log=lambda s: None)
    return root, result


def test_clip_ir_hps_run_end_to_end_through_an_ablation(study):
    from var_core.eval.lightning import GenerationRun
    from var_core.eval.metric_registry import weights_identity
    from var_core.eval import records as rec

    root, result = study
    assert [r["arm"] for r in result.records] == ["baseline", "ldpruning"]
    assert result.records[1]["summary"]["identical"]["mean"] == 0  # the arm's images differ: scored on their own
    from transformers import CLIPModel

    clip = CLIPModel.from_pretrained(str(root / "clip")).eval()  # the study's model, read by transformers itself
    proc, tok = ts.pil_processor(32), ts.clip_tokenizer()
    n = len(PROMPTS) * REPEATS
    for record in result.records:
        per = record["metrics"]["per_sample"]
        assert all(len(per[k]) == n for k in ("clip_score", "image_reward", "hpsv2"))
        run = GenerationRun.load(rec.record_paths(result.out_dir, record["arm"])[1])
        texts = [PROMPTS[i % len(PROMPTS)]["prompt"] for i in range(n)]  # sample i uses prompt i mod P
        with torch.no_grad():
            px = proc(images=list(run.images_u8), return_tensors="pt")["pixel_values"]
            img = clip.visual_projection(clip.vision_model(pixel_values=px).pooler_output)
            txt = clip.text_projection(clip.text_model(**tok(texts, padding=True, return_tensors="pt")).pooler_output)
        expected = np.maximum(100 * torch.nn.functional.cosine_similarity(img, txt).double().numpy(), 0)
        np.testing.assert_allclose(per["clip_score"], expected, atol=1e-4)
        assert (expected > 0).all() and np.ptp(expected) > 0.1  # informative: positive and varying
        summary = record["summary"]["clip_score"]
        assert summary["n"] == n and summary["mean"] == pytest.approx(float(expected.mean()), abs=1e-4)
        assert summary["low"] <= summary["mean"] <= summary["high"]
        info = record["metrics_info"]
        assert info["clip_score"]["state"] == "computed" and info["hpsv2"]["state"] == "computed"
        assert info["image_reward"]["weights"]["sha256"] == weights_identity(root / "ir")["sha256"]
        assert info["lpips"]["state"].startswith("unavailable") and info["geneval"]["kind"] == "import"
    table = (result.out_dir / "table.md").read_text()
    assert "| CLIP" in table and "ImageReward" in table and "HPSv2.1" in table
    assert "higher is better: " in table and "`clip_score`" in table
    assert "Not imported: `geneval`" in table


def _geneval_results(out_dir, path):
    """GenEval's evaluate_images.py output for the exported images, judged by CORRECT."""
    lines = []
    for arm, folder in (("baseline", "baseline"), ("arm", "ldpruning")):
        for idx, meta in enumerate(PROMPTS):
            prompt_dir = out_dir / "images" / folder / "geneval" / f"{idx:05d}"
            assert json.loads((prompt_dir / "metadata.jsonl").read_text().splitlines()[0])["prompt"] == meta["prompt"]
            for k in range(REPEATS):
                image = prompt_dir / "samples" / f"{k:04d}.png"
                assert image.is_file()
                lines.append({"filename": str(image), "tag": meta["tag"], "prompt": meta["prompt"],
                              "correct": CORRECT[arm][idx][k], "reason": "" if CORRECT[arm][idx][k] else "no match",
                              "metadata": json.dumps(meta)})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_geneval_import_gives_the_papers_columns_per_arm(study, tmp_path):
    from studies.report import main

    root, result = study
    results = tmp_path / "geneval_results.jsonl"
    _geneval_results(result.out_dir, results)
    assert main([str(result.out_dir), "--import", "geneval", str(results), "--no-plots"]) == 0
    # hand-worked: task accuracy = correct images / images of the task; overall = mean of the 6 task accuracies
    expected = {
        "baseline": {"single_object": 3 / 4, "two_object": 1 / 2, "counting": 0.0, "colors": 1.0, "position": 1 / 2,
                     "color_attr": 0.0},
        "ldpruning": {"single_object": 3 / 4, "two_object": 0.0, "counting": 0.0, "colors": 1.0,
                             "position": 0.0, "color_attr": 1 / 2},
    }
    frame = pd.read_csv(result.out_dir / "table.csv").set_index("arm")
    for arm, tasks in expected.items():
        for task, value in tasks.items():
            assert frame.loc[arm, f"geneval_{task}"] == pytest.approx(value)
        overall = sum(tasks.values()) / 6
        assert frame.loc[arm, "geneval_overall"] == pytest.approx(overall)
        assert frame.loc[arm, "geneval_overall_n"] == len(PROMPTS)
        assert frame.loc[arm, "geneval_overall_low"] <= overall <= frame.loc[arm, "geneval_overall_high"]
        # a task with one prompt: the bootstrap over prompts cannot move it
        assert frame.loc[arm, "geneval_counting_low"] == frame.loc[arm, "geneval_counting_high"] == 0.0
    assert frame.loc["baseline", "geneval_overall"] == pytest.approx(2.75 / 6)  # (0.75 + 0.5 + 0 + 1 + 0.5 + 0) / 6
    table = (result.out_dir / "table.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| arm"))
    for label in ("GenEval Single Obj.", "GenEval Two Obj.", "GenEval Counting", "GenEval Colors",
                  "GenEval Position", "GenEval Color Attri.", "GenEval Overall"):
        assert label in header
    assert "Imported GenEval results" in table and str(results.resolve()) in table
    side = json.loads((result.out_dir / "imports" / "geneval.json").read_text())
    assert side["arms"]["baseline"]["n_images"] == len(PROMPTS) * REPEATS
    assert side["sources"][0]["arms"] == ["baseline", "ldpruning"]


def test_dpg_import_per_arm_with_missing_categories(study, tmp_path):
    from ablations.imports import import_results
    from ablations.report import read_folder, write_report

    root, result = study
    csv_path = tmp_path / "dpg.csv"
    csv_path.write_text("item_id,global,entity,attribute,relation,other,overall\n"
                        "p0,1.0,0.5,,1.0,,0.75\n"
                        "p1,,1.0,0.5,0.0,1.0,0.6\n"
                        "p2,0.0,1.0,1.0,,,0.9\n")
    done = import_results(result.out_dir, "dpg", csv_path, arm="ldpruning",
                          arm_names=["baseline", "ldpruning"])
    s = done["arms"]["ldpruning"]["summary"]
    assert s["dpg_global"]["mean"] == pytest.approx(0.5) and s["dpg_global"]["n"] == 2
    assert s["dpg_entity"]["mean"] == pytest.approx(2.5 / 3)
    assert s["dpg_attribute"]["mean"] == pytest.approx(0.75) and s["dpg_other"]["n"] == 1
    assert s["dpg_overall"]["mean"] == pytest.approx((0.75 + 0.6 + 0.9) / 3) and s["dpg_overall"]["n"] == 3
    contents = read_folder(result.out_dir)
    write_report(result.out_dir, contents.records, contents.unavailable, plots=False, wandb_mode="disabled",
                 log=lambda s: None)
    frame = pd.read_csv(result.out_dir / "table.csv").set_index("arm")
    assert frame.loc["ldpruning", "dpg_overall"] == pytest.approx(0.75)
    assert math.isnan(frame.loc["baseline", "dpg_overall"])
    table = (result.out_dir / "table.md").read_text()
    assert "DPG Overall" in table and "`baseline`: no DPG-Bench results imported" in table


def test_import_errors_are_one_line_user_errors(study, tmp_path):
    from ablations.imports import import_results
    from studies.report import main

    root, result = study
    stray = tmp_path / "stray.jsonl"
    stray.write_text(json.dumps({"filename": "/elsewhere/00000/samples/0000.png", "tag": "colors", "prompt": "x",
                                 "correct": True, "reason": "", "metadata": "{}"}) + "\n")
    with pytest.raises(UserError, match="--import-arm"):
        import_results(result.out_dir, "geneval", stray, arm_names=["baseline"])
    with pytest.raises(UserError, match="Did you mean 'geneval'"):
        import_results(result.out_dir, "genevals", stray, arm_names=["baseline"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"filename": "a.png", "tag": "colors"}\n')
    with pytest.raises(UserError, match="lacks 'tag' or 'correct'"):
        import_results(result.out_dir, "geneval", bad, arm_names=["baseline"])
    with pytest.raises(UserError, match="not an arm of this folder"):
        import_results(result.out_dir, "geneval", stray, arm="nope", arm_names=["baseline"])
    from studies._cli import run_cli

    assert run_cli(main, [str(result.out_dir), "--import", "dpg", str(tmp_path / "missing.csv")]) == 2


def test_ls_metrics_lists_every_metric_with_its_weights(capsys, tmp_path):
    from studies.ablate import main

    ts.make_clip_folder(tmp_path / "clip")
    assert main(["ls", "metrics", "--clip-weights", str(tmp_path / "clip")]) == 0
    out = capsys.readouterr().out
    for name in ("psnr", "ssim", "ms_ssim", "lpips", "fid", "kid", "is", "clip_score", "image_reward", "hpsv2",
                 "geneval", "dpg"):
        line = next(line for line in out.splitlines() if line.startswith(f"  {name} "))
        assert "is better" in line
    assert "clip_score      higher is better; available" in out
    assert "image_reward    higher is better; unavailable (not requested: pass --image-reward-weights" in out
    assert "geneval         higher is better; import" in out
    assert "ImageReward.pt" in out and "HPS_v2.1_compressed.pt" in out and "pt_inception-2015-12-05" in out
