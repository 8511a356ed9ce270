"""Component base classes (one per kind) and the per-generation signal board they share.

A policy is composed of one component of each kind (DESIGN.md, seam 3):

* :class:`Scorer` — per-token importance ``[R, N]`` or ``[B, N]`` (higher = keep);
* :class:`Activation` — per sample, whether acceleration is active at this scale;
* :class:`Schedule` — the linkage: how many tokens each row keeps at this (scale, block, branch);
* :class:`Restorer` — what the pruned slots of a residual-branch output receive;
* :class:`Guidance` — CFG kept / stopped (fixed or adaptive) / null-only;
* :class:`ScaleSkip` — whole scales left out;
* :class:`KVPolicy` — which cached keys stay for later scales (eviction, budgets; ``engine.kvcache``).

Components never call each other. What one computes and another reads (scale entropies, the activation scale,
attention entropies, layer entropies) goes through :class:`Signals`, which is reset at every ``start``.
Each component declares the costly observations it needs (attention probabilities of some blocks, the logit
lens, branch outputs); the composed policy asks the loop for exactly the union of those declarations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..engine.context import GenerationInfo, GuidanceMode, ScaleContext, ScaleRecord
from ..engine.lens_probe import LensProbe
from .entropy import predictive_entropy
from .knobs import ComponentConfig


@dataclass
class Signals:
    """Per-generation shared measurements. Keys are 0-indexed scale numbers ``si`` and block numbers."""

    info: GenerationInfo
    # predictive entropy of the distribution actually sampled at each finished scale, [B, N] (lazy, cached)
    _token_entropy: dict[int, torch.Tensor] = field(default_factory=dict)
    records: dict[int, ScaleRecord] = field(default_factory=dict)
    # first accelerated scale per sample (int64 [B]; num_scales = never), written by the Activation
    activation_scale_B: torch.Tensor | None = None
    # head-averaged attention entropy per query of (scale, block): [R, N] map of the scale (NaN where not computed)
    attention_entropy: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # logit-lens token entropy of (scale, block): [B, N] (or [R, N])
    lens_entropy: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # whether the policy prunes at the scale being planned (set before components' ``needs`` are asked)
    pruning_now: bool = False
    # free-form per-component scratch (namespaced by component name) for diagnostics the studies report
    extras: dict[str, object] = field(default_factory=dict)
    # the policy's granularity is 'chunk': one token selection per block chunk (:func:`block_chunk`), so a restorer
    # that restores a chunk's output acts at the chunk's last block (:func:`ends_block_chunk`)
    chunked_selection: bool = False

    def token_entropy(self, si: int) -> torch.Tensor | None:
        """``[B, N]`` predictive entropy of scale ``si``'s guided logits (None if skipped / not yet run)."""
        if si not in self._token_entropy:
            record = self.records.get(si)
            if record is None or record.skipped or record.guided_logits_BNV is None:
                return None
            with self.info.tracer.span("accel/entropy", si):
                self._token_entropy[si] = predictive_entropy(record.guided_logits_BNV, self.info.family)
        return self._token_entropy[si]

    def token_entropy_map(self, si: int) -> torch.Tensor | None:
        """``[B, h, w]`` version of :meth:`token_entropy`."""
        ent = self.token_entropy(si)
        if ent is None:
            return None
        h, w = self.info.scale_hw[si]
        return ent.view(ent.shape[0], h, w)


BLOCK_CHUNKS = 8  # chunks of a model without its own (Infinity-2B's block_chunks: 8 groups of consecutive blocks)


def block_chunk(block: int, num_blocks: int, chunks: int | None = None) -> int:
    """Index of the chunk holding ``block`` when the ``num_blocks`` blocks are split into ``chunks`` groups of
    consecutive blocks (StageVAR's unit). ``chunks``: the model's own count (``GenerationInfo.block_chunks``,
    Infinity's ``block_chunks``: 8 on the 2B, 2 on the tiny fixtures); None = :data:`BLOCK_CHUNKS` (``L/8`` each
    when 8 divides ``L``; otherwise sizes differ by at most one; with fewer than 8 blocks every block is its own
    chunk)."""
    count = BLOCK_CHUNKS if chunks is None else chunks
    return block * count // max(num_blocks, 1)


def ends_block_chunk(block: int, num_blocks: int, chunks: int | None = None) -> bool:
    """Whether ``block`` is the last block of its chunk (:func:`block_chunk`)."""
    return block == num_blocks - 1 or block_chunk(block + 1, num_blocks, chunks) != block_chunk(block, num_blocks,
                                                                                                chunks)


