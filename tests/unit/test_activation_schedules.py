"""NOVA / ToProVAR / LD-Pruning activations and schedules: hand-computed formulas, then short generations.

Hand values (τ = 0.8, λ = 0.1 unless stated): sigmoid(0.8·9/t) for t = 9..13 is 0.68997, 0.67261, 0.65803, 0.64566,
0.63503 (methods.md: 0.69, 0.67, 0.66, 0.65, 0.64); the increasing variant sigmoid(0.8·t/9) is 0.68997 … 0.76052.
"""

from __future__ import annotations

import math

import pytest
import torch

from var_core.accel import PolicyConfig, build_policy, component_config
from var_core.accel.activation._entropy_growth import first_accelerated_scale, scale_entropy_curve
from var_core.accel.activation.low_entropy_ratio import below_mean_ratio, depth_fires
from var_core.accel.base import Signals
from var_core.accel.registry import ACTIVATIONS, SCHEDULES
from var_core.accel.schedules._linkage_math import keep_from_ratio, layer_adjusted_ratio, nova_scale_ratio
from var_core.accel.schedules.energy_fraction import energy_keep_counts
from var_core.accel.schedules.toprovar_gate import layer_score, normalized_entropy, prune_probability, pruned_count
from var_core.engine import SamplingConfig, generate
from var_core.engine.context import GenerationInfo, GuidanceMode, ScaleContext, ScaleRecord
from var_core.engine.tracing import NULL_TRACER


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------------------------- fake generation state
class Fake:
    """A Signals board and ScaleContexts for a made-up model (no network): B samples, K scales of hw, L blocks."""

    def __init__(self, B=2, K=13, hw=(10, 10), L=2, guidance=GuidanceMode.BOTH, scale_hw=None):
        self.B, self.K, self.L, self.guidance = B, K, L, guidance
        self.scale_hw = tuple(scale_hw) if scale_hw is not None else (hw,) * K
        self.info = GenerationInfo(B, K, L, ("attn", "ffn"), self.scale_hw, "var", guidance, NULL_TRACER)
        self.signals = Signals(self.info)
        self.history: list[ScaleRecord] = []

    def finish_scale(self, si: int, token_entropy_BN: torch.Tensor | None = None) -> ScaleRecord:
        record = ScaleRecord(si, self.scale_hw[si], skipped=False, guidance=self.guidance)
        if token_entropy_BN is not None:
            self.signals._token_entropy[si] = token_entropy_BN.float()
        self.signals.records[si] = record
        self.history.append(record)
        return record

    def ctx(self, si: int) -> ScaleContext:
        return ScaleContext(si, self.K, self.scale_hw[si], 0, self.B, self.guidance, self.L, ("attn", "ffn"), "var",
                            tuple(self.history[:si]))

    def rows(self) -> int:
        return 2 * self.B if self.guidance is GuidanceMode.BOTH else self.B


