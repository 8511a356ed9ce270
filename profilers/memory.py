"""Peak memory per scale: measured on CUDA, an analytic estimate from tensor sizes on CPU.

Two sources, never mixed in one column:

* **CUDA, measured** — :class:`PeakMemoryTracer` resets the allocator's peak counter in ``scale_begin`` and reads
  ``torch.cuda.max_memory_allocated`` in ``scale_end`` (no synchronisation: allocator statistics are host-side).
  ``peak_bytes`` is the highest amount of memory held by tensors at any time during the scale (weights, KV
  cache, activations and the allocator's rounding included); ``delta_peak_bytes`` subtracts what was allocated
  when the scale began. The generation-wide peak is kept across those resets (the counter is reset when the
  tracer is made, folded in before every reset and read again by ``report`` after ``generate`` returned), so
  ``MemoryReport.peak_bytes`` includes the text encoder before the first scale and the VAE decode after the last;
  ``reserved_bytes`` is ``torch.cuda.max_memory_reserved`` over the same window (what the caching allocator held).
  Requires ``torch.cuda.is_available()`` and a CUDA model.

* **Analytic (any device; the only option on CPU)** — :func:`analytic_memory` derives from the generation's
  records, per scale, the bytes of the tensors that dominate memory:

  - ``kv_cache_bytes``: keys + values the cache *holds* after the scale: ``Σ_blocks 2·K_b·C·e`` with ``K_b``
    the block's accumulated valid keys summed over rows — ``R·n`` per scale for a rectangle of ``R`` rows and
    ``n`` kept tokens, the record's ``packed_tokens`` when the rows were ragged (the packed cache stores each
    row's valid keys only, issue 16; ``e``: element size);
  - ``kv_reserved_bytes``: what :class:`~var_core.engine.kvcache.KVCache` actually allocates (it pre-allocates
    ``2·R·C·L_max·e`` per block at the block's first append, ``L_max`` = all tokens of all scales, and keeps that
    storage when guidance rows are dropped), so on a real allocator this, not ``kv_cache_bytes``, is resident;
    where the records carry the buffers' slots (``ScaleRecord.kv_slots``: rows × capacity per block during the
    scale) it is ``Σ_blocks 2·slots_b·C·e`` instead, which honours a KV policy's eviction (the cache then
    re-allocates each evicted block at the kept keys plus the tokens still to come);
  - activation tensors of the scale: ``hidden`` ``[R, N, C]``, ``qkv`` ``[R, n, 3C]``, ``mlp_hidden``
    ``[R, n, H_m]``, ``attn_scores`` ``[R, H, n, L]`` (only for blocks that ran eager attention — pass
    ``eager_attention``; the fused SDPA kernels never materialise it), ``logits`` ``[R, N, V]`` in fp32 (the head
    casts to float) — and ``largest_activation_bytes``, the largest of them;
  - ``estimate_bytes = weights + kv_reserved + 2·hidden + largest_activation``: a lower-bound style estimate
    of the live set at the scale's peak (weights, the cache, the residual stream and the branch output, plus
    the largest transient). It ignores allocator fragmentation, the sampler's temporaries (a few ``[B, N, V]``
    fp32 tensors while filtering), and the kept-token gather copies.

HART (family ``"hart"``): the cache also holds the ``context_token − 1`` context keys besides the loop's tokens
(``ArchSpec.prefix_len``; the first scale's activations are those of every context token), and
``MemoryReport.components`` reports the parts separately: ``transformer_weight_bytes`` (without the diffusion
head), ``diffusion_weight_bytes``, ``tokenizer_weight_bytes`` and ``diffusion_activation_bytes`` (the diffusion
head's live set during a step after the last scale, :func:`hart_diffusion_activation_bytes`).

Use the analytic numbers to compare scales and policies (they follow the kept-token counts exactly); use the
CUDA numbers for absolute peaks.

Bytes moved and the bandwidth-aware ideal (issue 16). :func:`op_bytes` gives, for every op of a FLOP report, the
bytes it streams (a linear op: its weight once plus its input and output rows; attention: the cached keys or
values it reads plus its queries), :func:`roofline_seconds` the modelled time of a generation on a
:class:`Roofline` (sustained GEMM FLOP/s and weight-streaming bytes/s, :func:`calibrate_roofline` measures them on
the model's own GEMM shape) and :func:`bandwidth_aware_ideal` the speedup a method could reach at that roofline.
The FLOPs-only ideal assumes time ∝ FLOPs; at batch 1 every scale streams all block weights whatever its token
count, so a method that keeps few tokens per scale (LD-Pruning) cannot approach it — the bandwidth-aware ideal
says how far it can.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

from var_core.engine.context import GuidanceMode, ScaleRecord
from var_core.engine.tracing import Tracer

from .flops import ArchSpec, arch_from_adapter

__all__ = ["MemoryReport", "PeakMemoryTracer", "Roofline", "ScaleMemory", "analytic_memory", "bandwidth_aware_ideal",
           "bytes_moved", "calibrate_roofline", "hart_diffusion_activation_bytes", "hart_weight_bytes", "linear_dims",
           "op_bytes", "roofline_seconds", "weight_bytes"]


@dataclass(frozen=True)
class ScaleMemory:
    scale: int
    source: str  # "cuda-measured" or "analytic"
    rows: int = 0
    tokens: int = 0
    peak_bytes: int = 0  # measured (CUDA) or estimate_bytes (analytic)
    delta_peak_bytes: int = 0  # CUDA: peak minus allocated at scale start; analytic: estimate minus weights
    kv_cache_bytes: int = 0
    kv_reserved_bytes: int = 0
    hidden_bytes: int = 0
    qkv_bytes: int = 0
    mlp_hidden_bytes: int = 0
    attn_scores_bytes: int = 0
    logits_bytes: int = 0
    largest_activation: str = ""
    largest_activation_bytes: int = 0


@dataclass
class MemoryReport:
    """Per-scale memory (see the module docstring for what each field is)."""

    scales: list[ScaleMemory] = field(default_factory=list)
    weight_bytes: int = 0
    source: str = "analytic"
    # HART: the parts reported separately (transformer / diffusion head / tokenizer weights, the diffusion head's
    # largest live activations after the last scale); empty for the other families
    components: dict = field(default_factory=dict)
    # CUDA-measured: the whole generation (text encoder, every scale, VAE decode) — allocated and reserved by the
    # caching allocator; 0 where not measured (analytic reports)
    overall_peak_bytes: int = 0
    overall_reserved_bytes: int = 0

    def frame(self):
        import pandas as pd

        columns = list(ScaleMemory.__dataclass_fields__)
        return pd.DataFrame([tuple(getattr(s, c) for c in columns) for s in self.scales], columns=columns)

    @property
    def peak_bytes(self) -> int:
        return max(max((s.peak_bytes for s in self.scales), default=0), self.overall_peak_bytes)

    @property
    def reserved_bytes(self) -> int:
        """Peak memory the CUDA caching allocator held (``max_memory_reserved``; 0 where not measured)."""
        return self.overall_reserved_bytes

    def to_dict(self) -> dict:
        out = {"source": self.source, "weight_bytes": self.weight_bytes, "peak_bytes": self.peak_bytes,
               "scales": [s.__dict__ for s in self.scales]}
        if self.overall_reserved_bytes:
            out["reserved_bytes"] = self.overall_reserved_bytes
        if self.components:
            out["components"] = dict(self.components)
        return out


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers."""
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


