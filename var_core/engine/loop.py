"""THE next-scale generation loop, written once for every model family and every acceleration method.

Control flow lives here and only here: policies return decisions through the hook slots of
:class:`~var_core.engine.policy.Policy`, adapters do the family-specific tensor work, tracers time named spans.
There is no method-specific code in this file: if a method needs a new kind of decision, add a slot (and a
field to :class:`~var_core.engine.context.ScalePlan`), not a branch on a method name.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .adapters.base import ModelAdapter, row_slice_after_drop
from .context import GenerationInfo, GuidanceMode, ScaleContext, ScalePlan, ScaleRecord
from .kvcache import apply_kv_policy
from .lens_probe import LensProbe
from .packing import copy_padding_outputs, padding_sources
from .policy import Policy, ProjectedTokens, TokenSelection, gather_tokens
from .precision import under_precision
from .sampling import SamplingConfig
from .switch import ModelSwitch, check_shared_tokenizer
from .tracing import NULL_TRACER, Tracer


class NonFiniteLogitsError(FloatingPointError):
    """Raised when a scale's logits contain NaN or inf (names the scale and the rows)."""


@dataclass
class GenerationResult:
    """Images in [0, 1] plus everything the studies measure (tokens, latent, per-scale records)."""

    images: torch.Tensor | None  # [B, 3, H, W]; None when decode=False
    records: tuple[ScaleRecord, ...]
    latent: torch.Tensor  # the accumulated f_hat (VAR) / summed codes (Infinity)
    stopped_at: int | None = None  # index of the first scale not generated when a policy stopped early
    context_length: int | None = None  # cross-attention context length (Infinity: padded text tokens), for FLOPs
    # second-model seam (engine.switch): the adapter that ran scales >= switch_scale, and its teacher-forced prefill
    # passes over the earlier scales (ScaleRecord.teacher_forced); None / () for a one-model generation
    refiner: ModelAdapter | None = None
    switch_scale: int | None = None
    prefill: tuple[ScaleRecord, ...] = ()

    @property
    def tokens(self) -> list[torch.Tensor | None]:
        return [r.tokens_BN for r in self.records]

    def computed_tokens_per_scale(self) -> list[int]:
        """Tokens computed per scale summed over blocks and branches (what FLOPs follow), per network row."""
        return [sum(sum(branches) for branches in r.kept_tokens) for r in self.records]


@dataclass(frozen=True)
class GenerationOptions:
    check_finite: bool = True  # one reduction per scale; on GPU it synchronises (turn off for timing runs)
    decode: bool = True
    keep_raw_logits: bool = True  # raw per-row logits in each ScaleRecord (references, no copy)
    # attention of ragged selections: "varlen" = each row's valid queries over its valid keys (packed KV cache,
    # engine.attention); "padded" = the padded rectangle with a mask (the reference path). Dense runs: identical.
    ragged_attention: str = "varlen"

    def __post_init__(self) -> None:
        from .attention import RAGGED_ATTENTION

        if self.ragged_attention not in RAGGED_ATTENTION:
            raise ValueError(f"ragged_attention={self.ragged_attention!r}; choose one of {RAGGED_ATTENTION}")


def _make_generators(seeds: Sequence[int] | None, batch_size: int, device: torch.device):
    if seeds is None:
        return None
    seeds = list(seeds)
    if len(seeds) != batch_size:
        raise ValueError(f"got {len(seeds)} seeds for {batch_size} samples: give one seed per sample")
    gen_device = device if device.type == "cuda" else torch.device("cpu")
    return [torch.Generator(device=gen_device).manual_seed(int(s)) for s in seeds]


