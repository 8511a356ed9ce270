"""The per-batch sample spool (var_core.eval.store) and the results-folder module's guarantees (issue 26): batches
round-trip exactly with no pickle, a crafted or damaged batch file is refused with one line naming it and runs
nothing, and an unreadable file is moved aside, never overwritten."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from ablations.results_folder import _quarantine, close_spool, open_spool, spool_path
from var_core.errors import UserError
from var_core.eval.store import SpoolError, finished_batches, read_batch, write_batch


def _batch(first: int, n: int = 3) -> dict:
    g = torch.Generator().manual_seed(first)
    return {"indices": list(range(first, first + n)), "labels": [first % 7 + j for j in range(n)],
            "seeds": [(1 << 62) + first + j for j in range(n)],  # 63-bit seeds survive the int64 store
            "images_u8": torch.randint(0, 256, (n, 3, 5, 5), dtype=torch.uint8, generator=g),
            "tokens": [[torch.tensor([j]), torch.arange(4) + j, None] for j in range(n)],
            "entropy": torch.tensor([[0.5 + j, float("nan"), 2.0] for j in range(n)]),
            "activation_scale": [2, None, 1][:n], "batch": {"size": n, "seconds": 0.25, "indices":
                                                           list(range(first, first + n))}}


def test_a_batch_round_trips_exactly_without_pickle(tmp_path):
    out = _batch(6)
    write_batch(tmp_path, out, {"rank": 0})
    assert finished_batches(tmp_path) == ["batch_000000006"]
    back = read_batch(tmp_path, "batch_000000006")
    assert back["indices"] == [6, 7, 8] and back["labels"] == out["labels"] and back["seeds"] == out["seeds"]
    assert torch.equal(back["images_u8"], out["images_u8"]) and back["images_u8"].dtype == torch.uint8
    for got, want in zip(back["tokens"], out["tokens"]):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] is None
    assert torch.equal(back["entropy"].nan_to_num(-7), out["entropy"].nan_to_num(-7))
    assert back["activation_scale"] == [2, None, 1] and back["batch"]["seconds"] == 0.25
    assert back["environment"] == {"rank": 0}
    # what is on disk: a safetensors header (JSON) and a JSON file, nothing a pickle loader would read
    raw = (tmp_path / "batch_000000006.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert set(header) - {"__metadata__"} == {"labels", "seeds", "entropy", "images_u8", "tokens.0", "tokens.1"}
    assert header["images_u8"]["dtype"] == "U8" and header["images_u8"]["shape"] == [3, 3, 5, 5]
    assert json.loads((tmp_path / "batch_000000006.json").read_text())["indices"] == [6, 7, 8]


class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"echo ran > {self.marker}",)


def test_a_crafted_batch_file_is_refused_naming_it_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    folder = tmp_path / "spool"
    write_batch(folder, _batch(0))
    data = folder / "batch_000000000.safetensors"
    data.write_bytes(pickle.dumps({"labels": _Payload(marker)}))
    with pytest.raises(SpoolError) as info:
        read_batch(folder, "batch_000000000")
    assert isinstance(info.value, UserError) and str(data) in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()
    (folder / "batch_000000000.json").write_text("{not json")
    with pytest.raises(SpoolError, match="batch_000000000.json"):
        read_batch(folder, "batch_000000000")


def test_an_unfinished_batch_does_not_count(tmp_path):
    write_batch(tmp_path, _batch(0))
    write_batch(tmp_path, _batch(3))
    (tmp_path / "batch_000000003.json").unlink()  # killed between the tensors and the JSON
    assert finished_batches(tmp_path) == ["batch_000000000"]
    assert not list(tmp_path.glob(".*.tmp"))


def test_spool_resumes_only_its_own_configuration_and_is_removed_when_done(tmp_path):
    logs: list[str] = []
    folder, skip = open_spool(tmp_path, "fast", {"samples": 6, "batch_size": 3}, 2, logs.append)
    assert folder == spool_path(tmp_path, "fast") and skip == []
    write_batch(folder, _batch(3))
    assert open_spool(tmp_path, "fast", {"samples": 6, "batch_size": 3}, 2, logs.append)[1] == [3]
    assert "1 of 2 batches" in logs[-1]
    _, skip = open_spool(tmp_path, "fast", {"samples": 6, "batch_size": 2}, 3, logs.append)
    assert skip == [] and finished_batches(folder) == [] and "another configuration" in logs[-1]
    close_spool(tmp_path, "fast")
    assert not folder.exists()


def test_quarantine_moves_aside_with_a_free_name_and_one_line(tmp_path):
    logs: list[str] = []
    for content in (b"first", b"second"):
        path = tmp_path / "arm.pt"
        path.write_bytes(content)
        _quarantine(path, "damaged", "recompute arm 'arm'", logs.append)
    assert (tmp_path / "arm.pt.corrupt").read_bytes() == b"first"
    assert (tmp_path / "arm.pt.corrupt1").read_bytes() == b"second"
    assert not (tmp_path / "arm.pt").exists()
    assert len(logs) == 2 and all("\n" not in line and "arm.pt" in line and "damaged" in line for line in logs)
