"""A GenEval-format prompt file drives a study on random:infinity-tiny with --save-images: every image is written
in every layout, the records carry each sample's prompt and tag, and the images are those of the prompts."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

os.environ.setdefault("WANDB_MODE", "disabled")

from studies import ablate  # noqa: E402
from studies._cli import run_cli  # noqa: E402
from var_core.engine import SamplingConfig, generate  # noqa: E402
from var_core.eval.lightning import GenerationRun, sample_seed  # noqa: E402
from var_core.zoo import load_model  # noqa: E402

# our own prompts, in GenEval's evaluation_metadata.jsonl format
LINES = [
    {"tag": "single_object", "include": [{"class": "umbrella", "count": 1}], "prompt": "a photo of an umbrella"},
    {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a photo of a red car"},
    {"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}],
     "prompt": "a photo of two cups"},
]
SAMPLES = 4  # prompts 0 1 2 0: prompt 0 twice (GenEval repeats 0000 and 0001)


def _png(path):
    return np.asarray(Image.open(path).convert("RGB"))


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prompts")
    prompts = tmp / "evaluation_metadata.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    out = tmp / "study"
    argv = ["method", "--model", "random:infinity-tiny", "--samples", str(SAMPLES), "--batch-size", "2",
            "--warmup", "0", "--threads", "1", "--arms", "nova", "--timing-rounds", "0", "--no-plots",
            "--no-progress", "--wandb", "disabled", "--seed", "3", "--out", str(out), "--prompts", str(prompts),
            "--save-images", "--cfg", "2.5", "--top-p", "0.9", "--temperature", "0.7"]
    assert ablate.main(argv) == 0
    return out, argv


def test_every_image_in_every_layout(study):
    out, _ = study
    for arm in ("baseline", "nova"):
        root = out / "images" / arm
        run = GenerationRun.load(out / "arms" / f"{arm}.pt")
        hwc = run.images_u8.permute(0, 2, 3, 1).numpy()
        assert sorted(p.name for p in (root / "flat").iterdir()) == [f"{i:05d}.png" for i in range(SAMPLES)]
        for i in range(SAMPLES):
            assert np.array_equal(_png(root / "flat" / f"{i:05d}.png"), hwc[i])
        expected = {0: ["0000.png", "0001.png"], 1: ["0000.png"], 2: ["0000.png"]}
        assert sorted(p.name for p in (root / "geneval").iterdir()) == ["00000", "00001", "00002"]
        for pid, files in expected.items():
            folder = root / "geneval" / f"{pid:05d}"
            assert sorted(p.name for p in (folder / "samples").iterdir()) == files
            assert json.loads((folder / "metadata.jsonl").read_text()) == LINES[pid]  # GenEval's own line
        assert np.array_equal(_png(root / "geneval" / "00000" / "samples" / "0001.png"), hwc[3])
        assert not (root / "samples.npz").exists()  # text-to-image: no ADM npz


def test_records_carry_prompts_tags_and_sampling(study):
    out, _ = study
    prompts = [LINES[j]["prompt"] for j in (0, 1, 2, 0)]
    tags = [LINES[j]["tag"] for j in (0, 1, 2, 0)]
    for arm in ("baseline", "nova"):
        record = json.loads((out / "arms" / f"{arm}.json").read_text())
        assert record["samples"]["prompts"] == prompts and record["samples"]["tags"] == tags
        assert record["samples"]["prompt_ids"] == [0, 1, 2, 0]
        assert record["sampling"] == {"cfg": 2.5, "top_k": 900, "top_p": 0.9, "temperature": 0.7, "draw": "multinomial"}
    manifest = json.loads((out / "study.json").read_text())
    assert manifest["samples"]["prompts"] == prompts and manifest["options"]["cfg"] == 2.5
    lines = [json.loads(x) for x in (out / "images" / "nova" / "samples.jsonl").read_text().splitlines()]
    assert [x["prompt"] for x in lines] == prompts and [x["tag"] for x in lines] == tags


def test_images_are_those_of_the_prompts(study):
    """Sample 1 generated directly from its prompt and seed gives the exported image (same tokens; the decoder
    may round one 8-bit level differently between batch sizes)."""
    out, _ = study
    adapter = load_model("random:infinity-tiny")
    sampling = SamplingConfig(cfg=2.5, top_k=900, top_p=0.9, temperature=0.7)
    result = generate(adapter, [LINES[1]["prompt"]], seeds=[sample_seed(3, 1)], sampling=sampling)
    direct = result.images[0].clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    exported = _png(out / "images" / "baseline" / "geneval" / "00001" / "samples" / "0000.png")
    assert np.abs(direct.astype(int) - exported.astype(int)).max() <= 1
    other = generate(adapter, [LINES[2]["prompt"]], seeds=[sample_seed(3, 1)], sampling=sampling)
    assert not torch.equal(other.images, result.images)  # the prompt, not only the seed, decides the image


def test_resume_exports_reused_arms_again(study):
    out, argv = study
    victim = out / "images" / "nova" / "flat" / "00002.png"
    victim.unlink()
    assert ablate.main(argv) == 0  # every arm reused; its stored samples are exported again
    assert victim.is_file()


def test_prompts_on_a_class_conditional_model_fail_before_loading(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a photo of a cat\n")
    code = run_cli(ablate.main, ["method", "--model", "official-tiny", "--prompts", str(prompts), "--out",
                                 str(tmp_path / "o")])
    assert code == 2
    assert "error: --prompts needs a text-to-image model" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
