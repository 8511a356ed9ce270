"""Where generation runs: one decision for accelerator, devices, nodes and strategy, and the ranks of a launch.

:func:`resolve_launch` turns what a user asked for (``--accelerator --devices --num-nodes --strategy``) and what
launched the process (torchrun, SLURM, Lightning's ``ddp`` launcher re-running the command) into one
:class:`Launch`. Everything downstream reads that one object: the Lightning ``Trainer`` of every generation, the
device the model is loaded on, the profiler probes (CUDA events or the CPU clock), the in-process re-timing and the
records. (Before, ``--accelerator auto`` let Lightning pick the GPU while the probes timed with the CPU clock.)

Modes
-----
``single``  one process; generation runs in the calling process.
``spawn``   ``ddp_spawn`` / ``ddp_fork`` on one node: the calling process starts the workers for every generation
            and reads their results back; it is not a rank itself. (``--strategy auto`` with several devices on
            one node means ``ddp_spawn``, as before.)
``ranks``   every process runs the whole command: ``--strategy ddp`` (Lightning's launcher re-runs the command in
            each process of a node; for several nodes run the command once per node with ``MASTER_ADDR``,
            ``MASTER_PORT`` and ``NODE_RANK`` set), ``torchrun`` or SLURM ``srun``. Global rank 0 does all the
            work that is not generation (records, metrics, report, the results-folder lock) and tells the other
            ranks, through the process group, which generation to join next (:class:`RankChannel`); results
            come back to rank 0 through the process group (``gather_object``), so no folder has to be shared
            between nodes.

``--devices`` takes Lightning's forms: a number of processes per node, ``auto``, ``-1`` (every GPU) or GPU indices
(``0,1``; ``3,`` is the single GPU 3). Under torchrun / SLURM the process count comes from the launcher; leaving
``--devices`` and ``--num-nodes`` at their defaults adopts it, anything else must match.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from ..errors import UserError, did_you_mean

__all__ = ["Launch", "LaunchedEnv", "RankChannel", "resolve_accelerator", "parse_devices", "processes_per_node",
           "launched_env", "resolve_launch", "started_ranks", "is_script_strategy", "ACCELERATORS"]

ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


def resolve_accelerator(name: str) -> str:
    """``cpu`` or ``gpu``: ``auto`` is decided here, once (a CUDA GPU when torch sees one, else the CPU)."""
    key = str(name).strip().lower()
    if key == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    if key in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"accelerator {name!r}: this machine has no CUDA GPU (torch.cuda.is_available() is "
                            f"False); use --accelerator cpu")
        return "gpu"
    if key == "cpu":
        return "cpu"
    raise UserError(f"unknown accelerator {name!r}.{did_you_mean(key, ACCELERATORS)} Choose from "
                    f"{', '.join(ACCELERATORS)}")


def parse_devices(value: Any) -> int | list[int] | str:
    """Lightning's ``devices`` forms: a process count ``N >= 1``, ``"auto"``, ``-1`` (every GPU) or GPU indices
    (``[0, 1]``, ``"0,1"``, ``"[0, 1]"``; ``"3,"`` is the single GPU 3). Returns an int, ``"auto"`` or a list."""
    if isinstance(value, bool):
        raise UserError(f"--devices: expected a number, auto, -1 or GPU indices like 0,1; got {value!r}")
    if isinstance(value, int):
        if value == -1 or value >= 1:
            return value
        raise UserError(f"--devices: must be >= 1 (processes per node), -1 (every GPU), auto or GPU indices like "
                        f"0,1; got {value}")
    if isinstance(value, (list, tuple)):
        indices = [_index(v, value) for v in value]
        if not indices:
            raise UserError("--devices: an empty list of GPU indices; give e.g. 0,1")
        if len(set(indices)) != len(indices):
            raise UserError(f"--devices: a GPU index is repeated in {value!r}")
        return indices
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1].strip() + ","
    if "," in text:
        return parse_devices([p for p in (s.strip() for s in text.split(",")) if p])
    try:
        return parse_devices(int(text))
    except ValueError:
        raise UserError(f"--devices: expected a number of processes (2), auto, -1 (every GPU) or GPU indices "
                        f"(0,1 or 3,); got {value!r}") from None


def _index(v: Any, whole: Any) -> int:
    try:
        i = int(str(v).strip())
    except ValueError:
        raise UserError(f"--devices: {v!r} is not a GPU index (in {whole!r})") from None
    if i < 0:
        raise UserError(f"--devices: GPU indices are >= 0; got {whole!r}")
    return i


def processes_per_node(accelerator: str, devices: Any) -> int:
    """How many processes ``devices`` starts on one node (checked against the GPUs of this machine)."""
    devices = parse_devices(devices)
    if accelerator == "gpu":
        count = torch.cuda.device_count()
        if devices in ("auto", -1):
            return max(1, count)
        if isinstance(devices, list):
            bad = [i for i in devices if i >= count]
            if bad:
                raise UserError(f"--devices {','.join(map(str, devices))}: this machine has {count} CUDA GPU(s) "
                                f"(indices 0 … {count - 1}); GPU(s) {bad} do not exist")
            return len(devices)
        if devices > count:
            raise UserError(f"--devices {devices}: this machine has {count} CUDA GPU(s); use --devices {count} or "
                            f"fewer, or --accelerator cpu (DDP processes on the CPU)")
        return devices
    if devices == "auto":
        return 1
    if devices == -1 or isinstance(devices, list):
        raise UserError(f"--devices {devices}: -1 and GPU indices select GPUs; on the CPU give a number of "
                        f"processes (e.g. --devices 2) or use --accelerator gpu")
    return devices


@dataclass(frozen=True)
class LaunchedEnv:
    """A process started by an external launcher (torchrun or SLURM) as one of several."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    node_rank: int
    local_world_size: int


