"""Metrics run on global rank 0 alone, on the merged samples, while the other ranks of a multi-process launch wait
for rank 0's next message (issue 25: torchmetrics' default cross-process sync on ``compute`` made rank 0 wait for
ranks that never joined it: a deadlock of every ``--strategy ddp`` / torchrun study on the testbed).

Two gloo processes: rank 1 waits in ``broadcast_object_list`` exactly as ``RankChannel.receive`` does, rank 0
computes the testbed metrics (class accuracy, FID / KID / IS proxies, FID against held-out images) and then sends.
A sync inside a metric blocks both; the join timeout turns that into a failure instead of a hang."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 0:
            message = {"kind": "done", "names": sorted(_testbed_metrics().set_level)}
        else:
            message = None
        box = [message]
        dist.broadcast_object_list(box, src=0)  # rank 1: RankChannel.receive
        results[rank] = box[0]
    finally:
        dist.destroy_process_group()


def _testbed_metrics(real_count: int = 6):
    from types import SimpleNamespace

    from var_core.eval.metrics import MetricContext, compute_arm_metrics
    from var_core.testbed.data import generate_image

    images = torch.stack([torch.from_numpy(generate_image("heldout", i, 0, 64)[0]).permute(2, 0, 1)
                          for i in range(6)])
    labels = torch.arange(6) % 10
    adapter = SimpleNamespace(family="var", cfg=SimpleNamespace(num_classes=10), image_size=64, model_name="testbed")
    ctx = MetricContext.build(adapter, real_count=real_count)
    ctx.n_resamples = 20
    tokens = [[torch.zeros(4, dtype=torch.long)] for _ in range(6)]
    return compute_arm_metrics(images * 0.7, images, labels, tokens, tokens, ctx)  # darker: FID > 0


def test_metrics_call_no_collective_while_a_process_group_exists(monkeypatch):
    """In one process: torch.distributed reports a process group, and every collective raises."""
    import torch.distributed as dist

    from var_core.testbed.classifier import default_weights_path

    if not default_weights_path().is_file():
        pytest.skip("the shipped testbed classifier is not in this checkout")
    torch.set_num_threads(1)
    calls = []

    def collective(name):
        def fail(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"torch.distributed.{name} called by a metric on rank 0")
        return fail

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for name in ("all_gather", "all_gather_object", "all_reduce", "broadcast", "broadcast_object_list", "barrier",
                 "gather", "gather_object", "get_world_size"):
        monkeypatch.setattr(dist, name, collective(name))
    metrics = _testbed_metrics()
    assert not calls
    assert {"fid_proxy", "kid_proxy", "is_proxy", "fid_real", "kid_real"} <= set(metrics.set_level)
    assert metrics.set_level["fid_proxy"]["mean"] > 0


@pytest.mark.slow  # two spawned processes: ~40 s on a loaded 2-core machine
def test_rank_zero_metrics_join_no_collective():
    from var_core.testbed.classifier import default_weights_path

    if not default_weights_path().is_file():
        pytest.skip("the shipped testbed classifier is not in this checkout")
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, results), daemon=True) for rank in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    assert not hung, f"ranks {hung} still waiting after 120 s: a metric on rank 0 joined a cross-process collective"
    assert [p.exitcode for p in procs] == [0, 0]
    for rank in (0, 1):  # rank 1 received rank 0's message after rank 0's metrics
        assert results[rank]["kind"] == "done"
        assert {"fid_proxy", "kid_proxy", "is_proxy", "fid_real", "kid_real"} <= set(results[rank]["names"])