def constant_entropy(B: int, N: int, values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(B, 1).expand(B, N).clone()


# ------------------------------------------------------------------------------------------------------ NOVA r_t
def test_nova_scale_ratio_printed_matches_methods_numbers():
    r = nova_scale_ratio(torch.arange(9, 14), 8, 0.0, tau=0.8, lam=0.1, direction="printed")
    assert [round(v, 2) for v in r.tolist()] == [0.69, 0.67, 0.66, 0.65, 0.64]
    assert r.tolist() == pytest.approx([0.68997, 0.67261, 0.65803, 0.64566, 0.63503], abs=1e-5)


def test_nova_scale_ratio_increasing_variant():
    r = nova_scale_ratio(torch.arange(9, 14), 8, 0.0, tau=0.8, lam=0.1, direction="increasing")
    assert r.tolist() == pytest.approx([0.68997, 0.70866, 0.72667, 0.74396, 0.76052], abs=1e-5)
    assert [round(v, 2) for v in (r[0].item(), r[-1].item())] == [0.69, 0.76]


def test_nova_scale_ratio_growth_term():
    # sigmoid(0.8·9/10 − 0.1·tanh(0.5)) = sigmoid(0.673788) = 0.66235; increasing with g = −0.3: 0.71464
    assert nova_scale_ratio(10, 8, 0.5, 0.8, 0.1).item() == pytest.approx(0.66235, abs=1e-5)
    assert nova_scale_ratio(10, 8, -0.3, 0.8, 0.1, "increasing").item() == pytest.approx(0.71464, abs=1e-5)


def test_keep_from_ratio_rounds_up():
    r = torch.tensor([sigmoid(0.8), 0.5, 0.0])
    assert keep_from_ratio(r, 100, "removed").tolist() == [32, 50, 100]  # ceil(31.0026) = 32
    assert keep_from_ratio(r, 100, "kept").tolist() == [69, 50, 0]  # ceil(68.997) = 69


def test_scale_linkage_component_counts_per_sample():
    fake = Fake(B=2, K=13, hw=(10, 10))
    for si in range(9):
        fake.finish_scale(si, constant_entropy(2, 100, [1.0, 2.0]))
    fake.signals.activation_scale_B = torch.tensor([8, 13])  # sample 0: t* = 8 (scales t >= 9 pruned); 1: never
    schedule = SCHEDULES.get("scale_linkage")()
    scores = torch.zeros(fake.rows(), 100)
    counts = schedule.keep_counts(fake.ctx(9), 0, "attn", scores, fake.signals)  # t = 10, g_9 = 0
    assert counts.tolist() == [33, 100, 33, 100]  # ceil((1 − 0.67261)·100) = 33; CFG rows follow their sample
    # growth of the last finished scale: H_8 − H_7 = 0.5 for sample 0 → r = 0.66235 → keep ceil(33.765) = 34
    fake.signals._token_entropy[8] = constant_entropy(2, 100, [1.5, 2.0])
    counts = schedule.keep_counts(fake.ctx(9), 0, "attn", scores, fake.signals)
    assert counts.tolist() == [34, 100, 34, 100]
    assert schedule.keep_counts(fake.ctx(7), 0, "attn", scores, fake.signals) is None  # nobody accelerated yet
    increasing = SCHEDULES.get("scale_linkage")(component_config("schedule", "scale_linkage",
                                                                  direction="increasing", ratio_is="kept"))
    # ratio_is='kept': keep ceil(r·N) with r = sigmoid(0.8·10/9 − 0.1·tanh(0.5)) = 0.69859 → 70
    r = sigmoid(0.8 * 10 / 9 - 0.1 * math.tanh(0.5))
    assert increasing.keep_counts(fake.ctx(9), 0, "attn", scores, fake.signals).tolist()[0] == math.ceil(r * 100)


# ------------------------------------------------------------------------------------------------------ NOVA t*
RISING = [1.0, 2.0, 2.9, 3.7, 4.4, 4.6, 4.7, 4.75]  # g_2..g_8 = 1, .9, .8, .7, .2, .1, .05; mean g_2..g_5 = 0.85


def curve(values) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float64)


def test_inflection_rule_on_a_known_curve():
    H = curve(RISING)
    # backward: δ_6 = (0.7 + 0.2)/2 = 0.45 ≥ 0.425 = α·ḡ; δ_7 = 0.15 < 0.425 → t* = 7 → first accelerated t = 8 (si 7)
    assert first_accelerated_scale(H, t_est=5, alpha=0.5).tolist() == [7]
    # no smoothing: g_6 = 0.2 < 0.425 → t* = 6 → si 6
    assert first_accelerated_scale(H, t_est=5, alpha=0.5, smoothing="none").tolist() == [6]
    # max reference: 0.5·max(g) = 0.5 > δ_6 = 0.45 → t* = 6
    assert first_accelerated_scale(H, t_est=5, alpha=0.5, reference="max").tolist() == [6]
    # on a rising curve the literal signed test agrees with the magnitude test
    assert first_accelerated_scale(H, t_est=5, alpha=0.5, test="signed").tolist() == [7]
    # never fires with a tiny alpha: K = 8 means never
    assert first_accelerated_scale(H, t_est=5, alpha=0.01).tolist() == [8]