def launched_env() -> LaunchedEnv | None:
    """torchrun's or SLURM's description of this process (Lightning's own detection), or None (not launched as
    one of several processes)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    env = os.environ
    if TorchElasticEnvironment.detect():
        world = int(env.get("WORLD_SIZE", "1"))
        if world > 1:
            return LaunchedEnv("torchrun", int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                               int(env.get("GROUP_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world)))
        return None
    if SLURMEnvironment.detect():
        world = int(env.get("SLURM_NTASKS", "1"))
        if world > 1:
            nodes = max(1, int(env.get("SLURM_NNODES", "1")))
            return LaunchedEnv("slurm", int(env.get("SLURM_PROCID", 0)), world, int(env.get("SLURM_LOCALID", 0)),
                               int(env.get("SLURM_NODEID", 0)), max(1, world // nodes))
    return None


def is_secondary_rank() -> bool:
    """True in every process of a multi-process launch except global rank 0 (torchrun, SLURM or Lightning's
    re-executing ``ddp`` launcher): such a process computes its share but reports nothing of its own."""
    env = os.environ
    return any(int(env.get(key, "0") or 0) > 0 for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def is_script_strategy(strategy: str) -> bool:
    """Strategies whose processes each run the whole command (``ddp``, ``ddp_find_unused_parameters_*``), as
    opposed to those that start workers from the calling process (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``)."""
    s = str(strategy).lower()
    return s.startswith("ddp") and not any(w in s for w in ("spawn", "fork", "notebook"))


def _spawn_like(strategy: str) -> bool:
    s = str(strategy).lower()
    return any(w in s for w in ("spawn", "fork", "notebook"))


@dataclass(frozen=True)
class Launch:
    """The one decision of where and how generation runs (see the module docstring for the modes)."""

    accelerator: str  # "cpu" | "gpu"
    devices: int | list[int] | str  # what the Lightning Trainer is given
    num_nodes: int
    strategy: str
    processes_per_node: int
    mode: str  # "single" | "spawn" | "ranks"
    rank: int = 0  # global rank of this process (0 outside "ranks")
    local_rank: int = 0
    launcher: str | None = None  # "torchrun" | "slurm" | "lightning" (the ddp launcher) in mode "ranks"
    notes: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.num_nodes

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """This process's device (in mode "spawn": that of the first worker, where in-process work runs)."""
        if self.accelerator != "gpu":
            return torch.device("cpu")
        index = self.devices[self.local_rank] if isinstance(self.devices, list) else self.local_rank
        return torch.device("cuda", int(index))

    @property
    def load_device(self) -> torch.device:
        """Where the model is loaded: this process's device, except in mode "spawn" (the CPU: the model is
        pickled to the workers, and Lightning moves each worker's copy to its own device)."""
        return torch.device("cpu") if self.mode == "spawn" else self.device

    def to_dict(self) -> dict:
        return {"accelerator": self.accelerator, "devices": self.devices, "num_nodes": self.num_nodes,
                "strategy": self.strategy, "processes_per_node": self.processes_per_node,
                "world_size": self.world_size, "mode": self.mode, "launcher": self.launcher,
                "device": str(self.device), "notes": list(self.notes)}