def last_block_of_chunk(block: int, num_blocks: int, chunks: int | None = None) -> int:
    """The last block of the chunk holding ``block``."""
    while not ends_block_chunk(block, num_blocks, chunks):
        block += 1
    return block


@dataclass(frozen=True)
class Needs:
    """Costly observations a component asks the loop for at one scale."""

    attention_blocks: frozenset[int] = frozenset()
    lens_blocks: frozenset[int] = frozenset()
    block_io: bool = False
    branch_outputs: bool = False
    logits: bool = False
    decoded_image: bool = False  # the latent decoded after this scale (ScaleRecord.image_B3HW): one VAE decode
    # the latent after this scale resized to these scales' latent grids and decoded (ScaleRecord.previews_B3HW)
    preview_scales: frozenset[int] = frozenset()

    def __or__(self, other: "Needs") -> "Needs":
        return Needs(self.attention_blocks | other.attention_blocks, self.lens_blocks | other.lens_blocks,
                     self.block_io or other.block_io, self.branch_outputs or other.branch_outputs,
                     self.logits or other.logits, self.decoded_image or other.decoded_image,
                     self.preview_scales | other.preview_scales)


NO_NEEDS = Needs()


class Component:
    """Base of every component: holds its frozen config; every hook defaults to doing nothing."""

    kind: ClassVar[str] = "?"
    name: ClassVar[str] = "?"

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass

    def __init__(self, config: "Component.Config | None" = None):
        self.config = config if config is not None else type(self).Config()
        if not isinstance(self.config, type(self).Config):
            raise TypeError(f"{self.kind} {self.name!r} expects {type(self).Config.__qualname__}, "
                            f"got {type(self.config).__qualname__}")

    # lifecycle ------------------------------------------------------------------------------------------
    def check_model(self, info: GenerationInfo) -> None:
        """Raise ``ValueError`` (saying how to fix it) if this configuration cannot run on the model ``info``
        describes — e.g. a scale number beyond its schedule. Studies call it for every arm before generating."""

    def start(self, info: GenerationInfo, signals: Signals) -> None:
        """Reset per-generation state (called before every generation)."""

    def needs(self, ctx: ScaleContext, signals: Signals) -> Needs:
        return NO_NEEDS

    # observations (called only when declared in ``needs``) ----------------------------------------------
    def observe_attention(self, ctx: ScaleContext, block: int, probs_RHnL: torch.Tensor,
                          keep_Rn: torch.Tensor | None, signals: Signals) -> None:
        pass

    def observe_lens(self, ctx: ScaleContext, block: int, lens: LensProbe, signals: Signals) -> None:
        pass

    def observe_block(self, ctx: ScaleContext, block: int, x_in_RNC: torch.Tensor, x_out_RNC: torch.Tensor,
                      signals: Signals) -> None:
        pass

    def observe_branch(self, ctx: ScaleContext, block: int, branch: str, out_RNC: torch.Tensor,
                       signals: Signals) -> None:
        pass

    def observe_logits(self, ctx: ScaleContext, raw_logits_RNV: torch.Tensor, signals: Signals) -> None:
        pass

    def end_scale(self, ctx: ScaleContext, record: ScaleRecord, signals: Signals) -> None:
        pass


class Scorer(Component):
    """Per-token importance; higher scores are kept."""

    def score(self, ctx: ScaleContext, block: int, branch: str, x_RNC: torch.Tensor, signals: Signals
              ) -> torch.Tensor:
        """``[R, N]`` (one score per network row) or ``[B, N]`` (one per sample, shared by its CFG rows)."""
        raise NotImplementedError

    def scores_per_scale(self) -> bool:
        """Whether :meth:`score` returns the same map for every block and branch of a scale (it reads earlier
        scales, not the block's input). With a schedule whose :meth:`Schedule.counts_per_scale` holds, the policy
        selects once per scale. Default False."""
        return False


class Activation(Component):
    """Decides per sample from which scale on acceleration is active."""

    def active_B(self, ctx: ScaleContext, signals: Signals) -> torch.Tensor:
        """bool ``[B]``: acceleration active for each sample at this scale."""
        raise NotImplementedError


