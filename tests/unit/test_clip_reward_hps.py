"""CLIP score, ImageReward and HPSv2.1 on tiny random models in the official file layouts, against independent
computations: transformers' own CLIP / BLIP implementations (``tests/tiny_scorers.py`` maps their weights to the
released key layouts) and the cosine / MLP computed by hand from their embeddings."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import tiny_scorers as ts  # noqa: E402  (tests/ is on sys.path through tests/conftest.py)
from var_core.eval.clip_score import clip_preprocess, clip_scores, load_clip  # noqa: E402
from var_core.eval.hps import hps_scores, load_hps  # noqa: E402
from var_core.eval.image_reward import REWARD_MEAN, REWARD_STD, image_reward_scores, load_image_reward  # noqa: E402
from var_core.eval.metric_registry import (METRICS, availability, describe_metrics, metrics_info,  # noqa: E402
                                           prompt_metrics, texts_for, weights_identity)
from var_core.eval.metrics import MetricContext, MetricUnavailable, clip_score  # noqa: E402


def _images(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g, dtype=torch.uint8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("scorers")
    clip = ts.make_clip_folder(root / "clip")
    ir = ts.make_image_reward(root / "ir")
    hps = ts.make_hps(root / "hps")
    return root, clip, ir, hps


def test_clip_preprocess_equals_transformers_pil_processor():
    """Bicubic shorter-side resize + centre crop + OpenAI normalisation, as CLIP's processor (non-square input)."""
    images = _images(3, 40, 48)
    ref = ts.pil_processor(32)(images=list(images), return_tensors="pt")["pixel_values"]
    assert torch.equal(clip_preprocess(images, 32), ref)
    # longest_pad: 40x48 -> 27x32 (round(40*32/48) = 27), padded with zeros to 32x32 before normalising
    padded = clip_preprocess(images, 32, resize="longest_pad")
    zero = (torch.zeros(3) - torch.tensor([0.48145466, 0.4578275, 0.40821073])) / torch.tensor(
        [0.26862954, 0.26130258, 0.27577711])
    assert torch.allclose(padded[:, :, 0, 5], zero.view(1, 3).expand(3, 3))  # row 0 lies in the top padding
    square = _images(2, 40, 40)
    assert torch.equal(clip_preprocess(square, 32, resize="longest_pad"), clip_preprocess(square, 32))


def test_clip_score_per_sample_equals_hand_computed_cosine(folders):
    root, model, _, _ = folders
    images = _images(3, 40, 48, seed=1)
    texts = ["a photo of object class 3", "red cat", "two dogs on the left"]
    got = clip_scores(images, texts, root / "clip")
    proc = ts.pil_processor(32)
    tok = ts.clip_tokenizer()
    with torch.no_grad():
        px = proc(images=list(images), return_tensors="pt")["pixel_values"]
        img = model.visual_projection(model.vision_model(pixel_values=px).pooler_output)
        enc = tok(texts, padding=True, return_tensors="pt")
        txt = model.text_projection(model.text_model(**enc).pooler_output)
    cos = (img / img.norm(dim=-1, keepdim=True) * (txt / txt.norm(dim=-1, keepdim=True))).sum(-1)
    expected = np.maximum(100 * cos.double().numpy(), 0.0)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    assert (expected == 0).any() and (expected > 0).any(), "the random model should give both signs"
    assert clip_score(images, texts, root / "clip") == pytest.approx(float(expected.mean()), abs=1e-4)


def test_clip_mean_equals_torchmetrics_batch_score_when_all_positive(folders):
    root, _, _, _ = folders
    images = _images(12, 32, 32, seed=2)
    texts = ["a red cat", "blue dog", "photo 1", "two cars", "green", "an image of class 5", "left", "right", "cat",
             "dog", "x", "zz"]
    per = clip_scores(images, texts, root / "clip")
    keep = per > 0
    assert keep.sum() >= 2
    loaded = load_clip(root / "clip")
    metric = loaded.metric()
    metric.update(images[torch.from_numpy(keep)], [t for t, k in zip(texts, keep) if k])
    assert float(metric.compute()) == pytest.approx(float(per[keep].mean()), abs=1e-4)


def test_clip_unavailable_says_what_to_pass(tmp_path):
    with pytest.raises(MetricUnavailable, match="--clip-weights"):
        clip_scores(_images(1, 8, 8), ["a"], None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MetricUnavailable, match="cannot load the CLIP model"):
        load_clip(tmp_path / "empty")


