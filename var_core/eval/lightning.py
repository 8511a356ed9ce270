"""Lightning-wrapped generation over a condition set: per-sample seeds, any accelerator / devices / strategy.

``run_generation(adapter, conditions, ...)`` is the one entry point the ablation runner (and sweeps) call. It runs
``Trainer.predict`` with a :class:`GenerationModule` (one policy, one sampling config) over a
:class:`GenerationDataModule` (class labels with per-sample seeds) and returns a :class:`GenerationRun` sorted by
sample index.

Reproducibility contract
------------------------
* Sample ``i``'s seed is :func:`sample_seed` ``(base_seed, i)``, a hash, so it depends on neither the batch size
  nor the number of devices, and each sample draws from its own generator (the engine's per-sample generators).
* Batches are cut from the index order first and then dealt round-robin to the processes (whole batches), so a
  sample sits in the same batch with the same neighbours whatever the number of processes: DDP on N processes
  returns exactly the records one process does. At the end of ``predict`` every process's per-sample results go
  to global rank 0 through the process group (``gather_object``; no folder is shared between nodes); rank 0
  merges them and sorts by sample index (duplicates, if any, are dropped).
* Where it runs is one decision, :func:`var_core.eval.distributed.resolve_launch` (accelerator ``auto`` decided
  once, Lightning's ``devices`` forms, ``num_nodes``, the strategy, torchrun / SLURM). With ``devices > 1`` on one
  node and ``strategy="auto"`` the ``ddp_spawn`` strategy is used: the caller's process stays the only one that
  continues after ``predict``. With ``ddp`` (Lightning's launcher re-runs the command in every process), torchrun
  or SLURM every process calls this function; rank 0 gets the run, the other ranks ``None``.
* The model stays on the device it ran on: Lightning's strategy teardown moves the module back to the CPU after
  ``predict``; :class:`GenerationModule` keeps it where it ran in the calling process, so work done after
  ``predict`` (the runner's interleaved re-timing) runs on the device the user asked for. Each process's record
  (``GenerationRun.processes``) says what actually ran: device, device name, dtype, attention backend, threads.

What is timed
-------------
Only the ``generate()`` call of each batch (the transformer, the policy's hooks, sampling, the VQ decode and the
spans of any attached tracer), between two clock reads with a device synchronisation before each on CUDA. Outside:
data loading, moving labels to the device, the ``warmup`` generations each process runs first (discarded), copying
results to the host, the per-scale entropy statistics, and any probe's ``after_batch`` work.

Profilers attach from above through *probes* (``var_core`` never imports ``profilers``): any object with
``tracer() -> Tracer | None`` (called per batch; the tracer is handed to ``generate``) and
``after_batch(result, adapter=..., policy=..., batch_size=..., seconds=...) -> dict | None`` (JSON-able per-batch
measurements, stored in ``GenerationRun.batches[i]["probes"][probe.name]``). Extra Lightning callbacks pass
straight through to the Trainer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, TQDMProgressBar

from ..engine import GenerationOptions, Policy, SamplingConfig, generate
from ..engine.adapters.base import adapter_modules
from ..errors import UserError, writing
from ..engine.tracing import NULL_TRACER, CompositeTracer, Tracer
from .distributed import Launch, resolve_launch

__all__ = [
    "ConditionSet", "ConditionDataset", "GenerationDataModule", "GenerationModule", "GenerationRun",
    "TracerProbe", "run_generation", "sample_seed", "TIMED_REGION", "ResultFileError", "load_shard", "RUN_FORMAT",
]

TIMED_REGION = ("generate() per batch: transformer + policy hooks + sampling + VQ decode + attached tracer spans; "
                "synchronised on CUDA; excludes warm-up generations, data loading, host copies, metrics")

_QUIET_WARNINGS = (
    r".*does not have many workers.*",
    r".*treespec, LeafSpec.*",
    r".*GPU available but not used.*",
    r".*predict_dataloader.*",
    r".*Consider setting `persistent_workers=True`.*",
)


def _quiet_lightning() -> None:
    for pattern in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
                 "lightning.pytorch.accelerators.cuda"):
        logging.getLogger(name).setLevel(logging.WARNING)


# ----- conditions ------------------------------------------------------------------------------------------
def sample_seed(base_seed: int, index: int) -> int:
    """The seed of sample ``index`` in a run seeded ``base_seed`` (63-bit, a hash of both numbers)."""
    digest = hashlib.blake2b(f"varscope-sample/{int(base_seed)}/{int(index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class ConditionSet:
    """Class labels with per-sample seeds derived from ``base_seed`` and the sample index; for text-to-image
    models optionally a prompt per sample (``prompts``, with its ``tags`` / ``categories`` and ``prompt_ids``, the
    prompt's position in its prompt file; see :meth:`from_prompts`)."""

    labels: tuple[int, ...]
    base_seed: int = 0
    prompts: tuple[str, ...] | None = None
    tags: tuple[str | None, ...] | None = None
    categories: tuple[str | None, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None

    @staticmethod
    def balanced(num_samples: int, num_classes: int, base_seed: int = 0) -> "ConditionSet":
        """Labels ``i mod num_classes`` (balanced; any prefix is as balanced as possible)."""
        if num_samples < 1:
            raise ValueError(f"need at least one sample, got {num_samples}")
        if num_classes < 1:
            raise ValueError(f"need at least one class, got {num_classes}")
        return ConditionSet(tuple(i % num_classes for i in range(num_samples)), int(base_seed))

    @staticmethod
    def from_prompts(prompts, num_samples: int | None = None, base_seed: int = 0, tags=None,
                     categories=None) -> "ConditionSet":
        """Sample ``i`` uses prompt ``i mod P`` (its repeat number is ``i // P``), so the first ``P`` samples
        cover every prompt once and ``num_samples = 4·P`` gives GenEval's four images per prompt; ``None``: one
        sample per prompt. ``labels`` hold the prompt's position (``prompt_ids``)."""
        prompts = tuple(str(p) for p in prompts)
        if not prompts:
            raise ValueError("need at least one prompt")
        n = len(prompts) if num_samples is None else int(num_samples)
        if n < 1:
            raise ValueError(f"need at least one sample, got {n}")
        P = len(prompts)
        ids = tuple(i % P for i in range(n))

        def per_sample(values):
            if values is None:
                return None
            values = tuple(values)
            if len(values) != P:
                raise ValueError(f"{len(values)} tags/categories for {P} prompts")
            return tuple(None if values[j] is None else str(values[j]) for j in ids)

        return ConditionSet(ids, int(base_seed), tuple(prompts[j] for j in ids), per_sample(tags),
                            per_sample(categories), ids)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def seeds(self) -> list[int]:
        return [sample_seed(self.base_seed, i) for i in range(len(self.labels))]

    def inputs(self, indices: Sequence[int], device=None):
        """What ``generate`` takes for the samples ``indices``: their prompts, or their labels as a tensor."""
        if self.prompts is not None:
            return [self.prompts[i] for i in indices]
        return torch.tensor([self.labels[i] for i in indices], dtype=torch.long, device=device)

    def content_hash(self) -> str:
        """Identifies the sample set (labels, seeds and any prompts) in result records."""
        data: dict[str, Any] = {"labels": list(self.labels), "base_seed": self.base_seed, "seed_fn": "blake2b/v1"}
        if self.prompts is not None:  # label-only sets keep the hash they always had
            data.update(prompts=list(self.prompts), tags=None if self.tags is None else list(self.tags),
                        categories=None if self.categories is None else list(self.categories),
                        prompt_ids=None if self.prompt_ids is None else list(self.prompt_ids))
        payload = json.dumps(data)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        out = {"n": len(self.labels), "base_seed": self.base_seed, "labels": list(self.labels),
               "seeds": self.seeds, "seed_rule": "blake2b('varscope-sample/{base_seed}/{index}') & (2^63-1)",
               "hash": self.content_hash()}
        if self.prompts is not None:
            out.update(prompts=list(self.prompts), tags=None if self.tags is None else list(self.tags),
                       categories=None if self.categories is None else list(self.categories),
                       prompt_ids=None if self.prompt_ids is None else list(self.prompt_ids))
        return out


class ConditionDataset(Dataset):
    """Items ``{"index", "label", "seed"}`` of a :class:`ConditionSet` (and ``"prompt"`` when it has prompts)."""

    def __init__(self, conditions: ConditionSet):
        self.conditions = conditions
        self._seeds = conditions.seeds

    def __len__(self) -> int:
        return len(self.conditions)

    def __getitem__(self, index: int) -> dict:
        item = {"index": index, "label": self.conditions.labels[index], "seed": self._seeds[index]}
        if self.conditions.prompts is not None:
            item["prompt"] = self.conditions.prompts[index]
        return item


def shard_indices(num_samples: int, batch_size: int, rank: int, world_size: int) -> list[int]:
    """Sample indices of one process: whole batches of the index order, dealt round-robin."""
    batches = [list(range(s, min(s + batch_size, num_samples))) for s in range(0, num_samples, batch_size)]
    return [i for b, batch in enumerate(batches) if b % world_size == rank for i in batch]


class GenerationDataModule(pl.LightningDataModule):
    """Serves a :class:`ConditionSet` for ``Trainer.predict``; shards whole batches itself (set the Trainer's
    ``use_distributed_sampler=False``, as :func:`run_generation` does)."""

    def __init__(self, conditions: ConditionSet, batch_size: int, skip_first: Sequence[int] = ()):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.conditions = conditions
        self.batch_size = int(batch_size)
        self.skip_first = frozenset(int(i) for i in skip_first)  # first indices of batches already on disk

    def predict_dataloader(self) -> DataLoader:
        rank, world = 0, 1
        if self.trainer is not None:
            rank, world = self.trainer.global_rank, self.trainer.world_size
        dataset = ConditionDataset(self.conditions)
        if self.skip_first:  # resuming: the remaining whole batches (same cut, same neighbours), dealt round-robin
            starts = [s for s in range(0, len(dataset), self.batch_size) if s not in self.skip_first]
            mine = [i for b, s in enumerate(starts) if b % world == rank
                    for i in range(s, min(s + self.batch_size, len(dataset)))]
        else:
            mine = shard_indices(len(dataset), self.batch_size, rank, world)
        subset = Subset(dataset, mine)
        return DataLoader(subset, batch_size=self.batch_size, shuffle=False, num_workers=0)


# ----- tracing -------------------------------------------------------------------------------------------------
class TracerProbe:
    """A probe that only hands a fresh tracer (from ``factory()``) to every timed batch."""

    name = "tracer"

    def __init__(self, factory: Callable[[], Tracer]):
        self.factory = factory

    def tracer(self) -> Tracer:
        return self.factory()


def _combine(tracers: Sequence[Tracer | None]) -> Tracer:
    tracers = [t for t in tracers if t is not None]
    if not tracers:
        return NULL_TRACER
    return tracers[0] if len(tracers) == 1 else CompositeTracer(*tracers)


# ----- the module --------------------------------------------------------------------------------------------
def _scale_entropy_B(record, family: str) -> torch.Tensor | None:
    if record.skipped or record.guided_logits_BNV is None:
        return None
    from ..accel.entropy import predictive_entropy

    return predictive_entropy(record.guided_logits_BNV, family).mean(-1)


class GenerationModule(pl.LightningModule):
    """Generates one batch of conditions per ``predict_step`` with one policy and one sampling config.

    Args:
        adapter: an engine adapter (``var_core.zoo.load_model``); its modules (``adapter.modules()``: every
            module holding a tensor generation reads) become sub-modules, so Lightning moves them to each
            process's device.
        policy_config: a ``var_core.accel.PolicyConfig`` built into a fresh policy in every process; ``None``
            with no ``policy_factory`` runs the plain loop.
        policy_factory: instead, a picklable callable returning a ``var_core.engine.Policy``.
        warmup: discarded generations each process runs before the first timed batch.
        warmup_batch_size: samples per warm-up generation.
        probes: see the module docstring.
    """

    def __init__(self, adapter, *, policy_config=None, policy_factory: Callable[[], Policy] | None = None,
                 sampling: SamplingConfig = SamplingConfig(), options: GenerationOptions | None = None,
                 warmup: int = 1, warmup_batch_size: int = 1, probes: Sequence[Any] = (),
                 keep_tokens: bool = True, threads: int | None = None, stay_on_device: bool = False):
        super().__init__()
        self.adapter = adapter
        modules = adapter.modules() if callable(getattr(adapter, "modules", None)) else adapter_modules(adapter)
        self.models = torch.nn.ModuleDict(modules)
        self.stay_on_device = bool(stay_on_device)
        self.policy_config = policy_config
        self.policy_factory = policy_factory
        self.sampling = sampling
        self.options = options
        self.warmup = int(warmup)
        self.warmup_batch_size = int(warmup_batch_size)
        self.probes = list(probes)
        self.keep_tokens = keep_tokens
        self.threads = threads
        self.policy: Policy | None = None
        self.switch = None  # engine.switch.ModelSwitch when the policy config names a refiner (on_predict_start)

    def setup(self, stage: str) -> None:
        _quiet_lightning()

    def cpu(self):
        """Lightning's strategy teardown calls ``cpu()`` after ``predict``; with ``stay_on_device`` (the calling
        process is a rank: single process, ``ddp``, torchrun) the modules stay on the device they ran on, so the
        caller's later work (re-timing, records) happens there and not on the CPU. ``.to("cpu")`` still moves."""
        if self.stay_on_device:
            return self
        return super().cpu()

    def _build_policy(self) -> Policy:
        if self.policy_factory is not None:
            return self.policy_factory()
        if self.policy_config is None:
            return Policy()
        from ..accel.policy import build_policy

        return build_policy(self.policy_config)

    def _sync(self) -> None:
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.synchronize(self.device)

    def _options(self) -> GenerationOptions:
        if self.options is not None:
            return self.options
        # the finiteness check is one reduction per scale; it forces a sync on CUDA, so only CPU keeps it
        return GenerationOptions(check_finite=self.device.type == "cpu")

    def on_predict_start(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(int(self.threads))
        for probe in self.probes:  # probes time and measure memory on this process's device (CUDA events or CPU)
            if callable(getattr(probe, "bind", None)):
                probe.bind(self.device)
        self.policy = self._build_policy()
        from .twomodel import model_switch_for  # a config naming a second model (CoDe's refiner): load it here

        self.switch = model_switch_for(self.policy_config, self.adapter) if self.policy_config is not None else None
        num_classes = getattr(getattr(self.adapter, "cfg", None), "num_classes", 1) or 1
        for w in range(self.warmup):
            labels = torch.arange(self.warmup_batch_size, device=self.device) % num_classes
            seeds = [(1 << 62) + w * 1000 + i for i in range(self.warmup_batch_size)]
            generate(self.adapter, labels, seeds=seeds, sampling=self.sampling, policy=self.policy,
                     options=GenerationOptions(check_finite=True), switch=self.switch)
        self._sync()

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        indices = [int(i) for i in batch["index"]]
        labels = batch["label"].to(self.device)
        seeds = [int(s) for s in batch["seed"]]
        B = len(indices)
        tracer = _combine([probe.tracer() for probe in self.probes if hasattr(probe, "tracer")])
        self._sync()
        t0 = time.perf_counter_ns()
        conditions = list(batch["prompt"]) if "prompt" in batch else labels  # text-to-image prompt sets
        result = generate(self.adapter, conditions, seeds=seeds, sampling=self.sampling, policy=self.policy,
                          tracer=tracer, options=self._options(), switch=self.switch)
        self._sync()
        seconds = (time.perf_counter_ns() - t0) / 1e9
        probe_data = {}
        for probe in self.probes:
            if hasattr(probe, "after_batch"):
                data = probe.after_batch(result, adapter=self.adapter, policy=self.policy, batch_size=B,
                                         seconds=seconds)
                if data is not None:
                    probe_data[getattr(probe, "name", type(probe).__name__)] = data
        family = getattr(self.adapter, "family", "var")
        entropy = torch.full((B, len(result.records)), float("nan"))
        tokens: list[list[torch.Tensor | None]] = [[] for _ in range(B)]
        for s, record in enumerate(result.records):
            ent = _scale_entropy_B(record, family)
            if ent is not None:
                entropy[:, s] = ent.float().cpu()
            for b in range(B):
                tokens[b].append(None if (record.tokens_BN is None or not self.keep_tokens)
                                 else record.tokens_BN[b].detach().cpu().clone())
        activation = None
        scales_fn = getattr(self.policy, "activation_scales", None)
        if callable(scales_fn):
            act = scales_fn()
            if act is not None:
                activation = [int(v) for v in act.cpu()]
        images = None
        if result.images is not None:
            images = result.images.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).cpu()
        history = [dict(h) for h in getattr(self.policy, "history", [])]
        return {
            "indices": indices, "labels": [int(v) for v in batch["label"]], "seeds": seeds,
            "images_u8": images, "tokens": tokens, "entropy": entropy, "activation_scale": activation,
            "batch": {
                "rank": int(self.global_rank), "batch_idx": int(batch_idx), "indices": indices, "size": B,
                "seconds": seconds, "stopped_at": result.stopped_at,
                "kept_tokens": [list(map(list, r.kept_tokens)) for r in result.records],
                "valid_tokens": [_row_mean_kept(r) for r in result.records],
                "guidance": [r.guidance.value for r in result.records],
                "skipped": [bool(r.skipped) for r in result.records],
                "history": _jsonable(history), "probes": probe_data,
            },
        }


def _row_mean_kept(record) -> list[list[float]]:
    """Per block, per branch: the tokens a network row kept, averaged over the rows. A ragged selection counts
    each row's own tokens (``valid_tokens_R``), not the padded width in ``kept_tokens``, so a sample's count is
    the same alone and inside any batch."""
    out = []
    for block, counts in enumerate(record.kept_tokens):
        valid = record.valid_tokens_R[block] if record.valid_tokens_R else (None,) * len(counts)
        out.append([float(n) if v is None else int(v.sum()) / v.numel() for n, v in zip(counts, valid)])
    return out


def _plain(value):
    """A copy made only of what ``torch.load(weights_only=True)`` reads back (dict / list / tuple, numbers,
    strings, ``None``, tensors): numpy values become numbers or tensors, any other object its ``str``."""
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int)) else str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if type(value) in (list, tuple) else [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def process_environment(trainer, pl_module) -> dict:
    """What one process actually ran on: rank, host, device and its name, dtype, attention backend, threads."""
    import platform

    from .environment import attention_backend, device_name, model_dtype

    adapter = getattr(pl_module, "adapter", None)
    device = pl_module.device
    return {
        "rank": int(trainer.global_rank), "world_size": int(trainer.world_size),
        "local_rank": int(getattr(trainer, "local_rank", 0)), "node_rank": int(getattr(trainer, "node_rank", 0)),
        "hostname": platform.node(), "device": str(device), "device_name": device_name(device),
        "dtype": model_dtype(adapter) if adapter is not None else None,
        "attention_backend": attention_backend(adapter, device) if adapter is not None else None,
        "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
    }


class _ShardCollector(Callback):
    """Keeps this process's per-batch outputs; at the end they reach global rank 0 (``gather_object`` when there
    are several processes), which writes one ``<folder>/rank<r>.pt`` per process."""

    def __init__(self, folder: str, spool: str | Path | None = None):
        self.folder = folder
        self.spool = None if spool is None else Path(spool)  # batches go to disk as they finish (issue 26)
        self.outputs: list[dict] = []
        self.spooled: list[str] = []

    def on_predict_start(self, trainer, pl_module) -> None:
        from ..engine.attention import sdpa_kernels_run

        self.outputs = []
        sdpa_kernels_run(reset=True)  # the SDPA kernel count is per process: this arm's calls only (issue 27)
        self.environment = process_environment(trainer, pl_module)

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        # the module sets its threads in its own on_predict_start, which Lightning calls after this callback's
        self.environment["threads"] = torch.get_num_threads()
        self.environment["interop_threads"] = torch.get_num_interop_threads()
        adapter = getattr(pl_module, "adapter", None)
        if adapter is not None:  # the SDPA kernels this arm's batches ran so far (counter reset at predict start)
            from ..engine.attention import sdpa_kernels_run
            from .environment import attention_backend

            self.environment["attention_backend"] = attention_backend(adapter, pl_module.device)
            self.environment["sdpa_kernels"] = {k: v for k, v in sdpa_kernels_run().items()
                                                if k.split(":", 1)[0] == pl_module.device.type}
        ran = getattr(adapter, "precision_ran", None)
        if ran:  # --precision as generate() entered it (var_core.engine.precision)
            self.environment.update(ran)
        if self.spool is not None:  # memory O(batch): the batch is on disk, nothing of it is kept here
            from .metrics import release_freed_memory
            from .store import write_batch

            self.spooled.append(write_batch(self.spool, outputs, self.environment).name[:-len(".json")])
            release_freed_memory()  # the batch's freed activations back to the OS: the peak is one batch's, not a drift
            return
        self.outputs.append(outputs)

    def on_predict_end(self, trainer, pl_module) -> None:
        if self.spool is not None:
            self._gather_spool(trainer)
            return
        # plain containers, numbers, strings and tensors only: the caller reads it back with weights_only=True
        shard = _plain({"environment": self.environment, "outputs": self.outputs})
        shards = [shard]
        if trainer.world_size > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"{trainer.world_size} processes but no process group to gather results")
            gathered = [None] * trainer.world_size if trainer.global_rank == 0 else None
            dist.gather_object(shard, gathered, dst=0)
            if trainer.global_rank != 0:
                return
            shards = gathered
        for one in shards:
            path = Path(self.folder) / f"rank{int(one['environment']['rank'])}.pt"
            tmp = path.with_suffix(".tmp")
            torch.save(one, tmp)
            os.replace(tmp, path)


    def _gather_spool(self, trainer) -> None:
        """Every rank wrote its batches into its spool folder as they finished; rank 0 receives the other ranks'
        batches one at a time (a folder is not shared between nodes), so it never holds more than one batch per
        process. Rank 0 then writes the processes' environments as ``<folder>/environment.json``."""
        from .store import read_batch, write_batch

        environments = [self.environment]
        if trainer.world_size > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"{trainer.world_size} processes but no process group to gather results")
            rank0 = trainer.global_rank == 0
            counts = [None] * trainer.world_size
            dist.all_gather_object(counts, (self.environment, len(self.spooled)))
            environments = [c[0] for c in counts]
            for k in range(max(c[1] for c in counts)):
                mine = read_batch(self.spool, self.spooled[k]) if k < len(self.spooled) and not rank0 else None
                got = [None] * trainer.world_size if rank0 else None
                dist.gather_object(_plain(mine), got, dst=0)
                if rank0:
                    for one in got:
                        if one is not None and not (self.spool / f"{batch_name_of(one)}.json").exists():
                            write_batch(self.spool, one, one.get("environment"))
            if not rank0:
                return
        path = Path(self.folder) / "environment.json"
        path.write_text(json.dumps(_jsonable(environments)))