class PeakMemoryTracer(Tracer):
    """Measures CUDA peak memory per scale (a no-op recorder on machines without CUDA: use
    :func:`analytic_memory` there). Spans are not instrumented (``span`` is the null context)."""

    enabled = False  # spans cost nothing; only the scale hooks do work

    def __init__(self, device: torch.device | str | None = None):
        self.active = torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if self.active else torch.device("cpu"))
        if self.active and self.device.index is None:  # "cuda": the current device, named once
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._start: dict[int, int] = {}
        self.scales: list[ScaleMemory] = []
        self.overall_peak_bytes = 0
        self.overall_reserved_bytes = 0
        if self.active:  # the generation is measured from here: text encoder, every scale, the VAE decode
            torch.cuda.reset_peak_memory_stats(self.device)

    def reset(self) -> None:
        self._start.clear()
        self.scales = []
        self.overall_peak_bytes = self.overall_reserved_bytes = 0
        if self.active:
            torch.cuda.reset_peak_memory_stats(self.device)

    def _fold_overall(self) -> None:
        """Keep the generation-wide peaks before the counters are reset (and at the end): what ran between scales
        — the text encoder before the first, the VAE decode after the last — counts too."""
        self.overall_peak_bytes = max(self.overall_peak_bytes, int(torch.cuda.max_memory_allocated(self.device)))
        self.overall_reserved_bytes = max(self.overall_reserved_bytes,
                                          int(torch.cuda.max_memory_reserved(self.device)))

    def scale_begin(self, scale: int) -> None:
        if not self.active:
            return
        self._fold_overall()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._start[scale] = torch.cuda.memory_allocated(self.device)

    def scale_end(self, scale: int) -> None:
        if not self.active:
            return
        peak = torch.cuda.max_memory_allocated(self.device)
        start = self._start.pop(scale, 0)
        self.scales.append(ScaleMemory(scale, "cuda-measured", peak_bytes=peak, delta_peak_bytes=peak - start))

    def report(self, weights: int = 0) -> MemoryReport:
        """Per-scale peaks plus the whole generation's (call after ``generate`` returned: the decode is in)."""
        if self.active:
            self._fold_overall()
        return MemoryReport(list(self.scales), weights, "cuda-measured", overall_peak_bytes=self.overall_peak_bytes,
                            overall_reserved_bytes=self.overall_reserved_bytes)