class Schedule(Component):
    """The linkage: kept-token counts per row at a (scale, block, branch)."""

    def prunes_scale(self, ctx: ScaleContext, signals: Signals) -> bool:
        """Whether this schedule may prune anything at this scale (cheap; decides the loop's fast path)."""
        return True

    def skips_scale(self, ctx: ScaleContext, signals: Signals) -> bool:
        """Whether this scale is pruned 100 %, i.e. not generated (``fixed_table``'s ratio 1.0). The policy skips
        it when acceleration is active for every sample."""
        return False

    def keep_counts(self, ctx: ScaleContext, block: int, branch: str, scores_RN: torch.Tensor,
                    signals: Signals) -> torch.Tensor | None:
        """int64 ``[R]`` tokens to keep per row (N = dense), or None for a dense block."""
        raise NotImplementedError

    def counts_per_scale(self) -> bool:
        """Whether :meth:`keep_counts` depends on the scores alone (not on the block or branch). Default False."""
        return False

    def count_bound(self, ctx: ScaleContext, block: int, rows: int, signals: Signals
                    ) -> int | tuple[int, ...] | None:
        """A host-known upper bound of :meth:`keep_counts` at this block — one for every row, or one per row —
        known without reading anything the scale computed (``count_sync='bounded'`` runs that many tokens per row
        and masks the rest), or None (no bound: the policy reads the counts). Default None."""
        return None


class Restorer(Component):
    """Fills the pruned slots of a residual-branch output."""

    def forced_keep(self, ctx: ScaleContext, signals: Signals) -> torch.Tensor | None:
        """bool ``[N]`` of tokens that must always be computed (e.g. SparseVAR anchors), or None."""
        return None

    def restore(self, ctx: ScaleContext, block: int, branch: str, out_kept_RnC: torch.Tensor,
                keep_Rn: torch.Tensor, x_RNC: torch.Tensor, signals: Signals) -> torch.Tensor:
        raise NotImplementedError

    def projects_chunks(self) -> bool:
        """Whether a pruned block chunk runs on tokens this restorer builds (:meth:`project`) instead of on kept
        tokens (``granularity='chunk'`` only)."""
        return False

    def project(self, ctx: ScaleContext, block: int, weights_RN: torch.Tensor, count: int, x_RNC: torch.Tensor,
                signals: Signals):
        """A :class:`~var_core.engine.policy.ProjectedTokens` run of ``count`` tokens for the chunk starting at
        ``block`` (``weights_RN``: the scorer's output), when :meth:`projects_chunks`."""
        raise NotImplementedError

    def restore_projected(self, ctx: ScaleContext, block: int, state_RrC: torch.Tensor, run,
                          x_RNC: torch.Tensor, signals: Signals) -> torch.Tensor:
        """The full hidden state after a projected run (:meth:`project`) ended at ``block``."""
        raise NotImplementedError

    def latent_mask(self, ctx: ScaleContext, signals: Signals) -> torch.Tensor | None:
        """bool ``[B, N]``: tokens whose sampled residual enters the latent at this scale (None: all of them)."""
        return None


@dataclass(frozen=True)
class GuidanceDecision:
    mode: GuidanceMode | None = None  # physical row layout from this scale on (None: unchanged)
    cond_only_B: torch.Tensor | None = None  # per-sample logical stop while rows are still computed


KEEP_GUIDANCE = GuidanceDecision()


class Guidance(Component):
    """Classifier-free guidance policy: which CFG halves are computed and used at each scale."""

    def initial_mode(self, mode: GuidanceMode) -> GuidanceMode:
        """The rows to start with, given ``mode`` (what the sampling settings need); default: ``mode``."""
        return mode

    def decide(self, ctx: ScaleContext, signals: Signals) -> GuidanceDecision:
        return KEEP_GUIDANCE


@dataclass(frozen=True)
class SkipDecision:
    stop: bool = False  # end generation here and decode what has accumulated
    skip: bool = False  # leave this scale out, continue with the next


class ScaleSkip(Component):
    """Whole-scale skipping (100 % pruning of a scale)."""

    def decide(self, ctx: ScaleContext, signals: Signals) -> SkipDecision:
        return SkipDecision()

    def latent_mask(self, ctx: ScaleContext, signals: Signals) -> torch.Tensor | None:
        """bool ``[B, N]``: tokens whose residual enters the latent at this scale (None: all). A per-sample stop
        inside a batch freezes the stopped samples' latents with an all-False row (SkipVAR's batch rule)."""
        return None


class KVPolicy(Component):
    """The KV-cache policy: after each scale, which cached positions of each block stay for later scales."""

    def plan_kv(self, ctx: ScaleContext, cache, signals: Signals) -> dict | None:
        """``{block: engine.kvcache.KVKeep}`` (blocks left out keep everything) or None; ``cache.view(block)``
        gives a block's live keys (:class:`~var_core.engine.kvcache.KVBlockView`)."""
        return None


class AttentionSparsity(Component):
    """The attention pattern: per block and scale, which cached keys each query attends to (``engine.attention``)."""

    def pattern(self, ctx: ScaleContext, block: int, signals: Signals):
        """An :class:`~var_core.engine.attention.AttentionPattern` for ``block``'s self-attention at this scale, or
        None (dense)."""
        return None