def batch_name_of(out: dict) -> str:
    from .store import batch_name

    return batch_name(int(out["indices"][0]))


class _NamedProgressBar(TQDMProgressBar):
    def __init__(self, description: str):
        super().__init__(leave=True)
        self.description = description

    def init_predict_tqdm(self):
        bar = super().init_predict_tqdm()
        bar.set_description(self.description)
        return bar

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        super().on_predict_batch_start(trainer, pl_module, batch, batch_idx, dataloader_idx)
        self.predict_progress_bar.set_description(self.description)


class PlainProgress(Callback):
    """Progress as whole lines, for logs: ``<label>: batch k/n, i images, s elapsed, ETA`` after the first batch,
    then at most every ``every_seconds`` and after the last one (global rank 0 only). No carriage returns, so a
    log file or a pipe receives one readable line per report instead of a terminal bar's ``\\r`` redraws. Written
    to ``stream`` (default: ``sys.stdout`` at the time of writing, in order with the runner's own lines)."""

    def __init__(self, description: str, every_seconds: float = 30.0, stream=None):
        self.description = description
        self.every_seconds = float(every_seconds)
        self.stream = stream
        self._start = self._last = 0.0
        self._images = 0

    def _write(self, line: str) -> None:
        import sys

        stream = self.stream if self.stream is not None else sys.stdout
        print(line, file=stream, flush=True)

    def on_predict_start(self, trainer, pl_module):
        self._start = self._last = time.perf_counter()
        self._images = 0

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if not trainer.is_global_zero:
            return
        index = batch.get("index") if isinstance(batch, dict) else None
        self._images += int(len(index)) if index is not None else 0
        total = trainer.num_predict_batches[dataloader_idx] if trainer.num_predict_batches else None
        done = batch_idx + 1
        now = time.perf_counter()
        last = total is not None and done >= total
        if not (done == 1 or last or now - self._last >= self.every_seconds):
            return
        self._last = now
        elapsed = now - self._start
        line = f"{self.description}: batch {done}/{total if total is not None else '?'}"
        if self._images:
            line += f", {self._images} images"
        line += f", {elapsed:.1f} s"
        if total is not None and not last and done:
            line += f", ETA {elapsed / done * (total - done):.0f} s"
        self._write(line)