def _rows(guidance: GuidanceMode, batch_size: int) -> int:
    return batch_size * (2 if guidance is GuidanceMode.BOTH else 1)


def analytic_memory(
    adapter_or_arch,
    records: Sequence[ScaleRecord],
    batch_size: int,
    activation_bytes: int | None = None,
    eager_attention: Mapping[int, Iterable[int]] | None = None,
    weights: int | None = None,
) -> MemoryReport:
    """Per-scale analytic memory of a finished generation (see the module docstring).

    Args:
        adapter_or_arch: the engine adapter or an :class:`~profilers.flops.ArchSpec`.
        activation_bytes: element size of activations / cache (default: the weights' element size).
        eager_attention: scale → blocks that materialised attention probabilities (policies that observe
            attention); their ``[R, H, n, L]`` score tensor counts as an activation.
        weights: weight bytes to add (default: the adapter's transformer + VQVAE parameters; 0 for an ArchSpec).
    """
    components: dict = {}
    if isinstance(adapter_or_arch, ArchSpec):
        arch, weights = adapter_or_arch, (weights or 0)
    else:
        arch = arch_from_adapter(adapter_or_arch)
        if arch.family == "hart":
            components = hart_weight_bytes(adapter_or_arch)
            if weights is None:
                weights = sum(components.values())
        if weights is None:
            weights = weight_bytes(adapter_or_arch.var) + weight_bytes(adapter_or_arch.vae) \
                if hasattr(adapter_or_arch, "var") else 0
    e = activation_bytes or arch.param_bytes
    C, H, V = arch.embed_dim, arch.num_heads, arch.head_out
    try:
        attn_index = arch.branches.index("attn")
    except ValueError:
        attn_index = None
    eager_attention = eager_attention or {}
    kv_len = [0] * arch.depth  # per block: tokens appended (the rectangle's width), for the attention scores
    kv_keys = [0] * arch.depth  # per block: valid keys held, summed over rows
    reserved_rows = [0] * arch.depth  # rows of each block's buffers at its first append (kept after a row drop:
    # KVCache.select_rows slices views, so the storage is not released)
    L_max = arch.total_tokens + arch.prefix_len
    report = MemoryReport(weight_bytes=weights, source="analytic", components=dict(components))
    for record in records:
        if record.skipped:
            continue
        si = record.scale_index
        N = record.hw[0] * record.hw[1]
        R = _rows(record.guidance, batch_size)
        kept = record.kept_tokens or tuple((N,) * len(arch.branches) for _ in range(arch.depth))
        if si == 0 and arch.prefix_len:  # HART's first scale runs every context token
            kept = tuple(tuple(n + arch.prefix_len for n in counts) for counts in kept)
            N = N + arch.prefix_len
        max_n = max((n for counts in kept for n in counts), default=N)
        scores = 0
        eager = set(eager_attention.get(si, ()))
        for block, counts in enumerate(kept):
            if attn_index is not None:
                kv_len[block] += counts[attn_index]
                packed = record.packed_tokens[block][attn_index] if record.packed_tokens else None
                kv_keys[block] += packed if packed is not None else R * counts[attn_index]
                if not reserved_rows[block] and counts[attn_index] > 0:
                    reserved_rows[block] = R
                if block in eager:
                    scores = max(scores, R * H * counts[attn_index] * kv_len[block] * e)
        kv_used = sum(2 * keys * C * e for keys in kv_keys)
        kv_reserved = sum(2 * rows * L_max * C * e for rows in reserved_rows)
        if getattr(record, "kv_slots", ()):  # measured buffer sizes: an eviction re-allocated smaller buffers
            kv_reserved = sum(2 * slots * C * e for slots in record.kv_slots)
        sizes = {
            "hidden": R * N * C * e,
            "qkv": R * max_n * 3 * C * e,
            "mlp_hidden": R * max_n * arch.mlp_hidden * e,
            "attn_scores": scores,
            "logits": R * N * V * 4,
        }
        largest = max(sizes, key=sizes.get)
        estimate = weights + kv_reserved + 2 * sizes["hidden"] + sizes[largest]
        report.scales.append(ScaleMemory(
            scale=si, source="analytic", rows=R, tokens=N, peak_bytes=estimate, delta_peak_bytes=estimate - weights,
            kv_cache_bytes=kv_used, kv_reserved_bytes=kv_reserved, hidden_bytes=sizes["hidden"],
            qkv_bytes=sizes["qkv"], mlp_hidden_bytes=sizes["mlp_hidden"], attn_scores_bytes=sizes["attn_scores"],
            logits_bytes=sizes["logits"], largest_activation=largest, largest_activation_bytes=sizes[largest],
        ))
        if arch.diff_steps > 0 and si == len(arch.scale_hw) - 1:
            report.components["diffusion_activation_bytes"] = hart_diffusion_activation_bytes(
                arch, R if record.guidance is GuidanceMode.BOTH else batch_size, N, e)
    return report