def test_inflection_first_accelerated_at_tests_one_scale_earlier():
    # g_2..g_6 = 2, 1.2, 0.2, 0.1, 0.05; ḡ = 0.875, α·ḡ = 0.4375; δ_5 = 0.15, δ_6 = 0.075
    H = curve([0.0, 2.0, 3.2, 3.4, 3.5, 3.55])
    after = first_accelerated_scale(H, t_est=5, alpha=0.5, first_accelerated="after")
    at = first_accelerated_scale(H, t_est=5, alpha=0.5, first_accelerated="at")
    assert after.tolist() == [6]  # t* = 6 (δ_6), first accelerated t = 7 → si 6 = K: never on this 6-scale curve
    assert at.tolist() == [5]  # t* = 6 from δ_5, scale t* = 6 itself accelerated → si 5


def test_inflection_on_a_falling_codebook_curve():
    # per-token mean falling then flat with bumps (the measured codebook-VAR shape): ḡ = −0.5 over g_2..g_5
    falling = curve([3.5, 2.8, 2.2, 1.8, 1.5, 1.45, 1.6, 1.5, 1.4, 1.7])
    # magnitude: |δ_6| = |(−0.3 − 0.05)/2| = 0.175 < 0.25 → t* = 6 → si 6
    assert first_accelerated_scale(falling, t_est=5, alpha=0.5).tolist() == [6]
    # signed (literal): δ_t < −0.25 never holds after the curve flattens → never (K = 10)
    assert first_accelerated_scale(falling, t_est=5, alpha=0.5, test="signed").tolist() == [10]


def test_inflection_component_online_equals_offline_and_is_per_sample():
    curves = torch.tensor([RISING, [3.5, 2.8, 2.2, 1.8, 1.5, 1.45, 1.6, 1.5]])
    fake = Fake(B=2, K=8, hw=(4, 4))
    activation = ACTIVATIONS.get("entropy_inflection")()
    activation.start(fake.info, fake.signals)
    for si in range(8):
        ctx = fake.ctx(si)
        assert activation.active_B(ctx, fake.signals).tolist() == (fake.signals.activation_scale_B <= si).tolist()
        record = fake.finish_scale(si, curves[:, si:si + 1].expand(2, 16))
        activation.end_scale(ctx, record, fake.signals)
    assert fake.signals.activation_scale_B.tolist() == [7, 6]
    assert first_accelerated_scale(curves.double(), t_est=5, alpha=0.5).tolist() == [7, 6]
    assert fake.signals.extras["entropy_inflection"]["t_star_B"].tolist() == [6, 5]
    # definitions: 'normalized' = mean / ln V gives the same t*; 'sum' multiplies by N (same here: constant N)
    assert torch.allclose(scale_entropy_curve(fake.signals, 7, "sum"), curves.double() * 16)


def test_inflection_config_ranges():
    with pytest.raises(ValueError, match="t_est"):
        component_config("activation", "entropy_inflection", t_est=1)
    with pytest.raises(ValueError, match="alpha"):
        component_config("activation", "entropy_inflection", alpha=0.0)
    with pytest.raises(ValueError, match="alpha"):
        component_config("activation", "entropy_inflection", alpha=1.5)
    with pytest.raises(ValueError, match="tau"):
        component_config("schedule", "scale_linkage", tau=1.2)
    with pytest.raises(ValueError, match="lam"):
        component_config("schedule", "scale_linkage", lam=0.0)


# ------------------------------------------------------------------------------------------------------ layer linkage
def test_layer_adjusted_ratio_values():
    # r_base 0.5, λ = 1: higher entropy than before → smaller reduction, lower → larger
    assert layer_adjusted_ratio(0.5, 3.0, 2.0, 1.0).item() == pytest.approx(sigmoid(-math.tanh(1.0)))  # 0.31830
    assert layer_adjusted_ratio(0.5, 1.0, 2.5, 1.0).item() == pytest.approx(sigmoid(math.tanh(1.5)))  # 0.71201
    assert layer_adjusted_ratio(0.6, 2.5, 2.0, 0.1).item() == pytest.approx(0.58886, abs=1e-5)
    assert layer_adjusted_ratio(0.6, float("nan"), 2.0, 0.1).item() == pytest.approx(0.6)


