"""Measurements on dense generations: a tracing policy, and ToProVAR's τ calibration (ToProVAR Fig. 8, App. A.2).

:class:`TracePolicy` runs the plain algorithm (nothing is pruned, the images are the baseline's) while it asks
the loop for observations — attention probabilities, the logit lens, the decoded image after a scale — and lets
registered scorer components score chosen scales without acting on the scores. The analyses of the ablation
families (NOVA's per-layer entropy maps, LD-Pruning's criterion IoU and γ_k curve) and ``python -m studies.calibrate``
are built on it.

ToProVAR's scale depth ``D = min{s : ρ_s ≤ τ}`` (``ρ_s`` = fraction of the tokens of scale s whose attention entropy
is below the scale's mean) exits, or starts pruning, at D. The paper chose τ = 0.4 "because generations with SSIM
> 0.8 to the full baseline cluster at ρ ≈ 0.4", calibrated once per backbone on ~50 prompts (specs/methods.md
§4.2). :func:`measure_rho_ssim` measures, per sample, ``ρ_s`` at every scale and the SSIM between the image decoded
after scale s (exiting there) and the full image; :func:`implied_tau` turns that table into τ:

* a sample's **good depth** ``s*`` is the earliest scale from which every later exit keeps SSIM above the threshold
  (RECONSTRUCTED: "stays above", so a transient good scale does not count; the last scale always qualifies);
* its **ρ\\*** is ``ρ`` at ``s*`` — or at the first tested scale after it when ``s*`` is too small to be tested —,
  the value τ must reach for D to come as early as allowed, and its **ceiling** is ``min_{s < s*} ρ_s`` (τ must stay
  below it for D to come no earlier than s*);
* τ = the ``statistic`` (median by default, RECONSTRUCTED: "cluster at") of ρ\\* over the samples; the result also
  reports, for τ and for the paper's 0.4, the share of samples whose exit is safe (not before s*), and the largest
  τ that keeps 90 % of the samples safe (``tau_safe``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from var_core.engine import Policy, ScalePlan

__all__ = ["TracePolicy", "trace_batches", "batch_conditions", "RhoTable", "TauCalibration", "measure_rho_ssim",
           "implied_tau", "depth_of", "RHO_SOURCES", "PAPER_TAU"]

RHO_SOURCES = ("attention_block0", "attention_mean_previous", "predictive")  # as low_entropy_ratio / depth_exit
STATISTICS = ("median", "mean")
PAPER_TAU = 0.4


# ----------------------------------------------------------------------------------------------- tracing
class TracePolicy(Policy):
    """A dense generation that observes. All arguments are per-scale predicates ``f(si) -> ...``.

    Args:
        attention_blocks: blocks whose head-averaged attention entropy is recorded (``attention_entropy``).
        lens_blocks: blocks whose output goes through the head; the conditional rows' predictive entropy is kept
            (``lens_entropy[(si, block)]``, ``[B, N]``).
        decode: whether the latent is decoded after the scale (``ScaleRecord.image_B3HW``).
        scorers: ``{label: Scorer component}``; at the scales of ``score_scales`` each scores the tokens at block
            ``score_block`` (first branch) and its ``[B, N]`` scores are kept in ``scores[label][si]``. The
            scorers see a :class:`~var_core.accel.base.Signals` board whose activation scale is the first scored
            scale (so they ask for their observations on the scales they need) and get every observation they
            declare. Nothing is pruned.
        observers: ``{label: component}`` of any kind that only observe (start, needs, observation slots,
            end_scale; e.g. SATS measuring γ_k with a δ that never fires), on the same board.
    """

    name = "trace"

    def __init__(self, *, attention_blocks: Callable[[int], Iterable[int]] = lambda si: (),
                 lens_blocks: Callable[[int], Iterable[int]] = lambda si: (),
                 decode: Callable[[int], bool] = lambda si: False, scorers: dict[str, Any] | None = None,
                 score_scales: Sequence[int] = (), score_block: int = 0, observers: dict[str, Any] | None = None):
        self._attention = attention_blocks
        self._lens = lens_blocks
        self._decode = decode
        self.scorers = dict(scorers or {})
        self.observers = dict(observers or {})
        self._parts = list(self.observers.values()) + list(self.scorers.values())
        self.score_scales = tuple(score_scales)
        self.score_block = score_block
        self.signals = None

    def start(self, info) -> None:
        from var_core.accel.base import Signals

        self.info = info
        self.signals = Signals(info)
        first = min((s for s in self.score_scales), default=info.num_scales)
        if self.scorers:
            self.signals.activation_scale_B = torch.full((info.batch_size,), first, dtype=torch.long)
        for part in self._parts:
            part.start(info, self.signals)
        self.lens_entropy: dict[tuple[int, int], torch.Tensor] = {}
        self.scores: dict[str, dict[int, torch.Tensor]] = {label: {} for label in self.scorers}
        self.records = []
        self._attention_now: set[int] = set()

    def plan_scale(self, ctx) -> ScalePlan:
        from var_core.accel.base import Needs

        si = ctx.scale_index
        self.signals.pruning_now = si in self.score_scales
        needs = Needs()
        for part in self._parts:
            needs = needs | part.needs(ctx, self.signals)
        self._attention_now = set(self._attention(si))
        return ScalePlan(prune=si in self.score_scales and bool(self.scorers),
                         attention_blocks=frozenset(self._attention_now) | needs.attention_blocks,
                         lens_blocks=frozenset(self._lens(si)) | needs.lens_blocks,
                         observe_blocks=needs.block_io, observe_branches=needs.branch_outputs,
                         decode_latent=bool(self._decode(si)) or needs.decoded_image)

    def plan_block(self, ctx, block, branch, x_RNC):
        if block == self.score_block and branch == ctx.branches[0]:
            B = ctx.batch_size
            for label, part in self.scorers.items():
                scores = part.score(ctx, block, branch, x_RNC, self.signals).float()
                self.scores[label][ctx.scale_index] = scores[:B].detach().cpu()
        return None  # dense

    def observe_attention(self, ctx, block, probs_RHnL, keep_Rn) -> None:
        from var_core.accel.attention_stats import record_attention_entropy

        if block in self._attention_now:
            record_attention_entropy(self.signals, ctx, block, probs_RHnL, keep_Rn)
        for part in self._parts:
            part.observe_attention(ctx, block, probs_RHnL, keep_Rn, self.signals)

    def observe_lens(self, ctx, block, lens) -> None:
        from var_core.accel.entropy import predictive_entropy

        if block in set(self._lens(ctx.scale_index)):
            self.lens_entropy[(ctx.scale_index, block)] = predictive_entropy(lens.cond_logits(),
                                                                             ctx.family).float().cpu()
        for part in self._parts:
            part.observe_lens(ctx, block, lens, self.signals)

    def observe_block(self, ctx, block, x_in_RNC, x_out_RNC) -> None:
        for part in self._parts:
            part.observe_block(ctx, block, x_in_RNC, x_out_RNC, self.signals)

    def observe_branch(self, ctx, block, branch, out_RNC) -> None:
        for part in self._parts:
            part.observe_branch(ctx, block, branch, out_RNC, self.signals)

    def observe_logits(self, ctx, raw_logits_RNV) -> None:
        for part in self._parts:
            part.observe_logits(ctx, raw_logits_RNV, self.signals)

    def end_scale(self, ctx, record) -> None:
        self.signals.records[ctx.scale_index] = record
        self.records.append(record)
        for part in self._parts:
            part.end_scale(ctx, record, self.signals)

    def attention_entropy(self, si: int, block: int) -> torch.Tensor | None:
        """``[B, N]`` head-averaged attention entropy of the conditional rows (None if not observed)."""
        ent = self.signals.attention_entropy.get((si, block)) if self.signals is not None else None
        return None if ent is None else ent[: self.info.batch_size].float().cpu()


def batch_conditions(conditions, indices: Sequence[int]):
    """The conditions of the samples ``indices`` of a :class:`~var_core.eval.lightning.ConditionSet`, as
    :func:`var_core.engine.generate` takes them (prompts when the set has them, else class labels)."""
    prompts = getattr(conditions, "prompts", None)
    if prompts:
        return [prompts[i] for i in indices]
    return torch.tensor([conditions.labels[i] for i in indices], dtype=torch.long)


def trace_batches(adapter, conditions, sampling, make_policy: Callable[[], TracePolicy], *, samples: int,
                  batch_size: int = 8, decode: bool = True):
    """Generate the first ``samples`` samples of ``conditions`` (their own seeds) in batches with a fresh
    :class:`TracePolicy` each; yields ``(indices, policy, result)``."""
    from var_core.engine import GenerationOptions, generate

    n = min(samples, len(conditions))
    seeds = conditions.seeds
    options = GenerationOptions(check_finite=True, decode=decode)
    for start in range(0, n, batch_size):
        indices = list(range(start, min(n, start + batch_size)))
        policy = make_policy()
        result = generate(adapter, batch_conditions(conditions, indices), seeds=[seeds[i] for i in indices],
                          sampling=sampling, policy=policy, options=options)
        yield indices, policy, result


# ----------------------------------------------------------------------------------------------- ToProVAR τ
@dataclass
class RhoTable:
    """Per sample and scale: ToProVAR's ρ_s (NaN where not tested) and the SSIM of exiting after scale s."""

    rho: np.ndarray  # [samples, scales]
    ssim: np.ndarray  # [samples, scales]; the last scale is 1 (the full image itself)
    scale_hw: tuple[tuple[int, int], ...]
    source: str
    min_test_tokens: int
    indices: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"rho": _nan_list(self.rho), "ssim": _nan_list(self.ssim), "scale_hw": [list(hw) for hw in self.scale_hw],
                "source": self.source, "min_test_tokens": self.min_test_tokens, "indices": self.indices}


