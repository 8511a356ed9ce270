"""Shared math of the linkage schedules (NOVA §2.3, ToProVAR §4.4, LD-Pruning §3.1): a helper, not a component.

Conventions: scales are 0-indexed ``si`` here; NOVA's formulas use the 1-indexed ``t = si + 1``. Network rows are
``R = B`` or ``2B`` (conditional rows first), and row ``r`` belongs to sample ``r mod B``. Every per-sample quantity
is computed per sample and broadcast to its rows, so a sample keeps the same count in both CFG halves and does not
depend on its batch neighbours.

Host synchronisations (issue 27): the entropy-derived quantities (growth, lens and predictive entropies, ratios,
counts) stay on the device the entropies live on; only the activation scales are host data, moved to the device
once per scale (:func:`per_scale`). A block's kept count reaches the host once, in the policy, where it becomes a
shape.
"""

from __future__ import annotations

import torch

from ..activation._entropy_growth import growth, scale_entropy_curve
from ..attention_stats import may_prune_at
from ..base import NO_NEEDS, Needs, Signals
from ..lens import record_lens_entropy
from ...engine.packing import attach_host_copy

DIRECTIONS = ("printed", "increasing")
RATIO_MEANINGS = ("removed", "kept")
FIRST_BLOCK_REFERENCES = ("previous_scale", "none")

_CEIL_SLACK = 1e-9  # (1 − r)·N computed in float64 may land a hair above an integer


# ------------------------------------------------------------------------------------------------ pure formulas
def nova_scale_ratio(t: float | torch.Tensor, t_star: float | torch.Tensor, g_prev: float | torch.Tensor,
                     tau: float, lam: float, direction: str = "printed") -> torch.Tensor:
    """NOVA's scale-linkage ratio (1-indexed ``t``, ``t*``), float64.

    ``printed``: ``sigmoid(τ·(t*+1)/t − λ·tanh(g))`` (decreases with t); ``increasing``:
    ``sigmoid(τ·t/(t*+1) − λ·tanh(g))``. ``g`` is the growth of the last finished scale (``g_{t−1}``; the
    write-up's ``g_t`` is unknown before scale t's logits).
    """
    t = torch.as_tensor(t, dtype=torch.float64)
    t_star = torch.as_tensor(t_star, dtype=torch.float64)
    g = torch.as_tensor(g_prev, dtype=torch.float64)
    if direction == "printed":
        x = tau * (t_star + 1) / t
    elif direction == "increasing":
        x = tau * t / (t_star + 1)
    else:
        raise ValueError(f"unknown direction {direction!r}; choose one of {DIRECTIONS}")
    return torch.sigmoid(x - lam * torch.tanh(g))


def layer_adjusted_ratio(r_base: float | torch.Tensor, h_layer: float | torch.Tensor,
                         h_before_mean: float | torch.Tensor, lam: float) -> torch.Tensor:
    """NOVA's layer linkage (RECONSTRUCTED): ``sigmoid(logit(r) − λ·tanh(H_l − mean_{j<l} H_j))``, float64.

    A layer whose entropy is above the mean of the earlier layers gets a smaller reduction. A NaN entropy
    difference (nothing to compare with) leaves ``r`` unchanged.
    """
    r = torch.as_tensor(r_base, dtype=torch.float64)
    diff = torch.as_tensor(h_layer, dtype=torch.float64) - torch.as_tensor(h_before_mean, dtype=torch.float64)
    diff = torch.nan_to_num(diff, nan=0.0)
    return torch.sigmoid(torch.logit(r) - lam * torch.tanh(diff))