@torch.inference_mode()
def generation_info(adapter: ModelAdapter, batch_size: int, guidance: GuidanceMode, tracer: Tracer = NULL_TRACER,
                    sampling: SamplingConfig | None = None, shared_generator: bool = False) -> GenerationInfo:
    """What ``Policy.start`` receives for a generation of ``batch_size`` samples on ``adapter`` (also used to
    check a policy against a model before any generation). ``block_chunks``: the adapter's optional attribute of
    that name (the checkpoint's own grouping of its blocks, Infinity's ``block_chunks``), else None."""
    return GenerationInfo(batch_size, adapter.num_scales, adapter.num_blocks, adapter.branches, adapter.scale_hw,
                          adapter.family, guidance, tracer, sampling, getattr(adapter, "block_chunks", None),
                          shared_generator)


@under_precision  # adapter.precision (--precision): autocast / TF32 around the whole generation
def generate(
    adapter: ModelAdapter,
    conditions: Any,
    seeds: Sequence[int] | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    policy: Policy | None = None,
    tracer: Tracer = NULL_TRACER,
    options: GenerationOptions = GenerationOptions(),
    shared_generator: torch.Generator | None = None,
    switch: ModelSwitch | None = None,
) -> GenerationResult:
    """Generate one batch.

    Args:
        conditions: class labels ``[B]`` (VAR) or prompts (Infinity), as the adapter expects.
        seeds: one seed per sample, so a sample's result does not depend on the batch it is generated in.
        shared_generator: instead of ``seeds``, one generator for the whole batch (official-code behaviour; with
            neither, the samplers draw from torch's global generator, as the official codes do without a seed).
            Either way the policy is told (``GenerationInfo.shared_generator``), so a component that draws can
            follow the official codes too (e.g. from the global generator, in their order).
        policy: the acceleration policy; ``None`` runs the plain algorithm.
        switch: hand the generation to a second model (same tokenizer) at a scale (:mod:`var_core.engine.switch`);
            scales from ``switch.at_scale`` on run on ``switch.adapter``, which first prefills its own KV cache over
            the scales already generated. The policy sees the running model's blocks in each ``ScaleContext``.
            None: the policy's ``model_switch`` attribute if it has one (``var_core.eval.twomodel.attach_model_switch``).
    """
    policy = policy if policy is not None else Policy()
    switch = switch if switch is not None else getattr(policy, "model_switch", None)
    if switch is not None:
        check_shared_tokenizer(adapter, switch.adapter)
        if switch.at_scale == 0:  # the refiner alone
            adapter = switch.adapter
        elif switch.at_scale >= adapter.num_scales:  # the drafter alone
            switch = None
    initial_guidance = policy.initial_guidance(adapter.initial_guidance(sampling))
    state = adapter.begin(conditions, initial_guidance, sampling)
    B = state.batch_size
    generators = None if shared_generator is not None else _make_generators(seeds, B, adapter.device)
    guidance = state.guidance
    branches = adapter.branches
    offsets = adapter.token_offsets()
    records: list[ScaleRecord] = []
    prefill: tuple[ScaleRecord, ...] = ()
    stopped_at = None
    policy.start(generation_info(adapter, B, guidance, tracer, sampling,
                                 shared_generator=shared_generator is not None or seeds is None))
    layout = "packed" if options.ragged_attention == "varlen" else "padded"
    model_stack = ExitStack()  # the running model's KV cache (closed at a switch: the drafter's memory goes)
    try:
        with model_stack:
            cache = model_stack.enter_context(adapter.kv_cache())
            cache.set_layout(layout)
            for si, hw in enumerate(adapter.scale_hw):
                if switch is not None and si == switch.at_scale:
                    latent = adapter.latent(state)
                    model_stack.close()
                    adapter, state, cache, prefill = _hand_over(switch.adapter, conditions, initial_guidance,
                                                                sampling, records, latent, model_stack, layout,
                                                                tracer)
                    branches, offsets = adapter.branches, adapter.token_offsets()
                ctx = ScaleContext(si, adapter.num_scales, hw, offsets[si], B, guidance, adapter.num_blocks,
                                   branches, adapter.family, tuple(records))
                plan: ScalePlan = policy.plan_scale(ctx)
                if plan.stop:
                    stopped_at = si
                    break
                if plan.guidance is not None and plan.guidance is not guidance:
                    rows = row_slice_after_drop(guidance, plan.guidance, B)
                    cache.select_rows(rows)
                    adapter.select_rows(state, rows, plan.guidance)
                    guidance = plan.guidance
                    ctx = ScaleContext(si, adapter.num_scales, hw, offsets[si], B, guidance, adapter.num_blocks,
                                       branches, adapter.family, ctx.history)
                if plan.skip:
                    record = ScaleRecord(si, hw, skipped=True, guidance=guidance)
                    records.append(record)
                    policy.end_scale(ctx, record)
                    continue
                tracer.scale_begin(si)
                record = _run_scale(adapter, state, ctx, plan, policy, cache, tracer, sampling, generators,
                                    shared_generator, options)
                tracer.scale_end(si)
                record = apply_kv_policy(policy, ctx, cache, record)  # eviction + measured KV bytes
                records.append(record)
                policy.end_scale(ctx, record)
        images = None
        if options.decode:
            with tracer.span("vq_decode"):
                images = adapter.decode(state)
    finally:
        policy.end()
    return GenerationResult(images, tuple(records), adapter.latent(state), stopped_at,
                            adapter.context_length(state), refiner=switch.adapter if switch is not None else None,
                            switch_scale=switch.at_scale if switch is not None else None, prefill=prefill)