@pytest.mark.parametrize("reference", ["previous_scale", "none"])
def test_layer_linkage_component_numbers(reference):
    fake = Fake(B=1, K=3, hw=(10, 10), L=4, guidance=GuidanceMode.COND_ONLY)
    fake.finish_scale(0, constant_entropy(1, 100, [9.0]))
    fake.finish_scale(1, constant_entropy(1, 100, [2.0]))  # previous scale's mean entropy: stands for H_{t,1}
    fake.signals.activation_scale_B = torch.tensor([2])
    lens = {0: 3.0, 1: 1.0, 2: 2.5}  # lens after block b = entropy entering block b + 1 (H_{t,2}, H_{t,3}, H_{t,4})
    for block, value in lens.items():
        fake.signals.lens_entropy[(2, block)] = torch.full((1, 100), value)
    schedule = SCHEDULES.get("layer_linkage")(component_config("schedule", "layer_linkage", r_base=0.5, lam=1.0,
                                                               first_block_reference=reference))
    ctx = fake.ctx(2)
    got = [schedule.keep_counts(ctx, b, "attn", torch.zeros(1, 100), fake.signals) for b in range(4)]
    got = [100 if c is None else int(c[0]) for c in got]
    if reference == "previous_scale":
        ratios = [0.5, sigmoid(-math.tanh(3.0 - 2.0)), sigmoid(-math.tanh(1.0 - 2.5)),
                  sigmoid(-math.tanh(2.5 - 2.0))]
    else:
        ratios = [0.5, 0.5, sigmoid(-math.tanh(1.0 - 3.0)), sigmoid(-math.tanh(2.5 - 2.0))]
    assert got == [math.ceil((1 - r) * 100) for r in ratios]
    assert got[:2] == ([50, 69] if reference == "previous_scale" else [50, 50])  # 1 − 0.31830 → 68.17 → 69


def test_dual_linkage_uses_scale_ratio_as_base():
    fake = Fake(B=1, K=10, hw=(10, 10), L=3, guidance=GuidanceMode.COND_ONLY)
    for si in range(8):
        fake.finish_scale(si, constant_entropy(1, 100, [2.0]))
    fake.signals.activation_scale_B = torch.tensor([8])  # t* = 8; at t = 9: r_t = sigmoid(0.8) (g_8 = 0)
    fake.signals.lens_entropy[(8, 0)] = torch.full((1, 100), 2.5)  # entering block 2 (1-indexed)
    fake.signals.lens_entropy[(8, 1)] = torch.full((1, 100), 2.0)  # entering block 3
    schedule = SCHEDULES.get("dual_linkage")()
    ctx = fake.ctx(8)
    r_t = sigmoid(0.8)
    r1 = sigmoid(math.log(r_t / (1 - r_t)) - 0.1 * math.tanh(2.5 - 2.0))  # 0.68000 (reference: previous scale, 2.0)
    r2 = sigmoid(math.log(r_t / (1 - r_t)) - 0.1 * math.tanh(2.0 - (2.0 + 2.5) / 2))  # 0.69519
    expected = [math.ceil((1 - r) * 100) for r in (r_t, r1, r2)]
    got = [int(schedule.keep_counts(ctx, b, "attn", torch.zeros(1, 100), fake.signals)[0]) for b in range(3)]
    assert got == expected == [32, 32, 31]


# ------------------------------------------------------------------------------------------------------ ToProVAR depth
def test_below_mean_ratio_and_depth_rule():
    maps = torch.tensor([[1.0, 1.0, 1.0, 5.0], [1.0, 5.0, 5.0, 5.0], [2.0, 2.0, 2.0, 2.0]])
    rho = below_mean_ratio(maps)
    assert rho.tolist() == [0.75, 0.25, 0.0]  # means 2, 4, 2 (strictly below)
    assert depth_fires(rho, 0.4, "le").tolist() == [False, True, True]
    assert depth_fires(rho, 0.4, "ge").tolist() == [True, False, False]
    with_missing = torch.tensor([[1.0, float("nan"), 3.0, 2.0]])  # mean of the computed 3 is 2 → 1 of 3 below
    assert below_mean_ratio(with_missing).tolist() == pytest.approx([1 / 3])


@pytest.mark.parametrize("comparison,first_accelerated,expected", [
    ("le", "after", [13, 5]), ("ge", "after", [5, 13]), ("le", "at", [13, 4]), ("ge", "at", [4, 13])])
