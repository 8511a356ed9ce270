"""The shipped testbeds (``testbed``: depth 8 width 256; ``testbed-small``: depth 4 width 128) — card, size, load
time, class fidelity — and the training code (smoke, resume, step-exact schedule)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import pytest
import torch

from var_core.zoo import TESTBED_FOLDERS, load_model
from var_core.testbed.classifier import default_weights_path

HAVE_CLASSIFIER = default_weights_path().is_file()
# (entry, shipped-size budget in bytes, depth, width) as the model cards state them
TESTBEDS = [("testbed", 50e6, 8, 256), ("testbed-small", 25e6, 4, 128)]


def _files(name):
    folder = TESTBED_FOLDERS[name]
    card = json.loads((folder / "testbed.json").read_text())
    return folder, card, [folder / "testbed.json", folder / "var.safetensors",
                          (folder / card.get("vqvae_file", "vqvae.safetensors")).resolve()]


def _shipped(name):
    return (TESTBED_FOLDERS[name] / "testbed.json").is_file()


@pytest.mark.parametrize("name,budget,depth,width", TESTBEDS)
def test_shipped_testbed_card_and_size(name, budget, depth, width):
    if not _shipped(name):
        pytest.skip(f"shipped weights of {name} absent in {TESTBED_FOLDERS[name]}")
    folder, card, files = _files(name)
    assert {"var_config", "vqvae_config", "default_sampling"} <= set(card)
    assert set(card["default_sampling"]) >= {"cfg", "top_k", "top_p"}
    assert (card["var_config"]["depth"], card["var_config"]["embed_dim"]) == (depth, width)
    assert all(f.is_file() for f in files), files
    assert sum(f.stat().st_size for f in files) <= budget


def test_both_testbeds_share_one_vqvae_file():
    if not (_shipped("testbed") and _shipped("testbed-small")):
        pytest.skip("a shipped testbed is absent")
    assert _files("testbed")[2][2] == _files("testbed-small")[2][2]


@pytest.mark.parametrize("name", [t[0] for t in TESTBEDS])
def test_shipped_testbed_loads_fast(name):
    if not _shipped(name):
        pytest.skip(f"shipped weights of {name} absent")
    load_model(name)  # warm imports / file cache, as any second call in a process would be
    t0 = time.perf_counter()
    adapter = load_model(name)
    assert time.perf_counter() - t0 < 5.0
    assert adapter.cfg.num_classes == 10
    assert adapter.image_size == 64
    assert adapter.model_name == name


@pytest.mark.skipif(not HAVE_CLASSIFIER, reason="shipped testbed classifier absent")
@pytest.mark.parametrize("name", [t[0] for t in TESTBEDS])
def test_shipped_testbed_generates_its_classes(name):
    if not _shipped(name):
        pytest.skip(f"shipped weights of {name} absent")
    from var_core.engine import generate
    from var_core.testbed.classifier import load_classifier
    from var_core.testbed.evaluate import default_sampling

    adapter = load_model(name)
    labels = torch.arange(20) % 10
    res = generate(adapter, labels, seeds=list(range(100, 120)), sampling=default_sampling(model=name))
    assert res.images.shape == (20, 3, 64, 64)
    assert float(res.images.min()) >= 0.0 and float(res.images.max()) <= 1.0
    pred = load_classifier().predict(res.images * 2 - 1)
    acc = float((pred == labels).float().mean())
    assert acc >= 0.7, f"class accuracy {acc:.2f} of the shipped {name} (chance 0.1; the card states >= 0.95)"


def test_lr_schedule_is_step_exact_with_a_time_box():
    """Warmup then cosine, read from the step alone: a time box never bends it (hand-worked values)."""
    from var_core.testbed import train as T

    assert T._lr_factor(0, 0.0, warmup=4, min_ratio=0.1) == pytest.approx(0.25)
    assert T._lr_factor(3, 0.03, warmup=4, min_ratio=0.1) == pytest.approx(1.0)
    assert T._lr_factor(50, 0.5, warmup=4, min_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert T._lr_factor(100, 1.0, warmup=4, min_ratio=0.1) == pytest.approx(0.1)

    class _Stub(T._ScheduledModule):
        def __init__(self):
            super().__init__()
            self.cfg = replace(T.VARTrainConfig(), total_steps=200)

    stub = _Stub()
    type(stub).global_step = property(lambda self: 50)
    assert stub.progress() == pytest.approx(0.25)


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


def test_resumed_training_equals_an_uninterrupted_run(tmp_path):
    """Two steps, stop, resume for two more == four steps straight: same weights, bit for bit."""
    from var_core.testbed import train as T

    torch.set_num_threads(1)
    vq_cfg = replace(T.VQVAETrainConfig(), **T.PRESETS["tiny"]["vqvae"])
    var_cfg = replace(T.VARTrainConfig(), **{**T.PRESETS["tiny"]["var"], "total_steps": 6, "warmup_steps": 2})
    straight, split = tmp_path / "straight", tmp_path / "split"
    for out in (straight, split):
        T.train_vqvae(out, vq_cfg, seed=0, max_steps=2, ckpt_every=0, cache=False, log_every=0)
    T.train_var(straight, var_cfg, seed=0, max_steps=6, ckpt_every=0, cache=False, log_every=0)
    T.train_var(split, var_cfg, seed=0, max_steps=2, ckpt_every=0, cache=False, log_every=0)
    T.train_var(split, var_cfg, seed=0, max_steps=6, resume=True, ckpt_every=0, cache=False, log_every=0)
    a = load_model("testbed", weights=straight).var.state_dict()
    b = load_model("testbed", weights=split).var.state_dict()
    assert a.keys() == b.keys()
    diff = {k: float((a[k].float() - b[k].float()).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not diff, diff


def test_var_stage_can_start_from_a_shipped_vqvae(tmp_path):
    """--vqvae-from: the small testbed's card names the shared VQVAE file; the training folder gets those bytes."""
    from var_core.errors import UserError
    from var_core.testbed import train as T

    if not _shipped("testbed-small"):
        pytest.skip("testbed-small is not shipped")
    folder, card, files = _files("testbed-small")
    T.use_shipped_vqvae(folder, tmp_path / "run")
    assert (tmp_path / "run" / "vqvae.safetensors").read_bytes() == files[2].read_bytes()
    assert json.loads((tmp_path / "run" / "vqvae.json").read_text())["vqvae_config"] == card["vqvae_config"]
    with pytest.raises(UserError, match="no testbed.json"):
        T.use_shipped_vqvae(tmp_path / "nowhere", tmp_path / "run2")


@pytest.mark.parametrize("argv, expected", [([], "multinomial"), (["--draw", "inverse_cdf"], "inverse_cdf")])
def test_evaluate_cli_passes_the_draw(monkeypatch, tmp_path, argv, expected):
    """``--draw`` reaches the evaluation's SamplingConfig (the card's two streams are both reproducible)."""
    import var_core.testbed.evaluate as E

    seen = {}

    def fake_evaluate(samples, batch_size, out, weights, sampling, *rest, **kwargs):
        seen["sampling"] = sampling
        raise SystemExit(0)

    monkeypatch.setattr(E, "evaluate", fake_evaluate)
    with pytest.raises(SystemExit):
        E.main(["--samples", "2", "--out", str(tmp_path), *argv])
    assert seen["sampling"].draw == expected
    assert (seen["sampling"].cfg, seen["sampling"].top_k, seen["sampling"].top_p) == (1.5, 100, 0.95)
