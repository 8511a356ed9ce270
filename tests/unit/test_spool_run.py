"""An arm's samples stay on disk (issue 26): a finished spool read as a run (``GenerationRun.from_spool``) gives
the same images, tokens, per-sample numbers and content hash as the whole run merged in memory, while reading
one batch file at a time; the index file (``varscope.run/2``) and the old one-file format both load."""

from __future__ import annotations

import pytest
import torch

from var_core.eval.lightning import INDEX_FORMAT, GenerationRun, ResultFileError
from var_core.eval.store import samples_folder, write_batch


def _batch(first: int, n: int) -> dict:
    g = torch.Generator().manual_seed(first)
    return {"indices": list(range(first, first + n)), "labels": [(first + j) % 5 for j in range(n)],
            "seeds": [100 + first + j for j in range(n)],
            "images_u8": torch.randint(0, 256, (n, 3, 4, 6), dtype=torch.uint8, generator=g),
            "tokens": [[torch.tensor([first + j]), torch.arange(3) * j, None] for j in range(n)],
            "entropy": torch.tensor([[0.25 * (first + j), float("nan"), 2.0] for j in range(n)]),
            "activation_scale": [1 + j % 2 for j in range(n)],
            "batch": {"size": n, "seconds": 0.5, "indices": list(range(first, first + n))}}


def _spool(folder, sizes=(3, 3, 2)):
    outs, first = [], 0
    for n in sizes:
        outs.append(_batch(first, n))
        first += n
    for out in reversed(outs):  # written out of order (DDP ranks finish in any order)
        write_batch(folder, out, {"rank": 0})
    return outs


def test_a_spool_read_as_a_run_equals_the_samples_written(tmp_path):
    outs = _spool(tmp_path / "s")
    run = GenerationRun.from_spool(tmp_path / "s")
    images = torch.cat([o["images_u8"] for o in outs])  # written by hand above, concatenated here
    assert run.indices == list(range(8)) and run.seeds == [100 + i for i in range(8)]
    assert run.labels.tolist() == [i % 5 for i in range(8)]
    assert run.activation_scale == [1, 2, 1, 1, 2, 1, 1, 2]
    assert run.entropy[5, 0] == pytest.approx(1.25) and run.entropy[7, 2] == 2.0
    assert len(run.images_u8) == 8 and tuple(run.images_u8.shape) == (8, 3, 4, 6)
    for a, b in ((0, 8), (2, 7), (3, 6), (5, 6), (7, 8)):  # slices inside a batch and across batch files
        assert torch.equal(run.images_u8[a:b], images[a:b]), (a, b)
    assert torch.equal(run.images_u8[-1], images[-1]) and torch.equal(torch.stack(list(run.images_u8)), images)
    tokens = list(run.tokens)
    assert len(tokens) == 8 and tokens[4][2] is None
    assert torch.equal(tokens[4][0], torch.tensor([4])) and torch.equal(tokens[4][1], torch.arange(3) * 1)
    assert torch.equal(run.tokens[6][1], torch.arange(3) * 0)
    # the hash of the on-disk run is the hash of the same samples held in memory (the format before)
    whole = GenerationRun(list(range(8)), torch.tensor([i % 5 for i in range(8)]), [100 + i for i in range(8)],
                          images, [t for o in outs for t in o["tokens"]],
                          torch.cat([o["entropy"] for o in outs]).double().numpy(),
                          [a for o in outs for a in o["activation_scale"]], [], [])
    assert run.content_hash() == whole.content_hash()
    whole.images_u8 = images.clone()
    whole.images_u8[7, 0, 0, 0] ^= 1
    assert run.content_hash() != whole.content_hash()