def keep_from_ratio(ratio: torch.Tensor, num_tokens: int, ratio_is: str = "removed") -> torch.Tensor:
    """int64 kept count ``ceil((1 − r)·N)`` (``r`` removed) or ``ceil(r·N)`` (``r`` kept), within ``[0, N]``."""
    if ratio_is not in RATIO_MEANINGS:
        raise ValueError(f"unknown ratio meaning {ratio_is!r}; choose one of {RATIO_MEANINGS}")
    frac = (1.0 - ratio) if ratio_is == "removed" else ratio
    keep = torch.ceil(frac.double() * num_tokens - _CEIL_SLACK * num_tokens)
    return keep.clamp(0, num_tokens).long()


def linkage_keep_bound(ctx, signals: Signals, logit_centre_B: torch.Tensor, lam_total: float,
                       ratio_is: str = "removed", rows: int | None = None) -> tuple[int, ...]:
    """Host-known upper bounds of a linkage schedule's kept counts at this scale, one per network row
    (``count_sync='bounded'``; ``rows`` default ``B``; row ``r`` is sample ``r mod B``).

    The ratio is ``sigmoid(logit_centre − Σ λ·tanh(·))`` with every ``tanh`` in ``[−1, 1]``, so it lies in
    ``sigmoid(logit_centre ± lam_total)`` whatever the entropies the scale will measure; a sample's bound is the
    largest kept count over that range plus one token against rounding at a ceiling, ``N`` while the sample has
    not started (its rows run dense). ``logit_centre_B``: float64 ``[B]`` on the host, known before the scale
    (``logit(r_t)`` of NOVA's scale linkage, ``logit(r_base)`` of the layer linkage alone)."""
    N = ctx.num_tokens
    centre = logit_centre_B.double()
    extreme = torch.sigmoid(centre - lam_total) if ratio_is == "removed" else torch.sigmoid(centre + lam_total)
    keep_B = (keep_from_ratio(extreme, N, ratio_is) + 1).clamp(max=N)
    keep_B = torch.where(started_B(ctx, signals), keep_B, torch.full_like(keep_B, N))  # host data
    per_sample = keep_B.tolist()
    B = ctx.batch_size
    return tuple(per_sample[r % B] for r in range(B if rows is None else rows))


# ------------------------------------------------------------------------------------------------ per-sample plumbing
def sample_of_row(batch_size: int, rows: int, device=None) -> torch.Tensor:
    """int64 ``[R]``: the sample each network row belongs to (``r mod B``)."""
    return torch.arange(rows, device=device) % batch_size


def to_rows(values_B: torch.Tensor, batch_size: int, rows: int, device) -> torch.Tensor:
    return values_B.to(device)[sample_of_row(batch_size, rows, device)]


_MEMO_KEY = "linkage.per_scale"


def per_scale(ctx, signals: Signals, name, compute):
    """``compute()`` once per scale (memoised in ``signals.extras``; every block of a scale reads the same value),
    so a host→device copy of a per-scale decision happens once per scale, not once per block. The memo is also
    keyed on the activation's ``signals.activation_scale_B`` object: an activation that decides inside a scale
    (``low_entropy_ratio``'s ``first_accelerated='at'``) replaces it, and the later blocks recompute."""
    extras = getattr(signals, "extras", None)
    if extras is None:
        return compute()
    memo = extras.setdefault(_MEMO_KEY, {})
    first = getattr(signals, "activation_scale_B", None)
    if memo.get("scale") != ctx.scale_index or memo.get("first") is not first:
        memo.clear()
        memo["scale"], memo["first"] = ctx.scale_index, first
    if name not in memo:
        memo[name] = compute()
    return memo[name]


def activation_scales(ctx, signals: Signals) -> torch.Tensor:
    """int64 ``[B]`` (CPU) first accelerated scale per sample; with an activation that publishes none, every
    sample counts as accelerated from scale 0 (the policy's activation mask still applies)."""
    first = signals.activation_scale_B
    if first is None:
        return torch.zeros(ctx.batch_size, dtype=torch.long)
    return first.cpu()