def _hand_over(refiner: ModelAdapter, conditions, initial_guidance: GuidanceMode, sampling: SamplingConfig,
               history: Sequence[ScaleRecord], latent: torch.Tensor, model_stack: ExitStack, layout: str,
               tracer: Tracer):
    """The refiner takes the generation over: it encodes the conditions with its own weights, opens its own KV cache,
    prefills it by running every block over each generated scale's input (teacher forcing: the input of scale ``j``
    is rebuilt from the residuals of scales ``< j`` exactly as the drafter built it), following the row layout the
    drafter had at each scale (CFG rows dropped where it dropped them), then adopts the drafter's latent.

    The prefill runs scale by scale through the same ``run_branch`` calls a dense scale makes, so its cache equals
    the one the refiner would have built generating those tokens itself (bitwise on the CPU); CoDe's code runs it as
    one block-causal pass fused with the first refined scale (the same attention, other kernel shapes)."""
    state = refiner.begin(conditions, initial_guidance, sampling)
    cache = model_stack.enter_context(refiner.kv_cache())
    cache.set_layout(layout)
    B = state.batch_size
    guidance = state.guidance
    done: list[ScaleRecord] = []
    for record in history:
        if record.guidance is not guidance:
            rows = row_slice_after_drop(guidance, record.guidance, B)
            cache.select_rows(rows)
            refiner.select_rows(state, rows, record.guidance)
            guidance = record.guidance
        if record.skipped:
            continue
        si = record.scale_index
        with tracer.span("prefill", si):
            x_RNC = refiner.scale_input(state, si)
            for block in range(refiner.num_blocks):
                for branch in refiner.branches:
                    out, _ = refiner.run_branch(state, si, block, branch, x_RNC, None, None, cache, False)
                    if branch == "attn":
                        cache.take_attention_pairs(block)
                    x_RNC = x_RNC + out
            refiner.replay_latent(state, si, record)
        n = x_RNC.shape[1]
        done.append(ScaleRecord(si, record.hw, skipped=False, guidance=guidance, teacher_forced=True,
                                kept_tokens=tuple((n,) * len(refiner.branches) for _ in range(refiner.num_blocks))))
    refiner.adopt_latent(state, latent)
    return refiner, state, cache, tuple(done)