def _stream_is_terminal(stream) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed or file-like objects without isatty
        return False


def progress_callback(description: str, *, stream=None) -> Callback:
    """The progress reporter of a run: Lightning's bar when it draws on a terminal (tqdm writes to ``sys.stderr``),
    else :class:`PlainProgress` lines (a log file, a pipe, a notebook capture). ``VARSCOPE_PROGRESS=bar`` /
    ``plain`` forces one."""
    import sys

    forced = os.environ.get("VARSCOPE_PROGRESS", "").strip().lower()
    if forced == "bar" or (forced != "plain" and _stream_is_terminal(sys.stderr)):
        return _NamedProgressBar(description)
    return PlainProgress(description, stream=stream)


# ----- the run ---------------------------------------------------------------------------------------------
@dataclass
class GenerationRun:
    """All samples of one policy, sorted by sample index."""

    indices: list[int]
    labels: torch.Tensor  # [n] int64
    seeds: list[int]
    images_u8: torch.Tensor | None  # [n, 3, H, W] uint8
    tokens: list[list[torch.Tensor | None]]  # [n][num_scales]
    entropy: np.ndarray  # [n, num_scales] mean predictive entropy per scale (NaN: skipped / not generated)
    activation_scale: list[int | None]  # first accelerated scale per sample (num_scales = never), if known
    batches: list[dict]  # per batch: rank, indices, size, seconds, kept tokens, history, probe data
    processes: list[dict]  # per process: rank, device, threads
    wall_seconds: float = 0.0  # the whole Trainer.predict call (incl. start-up and warm-up)
    warmup_batch_size: int = 0  # samples per discarded warm-up generation in each process
    resumed_batches: int = 0  # batches read back from a spool a killed run left (not generated by this call)
    # the spool folder its images and tokens are read from, batch by batch (var_core.eval.store.SpoolImages /
    # SpoolTokens); None: held in memory (runs without a spool, index files of format varscope.run/1)
    samples_dir: Path | None = None

    @property
    def images(self) -> torch.Tensor | None:
        """A float copy of all images (memory 12 bytes per pixel: in-memory runs only, e.g. sweeps' small sets)."""
        return None if self.images_u8 is None else self.images_u8[:].float() / 255.0

    @staticmethod
    def from_spool(folder: str | Path, environments: list | None = None) -> "GenerationRun":
        """The run a finished spool holds, its images and tokens read from the folder on demand (issue 26)."""
        from .store import read_spool

        data = read_spool(folder)
        envs = [e for e in (environments if environments is not None else data["environments"]) if e]
        by_rank = {int(e.get("rank", 0)): e for e in envs}
        return GenerationRun(data["indices"], data["labels"], data["seeds"], data["images_u8"], data["tokens"],
                             data["entropy"], data["activation_scale"], data["batches"],
                             [by_rank[r] for r in sorted(by_rank)], samples_dir=Path(folder))

    def move_samples(self, folder: str | Path) -> None:
        """Rename the spool folder this run reads from to ``folder`` (an arm's finished ``.samples``)."""
        folder = Path(folder)
        if self.samples_dir is None or Path(self.samples_dir) == folder:
            return
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(self.samples_dir, folder)
        self.samples_dir = folder
        for view in (self.images_u8, self.tokens):
            if hasattr(view, "layout"):
                view.layout.folder = folder

    def __len__(self) -> int:
        return len(self.indices)

    def tensors(self) -> dict:
        """What :meth:`save` writes: plain containers, numbers and tensors (no pickled objects). A run read from
        a spool (``samples_dir``) writes an index (format ``varscope.run/2``): its per-sample numbers and the name
        of its samples folder, which holds the images and tokens batch by batch."""
        if self.samples_dir is not None:
            return {"format": INDEX_FORMAT, "indices": [int(i) for i in self.indices], "labels": self.labels,
                    "seeds": [int(s) for s in self.seeds], "images_u8": None, "tokens": None,
                    "samples": Path(self.samples_dir).name,
                    "entropy": torch.from_numpy(np.ascontiguousarray(self.entropy)),
                    "activation_scale": [None if a is None else int(a) for a in self.activation_scale]}
        return {"format": RUN_FORMAT, "indices": [int(i) for i in self.indices], "labels": self.labels,
                "seeds": [int(s) for s in self.seeds], "images_u8": self.images_u8, "tokens": self.tokens,
                "entropy": torch.from_numpy(np.ascontiguousarray(self.entropy)),
                "activation_scale": [None if a is None else int(a) for a in self.activation_scale]}

    def content_hash(self) -> str:
        """SHA-256 (hex, 16 digits) of the samples: indices, labels, seeds, images, tokens, entropy, activation.

        Two runs have the same hash exactly when :meth:`save` would store the same numbers; records keep it to
        tie a record to its tensor file and an arm to the baseline it was measured against."""
        digest = hashlib.sha256()

        def add(value) -> None:
            if isinstance(value, torch.Tensor):
                t = value.detach().cpu().contiguous()
                digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
                # the buffer itself, not a bytes copy of it (a whole arm's images at once)
                digest.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
            elif isinstance(value, (list, tuple)):
                digest.update(f"L{len(value)}".encode())
                for v in value:
                    add(v)
            else:
                digest.update(f"V{value!r};".encode())

        def add_images(images) -> None:  # batch by batch: the same bytes as the whole tensor's buffer
            digest.update(f"T{images.dtype}{tuple(images.shape)}".encode())
            for part in images.batches():
                digest.update(part.contiguous().reshape(-1).numpy())

        blob = self.tensors()
        for key in ("indices", "labels", "seeds", "images_u8", "tokens", "entropy", "activation_scale"):
            digest.update(key.encode())
            value = getattr(self, key) if key in ("images_u8", "tokens") else blob[key]
            if hasattr(value, "batches"):
                add_images(value)
            elif key == "tokens" and not isinstance(value, list):  # a spool's tokens, sample by sample
                digest.update(f"L{len(value)}".encode())
                for row in value:
                    add(row)
            else:
                add(value)
        return digest.hexdigest()[:16]

    def save(self, path: str | Path) -> Path:
        """Tensors needed to compare later arms against this one (atomic: temporary file, fsync, rename; an
        interruption leaves the previous file, or none, and no temporary file)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with writing(path):  # a full disk / read-only folder: an OSError naming path (torch's writer loses it)
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(tmp, "wb") as handle:
                    torch.save(self.tensors(), handle)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):  # on a read-only file system even this fails: keep the first error
                tmp.unlink(missing_ok=True)
            raise
        return path

    @staticmethod
    def load(path: str | Path) -> "GenerationRun":
        """Read a file written by :meth:`save` with ``torch.load(weights_only=True)``: no pickled code runs.

        Raises :class:`ResultFileError` (a ``UserError`` naming the file) when it cannot be read or does not hold
        what :meth:`save` writes (damaged, truncated, from another program, or crafted)."""
        path = Path(path)
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ResultFileError(path, "the file does not exist") from None
        except Exception as exc:  # noqa: BLE001 - UnpicklingError (objects other than tensors), zip errors, EOF
            raise ResultFileError(path, f"torch.load(weights_only=True) refused it, so nothing in it was run "
                                        f"({type(exc).__name__}: {_load_error_reason(exc)})") from None
        try:
            if isinstance(blob, dict) and blob.get("format") == INDEX_FORMAT:
                return _index_run(path, blob)
            return GenerationRun._from_blob(blob)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ResultFileError(path, f"it does not hold a generation run ({type(exc).__name__}: {exc})") from None

    @staticmethod
    def _from_blob(blob) -> "GenerationRun":
        if not isinstance(blob, dict):
            raise TypeError(f"top level is {type(blob).__name__}, expected dict")
        indices = [int(i) for i in blob["indices"]]
        n = len(indices)
        labels, entropy, images = blob["labels"], blob["entropy"], blob["images_u8"]
        if not isinstance(labels, torch.Tensor) or labels.shape != (n,):
            raise ValueError(f"labels must be a tensor of shape ({n},)")
        if not isinstance(entropy, torch.Tensor) or entropy.dim() != 2 or entropy.shape[0] != n:
            raise ValueError(f"entropy must be a tensor of shape ({n}, scales)")
        if images is not None and (not isinstance(images, torch.Tensor) or images.dtype != torch.uint8
                                   or images.dim() != 4 or images.shape[0] != n):
            raise ValueError(f"images_u8 must be a uint8 tensor of shape ({n}, 3, H, W) or None")
        tokens = blob["tokens"]
        if not isinstance(tokens, list) or len(tokens) != n or not all(
                isinstance(row, list) and all(t is None or isinstance(t, torch.Tensor) for t in row)
                for row in tokens):
            raise ValueError(f"tokens must be {n} lists of tensors / None")
        seeds = [int(s) for s in blob["seeds"]]
        activation = [None if a is None else int(a) for a in blob["activation_scale"]]
        if len(seeds) != n or len(activation) != n:
            raise ValueError(f"seeds and activation_scale must have {n} entries")
        return GenerationRun(indices, labels, seeds, images, tokens, entropy.numpy(), activation, [], [])


RUN_FORMAT = "varscope.run/1"  # one file holding every image and token of the arm (before issue 26; still read)
INDEX_FORMAT = "varscope.run/2"  # an index beside the arm's samples folder (batch files, var_core.eval.store)


def _index_run(path: Path, blob: dict) -> "GenerationRun":
    """The run an index file (:data:`INDEX_FORMAT`) names: its samples folder, read batch by batch."""
    from .store import SpoolError

    name = str(blob["samples"])
    if "/" in name or "\\" in name or name in ("", ".", ".."):
        raise ValueError(f"samples folder {name!r} is not a plain name")
    folder = path.parent / name
    if not folder.is_dir() or folder.is_symlink():
        raise ResultFileError(path, f"its samples folder {folder} is missing")
    try:
        run = GenerationRun.from_spool(folder)
    except SpoolError as exc:
        raise ResultFileError(path, f"its samples folder cannot be read ({exc.path.name}: {exc.reason})") from None
    if run.indices != [int(i) for i in blob["indices"]]:
        raise ResultFileError(path, f"its samples folder {folder.name} holds other samples than the index")
    return run


def _load_error_reason(exc: BaseException) -> str:
    """The informative part of a ``torch.load`` error, on one line (torch's advice to retry with
    ``weights_only=False`` is exactly what must not be done with a results file, so it is left out)."""
    lines = []
    for line in str(exc).splitlines():
        line = line.strip()
        if not line or line.startswith(("Weights only load failed", "Check the documentation")):
            continue
        if "WeightsUnpickler error:" in line:
            line = line.split("WeightsUnpickler error:", 1)[1].strip()
            if not line:
                continue
        lines.append(line)
    text = "; ".join(lines) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


class ResultFileError(UserError):
    """A tensor file of a results folder that cannot be read safely (its ``path`` and the ``reason``)."""

    def __init__(self, path: str | Path, reason: str):
        self.path = Path(path)
        self.reason = reason
        fix = ("re-run the study with the same --out to recompute it" if not self.path.exists() else
               "move it away (a study re-run with the same --out does that itself) and re-run to recompute it")
        super().__init__(f"cannot read {self.path}: {reason}; {fix}")


def load_shard(path: str | Path) -> dict:
    """One process's results shard (written by ``_ShardCollector``), read with ``weights_only=True``."""
    shard = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(shard, dict) or not isinstance(shard.get("outputs"), list) \
            or not isinstance(shard.get("environment"), dict):
        raise RuntimeError(f"result shard {path} does not hold {{'environment', 'outputs'}}")
    return shard