def two_model_memory(drafter, result, batch_size: int, eager_attention=None) -> MemoryReport:
    """Analytic memory of a generation that switched models (``var_core.engine.switch``, CoDe): the drafter's scales
    on its architecture, the refiner's prefill and scales on its own (the drafter's KV cache is released at the
    switch, the refiner's starts with the prefilled scales); both models' weights stay resident throughout."""
    refiner, at = result.refiner, int(result.switch_scale)
    weights = sum(weight_bytes(m) for a in (drafter, refiner) for m in (getattr(a, "var", None), getattr(a, "vae", None))
                  if m is not None)
    first = analytic_memory(drafter, [r for r in result.records if r.scale_index < at], batch_size,
                            eager_attention=eager_attention, weights=weights)
    second = analytic_memory(refiner, [*result.prefill, *(r for r in result.records if r.scale_index >= at)],
                             batch_size, eager_attention=eager_attention, weights=weights)
    return MemoryReport(scales=first.scales + second.scales, weight_bytes=weights)


def hart_weight_bytes(adapter) -> dict[str, int]:
    """HART's weights by part: the transformer without its diffusion head, the diffusion head, the tokenizer."""
    model = adapter.model
    diffusion = weight_bytes(model.diffloss)
    return {"transformer_weight_bytes": weight_bytes(model) - diffusion, "diffusion_weight_bytes": diffusion,
            "tokenizer_weight_bytes": weight_bytes(adapter.tokenizer)}