def started_B(ctx, signals: Signals) -> torch.Tensor:
    """bool ``[B]``: the sample's activation scale has been reached (rows of other samples stay dense, which also
    lets an activation switch on inside a scale: see ``low_entropy_ratio``'s ``first_accelerated='at'``)."""
    return activation_scales(ctx, signals) <= ctx.scale_index


def started_on(ctx, signals: Signals, device) -> torch.Tensor:
    """:func:`started_B` on ``device``, copied there once per scale."""
    return activation_scales_on(ctx, signals, device) <= ctx.scale_index


def activation_scales_on(ctx, signals: Signals, device) -> torch.Tensor:
    """:func:`activation_scales` on ``device``, copied there once per scale; filled there (no copy) when every
    sample has the same activation scale (always at batch 1)."""
    def on_device():
        first = activation_scales(ctx, signals)
        if bool((first == first[0]).all()):  # host data
            return torch.full(first.shape, int(first[0]), dtype=first.dtype, device=device)
        return first.to(device)
    return per_scale(ctx, signals, ("first", str(device)), on_device)


def counts_for_rows(ctx, keep_B: torch.Tensor, active_B: torch.Tensor, rows: int, device=None) -> torch.Tensor:
    """``[R]`` kept counts: ``keep_B`` for rows of ``active_B`` samples, ``N`` elsewhere, where ``keep_B`` lives
    (host data stays on the host: the policy reads it for free; ``device`` is accepted for older callers and not
    used). Rows that all keep ``N`` are dense: the policy runs them dense (no host read here)."""
    N = ctx.num_tokens
    if active_B.device != keep_B.device:
        active_B = active_B.to(keep_B.device)
    keep_B = torch.where(active_B, keep_B, torch.full_like(keep_B, N))
    return keep_B[sample_of_row(ctx.batch_size, rows, keep_B.device)]


# ------------------------------------------------------------------------------------------------ entropy plumbing
def last_growth_B(ctx, signals: Signals, definition: str, device=None) -> torch.Tensor:
    """float64 ``[B]`` (on the entropies' device; on ``device`` where undefined): the growth ``g_{t−1} = H_{t−1} −
    H_{t−2}`` of the last finished scale (0 where it is undefined: before scale 2, or next to a skipped scale)."""
    si = ctx.scale_index
    B = ctx.batch_size
    if si < 2:
        return torch.zeros(B, dtype=torch.float64, device=device)
    H = scale_entropy_curve(signals, si - 1, definition)
    if H is None:
        return torch.zeros(B, dtype=torch.float64, device=device)
    return torch.nan_to_num(growth(H)[:, si - 1], nan=0.0)


def previous_scale_mean_entropy_B(ctx, signals: Signals, device=None) -> torch.Tensor:
    """float64 ``[B]`` (on the entropies' device): mean predictive entropy of the last computed scale (NaN, on
    ``device``, if none)."""
    record = ctx.last_computed()
    ent = None if record is None else signals.token_entropy(record.scale_index)
    if ent is None:
        return torch.full((ctx.batch_size,), float("nan"), dtype=torch.float64, device=device)
    return ent.double().mean(-1)


def lens_mean_B(ctx, signals: Signals, block: int, device=None) -> torch.Tensor:
    """float64 ``[B]`` (on the lens entropies' device): mean logit-lens entropy of the hidden state AFTER ``block``
    at this scale (the sample's conditional row, or its only row); NaN (on ``device``) when it was not recorded."""
    ent = signals.lens_entropy.get((ctx.scale_index, block))
    if ent is None:
        return torch.full((ctx.batch_size,), float("nan"), dtype=torch.float64, device=device)
    return ent[: ctx.batch_size].double().nanmean(-1)