def _merge(shards: list[dict], outputs=None) -> GenerationRun:
    if outputs is None:
        outputs = [o for shard in shards for o in shard["outputs"]]
    samples: dict[int, tuple] = {}
    batches = []
    for out in outputs:
        batches.append(out["batch"])
        for j, idx in enumerate(out["indices"]):
            if idx in samples:
                continue  # a padded duplicate
            act = out["activation_scale"][j] if out["activation_scale"] is not None else None
            img = out["images_u8"][j] if out["images_u8"] is not None else None
            samples[idx] = (out["labels"][j], out["seeds"][j], img, out["tokens"][j], out["entropy"][j], act)
    order = sorted(samples)
    num_scales = max((samples[i][4].shape[0] for i in order), default=0)
    entropy = np.full((len(order), num_scales), np.nan)
    for row, i in enumerate(order):
        e = samples[i][4].numpy()
        entropy[row, :e.shape[0]] = e
    images = None
    if order and samples[order[0]][2] is not None:
        images = torch.stack([samples[i][2] for i in order])
    batches.sort(key=lambda b: (b["indices"][0] if b["indices"] else -1))
    return GenerationRun(
        indices=order, labels=torch.tensor([samples[i][0] for i in order], dtype=torch.long),
        seeds=[samples[i][1] for i in order], images_u8=images, tokens=[samples[i][3] for i in order],
        entropy=entropy, activation_scale=[samples[i][5] for i in order], batches=batches,
        processes=sorted((shard["environment"] for shard in shards), key=lambda e: e["rank"]),
    )