def hart_diffusion_activation_bytes(arch: ArchSpec, rows: int, tokens: int, e: int) -> int:
    """The diffusion head's largest live set during one step, ``n = rows·tokens`` net rows: the conditions ``[n, C]``
    and ``y``, ``h``, the block's modulation ``[n, 3W]`` and MLP hidden ``[n, W]``, the output ``[n, 2·C_vae]`` and
    the running ``x`` ``[n, C_vae]`` (the condition embedding is recomputed at every step, as in the official
    ``forward``)."""
    n = rows * tokens
    W, C, c = arch.diff_width, arch.embed_dim, arch.latent_channels
    return n * (C + 3 * W + 3 * W + 3 * c) * e


# ----- bytes moved and the bandwidth-aware ideal ------------------------------------------------------------
#: ops that read a KV (or text) cache instead of a weight matrix: attention scores and values
ATTENTION_OPS = frozenset({"scores", "pv", "text_pool_attn", "qk"})  # qk: attention statistics (attn_stats)
ROOFLINE_RULES = ("sum", "max")


@dataclass(frozen=True)
class Roofline:
    """A machine's matrix throughput and memory bandwidth, for :func:`roofline_seconds`.

    ``peak_flops`` (FLOP/s) and ``bandwidth`` (bytes/s) are what the machine sustains on this workload's GEMMs
    (:func:`calibrate_roofline` measures both on the model's own shapes). ``rule`` combines an op's compute time
    ``F/P`` and memory time ``bytes/W``: ``sum`` (default; a GEMM first streams and packs its weight panel, then
    computes, so small-row matmuls cost their weights plus their rows — what CPU BLAS timings show) or ``max``
    (the classic roofline: perfect overlap, a lower bound)."""

    peak_flops: float
    bandwidth: float
    rule: str = "sum"
    source: str = "given"

    def __post_init__(self) -> None:
        if self.rule not in ROOFLINE_RULES:
            raise ValueError(f"unknown roofline rule {self.rule!r}; choose one of {ROOFLINE_RULES}")
        if self.peak_flops <= 0 or self.bandwidth <= 0:
            raise ValueError(f"roofline needs positive peak_flops and bandwidth, got {self.peak_flops}, "
                             f"{self.bandwidth}")

    def seconds(self, flops: float, nbytes: float) -> float:
        compute, memory = flops / self.peak_flops, nbytes / self.bandwidth
        return compute + memory if self.rule == "sum" else max(compute, memory)

    def describe(self) -> str:
        return (f"roofline({self.source}: {self.peak_flops / 1e9:.1f} GFLOP/s, {self.bandwidth / 1e9:.1f} GB/s, "
                f"rule={self.rule})")


def linear_dims(arch: ArchSpec, component: str, op: str) -> tuple[int, int, int] | None:
    """``(K, N, matrices)`` of the weight(s) behind a FLOP-report op (``K → N`` per matrix, ``matrices`` of them),
    or None for an op without a weight matrix (attention) or one this model does not size (then only its FLOPs
    count: Infinity's text pooling, HART's diffusion head)."""
    C, Hm, V, c = arch.embed_dim, arch.mlp_hidden, arch.head_out, arch.latent_channels
    table = {
        ("attn", "qkv"): (C, 3 * C, 1), ("attn", "proj"): (C, C, 1),
        ("cross", "q"): (C, C, 1), ("cross", "proj"): (C, C, 1), ("cross", "kv"): (C, 2 * C, 1),
        ("ffn", "fc1"): (C, Hm, 1), ("ffn", "fc2"): (Hm, C, 1), ("ffn", "fc1_gate"): (C, 2 * Hm, 1),
        ("head", "adaln"): (C, 2 * C, 1), ("head", "logits"): (C, V, 1),
        ("lens", "adaln"): (C, 2 * C, 1), ("lens", "logits"): (C, V, 1),
        ("embed", "word_embed"): (c, C, 1),
        ("condition", "adaln_modulation"): (C, 6 * C, 1 if arch.shared_aln else arch.depth),
        ("latent_update", "phi_conv"): (9 * c, c, 1),  # a 3x3 conv as im2col GEMM: (9·c) → c per output pixel
    }
    return table.get((component, op))