def _nan_list(a: np.ndarray) -> list:
    return [[None if not math.isfinite(float(v)) else float(v) for v in row] for row in np.asarray(a, dtype=float)]


def below_mean_fraction(entropy_BN: torch.Tensor) -> torch.Tensor:
    """ToProVAR Eq. 3 ρ per row (the ``low_entropy_ratio`` component's own formula)."""
    from var_core.accel.activation.low_entropy_ratio import below_mean_ratio

    return below_mean_ratio(entropy_BN)


def measure_rho_ssim(adapter, conditions, sampling, *, samples: int = 32, batch_size: int = 8,
                     source: str = "attention_block0", min_test_tokens: int = 16,
                     log: Callable[[str], None] | None = None) -> RhoTable:
    """ρ_s and exit-SSIM for the first ``samples`` samples of ``conditions`` (dense generations).

    ``source`` — the entropy map behind ρ_s: ``attention_block0`` (head-averaged attention entropy of block 0, the
    ``low_entropy_ratio`` default), ``attention_mean_previous`` (mean over all blocks of the scale) or ``predictive`` (the
    final logits' entropy). Scales with fewer than ``min_test_tokens`` tokens are not tested (NaN), as in the
    component. The exit image of scale s is the latent accumulated up to s, decoded — what ``depth_exit`` returns
    when it stops there; SSIM against the full image as the studies compute it (8-bit images, torchmetrics)."""
    from var_core.accel.entropy import predictive_entropy
    from var_core.eval.metrics import fidelity_per_sample

    if source not in RHO_SOURCES:
        from var_core.errors import UserError, did_you_mean

        raise UserError(f"unknown rho source {source!r}.{did_you_mean(source, RHO_SOURCES)} Sources: "
                        f"{', '.join(RHO_SOURCES)}")
    K, L = adapter.num_scales, adapter.num_blocks
    testable = [h * w >= min_test_tokens for h, w in adapter.scale_hw]

    def attention(si):
        if source == "predictive" or not testable[si]:
            return ()
        return (0,) if source == "attention_block0" else range(L)

    rho_rows, ssim_rows, indices = [], [], []
    for idx, policy, result in trace_batches(adapter, conditions, sampling,
                                             lambda: TracePolicy(attention_blocks=attention, decode=lambda si: True),
                                             samples=samples, batch_size=batch_size):
        B = len(idx)
        rho = torch.full((B, K), float("nan"), dtype=torch.float64)
        ssim = torch.full((B, K), float("nan"), dtype=torch.float64)
        final = result.images
        for record in policy.records:
            si = record.scale_index
            if record.skipped:
                continue
            if testable[si]:
                if source == "predictive":
                    ent = predictive_entropy(record.guided_logits_BNV, adapter.family).float().cpu()
                elif source == "attention_block0":
                    ent = policy.attention_entropy(si, 0)
                else:
                    maps = [policy.attention_entropy(si, b) for b in range(L)]
                    ent = torch.stack([m for m in maps if m is not None]).nanmean(0)
                rho[:, si] = below_mean_fraction(ent).cpu()
            values, _ = fidelity_per_sample(record.image_B3HW.cpu(), final.cpu())
            ssim[:, si] = torch.from_numpy(values["ssim"]) if "ssim" in values else float("nan")
        rho_rows.append(rho.numpy())
        ssim_rows.append(ssim.numpy())
        indices += idx
        if log is not None:
            log(f"  traced samples {idx[0]}..{idx[-1]}")
    return RhoTable(np.concatenate(rho_rows), np.concatenate(ssim_rows), tuple(adapter.scale_hw), source,
                    min_test_tokens, indices)