def run_generation(adapter, conditions: ConditionSet, *, policy_config=None, policy_factory=None,
                   sampling: SamplingConfig = SamplingConfig(), batch_size: int = 16, warmup: int = 1,
                   warmup_batch_size: int | None = None, accelerator: str = "cpu",
                   devices: int | str | list[int] = 1, strategy: str = "auto",
                   num_nodes: int = 1, probes: Sequence[Any] = (), callbacks: Sequence[Callback] = (),
                   progress: bool | str = True, options: GenerationOptions | None = None, keep_tokens: bool = True,
                   threads: int | None = None, tracer_factory: Callable[[], Tracer] | None = None,
                   launch: Launch | None = None, spool: str | Path | None = None,
                   skip_first: Sequence[int] | None = None) -> GenerationRun | None:
    """Generate every condition with one policy through ``Trainer.predict`` and return the merged samples.

    ``accelerator`` / ``devices`` / ``num_nodes`` / ``strategy``: see :mod:`var_core.eval.distributed` (or pass the
    resolved ``launch``). Returns ``None`` on the ranks other than global rank 0 of a ``ddp`` / torchrun / SLURM
    launch (every rank calls this function; the run is rank 0's).

    ``progress``: ``False`` for no progress, ``True`` or a string (the label): Lightning's bar on a terminal, plain
    lines when the output goes to a file or a pipe (:func:`progress_callback`).
    ``tracer_factory``: shorthand for a probe that only supplies a fresh tracer per batch.
    ``warmup_batch_size``: samples per discarded warm-up generation (``None``: a full batch, which also warms the
    allocator at the timed shapes; a process that already generated at this batch size only needs the policy's own
    code paths run once, for which one sample does).
    ``threads``: intra-op threads set in every process (``None``: leave them; Lightning gives each DDP process on
    the CPU ``cores / processes``). CPU kernels round differently with different thread counts (images differ in
    the 1e-5 range), so records are bit-identical across process counts only at equal thread counts.
    ``spool``: a folder (:mod:`var_core.eval.store`) each finished batch is written to as it finishes, so the
    processes hold one batch at a time; the batches already finished there (a killed run) are not generated
    again. The returned run is read back from it. ``skip_first``: the first sample indices of the batches to
    leave out (default: those finished in ``spool``); every process of a launch must pass the same.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    _quiet_lightning()
    if launch is None:  # torchrun / SLURM make ranks only of callers that say so (the runner passes its launch)
        launch = resolve_launch(accelerator, devices, num_nodes, strategy, external=False)
    module = GenerationModule(adapter, policy_config=policy_config, policy_factory=policy_factory,
                              sampling=sampling, options=options, warmup=warmup,
                              warmup_batch_size=min(warmup_batch_size or batch_size, batch_size, len(conditions)),
                              probes=probes,
                              keep_tokens=keep_tokens, threads=threads, stay_on_device=launch.mode != "spawn")
    previous_threads = torch.get_num_threads()
    if tracer_factory is not None:
        module.probes.append(TracerProbe(tracer_factory))
    done: list[str] = []
    if spool is not None:
        from .store import finished_batches, first_index

        done = finished_batches(spool)
    skip = [first_index(n) for n in done] if skip_first is None else [int(i) for i in skip_first]
    data = GenerationDataModule(conditions, batch_size, skip_first=skip)
    folder = tempfile.mkdtemp(prefix="varscope-predict-")
    collector = _ShardCollector(folder, spool=spool)
    remaining = len(set(range(0, len(conditions), batch_size)) - set(skip))
    all_callbacks: list[Callback] = [collector, *callbacks]
    reporter = progress_callback(progress if isinstance(progress, str) else "generating") if progress else None
    if reporter is not None:
        all_callbacks.append(reporter)
    try:
        trainer = pl.Trainer(accelerator=launch.accelerator, devices=launch.devices, strategy=launch.strategy,
                             num_nodes=launch.num_nodes, logger=False, enable_checkpointing=False,
                             enable_model_summary=False,
                             enable_progress_bar=isinstance(reporter, TQDMProgressBar), use_distributed_sampler=False,
                             inference_mode=True, callbacks=all_callbacks)
        start = time.perf_counter()
        if remaining > 0 or spool is None:
            with warnings.catch_warnings():
                _quiet_lightning()
                trainer.predict(module, datamodule=data, return_predictions=False)
        wall = time.perf_counter() - start
        if launch.mode == "ranks" and not launch.is_rank_zero:
            return None  # this rank's results went to rank 0
        if spool is not None:
            env_path = Path(folder) / "environment.json"
            environments = json.loads(env_path.read_text()) if env_path.is_file() else []
        else:
            shards = [load_shard(p) for p in sorted(Path(folder).glob("rank*.pt"))]
            world = trainer.world_size
            if len(shards) != world:
                raise RuntimeError(f"expected {world} result shards from the processes, found {len(shards)} in "
                                   f"{folder}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        torch.set_num_threads(previous_threads)
    if spool is not None:
        # the spool is the run: its images and tokens stay on disk and are read batch by batch (issue 26)
        run = GenerationRun.from_spool(spool, environments or None)
        run.resumed_batches = len(skip)
    else:
        run = _merge(shards)
    missing = set(range(len(conditions))) - set(run.indices)
    if missing:
        raise RuntimeError(f"{len(missing)} samples were not generated (e.g. {sorted(missing)[:5]})")
    run.wall_seconds = wall
    run.warmup_batch_size = module.warmup_batch_size if module.warmup else 0
    return run
