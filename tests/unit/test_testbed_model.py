"""The shipped ``testbed`` model (load time, class fidelity) and a smoke test of its training code."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import pytest
import torch

from var_core.zoo import TESTBED_DIR, load_model
from var_core.testbed.classifier import default_weights_path

HAVE_TESTBED = all((TESTBED_DIR / n).is_file() for n in ("testbed.json", "var.safetensors", "vqvae.safetensors"))
HAVE_CLASSIFIER = default_weights_path().is_file()
needs_testbed = pytest.mark.skipif(not HAVE_TESTBED, reason=f"shipped testbed weights absent in {TESTBED_DIR}")


@needs_testbed
def test_shipped_testbed_card_and_size():
    card = json.loads((TESTBED_DIR / "testbed.json").read_text())
    assert {"var_config", "vqvae_config", "default_sampling"} <= set(card)
    assert set(card["default_sampling"]) >= {"cfg", "top_k", "top_p"}
    total = sum((TESTBED_DIR / n).stat().st_size for n in ("testbed.json", "var.safetensors", "vqvae.safetensors"))
    assert total <= 25e6


@needs_testbed
def test_shipped_testbed_loads_fast():
    load_model("testbed")  # warm imports / file cache, as any second call in a process would be
    t0 = time.perf_counter()
    adapter = load_model("testbed")
    assert time.perf_counter() - t0 < 5.0
    assert adapter.cfg.num_classes == 10
    assert adapter.image_size == 64


@needs_testbed
@pytest.mark.skipif(not HAVE_CLASSIFIER, reason="shipped testbed classifier absent")
def test_shipped_testbed_generates_its_classes():
    from var_core.engine import generate
    from var_core.testbed.classifier import load_classifier
    from var_core.testbed.evaluate import default_sampling

    adapter = load_model("testbed")
    labels = torch.arange(20) % 10
    res = generate(adapter, labels, seeds=list(range(100, 120)), sampling=default_sampling())
    assert res.images.shape == (20, 3, 64, 64)
    assert float(res.images.min()) >= 0.0 and float(res.images.max()) <= 1.0
    pred = load_classifier().predict(res.images * 2 - 1)
    acc = float((pred == labels).float().mean())
    assert acc >= 0.4, f"class accuracy {acc:.2f} of the shipped testbed (chance 0.1)"


def test_training_smoke_and_resume(tmp_path):
    from var_core.testbed import train as T

    torch.set_num_threads(min(2, torch.get_num_threads()))
    vq_cfg = replace(T.VQVAETrainConfig(), **T.PRESETS["tiny"]["vqvae"])
    var_cfg = replace(T.VARTrainConfig(), **T.PRESETS["tiny"]["var"])

    vq = T.train_vqvae(tmp_path, vq_cfg, seed=0, max_steps=2, ckpt_every=0, cache=False, log_every=0)
    assert vq.trainer.global_step == 2
    assert math.isfinite(float(vq.trainer.callback_metrics["train/loss"]))
    assert (tmp_path / "vqvae.safetensors").is_file() and (tmp_path / "vqvae_last.ckpt").is_file()

    var = T.train_var(tmp_path, var_cfg, seed=0, max_steps=2, ckpt_every=0, cache=False, log_every=0)
    assert var.trainer.global_step == 2
    assert math.isfinite(float(var.trainer.callback_metrics["train/loss"]))
    assert (tmp_path / "var_last.ckpt").is_file() and (tmp_path / "testbed.json").is_file()

    # --resume continues from DIR/var_last.ckpt: one more step, not three
    resumed = T.train_var(tmp_path, var_cfg, seed=0, max_steps=3, resume=True, ckpt_every=0, cache=False,
                          log_every=0)
    assert resumed.trainer.global_step == 3
    assert math.isfinite(float(resumed.trainer.callback_metrics["train/loss"]))

    # the export is what the zoo loads (strict official layout)
    adapter = load_model("testbed", weights=tmp_path)
    sd = adapter.var.state_dict()
    ckpt = torch.load(tmp_path / "var_last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert torch.equal(sd["head.weight"], ckpt["var.head.weight"])

    dest = tmp_path / "shipped"
    T.export_to(tmp_path, dest, default_sampling={"cfg": 2.0, "top_k": 0, "top_p": 0.0})
    card = json.loads((dest / "testbed.json").read_text())
    assert card["default_sampling"]["cfg"] == 2.0
    load_model("testbed", weights=dest)
