"""The composed acceleration policy: one component of each kind, wired onto the engine's hook slots.

``PolicyConfig`` is the complete, hashable description of a method (its components' configs plus a few
policy-level options); ``build_policy`` turns it into an :class:`AccelPolicy`, which implements
:class:`var_core.engine.Policy`. Presets (``presets.py``) and ablation arms are functions returning
``PolicyConfig`` objects that differ in exactly the component being studied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..engine.context import GenerationInfo, ScaleContext, ScalePlan, ScaleRecord
from ..engine.packing import host_copy, mark_device_counts
from ..engine.policy import Policy, TokenSelection, ragged_selection
from .base import Component, Needs, Signals, block_chunk, ends_block_chunk
from .knobs import knob
from .registry import REGISTRIES

COMPONENT_KINDS = ("scorer", "activation", "schedule", "restorer", "guidance", "skip", "kv", "attention")


def component_config(kind: str, name: str, **params):
    """The ``Config`` of a registered component, built (and validated) from keyword parameters."""
    cls = REGISTRIES[kind].get(name)
    known = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = set(params) - known
    if unknown:
        raise ValueError(f"{kind} {name!r} has no option(s) {sorted(unknown)}; its options are {sorted(known)}")
    return cls.Config(**params)


def _default(kind: str, name: str):
    return field(default_factory=lambda: component_config(kind, name))


def _unhashed_default(default, doc: str, **kw):
    """A knob left out of ``to_dict`` (so of every config hash) while it holds its default: adding it to
    :class:`PolicyConfig` changed no existing hash."""
    spec = knob(default, doc, **kw)
    return field(default=default, metadata={**spec.metadata, "omit_default": True})


@dataclass(frozen=True)
class PolicyConfig:
    """A whole acceleration method. ``name`` is a label only; behaviour comes from the fields."""

    name: str = "baseline"
    scorer: Any = _default("scorer", "random")
    activation: Any = _default("activation", "never")
    schedule: Any = _default("schedule", "fixed_table")
    restorer: Any = _default("restorer", "identity")
    guidance: Any = _default("guidance", "full")
    skip: Any = _default("skip", "none")
    kv: Any = _default("kv", "keep_all")  # the KV-cache policy (issue 29); keep_all leaves config hashes unchanged
    attention: Any = _default("attention", "dense")  # the attention pattern (issue 29); dense: hashes unchanged
    cfg_rows: str = knob("shared", "how CFG rows choose tokens: 'shared' = the conditional row's choice is used "
                         "by both halves (keeps CFG rows aligned; NOVA, LD-Pruning), 'per_row' = each row selects "
                         "on its own scores (FastVAR's code)", choices=("shared", "per_row"))
    granularity: str = knob("block", "select tokens once per block ('block', reused by every branch), before "
                            "every sub-layer ('branch', as FastVAR re-selects before SA, CA and FFN) or once per "
                            "chunk of L/8 consecutive blocks ('chunk', Infinity's block chunks, StageVAR's unit: "
                            "the chunk runs on the kept tokens and a chunk-aware restorer acts at its last block)",
                            choices=("block", "branch", "chunk"))
    exempt_first_blocks: int = knob(0, "blocks at the start that are never pruned (FastVAR's Infinity code: 3)",
                                    low=0, unit="blocks")
    exempt_last_blocks: int = knob(0, "blocks at the end that are never pruned (counted from the model's last "
                                   "block)", low=0, unit="blocks")
    # Optional[int], not ``int | None``: knobs.coerce reads "--set pruned_blocks_end=none" only for the former
    pruned_blocks_end: Optional[int] = knob(None, "blocks with this absolute index and above are never pruned "
                                            "(FastVAR's Infinity code prunes range(3, 28): exempt_first_blocks=3, "
                                            "pruned_blocks_end=28, whatever the depth); None = no absolute end",
                                            low=0)
    min_keep: int = knob(1, "smallest number of tokens any pruned branch keeps per row", low=1)
    rank_bits: int = knob(16, "scores are rounded to steps of 2^-rank_bits of the row's largest finite |score| "
                          "before ranking (ties go to the lower position), so float noise from batch-size-"
                          "dependent kernels (~1e-6 relative) cannot reorder near-ties: a sample keeps the same "
                          "tokens alone and in a batch. 0 ranks the raw scores (the official codes' topk)",
                          low=0, high=52)
    per_model: str = knob("", "name of a preset whose authors' setting for the model in hand (family, depth, "
                          "schedule) this config is resolved to when a generation starts (presets.resolve_config): "
                          "values you changed from that preset's generic config are kept. '' = run as given")

    count_sync: str = _unhashed_default(
        "per_block", "how a data-dependent kept count becomes a shape: 'per_block' reads each pruned block's count "
        "on the host (exact shapes; one host synchronisation per pruned block where the count depends on the block's "
        "input, e.g. NOVA's logit-lens layer linkage); 'bounded' keeps the counts on the device and runs each row's "
        "host-known upper bound from the schedule (count_bound), the slots past each row's count masked out of "
        "attention and the KV cache (no read inside the scale; the padding runs and is counted as FLOPs). The kept "
        "tokens and their math are the same; outputs agree to float rounding. Schedules without a bound run "
        "'per_block'", choices=("per_block", "bounded"))

    # the second-model seam (engine.switch): CoDe's drafter -> refiner hand-over
    refiner: str = _unhashed_default("", "zoo entry of a second model that takes the generation over at "
                                     "switch_scale, prefilling its KV cache from the scales generated so far "
                                     "(engine.switch; CoDe's refiner, e.g. testbed-small or var-d16); it must share "
                                     "the model's tokenizer. '' = one model")
    switch_scale: int = _unhashed_default(0, "index of the first scale the refiner generates (CoDe's draft steps "
                                          "N: scales 0..N-1 on the model, N.. on the refiner); 0 = the refiner "
                                          "alone, >= the model's scales = the model alone; read only with refiner",
                                          low=0)

    def __post_init__(self) -> None:
        for kind in COMPONENT_KINDS:
            value = getattr(self, kind)
            if getattr(type(value), "component_kind", None) != kind:
                raise TypeError(f"PolicyConfig.{kind} must be a {kind} component Config, got {type(value).__name__}")
        from .knobs import validate_plain

        validate_plain(self, "policy")

    def components(self) -> dict[str, Any]:
        return {kind: getattr(self, kind) for kind in COMPONENT_KINDS}

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "kv" and value == component_config("kv", "keep_all"):
                continue  # the default KV policy: configs (and their hashes) read as before the kind existed
            if f.name == "attention" and value == component_config("attention", "dense"):
                continue  # dense attention: configs (and their hashes) read as before the kind existed
            if f.name in COMPONENT_KINDS:
                out[f.name] = value.to_dict()
            elif f.metadata.get("omit_default") and value == f.default:
                continue
            elif f.name != "name":
                out[f.name] = value
        return out

    def config_hash(self) -> str:
        """Hash of the behaviour-defining content (the label ``name`` is excluded)."""
        content = {k: v for k, v in self.to_dict().items() if k != "name"}
        return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:16]

    @staticmethod
    def from_dict(data: dict) -> "PolicyConfig":
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in COMPONENT_KINDS:
                params = dict(value)
                name = params.pop("name")
                params = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}
                kwargs[key] = component_config(key, name, **params)
            else:
                kwargs[key] = value
        return PolicyConfig(**kwargs)

    def replace_component(self, kind: str, name: str, **params) -> "PolicyConfig":
        return dataclasses.replace(self, **{kind: component_config(kind, name, **params)})


_PER_MODEL_RESOLVER: Callable[[PolicyConfig, Any], PolicyConfig] | None = None


def set_per_model_resolver(resolver: Callable[[PolicyConfig, Any], PolicyConfig]) -> None:
    """Install how a ``per_model`` config becomes the setting for one model (``presets.resolve_config``, which
    registers itself on import: presets build on this module, so this module never imports them)."""
    global _PER_MODEL_RESOLVER
    _PER_MODEL_RESOLVER = resolver


class AccelPolicy(Policy):
    """Runs a :class:`PolicyConfig` through the engine's slots. Per-generation state lives in ``signals``."""

    def __init__(self, config: PolicyConfig):
        self.requested = config  # as given; ``config`` is the one in force (resolved for the model at start)
        self.name = config.name
        self._build(config)
        self.signals: Signals | None = None
        self._tracer = None
        self._active_B: torch.Tensor | None = None
        self._active_rows_memo: dict = {}
        self._forced_memo: tuple[torch.Tensor, int] | None = None
        self._block_selection: dict[int, Any] = {}
        self._bound_overflow: torch.Tensor | None = None  # count_sync='bounded': a count above its bound (a bug)
        self.history: list[dict] = []  # per-scale diagnostics of the last generation

    def _build(self, config: PolicyConfig) -> None:
        self.config = config
        self.parts: dict[str, Component] = {
            kind: REGISTRIES[kind].get(cfg.component_name)(cfg) for kind, cfg in config.components().items()
        }
        self.scorer = self.parts["scorer"]
        self.activation = self.parts["activation"]
        self.schedule = self.parts["schedule"]
        self.restorer = self.parts["restorer"]
        self.guidance = self.parts["guidance"]
        self.skip = self.parts["skip"]
        self.kv = self.parts["kv"]
        self.attention = self.parts["attention"]

    def resolve_for(self, info: GenerationInfo) -> PolicyConfig:
        """Put the config resolved for the model ``info`` describes in force (``per_model``); returns it."""
        if self.requested.per_model:
            if _PER_MODEL_RESOLVER is None:
                raise RuntimeError("no per-model preset resolver registered (import var_core.accel)")
            resolved = _PER_MODEL_RESOLVER(self.requested, info)
            if resolved != self.config:
                self._build(resolved)
        return self.config

    # lifecycle -----------------------------------------------------------------------------------------
    def check_model(self, info: GenerationInfo) -> None:
        """Raise ``ValueError`` naming the component if any part cannot run on the model ``info`` describes."""
        self.resolve_for(info)
        self._check_chunk_exemptions(info.num_blocks, info.block_chunks)
        self._check_attention_composition()
        for kind, part in self.parts.items():
            try:
                part.check_model(info)
            except ValueError as exc:
                raise ValueError(f"{kind} {type(part).__name__}: {exc}") from None

    def _check_attention_composition(self) -> None:
        """A sparse attention pattern (seam 2) is laid over the DENSE cache's token positions; token pruning and KV
        eviction change which token each cache position holds, which the cache does not record yet: refuse the
        combination before anything runs instead of failing at the first pruned or evicted scale."""
        cfg = self.config
        if cfg.attention.component_name == "dense":
            return
        if cfg.kv.component_name != "keep_all":
            raise ValueError(f"attention={cfg.attention.component_name} with kv={cfg.kv.component_name}: a sparse "
                             "attention pattern needs the dense cache (KV eviction compacts it); use one of the two")
        if cfg.activation.component_name != "never":
            raise ValueError(f"attention={cfg.attention.component_name} with token pruning (activation="
                             f"{cfg.activation.component_name}): a sparse attention pattern runs on dense scales; "
                             "use one of the two")

    def _check_chunk_exemptions(self, num_blocks: int, chunks: int | None = None) -> None:
        """With ``granularity='chunk'`` a chunk is pruned whole or not at all: an exempt block inside a pruned
        chunk would read the stale pruned slots its chunk leaves for the restore at the chunk's end."""
        cfg = self.config
        if cfg.granularity != "chunk":
            return
        end = num_blocks if cfg.pruned_blocks_end is None else min(cfg.pruned_blocks_end, num_blocks)
        first, last = cfg.exempt_first_blocks, min(end, num_blocks - cfg.exempt_last_blocks)
        if first >= last:
            return
        chunk_of = [block_chunk(b, num_blocks, chunks) for b in range(num_blocks)]
        starts_chunk = first == 0 or chunk_of[first - 1] != chunk_of[first]
        if not (starts_chunk and ends_block_chunk(last - 1, num_blocks, chunks)):
            raise ValueError(
                f"granularity='chunk' prunes whole block chunks, but the pruned blocks {first}..{last - 1} of "
                f"{num_blocks} cut a chunk (chunks: {chunk_of}); "
                f"align exempt_first_blocks / exempt_last_blocks / pruned_blocks_end with chunk boundaries or use "
                f"granularity='block'")

    def initial_guidance(self, mode):
        """The guidance component's choice (of the config in force: a per-model preset is resolved only at
        ``start``, so its generic config's guidance decides here)."""
        return self.guidance.initial_mode(mode)

    def start(self, info: GenerationInfo) -> None:
        self.resolve_for(info)
        self._check_chunk_exemptions(info.num_blocks, info.block_chunks)
        self.signals = Signals(info, chunked_selection=self.config.granularity == "chunk")
        self._tracer = info.tracer
        self.history = []
        for part in self.parts.values():
            part.start(info, self.signals)
        self._bound_overflow = None

    def end(self) -> None:
        # signals are kept until the next start so studies can read diagnostics
        overflow, self._bound_overflow = self._bound_overflow, None
        if overflow is not None and bool(overflow):  # one read per generation (count_sync='bounded')
            raise RuntimeError(f"schedule {self.schedule.name!r}: a kept count exceeded the bound its count_bound "
                               f"promised; the generation kept fewer tokens than the method asks for (a bug: "
                               f"rerun with --set count_sync=per_block and report it)")

    def _span(self, kind: str, si: int | None = None, block: int | None = None):
        return self._tracer.span(f"accel/{kind}", si, block)

    # slots ----------------------------------------------------------------------------------------------
    def plan_scale(self, ctx: ScaleContext) -> ScalePlan:
        signals = self.signals
        with self._span("skip", ctx.scale_index):
            skip = self.skip.decide(ctx, signals)
        if skip.stop or skip.skip:
            self.history.append(dict(scale=ctx.scale_index, stop=skip.stop, skip=skip.skip))
            return ScalePlan(stop=skip.stop, skip=skip.skip)
        with self._span("activation", ctx.scale_index):
            active_B = self.activation.active_B(ctx, signals)
        if self.schedule.skips_scale(ctx, signals) and bool(active_B.all()):  # 100 % pruning: not generated
            self.history.append(dict(scale=ctx.scale_index, stop=False, skip=True))
            return ScalePlan(skip=True)
        with self._span("guidance", ctx.scale_index):
            decision = self.guidance.decide(ctx, signals)
        self._active_B = active_B
        self._active_rows_memo = {}
        self._block_selection = {}
        prune = bool(active_B.any()) and self.schedule.prunes_scale(ctx, signals)
        signals.pruning_now = prune
        needs = Needs()
        for part in self.parts.values():
            needs = needs | part.needs(ctx, signals)
        self.history.append(dict(scale=ctx.scale_index, prune=prune, active=int(active_B.sum()),
                                 guidance=(decision.mode or ctx.guidance).value,
                                 # per-sample guidance stops (a device copy, read after the generation: activity)
                                 cond_only=None if decision.cond_only_B is None else decision.cond_only_B.clone()))
        return ScalePlan(
            guidance=decision.mode, prune=prune, attention_blocks=needs.attention_blocks,
            lens_blocks=needs.lens_blocks, observe_blocks=needs.block_io, observe_branches=needs.branch_outputs,
            cond_only_B=decision.cond_only_B, decode_latent=needs.decoded_image,
            preview_scales=needs.preview_scales,
        )

    def plan_block(self, ctx: ScaleContext, block: int, branch: str, x_RNC: torch.Tensor):
        cfg = self.config
        if block < cfg.exempt_first_blocks or block >= ctx.num_blocks - cfg.exempt_last_blocks:
            return None
        if cfg.pruned_blocks_end is not None and block >= cfg.pruned_blocks_end:
            return None
        chunked = cfg.granularity == "chunk"
        key = block_chunk(block, ctx.num_blocks, self.signals.info.block_chunks) if chunked else block
        if cfg.granularity == "block" and self._selection_per_scale():
            key = "scale"  # the scorer's map and the schedule's counts are the scale's: one selection serves all
        if cfg.granularity != "branch" and key in self._block_selection:
            return self._block_selection[key]
        with self._span("scorer", ctx.scale_index, block):
            scores = self.scorer.score(ctx, block, branch, x_RNC, self.signals)
        if chunked and self.restorer.projects_chunks():
            selection = self._project(ctx, block, branch, scores, x_RNC)
        else:
            selection = self._select(ctx, block, branch, scores, x_RNC.shape[0])
        if cfg.granularity != "branch":
            self._block_selection[key] = selection
        return selection

    def _selection_per_scale(self) -> bool:
        """Whether every block of a scale selects the same tokens: the scorer's scores are the scale's (not its
        blocks' inputs) and the schedule's counts depend on the scores alone (LD-Pruning's LHEP map with its
        energy fraction; the third-party SparseVAR's MSE map with its threshold share). Then one selection — and
        one host read of its counts — serves every block: the same tokens, bit for bit, as selecting per block."""
        return self.scorer.scores_per_scale() and self.schedule.counts_per_scale()

    def _select(self, ctx: ScaleContext, block: int, branch: str, scores: torch.Tensor, rows: int):
        B, N = ctx.batch_size, ctx.num_tokens
        scores = scores.float()
        if scores.shape[0] == rows and rows != B and self.config.cfg_rows == "shared":
            scores = scores[:B]
        if scores.shape[0] != rows:
            scores = scores.repeat(rows // scores.shape[0], 1)
        forced = self.restorer.forced_keep(ctx, self.signals)
        floor = min(max(self.config.min_keep, self._forced_count(forced)), N)
        if forced is not None:
            forced = forced.to(scores.device)
            scores = scores.masked_fill(forced.view(1, N), float("inf"))
        scores = rank_grid(scores, self.config.rank_bits)
        with self._span("schedule", ctx.scale_index, block):
            counts = self.schedule.keep_counts(ctx, block, branch, scores, self.signals)
        if counts is None:
            return None
        if self.config.count_sync == "bounded" and host_copy(counts) is None:  # host copies are read for free
            bound = self.schedule.count_bound(ctx, block, rows, self.signals)
            if bound is not None:
                return self._select_bounded(ctx, scores, counts, floor, rows, bound)
        # The block's one host synchronisation (the counts become a shape), free where the schedule's counts are
        # host data (a table of the config); the clamp is integer work, the same on the host and on the device.
        counts_host = host_copy(counts)  # read with the scale's other counts (a fixed layer profile)
        counts_host = counts.cpu() if counts_host is None else counts_host
        counts_host = torch.where(self._active_rows("cpu", rows), counts_host.clamp(min=floor, max=N),
                                  torch.full_like(counts_host, N))
        n_max = int(counts_host.max())
        if n_max >= N and bool((counts_host >= N).all()):
            return None
        if bool((counts_host >= n_max).all()):  # every row keeps n_max: no per-row counts on the device
            return top_tokens(scores, counts_host, n_max, uniform=True)
        # ragged: the same counts where the schedule computed them (top_tokens copies host counts to the device)
        counts = torch.where(self._active_rows(counts.device, rows), counts.clamp(min=floor, max=N),
                             torch.full_like(counts, N))
        return top_tokens(scores, counts, n_max, uniform=False, host_counts_R=counts_host)

    def _select_bounded(self, ctx: ScaleContext, scores: torch.Tensor, counts: torch.Tensor, floor: int, rows: int,
                        bound):
        """``count_sync='bounded'``: each row's ``counts[r]`` (on the device, never read here) highest-ranked tokens,
        in a selection as wide as the largest row bound — the same kept set as reading the counts, sized by what
        the host knows. ``bound``: the schedule's bound for every row, or one per row; a row of an inactive sample
        keeps (and is bounded by) ``N``; every bound is at least the policy's floor. Packing then runs each row's
        bound (``engine.packing.RowPacking``). A count above its bound is clamped and flagged; the flag is read
        once, after the generation (:meth:`end`)."""
        N = ctx.num_tokens
        per_row = (int(bound),) * rows if isinstance(bound, int) else tuple(int(b) for b in bound)
        active_host = self._active_rows("cpu", rows).tolist()  # host data
        bounds_R = tuple(min(max(b, floor), N) if a else N for b, a in zip(per_row, active_host))
        n = max(bounds_R)
        bounds_dev = self._bounds_on(counts.device, bounds_R)
        active = self._active_rows(counts.device, rows)
        counts = torch.where(active, counts.clamp(min=floor, max=N), torch.full_like(counts, N))
        over = (counts > bounds_dev).any()
        self._bound_overflow = over if self._bound_overflow is None else self._bound_overflow | over
        counts = torch.minimum(counts, bounds_dev)
        selection = top_tokens(scores, counts, n, uniform=False)
        if isinstance(selection, TokenSelection) and selection.valid_Rn is not None:
            mark_device_counts(selection.valid_Rn, bounds_R, bounds_dev)
        return selection

    def _bounds_on(self, device, bounds_R: tuple[int, ...]) -> torch.Tensor:
        """The per-row bounds on ``device``, copied there once per scale (every block of a scale has the same)."""
        key = ("bounds", str(device), bounds_R)
        if key not in self._active_rows_memo:  # reset with the scale's activation mask
            self._active_rows_memo[key] = (
                torch.full((len(bounds_R),), bounds_R[0], dtype=torch.long, device=device)
                if len(set(bounds_R)) == 1 else torch.tensor(bounds_R, dtype=torch.long).to(device))
        return self._active_rows_memo[key]

    def _forced_count(self, forced: torch.Tensor | None) -> int:
        """Tokens the restorer forces to be kept, read once per mask (restorers hand out one cached mask per
        scale), not once per block."""
        if forced is None:
            return 0
        if self._forced_memo is None or self._forced_memo[0] is not forced:
            self._forced_memo = (forced, int(forced.sum()))
        return self._forced_memo[1]

    def _active_rows(self, device, rows: int) -> torch.Tensor:
        """The scale's activation mask per network row on ``device`` (``"cpu"``: the host), copied there once per
        scale."""
        key = (str(device), rows)
        if key not in self._active_rows_memo:
            B = len(self._active_B)
            source = self._active_B.cpu() if str(device) == "cpu" else self._active_B.to(device)
            self._active_rows_memo[key] = source.repeat(rows // B)
        return self._active_rows_memo[key]

    def _project(self, ctx: ScaleContext, block: int, branch: str, scores: torch.Tensor, x_RNC: torch.Tensor):
        """The chunk starting at ``block`` runs on tokens the restorer builds (a ProjectedTokens run), as many as
        the schedule's count; None (dense) where the schedule keeps everything or no sample is active."""
        rows, N = x_RNC.shape[0], ctx.num_tokens
        scores = scores.float()
        if scores.shape[0] != rows:
            scores = scores.repeat(rows // scores.shape[0], 1)
        with self._span("schedule", ctx.scale_index, block):
            counts = self.schedule.keep_counts(ctx, block, branch, scores, self.signals)
        active = self._active_B
        if counts is None or not bool(active.any()):
            return None
        if not bool(active.all()) or bool((counts != counts[0]).any()):
            raise ValueError(f"scale {ctx.scale_index}, block {block}: a projected chunk runs every row on the same "
                             f"number of tokens; got counts {counts.tolist()} with samples active "
                             f"{active.tolist()} (use a fixed activation and a schedule with one count per scale)")
        count = min(max(int(counts[0]), self.config.min_keep), N)
        if count >= N:
            return None
        with self._span("restorer", ctx.scale_index, block):
            return self.restorer.project(ctx, block, scores, count, x_RNC, self.signals)

    def restore_projected(self, ctx, block, state_RrC, run, x_RNC):
        with self._span("restorer", ctx.scale_index, block):
            return self.restorer.restore_projected(ctx, block, state_RrC, run, x_RNC, self.signals)

    def observe_attention(self, ctx, block, probs_RHnL, keep_Rn):
        for part in self.parts.values():
            part.observe_attention(ctx, block, probs_RHnL, keep_Rn, self.signals)

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC):
        with self._span("restorer", ctx.scale_index, block):
            return self.restorer.restore(ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC, self.signals)

    def latent_mask(self, ctx):
        restored = self.restorer.latent_mask(ctx, self.signals)
        frozen = self.skip.latent_mask(ctx, self.signals)
        if restored is None or frozen is None:
            return frozen if restored is None else restored
        return restored & frozen

    def observe_branch(self, ctx, block, branch, out_RNC):
        for part in self.parts.values():
            part.observe_branch(ctx, block, branch, out_RNC, self.signals)

    def observe_block(self, ctx, block, x_in_RNC, x_out_RNC):
        for part in self.parts.values():
            part.observe_block(ctx, block, x_in_RNC, x_out_RNC, self.signals)

    def observe_lens(self, ctx, block, lens):
        for part in self.parts.values():
            part.observe_lens(ctx, block, lens, self.signals)

    def observe_logits(self, ctx, raw_logits_RNV):
        for part in self.parts.values():
            part.observe_logits(ctx, raw_logits_RNV, self.signals)

    def plan_attention(self, ctx: ScaleContext, block: int):
        return self.attention.pattern(ctx, block, self.signals)

    def plan_kv(self, ctx: ScaleContext, cache):
        with self._span("kv", ctx.scale_index):
            return self.kv.plan_kv(ctx, cache, self.signals)

    def end_scale(self, ctx: ScaleContext, record: ScaleRecord) -> None:
        self.signals.records[ctx.scale_index] = record
        for part in self.parts.values():
            part.end_scale(ctx, record, self.signals)

    # diagnostics -----------------------------------------------------------------------------------------
    def activation_scales(self) -> torch.Tensor | None:
        """First accelerated scale per sample of the last generation (num_scales = never)."""
        return None if self.signals is None else self.signals.activation_scale_B


def rank_grid(scores_RN: torch.Tensor, bits: int) -> torch.Tensor:
    """Scores rounded to multiples of ``2^-bits · max_r |finite score|`` of their row (``bits=0``: unchanged).

    Infinite scores (forced keeps) and NaN pass through. The grid is per row, so the result depends on the row
    alone; values closer than one step become exact ties, which :func:`top_tokens` breaks by position.
    """
    if bits <= 0:
        return scores_RN
    finite = torch.isfinite(scores_RN)
    scale_R1 = torch.where(finite, scores_RN.abs(), torch.zeros_like(scores_RN)).amax(1, keepdim=True)
    step_R1 = (scale_R1 * 2.0 ** -bits).clamp_min(torch.finfo(scores_RN.dtype).tiny)
    return torch.where(finite, torch.round(scores_RN / step_R1) * step_R1, scores_RN)


def top_tokens(scores_RN: torch.Tensor, counts_R: torch.Tensor, n_max: int, uniform: bool | None = None,
               host_counts_R: torch.Tensor | None = None):
    """Indices of the ``counts[r]`` highest-scoring tokens of each row, sorted by position.

    The order is total and a function of the row alone: score descending, ties broken by the lower position.
    (``topk`` is not: which of several tied tokens survives depends on ``k``, i.e. on the batch's largest keep
    count, and Haar energies tie exactly inside 2×2 cells.) Rows keeping fewer than ``n_max`` are padded
    (repeating their first kept index) and marked invalid in a :class:`TokenSelection`, so each sample's result
    is independent of its batch neighbours. ``uniform``: whether every row keeps ``n_max`` (a caller that read the
    counts on the host says so; None: tested here, a host synchronisation on a GPU). ``host_counts_R``: the same
    counts already on the host; the selection then carries them (``engine.policy.ragged_selection``), so the
    engine's packing, attention and KV cache read no counts back.
    """
    R, N = scores_RN.shape
    # a stable sort keeps the original (position) order among equal scores; NaN would break the total order
    scores_RN = torch.nan_to_num(scores_RN, nan=float("-inf"))
    idx_desc = scores_RN.sort(dim=1, descending=True, stable=True).indices[:, :n_max]
    if uniform:
        return idx_desc.sort(dim=1).values
    valid = torch.arange(n_max, device=scores_RN.device).view(1, -1) < counts_R.to(scores_RN.device).view(-1, 1)
    if uniform is None and bool(valid.all()):
        return idx_desc.sort(dim=1).values
    keyed = torch.where(valid, idx_desc, torch.full_like(idx_desc, N)).sort(dim=1).values
    valid_sorted = keyed < N
    index = torch.where(valid_sorted, keyed, keyed[:, :1])
    if host_counts_R is not None:  # row r's valid slots: its first counts[r] (kept positions sorted, padding last)
        return ragged_selection(index, valid_sorted, host_counts_R.tolist())
    return TokenSelection(index, valid_sorted)


def build_policy(config: PolicyConfig | None) -> Policy:
    """``None`` or a config whose activation is ``never`` with no guidance/skip change is still an AccelPolicy;
    use ``Policy()`` for the bare loop."""
    return Policy() if config is None else AccelPolicy(config)