def test_image_reward_equals_transformers_blip_and_hand_mlp(folders):
    root, _, (vision, text, mlp), _ = folders
    images = _images(3, 40, 40, seed=3)
    texts = ["a red cat", "a photo of object class 7", "blue dog on the left"]
    scorer = load_image_reward(root / "ir")
    assert scorer.model.cfg.vision_heads == 3 and scorer.model.cfg.text_heads == 2  # width / 64
    got = image_reward_scores(images, texts, scorer)
    from transformers import BertTokenizer

    tok = BertTokenizer.from_pretrained(str(root / "ir" / "bert-base-uncased"))
    enc = tok(texts, padding="max_length", max_length=35, truncation=True, return_tensors="pt")
    vocab = ts.bert_vocab()
    # "a red cat" -> [CLS] a red cat [SEP] then [PAD] up to 35 tokens
    assert enc["input_ids"][0, :6].tolist() == [2, vocab.index("a"), vocab.index("red"), vocab.index("cat"), 3, 0]
    assert enc["input_ids"].shape == (3, 35)
    with torch.no_grad():
        px = ts.pil_processor(32)(images=list(images), return_tensors="pt")["pixel_values"]
        tokens = vision(pixel_values=px).last_hidden_state
        h = text(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], encoder_hidden_states=tokens,
                 encoder_attention_mask=torch.ones(tokens.shape[:2], dtype=torch.long),
                 is_decoder=False).last_hidden_state[:, 0]
        for layer in mlp:  # no activation between the head's layers (dropout only, off in eval)
            h = h @ layer.weight.T + layer.bias
    expected = ((h[:, 0] - REWARD_MEAN) / REWARD_STD).double().numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert len(set(np.round(got, 7))) == 3
    alone = image_reward_scores(images[1:2], texts[1:2], scorer)  # a sample's reward does not depend on its batch
    np.testing.assert_allclose(alone, got[1:2], atol=1e-6)


def test_image_reward_first_token_option_and_errors(folders, tmp_path):
    root, _, _, _ = folders
    enc = load_image_reward(root / "ir" / "ImageReward.pt", first_token="enc")
    ids, _ = enc.tokenize(["a red cat"])
    assert ids[0, 0].item() == len(ts.bert_vocab()) + 1  # [DEC] then [ENC] appended to the vocabulary
    cls = load_image_reward(root / "ir")
    assert cls.tokenize(["a red cat"])[0][0, 0].item() == 2
    images = _images(1, 32, 32)
    assert image_reward_scores(images, ["a"], enc)[0] != pytest.approx(image_reward_scores(images, ["a"], cls)[0])
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "ImageReward.pt").write_bytes((root / "ir" / "ImageReward.pt").read_bytes())
    with pytest.raises(MetricUnavailable, match="bert-base-uncased"):
        load_image_reward(lonely)
    with pytest.raises(MetricUnavailable, match="--image-reward-weights"):
        load_image_reward(None)
    bad = tmp_path / "bad"
    (bad / "bert-base-uncased").mkdir(parents=True)
    (bad / "bert-base-uncased" / "vocab.txt").write_text("[PAD]\n")
    torch.save({"visual.conv1.weight": torch.zeros(1)}, bad / "ImageReward.pt")
    with pytest.raises(MetricUnavailable, match="not an ImageReward checkpoint"):
        load_image_reward(bad)