def test_the_index_file_names_the_samples_folder_and_loads_it_back(tmp_path):
    arms = tmp_path / "arms"
    _spool(arms / "a.partial")
    run = GenerationRun.from_spool(arms / "a.partial")
    pt = arms / "a.pt"
    run.move_samples(samples_folder(pt))
    assert not (arms / "a.partial").exists() and (arms / "a.samples").is_dir()
    run.save(pt)
    blob = torch.load(pt, weights_only=True)
    assert blob["format"] == INDEX_FORMAT and blob["samples"] == "a.samples" and blob["images_u8"] is None
    assert pt.stat().st_size < 4000  # an index, not the images
    back = GenerationRun.load(pt)
    assert back.content_hash() == run.content_hash() and torch.equal(back.images_u8[1:5], run.images_u8[1:5])
    # the folder gone: one line naming the index and the folder
    (arms / "a.samples").rename(arms / "elsewhere")
    with pytest.raises(ResultFileError, match=r"a\.pt: its samples folder .*a\.samples is missing"):
        GenerationRun.load(pt)


def test_an_old_one_file_run_still_loads(tmp_path):
    images = torch.arange(2 * 3 * 2 * 2, dtype=torch.uint8).reshape(2, 3, 2, 2)
    old = GenerationRun([0, 1], torch.tensor([3, 4]), [7, 8], images, [[torch.tensor([1])], [torch.tensor([2])]],
                        torch.zeros(2, 1).double().numpy(), [None, 1], [], [])
    old.save(tmp_path / "old.pt")
    back = GenerationRun.load(tmp_path / "old.pt")
    assert back.samples_dir is None and torch.equal(back.images_u8, images)
    assert back.content_hash() == old.content_hash()


def test_only_one_batch_file_of_images_is_read_at_a_time(tmp_path, monkeypatch):
    _spool(tmp_path / "s", sizes=(4, 4, 4, 4))
    run = GenerationRun.from_spool(tmp_path / "s")
    from var_core.eval import store

    loaded = []
    real = store._tensor
    monkeypatch.setattr(store, "_tensor", lambda path, key: loaded.append((path.name, key)) or real(path, key))
    assert torch.equal(run.images_u8[5:7], run.images_u8[5:7])
    assert [k for _, k in loaded] == ["images_u8"]  # one file (rows 4-7), read once (the second slice is cached)
    assert run.images_u8[2:10].shape[0] == 8
    assert sorted({p for p, _ in loaded}) == ["batch_000000000.safetensors", "batch_000000004.safetensors",
                                              "batch_000000008.safetensors"]


def test_exported_images_of_stored_samples_match_the_in_memory_export(tmp_path):
    import numpy as np
    from PIL import Image

    from var_core.eval.export import export_images
    from var_core.eval.lightning import ConditionSet

    outs = _spool(tmp_path / "s")
    run = GenerationRun.from_spool(tmp_path / "s")
    images = torch.cat([o["images_u8"] for o in outs])
    conditions = ConditionSet.balanced(8, 5, 0)
    lazy = export_images(tmp_path / "lazy", "a", run.images_u8, conditions, layouts=("flat", "npz"))
    whole = export_images(tmp_path / "whole", "a", images, conditions, layouts=("flat", "npz"))
    a, b = np.load(lazy["npz"]), np.load(whole["npz"])
    assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])
    assert np.array_equal(a["arr_0"][6], images[6].permute(1, 2, 0).numpy())  # [N, H, W, 3] as the ADM tool reads
    png = np.asarray(Image.open(tmp_path / "lazy" / "images" / "a" / "flat" / "00005.png"))
    assert np.array_equal(png, images[5].permute(1, 2, 0).numpy())


def test_metric_chunks_shrink_with_the_image_size():
    """Images per metric chunk: 2**19 pixels (MS-SSIM held ~75 MB per 256-px image of a chunk), at most 64."""
    from var_core.eval.metrics import chunk_of

    sizes = {64: 64, 90: 64, 128: 32, 256: 8, 512: 2, 1024: 1, 2048: 1}
    assert {s: chunk_of(torch.empty(0, 3, s, s)) for s in sizes} == sizes
    assert chunk_of(torch.empty(0, 3, 512, 1024)) == 1  # Infinity 1:2


