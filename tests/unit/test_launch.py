"""``resolve_launch``: Lightning's ``--devices`` forms, ``--num-nodes``, the strategy, and the rank of a process under
the ``ddp`` launcher, torchrun and SLURM (hand-written environments; GPUs stood in for by patching torch.cuda)."""

from __future__ import annotations

import pytest
import torch

from var_core.errors import UserError
from var_core.eval.distributed import parse_devices, processes_per_node, resolve_launch


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


@pytest.mark.parametrize("text, value", [("2", 2), (3, 3), ("auto", "auto"), ("-1", -1), ("0,1", [0, 1]),
                                         ("3,", [3]), ("[0, 2]", [0, 2]), ([1, 3], [1, 3])])
def test_devices_forms(text, value):
    assert parse_devices(text) == value


@pytest.mark.parametrize("text", ["0", "-2", "x", "1,1", "a,b", "", True])
def test_bad_devices_are_user_errors(text):
    with pytest.raises(UserError, match="--devices"):
        parse_devices(text)


def test_cpu_devices_are_process_counts():
    assert processes_per_node("cpu", 2) == 2 and processes_per_node("cpu", "auto") == 1
    for gpu_only in (-1, "0,1"):
        with pytest.raises(UserError, match="select GPUs"):
            processes_per_node("cpu", gpu_only)


def test_gpu_devices_against_this_machine(four_gpus):
    assert processes_per_node("gpu", "auto") == 4 and processes_per_node("gpu", -1) == 4
    assert processes_per_node("gpu", "1,3") == 2
    with pytest.raises(UserError, match="has 4 CUDA GPU"):
        processes_per_node("gpu", 5)
    with pytest.raises(UserError, match=r"GPU\(s\) \[4\] do not exist"):
        processes_per_node("gpu", [2, 4])


def test_modes_on_one_node():
    single = resolve_launch("cpu", 1, environ={})
    assert (single.mode, single.world_size, single.rank, str(single.device)) == ("single", 1, 0, "cpu")
    spawn = resolve_launch("cpu", 2, environ={})
    assert (spawn.mode, spawn.strategy, spawn.world_size, str(spawn.load_device)) == ("spawn", "ddp_spawn", 2, "cpu")
    ddp = resolve_launch("cpu", 2, strategy="ddp", environ={})
    assert (ddp.mode, ddp.rank, ddp.launcher) == ("ranks", 0, "lightning")
    child = resolve_launch("cpu", 2, strategy="ddp", environ={"LOCAL_RANK": "1", "NODE_RANK": "0"})
    assert (child.mode, child.rank, child.local_rank) == ("ranks", 1, 1)


def test_auto_accelerator_decided_once(four_gpus):
    launch = resolve_launch("auto", 1, environ={})
    assert launch.accelerator == "gpu" and launch.devices == 1 and str(launch.device) == "cuda:0"
    assert str(launch.load_device) == "cuda:0"  # single process: loaded where it runs


def test_gpu_indices_give_each_local_rank_its_gpu(four_gpus):
    launch = resolve_launch("gpu", "1,3", strategy="ddp", environ={"LOCAL_RANK": "1"})
    assert launch.rank == 1 and str(launch.device) == "cuda:3"
    spawn = resolve_launch("gpu", [2, 3], environ={})
    assert spawn.mode == "spawn" and str(spawn.device) == "cuda:2" and str(spawn.load_device) == "cpu"


def test_several_nodes_with_the_ddp_launcher(four_gpus):
    launch = resolve_launch("gpu", 4, num_nodes=2, environ={"NODE_RANK": "1", "LOCAL_RANK": "2"})
    assert (launch.mode, launch.strategy, launch.world_size, launch.rank) == ("ranks", "ddp", 8, 6)
    assert str(launch.device) == "cuda:2"
    with pytest.raises(UserError, match="works on one node"):
        resolve_launch("gpu", 4, num_nodes=2, strategy="ddp_spawn", environ={})
    with pytest.raises(UserError, match="NODE_RANK=2"):
        resolve_launch("gpu", 4, num_nodes=2, environ={"NODE_RANK": "2"})


TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "3", "LOCAL_RANK": "1",
            "GROUP_RANK": "1"}


def test_torchrun_process_count_is_adopted_or_must_match():
    launch = resolve_launch("cpu", 1, environ=TORCHRUN)
    assert (launch.mode, launch.launcher, launch.strategy) == ("ranks", "torchrun", "ddp")
    assert (launch.devices, launch.num_nodes, launch.rank, launch.local_rank) == (2, 2, 3, 1)
    assert "torchrun started 4 processes (2 per node on 2 node(s))" in launch.notes[0]
    assert resolve_launch("cpu", 2, num_nodes=2, environ=TORCHRUN).notes == ()
    with pytest.raises(UserError, match="give --devices 2 --num-nodes 2"):
        resolve_launch("cpu", 3, environ=TORCHRUN)
    with pytest.raises(UserError, match="every process is started already"):
        resolve_launch("cpu", 1, strategy="ddp_spawn", environ=TORCHRUN)


def test_slurm_ranks_and_the_results_lock(monkeypatch):
    from ablations.runner import _is_ddp_child

    for var in ("LOCAL_RANK", "RANK", "NODE_RANK", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    slurm = {"SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
             "SLURM_NODEID": "0", "SLURM_JOB_NAME": "study", "SLURM_NTASKS_PER_NODE": "2"}
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    launch = resolve_launch("cpu", 1)
    assert (launch.mode, launch.launcher, launch.rank, launch.devices) == ("ranks", "slurm", 1, 2)
    assert _is_ddp_child()  # task 1 never takes the results-folder lock
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert resolve_launch("cpu", 1).rank == 0 and not _is_ddp_child()  # task 0 takes it