def op_bytes(arch: ArchSpec, row, element_bytes: int | None = None) -> tuple[int, int]:
    """``(weight_bytes, activation_bytes)`` one :class:`~profilers.flops.FlopRow` moves.

    A linear op streams its weight once (``K·N·e`` per matrix) and reads/writes ``M·(K + N)·e`` of activations, with
    ``M = flops / (2·K·N·matrices)`` the rows it really computed (exact for packed ragged rows too). Attention
    (``scores``, ``pv``) streams the keys (values) it attends to, ``rows·kv_len·C·e``, plus its queries (outputs)
    ``rows·tokens·C·e``. Element size ``e``: ``arch.param_bytes`` unless given."""
    e = element_bytes or arch.param_bytes
    if row.op in ATTENTION_OPS:
        return 0, e * arch.embed_dim * row.rows * (row.kv_len + row.tokens)
    dims = linear_dims(arch, row.component, row.op)
    if dims is None or row.flops == 0:
        return 0, 0
    K, N, matrices = dims
    M = row.flops / (2 * K * N * matrices)
    return e * K * N * matrices, int(round(e * M * (K + N) * matrices))


def bytes_moved(report) -> int:
    """Bytes every op of a :class:`~profilers.flops.FlopReport` streams, summed (see :func:`op_bytes`)."""
    return sum(sum(op_bytes(report.arch, row)) for row in report.rows)


def roofline_seconds(report, roofline: Roofline, components: Iterable[str] | None = None) -> float:
    """Modelled time of a generation: every op of ``report`` at ``roofline.seconds(flops, bytes)`` (only the
    given ``components`` if any). Element-wise work (norms, softmax, sampling) is outside the model, as it is
    outside the FLOPs count."""
    wanted = None if components is None else set(components)
    total = 0.0
    for row in report.rows:
        if wanted is not None and row.component not in wanted:
            continue
        total += roofline.seconds(row.flops, sum(op_bytes(report.arch, row)))
    return total


def bandwidth_aware_ideal(baseline_report, method_report, roofline: Roofline) -> float:
    """The speedup a method could reach if every op ran at the roofline: modelled baseline time / modelled method
    time. Unlike the FLOPs-only ideal (baseline FLOPs / method FLOPs) it charges every scale for the weights it
    streams, which pruning does not reduce: a batch-1 scale of few tokens costs at least its weights."""
    return roofline_seconds(baseline_report, roofline) / roofline_seconds(method_report, roofline)


def calibrate_roofline(shape: tuple[int, int] = (1024, 4096), rows: tuple[int, int] = (16, 256),
                       matrices: int = 16, repeats: int = 3, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu", rule: str = "sum") -> Roofline:
    """Measure a :class:`Roofline` on this machine with GEMMs of the model's shape (``K × N`` weights, e.g.
    VAR-d16's ``fc1``): ``matrices`` distinct weights (more bytes than the last-level cache, as a generation's
    blocks are) multiplied in turn by ``rows[0]`` and ``rows[1]`` rows; the time per matrix is fitted as
    ``bytes/W + flops/P`` through the two sizes (best of ``repeats``). A few hundred ms of matmuls."""
    import time

    K, N = shape
    device = torch.device(device)
    weights = [torch.randn(N, K, dtype=dtype, device=device) for _ in range(matrices)]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def per_matrix(m: int) -> float:
        x = torch.randn(m, K, dtype=dtype, device=device)
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass warms up
            sync()
            start = time.perf_counter()
            for w in weights:
                torch.nn.functional.linear(x, w)
            sync()
            best = min(best, (time.perf_counter() - start) / matrices)
        return best

    small, large = rows
    t_small, t_large = per_matrix(small), per_matrix(large)
    e = torch.tensor([], dtype=dtype).element_size()
    per_row = max((t_large - t_small) / (large - small), 1e-12)  # seconds per GEMM row: compute
    peak = 2 * K * N / per_row
    weight_time = max(t_small - small * per_row, 1e-9)  # the intercept: streaming the weight
    return Roofline(peak, K * N * e / weight_time, rule, source=f"measured {K}x{N} GEMM rows {small}/{large}")