def test_low_entropy_ratio_component_on_given_maps(comparison, first_accelerated, expected):
    fake = Fake(B=2, K=13, hw=(2, 2), L=2)
    activation = ACTIVATIONS.get("low_entropy_ratio")(component_config(
        "activation", "low_entropy_ratio", comparison=comparison, first_accelerated=first_accelerated,
        min_test_tokens=4))
    activation.start(fake.info, fake.signals)
    ctx = fake.ctx(4)
    assert activation.needs(ctx, fake.signals).attention_blocks == frozenset({0})
    # block-0 attention entropy of scale 4: sample 0 ρ = 0.75, sample 1 ρ = 0.25 (rows 2, 3: the uncond halves)
    fake.signals.attention_entropy[(4, 0)] = torch.tensor([[1.0, 1.0, 1.0, 5.0], [1.0, 5.0, 5.0, 5.0],
                                                           [9.0, 9.0, 9.0, 1.0], [9.0, 9.0, 9.0, 1.0]])
    activation.active_B(ctx, fake.signals)
    activation.observe_attention(ctx, 0, torch.zeros(4, 1, 4, 4), None, fake.signals)
    assert fake.signals.activation_scale_B.tolist() == expected
    assert fake.signals.extras["low_entropy_ratio"]["rho_BK"][:, 4].tolist() == [0.75, 0.25]


def test_low_entropy_ratio_at_needs_block0_source():
    with pytest.raises(ValueError, match="attention_block0"):
        component_config("activation", "low_entropy_ratio", first_accelerated="at", entropy_source="predictive")
    with pytest.raises(ValueError, match="tau"):
        component_config("activation", "low_entropy_ratio", tau=1.0)


# ------------------------------------------------------------------------------------------------------ ToProVAR gate
def test_layer_score_svd_ratio():
    maps = torch.tensor([[[3.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]]])
    ratio, R = layer_score(maps, beta=0.1)
    assert ratio[0].item() == pytest.approx(3.0)  # σ = (3, 1)
    assert R[0].item() == pytest.approx(math.exp(-0.2))  # 0.81873 → Detail at threshold 0.5
    assert math.isinf(ratio[1].item()) and R[1].item() == 0.0  # rank one: Global
    assert layer_score(maps[:1], beta=0.5)[1].item() == pytest.approx(math.exp(-1.0))  # 0.368 → Global


def test_gate_normalizations_and_counts():
    H = torch.tensor([[4.0, 1.0, 1.0, 0.0]])
    R = torch.tensor([math.exp(-0.2)])
    assert normalized_entropy(H, "max").tolist() == [[1.0, 0.25, 0.25, 0.0]]
    assert normalized_entropy(H, "rank")[0].tolist() == pytest.approx([1.0, 1 / 3, 2 / 3, 0.0])
    assert normalized_entropy(H, "literal").tolist() == [[4 / 6, 1 / 6, 1 / 6, 0.0]]
    # Σ p = 4·0.1 + 0.8·0.81873·ΣĤ: max ΣĤ = 1.5 → 1.3825 → 1; rank 2 → 1.7100 → 2; literal 1 → 1.0550 → 1
    for normalization, total, pruned in (("max", 1.38248, 1), ("rank", 1.70997, 2), ("literal", 1.05498, 1)):
        p = prune_probability(H, 1.0, R, 0.1, 0.9, normalization)
        assert p.sum().item() == pytest.approx(total, abs=1e-5)
        assert pruned_count(p, "deterministic").tolist() == [pruned]
    # φ(s) scales q: at s = S_max / 2 the max-normalised total is 0.4 + 0.8·0.5·0.81873·1.5 = 0.8912 → 1
    assert prune_probability(H, 0.5, R, 0.1, 0.9, "max").sum().item() == pytest.approx(0.89124, abs=1e-5)
    # Bernoulli: seeded, within [0, N], and unbiased on average
    p = prune_probability(H, 1.0, R, 0.1, 0.9, "max")
    draws = [pruned_count(p, "bernoulli", torch.Generator().manual_seed(s)).item() for s in range(400)]
    assert draws[:5] == [pruned_count(p, "bernoulli", torch.Generator().manual_seed(s)).item() for s in range(5)]
    assert all(0 <= d <= 4 for d in draws) and sum(draws) / 400 == pytest.approx(1.38248, abs=0.12)


@pytest.mark.parametrize("normalization,source,expected_keep", [
    ("max", "previous_layer", 3), ("rank", "previous_layer", 2), ("literal", "previous_layer", 3),
    ("max", "previous_scale", 3)])