def test_hps_equals_transformers_clip_cosine_times_100(folders):
    root, _, _, model = folders
    images = _images(3, 32, 32, seed=4)
    texts = ["a red cat", "photo of object class 12 with a long long long prompt that is cut", "dog"]
    scorer = load_hps(root / "hps")  # the {"state_dict": {"module.*": ...}} form of a training checkpoint
    cfg = scorer.model.cfg
    assert (cfg.vision_heads, cfg.text_heads, cfg.context_length) == (2, 2, 16)  # model_config.json: head_width 80
    got = hps_scores(images, texts, scorer)
    tok = ts.clip_tokenizer(specials_last=True)
    enc = tok(texts, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    ids = scorer.tokenize(texts)
    vocab = ts.clip_vocab(specials_last=True)
    sot, eot = vocab["<|startoftext|>"], vocab["<|endoftext|>"]
    assert ids[0, 0].item() == sot and ids[0, 8].item() == eot and ids[0, 9:].eq(0).all()  # 7 characters
    assert ids[1, -1].item() == eot and torch.equal(ids[1], enc["input_ids"][1])  # truncated: last kept as eot
    with torch.no_grad():
        px = ts.pil_processor(32)(images=list(images), return_tensors="pt")["pixel_values"]
        img = model.visual_projection(model.vision_model(pixel_values=px).pooler_output)
        txt = model.text_projection(model.text_model(**enc).pooler_output)
    expected = 100 * torch.nn.functional.cosine_similarity(img, txt).double().numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_hps_plain_state_dict_and_errors(tmp_path):
    ts.make_hps(tmp_path / "plain", wrap=False)
    scorer = load_hps(tmp_path / "plain" / "HPS_v2.1_compressed.pt")
    assert np.isfinite(hps_scores(_images(1, 32, 32), ["cat"], scorer)).all()
    assert load_hps(tmp_path / "plain", scale=1.0).model.cfg.scale == 1.0
    with pytest.raises(MetricUnavailable, match="--hps-weights"):
        load_hps(None)
    with pytest.raises(MetricUnavailable, match="not found"):
        load_hps(tmp_path / "nope")


def test_prompt_metrics_through_the_context(folders):
    root, _, _, _ = folders
    ctx = MetricContext(clip_weights=str(root / "clip"), image_reward_weights=str(root / "ir"),
                        hps_weights=str(root / "hps"), prompts=("a red cat", "blue dog"))
    images = _images(2, 32, 32, seed=5)
    values, unavailable = prompt_metrics(images, torch.tensor([0, 1]), ctx)
    assert not unavailable and set(values) == {"clip_score", "image_reward", "hpsv2"}
    np.testing.assert_allclose(values["hpsv2"], hps_scores(images, ["a red cat", "blue dog"], load_hps(root / "hps")))
    assert len(ctx._loaded_models) == 3  # loaded once per run
    ctx2 = MetricContext(label_prompt="a photo of object class {label}")
    assert texts_for(ctx2, [3, 4]) == ["a photo of object class 3", "a photo of object class 4"]
    assert texts_for(MetricContext(class_names=["red_square", "b"]), [0]) == ["a red square image"]
    values, unavailable = prompt_metrics(images, torch.tensor([0, 1]), MetricContext())
    assert not values and "--image-reward-weights" in unavailable["image_reward"]


def test_registry_lists_every_metric_with_direction_and_source(folders):
    root, _, _, _ = folders
    names = {"psnr", "ssim", "ms_ssim", "lpips", "fid", "kid", "is", "clip_score", "image_reward", "hpsv2",
             "geneval", "dpg"}
    assert names <= set(METRICS)
    assert {n: METRICS[n].direction for n in ("psnr", "lpips", "fid", "kid", "hpsv2", "geneval")} == {
        "psnr": "higher", "lpips": "lower", "fid": "lower", "kid": "lower", "hpsv2": "higher", "geneval": "higher"}
    assert METRICS["geneval"].kind == "import" and METRICS["fid_proxy"].proxy and not METRICS["fid"].proxy
    assert availability("clip_score", {}).startswith("not requested")
    assert availability("clip_score", {"clip_weights": str(root / "clip")}) is None
    text = "\n".join(describe_metrics({"hps_weights": str(root / "hps")}))
    for name in names:
        assert f"  {name} " in text
    assert "ImageReward.pt" in text and "HPS_v2.1_compressed.pt" in text


def test_weights_identity_and_metrics_info(folders):
    root, _, _, _ = folders
    path = root / "ir" / "ImageReward.pt"
    ident = weights_identity(path)
    assert ident["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and ident["files"] == 1
    folder = weights_identity(root / "hps")
    files = sorted(p for p in (root / "hps").rglob("*") if p.is_file())
    listing = "".join(f"{p.relative_to(root / 'hps').as_posix()} {hashlib.sha256(p.read_bytes()).hexdigest()}\n"
                      for p in files)
    assert folder["sha256"] == hashlib.sha256(listing.encode()).hexdigest() and folder["files"] == len(files)
    ctx = MetricContext(image_reward_weights=str(path))
    info = metrics_info(ctx, {"hpsv2": "hpsv2: not requested"}, ["image_reward"])
    assert info["image_reward"]["weights"]["sha256"] == ident["sha256"]
    assert info["image_reward"]["state"] == "computed" and info["image_reward"]["direction"] == "higher"
    assert info["hpsv2"]["state"].startswith("unavailable") and info["hpsv2"]["weights"] is None