def layer_entropy_difference_B(ctx, signals: Signals, block: int, first_block_reference: str,
                               device=None) -> torch.Tensor:
    """``[B]``: ``H_{t,l} − mean_{j<l} H_{t,j}`` for 0-indexed ``block`` (paper ``l = block + 1``).

    ``H_{t,l}`` is the lens entropy of the hidden state ENTERING block l, i.e. recorded after block ``block − 1``.
    The state entering the first block is the raw input (lens meaningless): with ``previous_scale`` its entropy is
    replaced by the previous scale's mean predictive entropy (methods.md §2.5); with ``none`` it is left out, so
    the first two blocks keep the base ratio. NaN (→ base ratio) where nothing is available.
    """
    B = ctx.batch_size
    nan = torch.full((B,), float("nan"), dtype=torch.float64, device=device)
    if block < 1:
        return nan
    current = lens_mean_B(ctx, signals, block - 1, device)
    earlier = [lens_mean_B(ctx, signals, j, device) for j in range(block - 1)]  # entering blocks 1 .. block-1
    if first_block_reference == "previous_scale":
        earlier.insert(0, previous_scale_mean_entropy_B(ctx, signals, device))
    elif first_block_reference != "none":
        raise ValueError(f"unknown first-block reference {first_block_reference!r}; "
                         f"choose one of {FIRST_BLOCK_REFERENCES}")
    if not earlier:
        return nan
    return current - torch.stack(earlier).nanmean(0)


def profile_difference_B(ctx, profile: tuple[float, ...], block: int) -> torch.Tensor:
    """``[B]`` (CPU): ``P_l − mean_{j<l} P_j`` from a FIXED per-block entropy profile (``P[b]`` = entropy of the
    state entering 0-indexed block ``b``, the same for every sample and scale); NaN (→ base ratio) for the first
    block. Host data: no synchronisation."""
    B = ctx.batch_size
    if block < 1:
        return torch.full((B,), float("nan"), dtype=torch.float64)
    values = torch.tensor(profile[: block + 1], dtype=torch.float64)
    return (values[block] - values[:block].mean()).expand(B).clone()


def layer_difference_B(ctx, signals: Signals, block: int, first_block_reference: str,
                       profile: tuple[float, ...], device=None) -> torch.Tensor:
    """The layer-entropy difference of the layer linkage: from the fixed ``profile`` when one is given (no lens,
    host data), else from the logit lens (:func:`layer_entropy_difference_B`, on the lens entropies' device;
    ``device`` where nothing was recorded)."""
    if profile:
        return profile_difference_B(ctx, profile, block)
    return layer_entropy_difference_B(ctx, signals, block, first_block_reference, device)


def layer_difference_on(ctx, signals: Signals, block: int, first_block_reference: str,
                        profile: tuple[float, ...], device) -> torch.Tensor:
    """:func:`layer_difference_B` on ``device``: a fixed profile's differences of every block are copied there once
    per scale, the lens route computes on the lens entropies' device."""
    if profile:  # the same for every scale: copied to the device once per generation
        memo = signals.extras.setdefault("linkage.profile", {})
        key = (profile, ctx.batch_size, str(device))
        if key not in memo:
            memo[key] = torch.stack([profile_difference_B(ctx, profile, b) for b in range(len(profile))]).to(device)
        return memo[key][block]
    return layer_entropy_difference_B(ctx, signals, block, first_block_reference, device).to(device)


def per_scale_block_counts(schedule, ctx, rows: int, signals: Signals, device) -> tuple[torch.Tensor, list]:
    """``(r [L, B] on the device, per block the counts [R] on the device)`` of every block of the scale from
    ``schedule._block_counts`` (a schedule whose counts need nothing measured inside the scale: a fixed layer
    profile), computed once per scale and copied to the host in one transfer; each block's device counts carry
    their host copy (``engine.packing.host_copy``), so the policy reads them for free and a ragged selection needs
    no copy back to the device."""
    def every_block():
        parts = [schedule._block_counts(ctx, b, rows, signals, device) for b in range(ctx.num_blocks)]
        counts_LR = torch.stack([c for _, c in parts])
        host_LR = counts_LR.cpu()
        return (torch.stack([r for r, _ in parts]),
                [attach_host_copy(counts_LR[b], host_LR[b]) for b in range(ctx.num_blocks)])
    return per_scale(ctx, signals, ("block_counts", id(schedule), rows, str(device)), every_block)


