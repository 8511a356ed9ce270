"""Under DDP each rank spools its own batches; at the arm's end rank 0 receives the other ranks' batches one round
at a time (one batch per rank per collective call) and writes each to its spool before the next arrives, so it
never holds another rank's whole arm (issue 26). Tested with a stand-in process group (rank 0's view)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from var_core.eval.lightning import GenerationRun, _plain, _ShardCollector
from var_core.eval.store import finished_batches, read_batch, write_batch


def _out(first: int, n: int = 2) -> dict:
    return {"indices": list(range(first, first + n)), "labels": [1] * n, "seeds": list(range(first, first + n)),
            "images_u8": torch.full((n, 3, 4, 4), first, dtype=torch.uint8),
            "tokens": [[torch.tensor([first + j])] for j in range(n)], "entropy": torch.zeros(n, 1),
            "activation_scale": [None] * n, "batch": {"size": n, "indices": list(range(first, first + n))}}


def test_rank_zero_merges_the_other_ranks_batches_one_at_a_time(tmp_path, monkeypatch):
    import torch.distributed as dist

    mine, theirs = tmp_path / "rank0", tmp_path / "rank1"
    for first in (0, 4, 8):  # rank 0's batches (round-robin: 0, 4, 8), already in its spool
        write_batch(mine, _out(first), {"rank": 0})
    for first in (2, 6, 10):  # rank 1's, in its own folder (another node)
        write_batch(theirs, _out(first), {"rank": 1})
    rank1 = [_plain(dict(read_batch(theirs, n), environment={"rank": 1})) for n in finished_batches(theirs)]
    on_disk_at_each_call = []

    def all_gather_object(out, obj):
        out[0], out[1] = obj, ({"rank": 1}, len(rank1))

    def gather_object(obj, got, dst=0):
        assert obj is None  # rank 0 sends nothing
        on_disk_at_each_call.append(len(finished_batches(mine)))
        got[0], got[1] = obj, rank1[len(on_disk_at_each_call) - 1]  # one batch of rank 1 per call

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "gather_object", gather_object)
    collector = _ShardCollector(str(tmp_path / "folder"), spool=mine)
    (tmp_path / "folder").mkdir()
    collector.environment = {"rank": 0}
    collector.spooled = finished_batches(mine)
    collector._gather_spool(SimpleNamespace(world_size=2, global_rank=0))
    # three rounds, each writing the batch it received before the next one is asked for
    assert on_disk_at_each_call == [3, 4, 5]
    run = GenerationRun.from_spool(mine)
    assert run.indices == list(range(12))
    assert [int(img[0, 0, 0]) for img in run.images_u8] == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10]
    assert [r[0].item() for r in run.tokens] == list(range(12))