def test_toprovar_gate_component_on_known_maps(normalization, source, expected_keep):
    fake = Fake(B=1, K=3, hw=(2, 2), L=2, guidance=GuidanceMode.COND_ONLY)
    gate = SCHEDULES.get("toprovar_gate")(component_config(
        "schedule", "toprovar_gate", s_rep=2, beta=0.1, normalization=normalization, entropy_source=source))
    gate.start(fake.info, fake.signals)
    fake.finish_scale(0)
    ctx1 = fake.ctx(1)
    assert gate.needs(ctx1, fake.signals).attention_blocks == frozenset({0, 1})  # every block at s_rep
    fake.signals.attention_entropy[(1, 0)] = torch.ones(1, 4)  # rank one → Global
    fake.signals.attention_entropy[(1, 1)] = torch.tensor([[3.0, 0.0, 0.0, 1.0]])  # σ1/σ2 = 3 → R = 0.819 Detail
    gate.end_scale(ctx1, fake.finish_scale(1), fake.signals)
    assert fake.signals.extras["toprovar_gate"]["R_BL"][0].tolist() == pytest.approx([0.0, math.exp(-0.2)])
    fake.signals.activation_scale_B = torch.tensor([2])
    ctx2 = fake.ctx(2)  # s = 3 = S_max: φ = 1
    fake.signals.attention_entropy[(2, 0)] = torch.tensor([[4.0, 1.0, 1.0, 0.0]])  # block l − 1 at this scale
    scores = torch.zeros(1, 4)
    assert gate.keep_counts(ctx2, 0, "attn", scores, fake.signals) is None  # Global layer: dense
    # previous_scale reads block 1's s_rep map [3, 0, 0, 1]: max ΣĤ = 4/3 → 0.4 + 0.65498·4/3 = 1.273 → prune 1
    assert gate.keep_counts(ctx2, 1, "attn", scores, fake.signals).tolist() == [expected_keep]
    fake.signals.activation_scale_B = torch.tensor([3])  # before D: dense
    assert gate.keep_counts(ctx2, 1, "attn", scores, fake.signals) is None
    assert gate.keep_counts(ctx1, 1, "attn", scores, fake.signals) is None  # at s_rep: classes unknown → dense


# ------------------------------------------------------------------------------------------------------ energy fraction
def test_energy_fraction_counts():
    scores = torch.tensor([[5.0, 1.0, 3.0, 1.0], [5.0, 3.0, 2.0, 0.0]])
    assert energy_keep_counts(scores, 0.5).tolist() == [1, 1]  # 5 ≥ 0.5·10
    assert energy_keep_counts(scores, 0.6).tolist() == [2, 2]  # 5 < 6 ≤ 8
    assert energy_keep_counts(scores, 1.0).tolist() == [4, 3]  # a zero-energy token is never needed
    assert energy_keep_counts(scores, 0.5, "tokens").tolist() == [2, 2]  # ceil(0.5·4)
    assert energy_keep_counts(scores, 0.3, "tokens").tolist() == [2, 2]  # ceil(1.2)
    assert energy_keep_counts(scores, 0.5, min_keep_fraction=0.5).tolist() == [2, 2]  # guard
    forced = torch.tensor([[float("inf"), 5.0, 3.0, 1.0, 1.0]])  # a restorer's forced keep rides on top
    assert energy_keep_counts(forced, 0.5).tolist() == [2]
    assert energy_keep_counts(torch.tensor([[-1.0, -2.0, 0.0, 0.0]]), 0.5, min_keep_fraction=0.25).tolist() == [1]
    with pytest.raises(ValueError, match="rho"):
        component_config("schedule", "energy_fraction", rho=0.0)


def test_energy_fraction_component_keeps_inactive_rows_dense():
    fake = Fake(B=2, K=3, hw=(2, 2))
    fake.signals.activation_scale_B = torch.tensor([1, 3])
    schedule = SCHEDULES.get("energy_fraction")()
    scores = torch.tensor([[5.0, 1.0, 3.0, 1.0]]).repeat(4, 1)
    assert schedule.keep_counts(fake.ctx(1), 0, "attn", scores, fake.signals).tolist() == [1, 4, 1, 4]
    assert schedule.keep_counts(fake.ctx(0), 0, "attn", scores, fake.signals) is None