def measure_layer_profile(signals: Signals, num_blocks: int) -> tuple[float, ...]:
    """A fixed layer profile (``layer_profile`` of the linkage schedules) measured from a generation that ran the
    logit lens: for every scale with lens records, per sample, the entropy entering block 0 is the previous
    computed scale's mean predictive entropy (``first_block_reference='previous_scale'``) and the entropy entering
    block ``b ≥ 1`` the mean lens entropy after block ``b − 1``; each block's value is the mean over those scales
    and samples (NaN where never measured). Run a lens arm on calibration prompts, then pass the result on."""
    per_block: list[list[torch.Tensor]] = [[] for _ in range(num_blocks)]
    scales = sorted({si for si, _ in signals.lens_entropy})
    for si in scales:
        previous = [sj for sj in range(si - 1, -1, -1) if signals.token_entropy(sj) is not None]
        if previous:
            per_block[0].append(signals.token_entropy(previous[0]).double().mean(-1).cpu())
        for block in range(1, num_blocks):
            ent = signals.lens_entropy.get((si, block - 1))
            if ent is not None:
                per_block[block].append(ent[: signals.info.batch_size].double().nanmean(-1).cpu())
    return tuple(float(torch.cat(values).nanmean()) if values else float("nan") for values in per_block)


def lens_blocks_needed(num_blocks: int) -> frozenset[int]:
    """Blocks whose output the layer linkage reads (entering blocks 1..L−1); the last block's output is the head."""
    return frozenset(range(max(0, num_blocks - 1)))


def layer_linkage_needs(ctx, signals: Signals) -> Needs:
    """Logit lens on blocks 0..L−2 at scales the policy prunes for an accelerated sample (the lens costs a head
    projection per block, a sizeable fraction of a block on codebook VARs: never asked for on dense scales)."""
    if not (signals.pruning_now and may_prune_at(ctx.scale_index, signals)):
        return NO_NEEDS
    return Needs(lens_blocks=lens_blocks_needed(ctx.num_blocks))


def layer_linkage_observe(ctx, block: int, lens, signals: Signals) -> None:
    """Record the lens entropy (shared definition of ``var_core.accel.lens``: guided CFG combination)."""
    if block in lens_blocks_needed(ctx.num_blocks) and may_prune_at(ctx.scale_index, signals):
        record_lens_entropy(signals, ctx, block, lens)


class LayerEntropyLinked:
    """Slots shared by the schedules that read NOVA's layer entropy (layer and dual linkage): ask for the logit
    lens on scales that may be pruned and record its entropy — unless the config gives a fixed ``layer_profile``
    (then no lens at all) — and prune a scale once any sample has started."""

    def _profile(self) -> tuple[float, ...]:
        return tuple(getattr(self.config, "layer_profile", ()))

    def check_model(self, info) -> None:
        profile = self._profile()
        if profile and len(profile) != info.num_blocks:
            raise ValueError(
                f"layer_profile has {len(profile)} values but the model has {info.num_blocks} blocks: give one "
                f"entropy per block (the state entering each block; measure it with "
                f"var_core.accel.schedules._linkage_math.measure_layer_profile on a lens run), or () for the lens")

    def start(self, info, signals: Signals) -> None:
        self.check_model(info)

    def needs(self, ctx, signals: Signals) -> Needs:
        if self._profile():
            return NO_NEEDS
        return layer_linkage_needs(ctx, signals)

    def observe_lens(self, ctx, block, lens, signals: Signals) -> None:
        if not self._profile():
            layer_linkage_observe(ctx, block, lens, signals)

    def prunes_scale(self, ctx, signals) -> bool:
        return bool(started_B(ctx, signals).any())
