"""What the generation loop tells its hooks: the per-scale context, the per-scale plan, the scale records.

Everything here is read-only data. Hooks receive a :class:`ScaleContext` and return decisions
(:class:`ScalePlan`, kept-token indices, restored tensors); they never mutate loop state. See DESIGN.md,
"Hook slots".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class GuidanceMode(enum.Enum):
    """Which rows of the classifier-free-guidance batch are still computed.

    ``BOTH``: conditional rows ``[0, B)`` then unconditional rows ``[B, 2B)``. Once a scale runs with one
    half only, the dropped half's KV cache is gone, so the loop refuses to go back to ``BOTH``.
    """

    BOTH = "both"
    COND_ONLY = "cond_only"
    UNCOND_ONLY = "uncond_only"
    NONE = "none"  # the model never had an unconditional branch (e.g. Infinity with cfg == 1)

    @property
    def computes_cond(self) -> bool:
        return self in (GuidanceMode.BOTH, GuidanceMode.COND_ONLY, GuidanceMode.NONE)

    @property
    def computes_uncond(self) -> bool:
        return self in (GuidanceMode.BOTH, GuidanceMode.UNCOND_ONLY)


@dataclass(frozen=True)
class ScaleRecord:
    """What a finished scale left behind (references to tensors the loop computed anyway; no copies).

    Shapes use ``B`` for samples (not CFG rows). ``skipped`` scales carry ``None`` tensors.
    """

    scale_index: int
    hw: tuple[int, int]
    skipped: bool
    guidance: GuidanceMode
    tokens_BN: torch.Tensor | None = None  # sampled token ids (VAR) or packed bits (Infinity: [B, N, d])
    residual_BChw: torch.Tensor | None = None  # this scale's quantised residual map, at scale resolution
    guided_logits_BNV: torch.Tensor | None = None  # the logits the sampler saw (after guidance, before top-k/p)
    raw_logits_RNV: torch.Tensor | None = None  # head output per computed row, before guidance
    kept_tokens: tuple[tuple[int, ...], ...] = ()  # per block, per branch: tokens actually computed
    lens_rows: tuple[tuple[int, int], ...] = ()  # (block, rows projected by the head) of each logit-lens probe
    # per block, per branch: valid tokens summed over rows when the per-token work ran packed (ragged selections,
    # engine.packing), else None; empty when nothing was packed at this scale
    packed_tokens: tuple[tuple[int | None, ...], ...] = ()
    # per block, per branch: each network row's own kept-token count ``[R]`` (int64) where the selection was ragged
    # (``kept_tokens`` is then the padded width every row ran), else None; empty when no block was ragged
    valid_tokens_R: tuple[tuple[torch.Tensor | None, ...], ...] = ()
    # per block: query-key pairs the self-attention computed, summed over rows, for blocks whose rows were ragged
    # (engine.attention: varlen rows attend with their own valid queries to their own keys), else None; empty
    # when no block was ragged (attention is then the rectangle rows x queries x cached keys)
    attention_pairs: tuple[int | None, ...] = ()
    # per block: matrix FLOPs the attention statistics an observer read cost (AttentionProbe.flops: entropy,
    # received mass), 0 where nothing was read; empty when no block was observed
    attention_stats_flops: tuple[int, ...] = ()
    # the image decoded from the latent accumulated up to this scale, [B, 3, H, W] in [0, 1]; only when the plan
    # asked for it (ScalePlan.decode_latent: pixel-domain criteria such as LD-Pruning's |I_k - I_{k-1}|)
    image_B3HW: torch.Tensor | None = None
    # ((grid scale j, [B, 3, h_j·f, w_j·f] in [0, 1]), ...): the accumulated latent resized to scale j's latent grid
    # and decoded, one per scale the plan named in ScalePlan.preview_scales (ModelAdapter.decode_preview)
    previews_B3HW: tuple[tuple[int, torch.Tensor], ...] = ()
    # KV-cache bytes measured from the cache's tensors (engine.kvcache.apply_kv_policy): during this scale (what
    # its attention read), kept for later scales after the KV policy's eviction (valid entries), and the entries
    # the buffers hold for them (per-head padding included); None when no cache step ran (e.g. a skipped scale)
    kv_bytes_peak: int | None = None
    kv_bytes: int | None = None
    kv_bytes_stored: int | None = None
    # bytes the KV buffers hold allocated (their storages, KVCache.allocated_nbytes): during this scale and after
    # its eviction (smaller once an eviction re-allocated a block's buffers), and per block the token slots of the
    # key storage during the scale (rows x capacity; the analytic memory model's KV term)
    kv_bytes_allocated_peak: int | None = None
    kv_bytes_allocated: int | None = None
    kv_slots: tuple[int, ...] = ()
    # per block: kept keys per row this scale's attention read, for blocks a KV policy evicted (else None); empty
    # when no block was ever evicted (the FLOPs / bytes counters then follow the dense key count)
    attention_lengths: tuple[int | None, ...] = ()
    # a refiner's teacher-forced prefill pass over a scale another model generated (engine.switch): its blocks ran
    # on every token and cached their keys; no head, no sampling (``GenerationResult.prefill``)
    teacher_forced: bool = False


@dataclass(frozen=True)
class GenerationInfo:
    """Handed to ``Policy.start``: what a policy may need to size its per-generation state."""

    batch_size: int
    num_scales: int
    num_blocks: int
    branches: tuple[str, ...]
    scale_hw: tuple[tuple[int, int], ...]
    family: str
    guidance: GuidanceMode
    tracer: object  # a ``var_core.engine.tracing.Tracer``; components wrap their own work in its spans
    sampling: object = None  # the run's ``SamplingConfig`` (cfg, temperature, top-k/p) for components that need it
    # the model's own grouping of its blocks into chunks (Infinity's ``block_chunks``); None = the model has none
    block_chunks: int | None = None
    # True when the loop draws from one generator for the whole batch (``generate(shared_generator=...)`` or no
    # seeds: the official codes' behaviour); a component that draws may then use the same kind of source
    shared_generator: bool = False


@dataclass(frozen=True)
class ScaleContext:
    """The per-scale view handed to every hook (DESIGN.md, seam 2)."""

    scale_index: int
    num_scales: int
    hw: tuple[int, int]
    token_offset: int  # position of this scale's first token in the full (all-scales) sequence
    batch_size: int  # samples B
    guidance: GuidanceMode  # rows computed at this scale
    num_blocks: int
    branches: tuple[str, ...]
    family: str
    history: tuple[ScaleRecord, ...]  # one record per earlier scale, in order

    @property
    def num_tokens(self) -> int:
        return self.hw[0] * self.hw[1]

    @property
    def rows(self) -> int:
        """Number of network batch rows at this scale (2B with both CFG halves)."""
        return self.batch_size * (2 if self.guidance is GuidanceMode.BOTH else 1)

    @property
    def is_last(self) -> bool:
        return self.scale_index == self.num_scales - 1

    @property
    def previous(self) -> ScaleRecord | None:
        return self.history[-1] if self.history else None

    def last_computed(self) -> ScaleRecord | None:
        """The most recent earlier scale that was actually generated (not skipped)."""
        for record in reversed(self.history):
            if not record.skipped:
                return record
        return None


@dataclass(frozen=True)
class ScalePlan:
    """A policy's decision for one scale, and the costly observations it asks the loop to make.

    ``stop`` ends generation before this scale (the image is decoded from what has accumulated);
    ``skip`` leaves this scale out but continues with the next. ``guidance=None`` keeps the current mode.
    ``prune`` tells the loop to call ``plan_block`` for every branch of every block (otherwise: dense).
    """

    stop: bool = False
    skip: bool = False
    guidance: GuidanceMode | None = None
    prune: bool = False
    attention_blocks: frozenset[int] = frozenset()  # blocks whose attention probabilities are observed
    lens_blocks: frozenset[int] = frozenset()  # blocks whose output goes through the head (logit lens)
    observe_blocks: bool = False  # call observe_block with each block's input and output
    observe_branches: bool = False  # call observe_branch with each branch's full residual output
    # Per-sample guidance stop while the batch still computes both halves (bool [B]); a policy switches
    # ``guidance`` to COND_ONLY (a physical row drop, which saves compute) once every sample agrees.
    cond_only_B: torch.Tensor | None = None
    # decode the latent after this scale's update into ScaleRecord.image_B3HW (one VAE decode, traced as
    # "accel/decode"); for pixel-domain token criteria
    decode_latent: bool = False
    # decode the latent after this scale's update resized to the latent grid of each of these scales (a small,
    # cheap preview; ScaleRecord.previews_B3HW); for decisions read off a coarse image (SkipVAR's features)
    preview_scales: frozenset[int] = frozenset()


DENSE_PLAN = ScalePlan()