def resolve_launch(accelerator: str = "cpu", devices: Any = 1, num_nodes: int = 1, strategy: str = "auto",
                   environ: Mapping[str, str] | None = None, external: bool = True) -> Launch:
    """The :class:`Launch` for these settings in this process (reads torchrun / SLURM / Lightning variables).

    ``external=False``: ignore torchrun / SLURM (a caller whose processes are independent of each other, e.g. one
    sweep worker per SLURM task, must not be made ranks of one process group)."""
    env = os.environ if environ is None else environ
    acc = resolve_accelerator(accelerator)
    devices = parse_devices(devices)
    if isinstance(num_nodes, bool) or int(num_nodes) < 1:
        raise UserError(f"--num-nodes {num_nodes}: give a number of nodes >= 1")
    num_nodes = int(num_nodes)
    strategy = str(strategy or "auto")
    external = None if not external else launched_env() if environ is None else _launched_from(env)
    if external is not None:
        per_node = processes_per_node(acc, devices)
        notes = []
        if per_node * num_nodes != external.world_size:
            nodes = external.world_size // external.local_world_size
            if devices in (1, "auto") and num_nodes == 1 and nodes * external.local_world_size == external.world_size:
                per_node, num_nodes, devices = external.local_world_size, nodes, external.local_world_size
                processes_per_node(acc, devices)  # this node must have that many GPUs
                notes.append(f"{external.launcher} started {external.world_size} processes ({per_node} per node on "
                             f"{num_nodes} node(s)): devices={per_node}, num_nodes={num_nodes}")
            else:
                raise UserError(
                    f"{external.launcher} started {external.world_size} processes ({external.local_world_size} per "
                    f"node) but --devices {devices} --num-nodes {num_nodes} asks for {per_node * num_nodes}; give "
                    f"--devices {external.local_world_size} --num-nodes {nodes}, or leave both out")
        if strategy == "auto":
            strategy = "ddp"
        elif not is_script_strategy(strategy):
            raise UserError(f"--strategy {strategy}: under {external.launcher} every process is started already; "
                            f"use --strategy ddp (or auto)")
        return Launch(acc, devices, num_nodes, strategy, per_node, "ranks", external.rank, external.local_rank,
                      external.launcher, tuple(notes))
    per_node = processes_per_node(acc, devices)
    world = per_node * num_nodes
    if _spawn_like(strategy) or (strategy == "auto" and world > 1 and num_nodes == 1):
        if strategy == "auto":
            strategy = "ddp_spawn"
        if num_nodes > 1:
            raise UserError(f"--strategy {strategy} starts its workers from this process and works on one node; for "
                            f"--num-nodes {num_nodes} use --strategy ddp (the same command on every node with "
                            f"MASTER_ADDR, MASTER_PORT and NODE_RANK set), torchrun or SLURM srun")
        return Launch(acc, devices, num_nodes, strategy, per_node, "spawn")
    if world == 1:
        return Launch(acc, devices, num_nodes, strategy, per_node, "single")
    if strategy == "auto":
        strategy = "ddp"
    if not is_script_strategy(strategy):
        raise UserError(f"--strategy {strategy!r} is not supported for generation; use auto, ddp or ddp_spawn")
    local = int(env.get("LOCAL_RANK", 0) or 0)
    node = int(env.get("NODE_RANK", 0) or 0)
    if node >= num_nodes:
        raise UserError(f"NODE_RANK={node} but --num-nodes {num_nodes}: node ranks run from 0 to {num_nodes - 1}")
    return Launch(acc, devices, num_nodes, strategy, per_node, "ranks", node * per_node + local, local, "lightning")


