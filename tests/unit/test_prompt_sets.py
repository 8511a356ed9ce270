"""Prompt-set readers (every format, each file written here), the prompt condition sets, and the image export
layouts (GenEval folders, flat PNGs, the ADM npz)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from PIL import Image

from var_core.errors import UserError
from var_core.eval.export import export_images
from var_core.eval.lightning import ConditionSet, sample_seed
from var_core.eval.prompts import load_prompt_set


# ----- readers --------------------------------------------------------------------------------------------------
def test_plain_text_skips_blank_and_comment_lines(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("\ufeff# our header\n  a red kite  \n\n#another comment\na green boat\n".encode("utf-8"))
    ps = load_prompt_set(path)
    assert ps.format == "text"
    assert ps.prompts == ("a red kite", "a green boat")
    assert ps.tags == (None, None) and ps.categories == (None, None)
    assert ps.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


GENEVAL_LINES = [
    {"tag": "single_object", "include": [{"class": "kite", "count": 1}], "prompt": "a photo of a kite"},
    {"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}],
     "prompt": "a photo of two cups"},
    {"tag": "colors", "include": [{"class": "boat", "count": 1, "color": "green"}], "prompt": "a photo of a green boat"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_geneval_metadata_keeps_every_line(tmp_path):
    ps = load_prompt_set(_write_jsonl(tmp_path / "evaluation_metadata.jsonl", GENEVAL_LINES))
    assert ps.format == "geneval"
    assert ps.prompts == ("a photo of a kite", "a photo of two cups", "a photo of a green boat")
    assert ps.tags == ("single_object", "counting", "colors")
    assert [ps.geneval_metadata(i) for i in range(3)] == GENEVAL_LINES  # written back unchanged for GenEval
    assert ps.describe()["tags"] == {"single_object": 1, "counting": 1, "colors": 1}


def test_jsonl_without_include_is_plain_jsonl(tmp_path):
    ps = load_prompt_set(_write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x y", "category": "animals"}]))
    assert ps.format == "jsonl" and ps.categories == ("animals",)
    assert ps.geneval_metadata(0) == {"prompt": "x y", "category": "animals"}


def test_dpg_bench_csv_one_prompt_per_item(tmp_path):
    path = tmp_path / "dpg_bench.csv"
    path.write_text(
        "item_id,text,keywords,proposition_id,dependency,category_broad,category_detailed,tuple,question_natural_language\n"
        'a1,"a cat, sitting on a mat",cat,1,0,entity,whole,x,Is there a cat?\n'
        'a1,"a cat, sitting on a mat",mat,2,0,entity,whole,x,Is there a mat?\n'
        "b2,two dogs,dog,1,0,attribute,count,x,Are there two dogs?\n"
        "a1,\"a cat, sitting on a mat\",sit,3,1,relation,spatial,x,Is the cat sitting?\n")
    ps = load_prompt_set(path)
    assert ps.format == "csv"
    assert ps.prompts == ("a cat, sitting on a mat", "two dogs")
    assert ps.categories == ("entity", "attribute")
    assert ps.metadata[1]["item_id"] == "b2"


def test_drawbench_csv_and_tsv(tmp_path):
    (tmp_path / "drawbench.csv").write_text('Prompts,Category\n"A red, round ball.",Colors\nA tiny house.,Counting\n')
    ps = load_prompt_set(tmp_path / "drawbench.csv")
    assert ps.prompts == ("A red, round ball.", "A tiny house.") and ps.categories == ("Colors", "Counting")
    (tmp_path / "p.tsv").write_text("caption\ttag\nsnow on a hill\tnature\n")
    ps = load_prompt_set(tmp_path / "p.tsv")
    assert ps.prompts == ("snow on a hill",) and ps.tags == ("nature",)


def test_coco_captions_first_caption_per_image_in_image_order(tmp_path):
    coco = {"images": [{"id": 9, "file_name": "b.jpg"}, {"id": 4, "file_name": "a.jpg"}],
            "annotations": [{"image_id": 4, "id": 30, "caption": "later caption of a"},
                            {"image_id": 9, "id": 12, "caption": "b's first"},
                            {"image_id": 4, "id": 7, "caption": "a's first"},
                            {"image_id": 9, "id": 40, "caption": "b's second"}]}
    path = tmp_path / "captions_val2014.json"
    path.write_text(json.dumps(coco))
    ps = load_prompt_set(path)
    assert ps.format == "coco"
    assert ps.prompts == ("b's first", "a's first")
    assert ps.metadata[1] == {"image_id": 4, "file_name": "a.jpg", "annotation_id": 7}
    every = load_prompt_set(path, coco_captions="all")
    assert every.prompts == ("b's first", "b's second", "a's first", "later caption of a")


def test_mjhq_meta_data_keeps_categories(tmp_path):
    meta = {"f00a": {"category": "animals", "prompt": "an owl at night"},
            "c31b": {"category": "food", "prompt": "a bowl of soup"}}
    (tmp_path / "meta_data.json").write_text(json.dumps(meta))
    ps = load_prompt_set(tmp_path / "meta_data.json")
    assert ps.format == "mjhq"
    assert ps.prompts == ("an owl at night", "a bowl of soup") and ps.categories == ("animals", "food")
    assert ps.metadata[1]["image_id"] == "c31b"
    assert ps.describe()["categories"] == {"animals": 1, "food": 1}


def test_json_list(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(["one", {"prompt": "two", "tag": "t"}]))
    ps = load_prompt_set(tmp_path / "p.json")
    assert ps.prompts == ("one", "two") and ps.tags == (None, "t")


def test_shipped_demo_set_is_geneval_format():
    ps = load_prompt_set("demo")
    assert ps.format == "geneval" and len(ps) == 8
    assert all(isinstance(m.get("include"), list) and m["tag"] for m in ps.metadata)


@pytest.mark.parametrize("name, content, message", [
    ("bad.jsonl", '{"prompt": "ok", "tag": "a", "include": []}\n{oops\n', "line 2: not JSON"),
    ("nocol.csv", "foo,bar\n1,2\n", "no prompt column among ['foo', 'bar']"),
    ("empty.txt", "# only a comment\n\n", "holds no prompts"),
    ("other.json", json.dumps({"a": 1}), "neither COCO captions"),
    ("noprompt.jsonl", '{"text": "x"}\n', 'expected an object with a "prompt"'),
])
def test_bad_files_are_user_errors_naming_the_problem(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        load_prompt_set(tmp_path / name)


def test_missing_file_suggests_the_near_name(tmp_path):
    (tmp_path / "evaluation_metadata.jsonl").write_text("")
    with pytest.raises(UserError, match="Did you mean 'evaluation_metadata.jsonl'"):
        load_prompt_set(tmp_path / "evaluation_metadata.json")


# ----- condition sets -----------------------------------------------------------------------------------------
def test_sample_i_uses_prompt_i_mod_p():
    cs = ConditionSet.from_prompts(["p0", "p1", "p2"], 7, base_seed=5, tags=["a", None, "c"])
    assert cs.prompt_ids == (0, 1, 2, 0, 1, 2, 0) and cs.labels == cs.prompt_ids
    assert cs.prompts == ("p0", "p1", "p2", "p0", "p1", "p2", "p0")
    assert cs.tags == ("a", None, "c", "a", None, "c", "a")
    assert cs.inputs([4, 6]) == ["p1", "p0"]
    assert len(ConditionSet.from_prompts(["x", "y"])) == 2  # default: one sample per prompt


def test_label_only_hash_is_unchanged_and_prompts_change_it():
    labels = ConditionSet.balanced(4, 3, base_seed=2)
    expected = hashlib.sha256(json.dumps({"labels": [0, 1, 2, 0], "base_seed": 2, "seed_fn": "blake2b/v1"})
                              .encode()).hexdigest()[:16]
    assert labels.content_hash() == expected  # records written before prompt sets existed still resume
    a = ConditionSet.from_prompts(["p0", "p1", "p2"], 4, 2)
    b = ConditionSet.from_prompts(["p0", "p1", "q2"], 4, 2)
    assert len({labels.content_hash(), a.content_hash(), b.content_hash()}) == 3
    d = a.to_dict()
    assert d["prompts"] == ["p0", "p1", "p2", "p0"] and d["prompt_ids"] == [0, 1, 2, 0]


# ----- export layouts -----------------------------------------------------------------------------------------
def _images(n, h=4, w=6):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8)


def _png(path):
    return np.asarray(Image.open(path).convert("RGB"))


def test_text_to_image_export_geneval_and_flat(tmp_path):
    ps_lines = GENEVAL_LINES[:2]
    ps = load_prompt_set(_write_jsonl(tmp_path / "m.jsonl", ps_lines))
    cs = ps.conditions(5, base_seed=3)  # prompts 0 1 0 1 0
    images = _images(5)
    out = export_images(tmp_path / "res", "scorer=lhep", images, cs, prompt_metadata=ps.geneval_metadata)
    root = tmp_path / "res" / "images" / "scorer=lhep"
    assert out["folder"] == str(root) and out["layouts"] == ["geneval", "flat"]
    hwc = images.permute(0, 2, 3, 1).numpy()
    for i in range(5):
        assert np.array_equal(_png(root / "flat" / f"{i:05d}.png"), hwc[i])
    # GenEval: <prompt index>/samples/<repeat>.png — sample 0, 2, 4 are prompt 0's repeats 0, 1, 2
    for i, (pid, k) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]):
        assert np.array_equal(_png(root / "geneval" / f"{pid:05d}" / "samples" / f"{k:04d}.png"), hwc[i])
    for pid in (0, 1):
        assert json.loads((root / "geneval" / f"{pid:05d}" / "metadata.jsonl").read_text()) == ps_lines[pid]
    assert sorted(p.name for p in (root / "geneval").iterdir()) == ["00000", "00001"]
    assert sorted(p.name for p in (root / "flat").iterdir()) == [f"{i:05d}.png" for i in range(5)]
    assert not (root / "samples.npz").exists()
    lines = [json.loads(x) for x in (root / "samples.jsonl").read_text().splitlines()]
    assert [x["prompt"] for x in lines] == [ps.prompts[j] for j in (0, 1, 0, 1, 0)]
    assert [x["seed"] for x in lines] == [sample_seed(3, i) for i in range(5)]
    assert lines[3]["tag"] == "counting" and lines[3]["geneval"] == "geneval/00001/samples/0001.png"


def test_class_conditional_export_npz_for_the_adm_evaluator(tmp_path):
    cs = ConditionSet.balanced(4, 3, base_seed=0)
    images = _images(3)
    export_images(tmp_path, "nova", images, cs, indices=[1, 2, 3])
    root = tmp_path / "images" / "nova"
    with np.load(root / "samples.npz") as npz:
        assert sorted(npz.files) == ["arr_0", "arr_1"]
        assert npz["arr_0"].dtype == np.uint8 and npz["arr_0"].shape == (3, 4, 6, 3)
        assert np.array_equal(npz["arr_0"], images.permute(0, 2, 3, 1).numpy())
        assert npz["arr_1"].tolist() == [1, 2, 0]
    assert sorted(p.name for p in (root / "flat").iterdir()) == ["00001.png", "00002.png", "00003.png"]
    assert not (root / "geneval").exists()
    with pytest.raises(UserError, match="GenEval layout needs prompts"):
        export_images(tmp_path, "nova", images, cs, layouts=["geneval"])