def test_chunked_fidelity_equals_one_image_at_a_time():
    from var_core.eval.metrics import fidelity_per_sample

    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 256, (19, 3, 256, 256), dtype=torch.uint8, generator=g)  # 3 chunks of 8 (8, 8, 3)
    arm = base.clone()
    arm[:, :, 100:140] = 17
    whole = fidelity_per_sample(arm, base)[0]
    for i in (0, 7, 8, 18):
        one = fidelity_per_sample(arm[i:i + 1], base[i:i + 1])[0]
        for key in ("psnr", "ssim", "ms_ssim"):
            assert whole[key][i] == pytest.approx(one[key][0], rel=1e-5), (key, i)
    assert len(whole["psnr"]) == 19


def test_readers_of_the_one_file_format_still_get_tensors(tmp_path):
    """Code written for varscope.run/1 (``run.images_u8`` a tensor) keeps working on stored samples: tensor methods
    and torch functions see all images (the whole arm in memory: a fallback, not what varscope itself does)."""
    outs = _spool(tmp_path / "s")
    run = GenerationRun.from_spool(tmp_path / "s")
    images = torch.cat([o["images_u8"] for o in outs])
    assert torch.equal(run.images_u8, images) and torch.equal(images, run.images_u8)
    assert torch.equal(run.images_u8.permute(0, 2, 3, 1), images.permute(0, 2, 3, 1))
    assert torch.allclose(run.images_u8.float() / 255, images.float() / 255)


def test_an_arm_is_measured_against_the_baseline_one_chunk_at_a_time(tmp_path, monkeypatch):
    """compute_arm_metrics, the samples' hash and the identical-to-baseline check on two stored arms never ask the
    stored images for more than one metric chunk at once, and never for all of them (the one-file format held both
    arms whole: 2 x 3 MB per 1024-px sample). 40 samples of 128 px: chunks of 32."""
    from ablations.runner import identical_to_baseline
    from var_core.eval import store
    from var_core.eval.metrics import MetricContext, chunk_of, compute_arm_metrics

    for name, shift in (("base", 0), ("arm", 1)):
        for first in range(0, 40, 8):
            g = torch.Generator().manual_seed(first)
            images = torch.randint(0, 200, (8, 3, 128, 128), dtype=torch.uint8, generator=g) + shift
            write_batch(tmp_path / name, {"indices": list(range(first, first + 8)), "labels": [0] * 8,
                                          "seeds": list(range(8)), "images_u8": images,
                                          "tokens": [[torch.tensor([first + j + shift])] for j in range(8)],
                                          "entropy": torch.zeros(8, 1), "activation_scale": None,
                                          "batch": {"size": 8, "indices": list(range(first, first + 8))}})
    base, arm = GenerationRun.from_spool(tmp_path / "base"), GenerationRun.from_spool(tmp_path / "arm")
    asked, real = [], store.SpoolImages.__getitem__

    def getitem(self, key):
        asked.append(len(range(*key.indices(len(self)))) if isinstance(key, slice) else 1)
        return real(self, key)

    monkeypatch.setattr(store.SpoolImages, "__getitem__", getitem)
    metrics = compute_arm_metrics(arm.images_u8, base.images_u8, arm.labels, arm.tokens, base.tokens,
                                  MetricContext())
    arm.content_hash()
    same = identical_to_baseline(arm, base)
    assert chunk_of(arm.images_u8) == 32 and asked and max(asked) <= 32, sorted(set(asked))
    assert len(metrics.per_sample["psnr"]) == 40 and same["images_equal"] == 0 and same["tokens_equal"] == 0


def test_a_renamed_arm_gets_its_own_copy_of_the_samples_folder(tmp_path):
    from ablations.runner import _copy_renamed
    from var_core.eval import records as rec

    old_pt, new_pt = rec.record_paths(tmp_path, "old")[1], rec.record_paths(tmp_path, "new")[1]
    _spool(tmp_path / "arms" / "old.partial")
    run = GenerationRun.from_spool(tmp_path / "arms" / "old.partial")
    run.move_samples(samples_folder(old_pt))
    run.save(old_pt)
    want = run.content_hash()
    _copy_renamed(tmp_path, "old", "new")
    assert samples_folder(new_pt).is_dir() and torch.load(new_pt, weights_only=True)["samples"] == "new.samples"
    import shutil

    shutil.rmtree(samples_folder(old_pt))  # the copy does not depend on the old arm's folder
    assert GenerationRun.load(new_pt).content_hash() == want