# ------------------------------------------------------------------------------------------------------ generations
SAMPLING = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)
LABELS = torch.tensor([3, 7])
SEEDS = [1, 2]


@pytest.fixture(scope="module")
def tiny():
    from var_core.models.zoo import load_model

    return load_model("official-tiny")


def run_twice(adapter, config: PolicyConfig):
    policy = build_policy(config)
    first = generate(adapter, LABELS, seeds=SEEDS, sampling=SAMPLING, policy=policy)
    signals = policy.signals
    second = generate(adapter, LABELS, seeds=SEEDS, sampling=SAMPLING, policy=build_policy(config))
    for a, b in zip(first.tokens, second.tokens):
        assert torch.equal(a, b)
    assert [r.kept_tokens for r in first.records] == [r.kept_tokens for r in second.records]
    return first, signals


def assert_kept(result, expected_per_block):
    """``expected_per_block[si][block]``: per-sample kept counts; the record holds the row maximum (padding)."""
    for si, blocks in expected_per_block.items():
        record = result.records[si]
        for block, per_sample in enumerate(blocks):
            assert record.kept_tokens[block] == (max(per_sample),) * 2, (si, block, record.kept_tokens, per_sample)


def test_generation_entropy_inflection_with_scale_linkage(tiny):
    config = PolicyConfig(activation=component_config("activation", "entropy_inflection", t_est=2, alpha=1.0),
                          schedule=component_config("schedule", "scale_linkage"))
    result, signals = run_twice(tiny, config)
    K = len(result.records)
    H = scale_entropy_curve(signals, K - 1, "mean")
    first = first_accelerated_scale(H.cpu(), t_est=2, alpha=1.0)
    assert signals.activation_scale_B.tolist() == first.tolist()
    assert int(first.min()) < K, "the test should fire on this curve (t_est=2, alpha=1)"
    g = torch.nan_to_num(H[:, 1:] - H[:, :-1], nan=0.0)
    expected = {}
    for si in range(K):
        N = result.records[si].hw[0] * result.records[si].hw[1]
        per_sample = []
        for b in range(2):
            if si < int(first[b]):
                per_sample.append(N)
                continue
            g_prev = float(g[b, si - 2]) if si >= 2 else 0.0  # g_{t−1} = H[si−1] − H[si−2]
            r = sigmoid(0.8 * (int(first[b]) + 1) / (si + 1) - 0.1 * math.tanh(g_prev))
            per_sample.append(math.ceil((1 - r) * N - 1e-9))
        expected[si] = [per_sample] * 2
    assert_kept(result, expected)


def test_generation_low_entropy_ratio_with_energy_fraction(tiny):
    config = PolicyConfig(activation=component_config("activation", "low_entropy_ratio"),
                          schedule=component_config("schedule", "energy_fraction", rho=0.5))
    result, signals = run_twice(tiny, config)
    from var_core.accel.scorers.random import RandomScorer

    K = len(result.records)
    rho = signals.extras["low_entropy_ratio"]["rho_BK"]
    D = []
    for b in range(2):  # recompute D from the recorded block-0 maps: first tested scale with ρ ≤ 0.4, plus one
        fired = [si for si in range(K) if (si, 0) in signals.attention_entropy
                 and below_mean_ratio(signals.attention_entropy[(si, 0)][:2])[b] <= 0.4]
        D.append(fired[0] + 1 if fired else K)
        assert torch.isnan(rho[b, : 3]).all()  # 1, 4, 9 tokens: never tested (min_test_tokens = 16)
    assert signals.activation_scale_B.tolist() == D
    scorer = RandomScorer()
    expected = {}
    for si in range(K):
        N = result.records[si].hw[0] * result.records[si].hw[1]
        ctx = ScaleContext(si, K, result.records[si].hw, 0, 2, GuidanceMode.BOTH, 2, ("attn", "ffn"), "var", ())
        blocks = []
        for block in range(2):
            scores = scorer.score(ctx, block, "attn", torch.zeros(4, N, 1), None)
            keep = int(energy_keep_counts(scores[:1], 0.5, "energy", 0.05)[0])
            blocks.append([keep if si >= D[b] else N for b in range(2)])
        expected[si] = blocks
    assert_kept(result, expected)