def depth_of(rho_row: np.ndarray, tau: float) -> int | None:
    """The exit scale of one sample: the first tested scale with ``ρ_s ≤ τ`` (NaN = not tested), the last scale
    generated (``depth_exit``'s D is the one after it); None = never fires (generated in full)."""
    for s, r in enumerate(rho_row):
        if math.isfinite(r) and r <= tau:
            return s
    return None


@dataclass
class TauCalibration:
    ssim_threshold: float
    statistic: str
    good_depth: list[int]  # s* per sample (0-indexed)
    rho_star: list[float | None]  # ρ at s*, or at the first tested scale after it (None: no tested scale left)
    star_scale: list[int | None]  # the scale rho_star was read at
    ceiling: list[float | None]  # min over tested s < s* of ρ_s (None: no tested scale before s*)
    pooled: list[float]  # ρ_s of every (sample, tested scale) whose exit SSIM exceeds the threshold
    tau: float | None
    safe_share: dict[str, float]  # "tau" / "paper" -> share of samples exiting at or after s* (never counts safe)
    depth: dict[str, list[int | None]]  # exit scale (depth_of) per sample for the implied τ and for the paper's
    safe_target: float = 0.9
    tau_safe: float | None = None  # the largest ρ value of the table at which ≥ safe_target of the samples are safe

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _safe_share(rho: np.ndarray, good: list[int], tau: float) -> float:
    exits = [depth_of(rho[i], tau) for i in range(rho.shape[0])]
    return float(np.mean([d is None or d >= s for d, s in zip(exits, good)])) if exits else math.nan