def _launched_from(env: Mapping[str, str]) -> LaunchedEnv | None:
    """:func:`launched_env` for an explicit environment mapping (tests): torchrun's variables only."""
    if "TORCHELASTIC_RUN_ID" in env and int(env.get("WORLD_SIZE", "1")) > 1:
        world = int(env["WORLD_SIZE"])
        return LaunchedEnv("torchrun", int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)),
                           int(env.get("GROUP_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world)))
    return None


class RankChannel:
    """Rank 0's messages to the other ranks of a ``ranks`` launch: one ``broadcast_object_list`` per message.

    Rank 0 sends ``{"kind": "generate", ...}`` before each generation it runs (the other ranks then call the same
    ``run_generation``), and ``{"kind": "done"}`` (or ``"abort"``) when there is nothing more to generate."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.closed = False
        self.sent = 0

    def send(self, message: dict) -> None:
        import torch.distributed as dist

        if self.closed:
            raise RuntimeError("the other ranks were already released (done); no generation can follow")
        dist.broadcast_object_list([message], src=0)
        self.sent += 1

    def receive(self) -> dict:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self, kind: str = "done") -> None:
        """Release the other ranks (rank 0; idempotent)."""
        if self.closed or not self.launch.is_rank_zero:
            return
        self.send({"kind": kind})
        self.closed = True


@contextlib.contextmanager
def started_ranks(launch: Launch, log: Callable[[str], None] = print) -> Iterator[RankChannel | None]:
    """In mode ``ranks``: start this node's other processes (when Lightning's launcher is the one to start them),
    join the process group, and yield the :class:`RankChannel`; on the way out rank 0 releases the others (``done``,
    or ``abort`` after an error) and every rank leaves the process group. Other modes: yields None.

    Starting the processes here, before anything is generated, rather than inside the first ``Trainer.predict``,
    lets rank 0 tell the others which arm to generate (or that every arm was reused) before any generation."""
    if launch.mode != "ranks":
        yield None
        return
    import torch.distributed as dist

    import lightning.pytorch as pl

    if not dist.is_initialized():
        trainer = pl.Trainer(accelerator=launch.accelerator, devices=launch.devices, num_nodes=launch.num_nodes,
                             strategy=launch.strategy, logger=False, enable_checkpointing=False,
                             enable_model_summary=False, enable_progress_bar=False)
        strategy = trainer.strategy
        if strategy.launcher is not None:
            strategy.launcher.launch(lambda: None)  # Lightning's launcher starts the other processes of this node
        strategy.setup_environment()  # joins the process group (Lightning's Trainers reuse it)
        if int(strategy.global_rank) != launch.rank:
            raise RuntimeError(f"Lightning sees this process as rank {strategy.global_rank}, the study as rank "
                               f"{launch.rank}; check LOCAL_RANK / NODE_RANK / RANK")
    if launch.is_rank_zero:
        log(f"{launch.world_size} processes ({launch.processes_per_node} per node on {launch.num_nodes} node(s), "
            f"{launch.launcher} launch, strategy {launch.strategy}); rank 0 writes the results")
    channel = RankChannel(launch)
    try:
        yield channel
        if launch.is_rank_zero:
            channel.close("done")
    except Exception:
        # rank 0 failed outside a generation: the other ranks wait for a message; tell them to stop. (Ctrl-C and
        # exits are not Exceptions: Lightning / torchrun stop the other processes themselves then.)
        if launch.is_rank_zero and not channel.closed:
            with contextlib.suppress(Exception):
                channel.close("abort")
        raise
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