@pytest.mark.parametrize("name", ["layer_linkage", "dual_linkage"])
def test_generation_layer_and_dual_linkage(tiny, name):
    config = PolicyConfig(activation=component_config("activation", "fixed", start_scale=-2),
                          schedule=component_config("schedule", name))
    result, signals = run_twice(tiny, config)
    K = len(result.records)
    assert set(signals.lens_entropy) == {(si, 0) for si in (K - 2, K - 1)}  # lens only where accelerated
    expected = {}
    for si in (K - 2, K - 1):
        N = result.records[si].hw[0] * result.records[si].hw[1]
        prev_mean = signals.token_entropy(si - 1).double().mean(-1)
        lens_mean = signals.lens_entropy[(si, 0)].double().mean(-1)
        if name == "layer_linkage":
            base = torch.full((2,), 0.5, dtype=torch.float64)
        else:
            H = scale_entropy_curve(signals, si - 1, "mean")
            g_prev = H[:, si - 1] - H[:, si - 2]
            base = torch.sigmoid(0.8 * (K - 2 + 1) / (si + 1) - 0.1 * torch.tanh(g_prev))
        r1 = torch.sigmoid(torch.logit(base) - 0.1 * torch.tanh(lens_mean - prev_mean))
        keep0 = [math.ceil((1 - float(r)) * N - 1e-9) for r in base]
        keep1 = [math.ceil((1 - float(r)) * N - 1e-9) for r in r1]
        expected[si] = [keep0, keep1]
    assert_kept(result, expected)
    assert all(all(c == r.hw[0] * r.hw[1] for bl in r.kept_tokens for c in bl) for r in result.records[:K - 2])


def test_generation_toprovar_gate_with_depth_at(tiny):
    config = PolicyConfig(
        activation=component_config("activation", "low_entropy_ratio", comparison="ge", tau=0.05,
                                    first_accelerated="at"),
        schedule=component_config("schedule", "toprovar_gate", beta=1e-3))
    result, signals = run_twice(tiny, config)
    K = len(result.records)
    assert signals.activation_scale_B.tolist() == [3, 3]  # ρ ≥ 0.05 at the first tested scale (4x4), pruned 'at'
    R_BL = signals.extras["toprovar_gate"]["R_BL"]
    detail = R_BL > 0.5
    assert bool(detail.any()), R_BL
    expected = {}
    for si in range(K):
        N = result.records[si].hw[0] * result.records[si].hw[1]
        blocks = []
        for block in range(2):
            per_sample = [N, N]
            if si >= 6:  # after s_rep = 6 (0-indexed 5)
                prev = signals.attention_entropy[(si - 1, block)][:2]
                h, w = result.records[si - 1].hw
                up = torch.nn.functional.interpolate(prev.view(2, 1, h, w), size=result.records[si].hw,
                                                     mode="bilinear", align_corners=False).view(2, N)
                p = prune_probability(up, (si + 1) / K, R_BL[:, block], 0.1, 0.9, "max")
                per_sample = [N - int(torch.round(p[b].sum())) if detail[b, block] else N for b in range(2)]
            blocks.append(per_sample)
        expected[si] = blocks
    assert_kept(result, expected)


def test_depth_at_refuses_a_schedule_that_ignores_the_activation_scale(tiny):
    config = PolicyConfig(
        activation=component_config("activation", "low_entropy_ratio", comparison="le", tau=0.01,
                                    first_accelerated="at"),
        schedule=component_config("schedule", "fixed_table"))
    with pytest.raises(RuntimeError, match="activation_scale_B"):
        generate(tiny, LABELS, seeds=SEEDS, sampling=SAMPLING, policy=build_policy(config))


def test_generation_batch_equals_single(tiny):
    config = PolicyConfig(activation=component_config("activation", "entropy_inflection", t_est=2, alpha=1.0),
                          schedule=component_config("schedule", "dual_linkage"))
    batch = generate(tiny, LABELS, seeds=SEEDS, sampling=SAMPLING, policy=build_policy(config))
    alone = generate(tiny, LABELS[1:], seeds=SEEDS[1:], sampling=SAMPLING, policy=build_policy(config))
    for a, b in zip(alone.tokens, batch.tokens):
        assert torch.equal(a[0], b[1])