def implied_tau(rho: np.ndarray, ssim: np.ndarray, *, ssim_threshold: float = 0.8, statistic: str = "median",
                paper_tau: float = PAPER_TAU, safe_target: float = 0.9) -> TauCalibration:
    """τ from a ρ / exit-SSIM table (see the module docstring for the rule). Also ``tau_safe``: the largest τ
    among the table's ρ values for which at least ``safe_target`` of the samples exit no earlier than their good
    depth (the safe share only falls as τ grows: a larger τ fires earlier)."""
    if statistic not in STATISTICS:
        raise ValueError(f"unknown statistic {statistic!r}; choose one of {STATISTICS}")
    rho, ssim = np.asarray(rho, dtype=float), np.asarray(ssim, dtype=float)
    if rho.shape != ssim.shape or rho.ndim != 2:
        raise ValueError(f"rho and ssim must be [samples, scales] tables of one shape, got {rho.shape} and "
                         f"{ssim.shape}")
    n, K = rho.shape
    good, stars, star_scales, ceilings, pooled = [], [], [], [], []
    for i in range(n):
        above = ssim[i] > ssim_threshold
        above[K - 1] = True  # exiting after the last scale IS the full image
        s_star = K - 1
        while s_star > 0 and above[s_star - 1]:
            s_star -= 1
        good.append(s_star)
        tested = [s for s in range(s_star, K) if math.isfinite(rho[i, s])]  # D can only fire at a tested scale
        stars.append(float(rho[i, tested[0]]) if tested else None)
        star_scales.append(tested[0] if tested else None)
        before = [r for r in rho[i, :s_star] if math.isfinite(r)]
        ceilings.append(float(min(before)) if before else None)
        pooled += [float(r) for r, ok in zip(rho[i], ssim[i] > ssim_threshold) if ok and math.isfinite(r)]
    values = [r for r in stars if r is not None]
    tau = None
    if values:
        tau = float(np.median(values)) if statistic == "median" else float(np.mean(values))
    depth, safe = {}, {}
    for key, t in (("tau", tau), ("paper", paper_tau)):
        if t is None:
            continue
        d = [depth_of(rho[i], t) for i in range(n)]
        depth[key] = d
        safe[key] = float(np.mean([di is None or di >= s for di, s in zip(d, good)])) if n else math.nan
    candidates = sorted({float(r) for r in rho.flatten() if math.isfinite(r)})
    tau_safe = max((t for t in candidates if _safe_share(rho, good, t) >= safe_target), default=None)
    return TauCalibration(ssim_threshold, statistic, good, stars, star_scales, ceilings, pooled, tau, safe, depth,
                          safe_target, tau_safe)


# ----------------------------------------------------------------------------------------------- HACK heads
def calibrate_hack(adapter, conditions, sampling, *, samples: int = 8, batch_size: int = 8, budget: float = 0.1,
                   window: int = 16) -> dict:
    """HACK's offline head classification (``var_core.accel.kv.hack``, RECONSTRUCTED): dense generations of the
    first ``samples`` samples with the HACK component observing every block's attention (its ``calibrating``
    mode), per block and head the recency mass and column concentration averaged over rows and scales, and
    ``structural`` where the former is larger. The result is the file ``kv.calibration`` reads."""
    from var_core.accel.kv.hack import HACK, calibration_table

    merged: dict[int, list] = {}
    config = HACK.Config(budget=budget, window=window, calibrating=True)
    for _, policy, _ in trace_batches(adapter, conditions, sampling,
                                      lambda: TracePolicy(observers={"hack": HACK(config)}),
                                      samples=samples, batch_size=batch_size, decode=False):
        for block, entries in policy.signals.extras.get("hack_stats", {}).items():
            merged.setdefault(block, []).extend(entries)
    data = calibration_table({"hack_stats": merged}, adapter.num_blocks)
    data.update(samples=min(samples, len(conditions)), budget=budget, window=window,
                heads=len(data["structural"][0]) if data["structural"] else 0)
    return data