def _run_scale(adapter, state, ctx: ScaleContext, plan: ScalePlan, policy: Policy, cache, tracer: Tracer,
               sampling: SamplingConfig, generators, shared_generator, options: GenerationOptions) -> ScaleRecord:
    si = ctx.scale_index
    with tracer.span("embed", si):
        x_RNC = adapter.scale_input(state, si)
    kept_counts: list[tuple[int, ...]] = []
    lens_rows: list[tuple[int, int]] = []
    packed_counts: list[tuple[int | None, ...]] = []
    valid_counts: list[tuple[torch.Tensor | None, ...]] = []  # ragged selections: each row's own kept count
    pairs: list[int | None] = []
    stats_flops = [0] * ctx.num_blocks
    packing, last_keep, sources = None, None, None
    run: ProjectedTokens | None = None  # a projected run in progress: its blocks work on its own r tokens
    run_RrC = run_input_RNC = None
    device_rows: dict = {}

    def rows_on(rows: torch.Tensor, device) -> torch.Tensor:
        """The lens's host row index on ``device``, copied once per scale (every block's lens projects the same
        samples), not once per block."""
        if rows.device == device:
            return rows
        key = (tuple(rows.tolist()), str(device))  # host data: free
        if key not in device_rows:
            device_rows[key] = rows.to(device)
        return device_rows[key]

    for block in range(ctx.num_blocks):
        x_in_RNC = x_RNC
        want_probs = block in plan.attention_blocks
        counts, packed, valid = [], [], []
        block_pairs = None
        for branch in ctx.branches:
            keep_Rn = valid_Rn = None
            if plan.prune and run is None:
                with tracer.span("plan", si, block):
                    selection = policy.plan_block(ctx, block, branch, x_RNC)
                if isinstance(selection, ProjectedTokens):
                    run, run_RrC, run_input_RNC = selection, selection.tokens_RrC, x_RNC
                    selection = None
                if isinstance(selection, TokenSelection):
                    keep_Rn, valid_Rn = selection.index_Rn, selection.valid_Rn
                else:
                    keep_Rn = selection
            if run is not None:  # the run's tokens take the positional encoding of run.positions_Rr
                with tracer.span(branch, si, block):
                    out, _ = adapter.run_branch(state, si, block, branch, run_RrC, run.positions_Rr, None, cache,
                                                False)
                if branch == "attn":
                    block_pairs = cache.take_attention_pairs(block)
                run_RrC = run_RrC + out
                counts.append(run_RrC.shape[1])
                packed.append(None)
                valid.append(None)
                continue
            tokens_in = x_RNC if keep_Rn is None else gather_tokens(x_RNC, keep_Rn)
            if valid_Rn is None:
                packing, last_keep = None, None
            elif keep_Rn is not last_keep:  # a block-level selection serves both branches: pack it once
                packing, last_keep = adapter.row_packing(keep_Rn, valid_Rn), keep_Rn
                sources = padding_sources(keep_Rn, valid_Rn) if packing is None else None
            pattern = policy.plan_attention(ctx, block) if branch == "attn" else None  # None: dense attention
            with tracer.span(branch, si, block):
                out, probs = adapter.run_branch(state, si, block, branch, tokens_in, keep_Rn, valid_Rn, cache,
                                                want_probs and branch == "attn", packing=packing,
                                                **({} if pattern is None else {"pattern": pattern}))
                if valid_Rn is not None and packing is None:  # padded rectangle: padding slots copy exactly
                    out = copy_padding_outputs(out, sources)
            if branch == "attn":
                block_pairs = cache.take_attention_pairs(block)
                if pattern is not None:  # the pattern's attended pairs (what the FLOPs counters charge)
                    block_pairs = pattern.take_pairs()
            if probs is not None:  # an AttentionProbe (engine.attention): statistics computed on demand
                policy.observe_attention(ctx, block, probs, keep_Rn)
                stats_flops[block] = getattr(probs, "flops", 0)
            if keep_Rn is not None:
                with tracer.span("restore", si, block):
                    out = policy.restore(ctx, block, branch, out, keep_Rn, x_RNC)
            if plan.observe_branches:
                policy.observe_branch(ctx, block, branch, out)
            x_RNC = x_RNC + out
            counts.append(tokens_in.shape[1])
            packed.append(packing.total if packing is not None else None)
            valid.append(None if valid_Rn is None else valid_Rn.sum(1))  # no sync: read after the generation
        if run is not None and block == run.last_block:
            with tracer.span("restore", si, block):
                x_RNC = policy.restore_projected(ctx, block, run_RrC, run, run_input_RNC)
            run = run_RrC = run_input_RNC = None
        kept_counts.append(tuple(counts))
        packed_counts.append(tuple(packed))
        valid_counts.append(tuple(valid))
        pairs.append(block_pairs)
        if plan.observe_blocks:
            policy.observe_block(ctx, block, x_in_RNC, x_RNC)
        if block in plan.lens_blocks:
            with tracer.span("lens", si, block):
                lens = LensProbe(lambda x=x_RNC: adapter.logits(state, x), ctx.batch_size, x_RNC.shape[0],
                                 head_parts=lambda rows=None, x=x_RNC: adapter.head_parts(
                                     state, x if rows is None else x.index_select(0, rows_on(rows, x.device)),
                                     rows))
                policy.observe_lens(ctx, block, lens)
                lens_rows.append((block, lens.projected_rows))
    if run is not None:
        raise ValueError(f"a projected run planned to end at block {run.last_block} but scale {si} has "
                         f"{ctx.num_blocks} blocks")
    with tracer.span("head", si):
        raw_logits_RNV = adapter.logits(state, x_RNC)
    if options.check_finite and not bool(torch.isfinite(raw_logits_RNV).all()):
        bad_rows = (~torch.isfinite(raw_logits_RNV)).flatten(1).any(1).nonzero().flatten().tolist()
        raise NonFiniteLogitsError(
            f"non-finite logits at scale {si} (index from 0, {ctx.hw[0]}x{ctx.hw[1]} tokens) in network rows "
            f"{bad_rows} (guidance {ctx.guidance.value}); check the weights (a mis-loaded checkpoint often shows "
            f"up here) and the dtype (fp16 overflows: try bf16 or fp32)"
        )
    policy.observe_logits(ctx, raw_logits_RNV)
    with tracer.span("sampling", si):
        guided_BNV = adapter.guide(state, si, raw_logits_RNV, sampling, plan.cond_only_B)
        tokens = adapter.sample(guided_BNV, sampling, generators, shared_generator)
    keep_BN = policy.latent_mask(ctx)  # None: every token's residual enters the latent
    with tracer.span("latent_update", si):
        residual = (adapter.update_latent(state, si, tokens) if keep_BN is None
                    else adapter.update_latent(state, si, tokens, keep_BN))
    if ctx.is_last:  # e.g. HART's residual diffusion head (a no-op for VAR and Infinity)
        with tracer.span("finish", si):
            adapter.finish(state, x_RNC, tokens, sampling, generators, shared_generator)
    image = None
    if plan.decode_latent:
        with tracer.span("accel/decode", si):
            image = adapter.decode(state)
    previews = []
    for grid_scale in sorted(plan.preview_scales):
        with tracer.span("accel/decode", si):
            previews.append((grid_scale, adapter.decode_preview(state, grid_scale)))
    return ScaleRecord(
        si, ctx.hw, skipped=False, guidance=ctx.guidance, tokens_BN=tokens, residual_BChw=residual,
        guided_logits_BNV=guided_BNV, raw_logits_RNV=raw_logits_RNV if options.keep_raw_logits else None,
        kept_tokens=tuple(kept_counts), lens_rows=tuple(lens_rows),
        packed_tokens=tuple(packed_counts) if any(c is not None for b in packed_counts for c in b) else (),
        valid_tokens_R=tuple(valid_counts) if any(c is not None for b in valid_counts for c in b) else (),
        attention_pairs=tuple(pairs) if any(p is not None for p in pairs) else (),
        attention_stats_flops=tuple(stats_flops) if any(stats_flops) else (),
        image_B3HW=image, previews_B3HW=tuple(previews),
    )
