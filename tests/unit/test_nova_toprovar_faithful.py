"""Issue 12, NOVA and ToProVAR as their authors ran them: every value below is worked out by hand in the comments.

NOVA: the signed vs magnitude inflection test, batch-level activation, the predictive-entropy scorer source and the
lens-free layer linkage. ToProVAR: per-scale Global/Detail classes, the appendix fallbacks (ambiguous split,
per-region keep floor), φ(s) = s/S_max, and the ``depth_exit`` skip (adaptive scale-depth truncation).
"""

from __future__ import annotations

import math

import pytest
import torch

from var_core.accel import PolicyConfig, build_policy, component_config
from var_core.accel.activation._entropy_growth import batch_first_scale, first_accelerated_scale, quorum_size
from var_core.accel.attention_stats import region_floor, region_ids, region_priority
from var_core.accel.base import NO_NEEDS, Signals
from var_core.accel.presets import get_preset
from var_core.accel.registry import ACTIVATIONS, SCHEDULES, SCORERS, SKIPS
from var_core.accel.schedules._linkage_math import measure_layer_profile
from var_core.accel.schedules.toprovar_gate import detail_layers, phi
from var_core.engine import SamplingConfig, generate
from var_core.engine.context import GenerationInfo, GuidanceMode, ScaleContext, ScaleRecord
from var_core.engine.tracing import NULL_TRACER


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


class Fake:
    """A Signals board and ScaleContexts for a made-up model: B samples, K scales of ``hw`` tokens, L blocks."""

    def __init__(self, B=1, K=6, hw=(4, 4), L=2, guidance=GuidanceMode.COND_ONLY):
        self.B, self.K, self.L, self.hw, self.guidance = B, K, L, hw, guidance
        self.info = GenerationInfo(B, K, L, ("attn", "ffn"), (hw,) * K, "var", guidance, NULL_TRACER)
        self.signals = Signals(self.info)
        self.history: list[ScaleRecord] = []

    def ctx(self, si: int) -> ScaleContext:
        return ScaleContext(si, self.K, self.hw, 0, self.B, self.guidance, self.L, ("attn", "ffn"), "var",
                            tuple(self.history[:si]))

    def finish_scale(self, si: int, token_entropy_BN: torch.Tensor | None = None) -> ScaleRecord:
        record = ScaleRecord(si, self.hw, skipped=False, guidance=self.guidance)
        if token_entropy_BN is not None:
            self.signals._token_entropy[si] = token_entropy_BN.float()
        self.signals.records[si] = record
        self.history.append(record)
        return record


def curves(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def run_activation(activation, fake: Fake, H_BK: torch.Tensor) -> None:
    """Feed per-sample scale entropies (constant over each scale's tokens) through the activation, online."""
    N = fake.hw[0] * fake.hw[1]
    activation.start(fake.info, fake.signals)
    for si in range(fake.K):
        ctx = fake.ctx(si)
        activation.active_B(ctx, fake.signals)
        record = fake.finish_scale(si, H_BK[:, si:si + 1].expand(fake.B, N))
        activation.end_scale(ctx, record, fake.signals)


# ------------------------------------------------------------------------------------------- NOVA: growth test
# g_2..g_5 = 1, 1, .8, .6 → ḡ = 0.85, α·ḡ = 0.425 (t_est = 5, α = 0.5); then a sharp fall g_6 = −2, g_7 = −0.1,
# g_8 = 0.05, g_9 = 0.05. Backward δ at the end of si 5, 6, 7, 8: (0.6 − 2)/2 = −0.7, (−2 − 0.1)/2 = −1.05,
# (−0.1 + 0.05)/2 = −0.025, 0.05.
DIP = [1.0, 2.0, 3.0, 3.8, 4.4, 2.4, 2.3, 2.35, 2.4]


def test_signed_and_magnitude_tests_on_a_hand_made_curve():
    H = curves(DIP)
    # signed: −0.7 < 0.425 at the end of si 5 → first accelerated si 6
    assert first_accelerated_scale(H, t_est=5, alpha=0.5, test="signed").tolist() == [6]
    # magnitude: 0.7 and 1.05 ≥ 0.425; 0.025 < 0.425 at the end of si 7 → first accelerated si 8
    assert first_accelerated_scale(H, t_est=5, alpha=0.5, test="magnitude").tolist() == [8]
    # the component's default is the signed test (issue 12)
    fake = Fake(K=9, hw=(2, 2))
    activation = ACTIVATIONS.get("entropy_inflection")()
    assert activation.config.growth_test == "signed"
    run_activation(activation, fake, H)
    assert fake.signals.activation_scale_B.tolist() == [6]
    magnitude = ACTIVATIONS.get("entropy_inflection")(component_config("activation", "entropy_inflection",
                                                                       growth_test="magnitude"))
    fake = Fake(K=9, hw=(2, 2))
    run_activation(magnitude, fake, H)
    assert fake.signals.activation_scale_B.tolist() == [8]


# ------------------------------------------------------------------------------------------- NOVA: batch scope
# Three samples, t_est = 5, α = 0.5, signed test, backward δ:
#   A: g = 1, 1, .8, .6, .1, … → ḡ = 0.85; δ(si 5) = (0.6 + 0.1)/2 = 0.35 < 0.425 → fires at si 5 → first si 6
#   B: g = 1, 1, .8, .6, .6, .2, … → δ(si 5) = 0.6, δ(si 6) = (0.6 + 0.2)/2 = 0.4 < 0.425 → fires at si 6 → si 7
#   C: g = 1 everywhere → ḡ = 1, δ = 1 ≥ 0.5 → never (K = 9)
THREE = curves([1.0, 2.0, 3.0, 3.8, 4.4, 4.5, 4.6, 4.7, 4.8],
               [1.0, 2.0, 3.0, 3.8, 4.4, 5.0, 5.2, 5.3, 5.4],
               [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])


@pytest.mark.parametrize("scope,share,expected", [
    ("sample", 0.5, [6, 7, 9]),  # each on its own
    ("batch", 0.5, [7, 7, 7]),  # ceil(0.5·3) = 2 samples: the second fires at the end of si 6 → all from si 7
    ("batch", 0.3, [6, 6, 6]),  # ceil(0.9) = 1: the first one (end of si 5) switches the batch on
    ("batch", 1.0, [9, 9, 9]),  # all three needed, C never fires → never
    # pooled: mean curve g = 1, 1, 2.6/3, 2.2/3 → ḡ = 0.9, α·ḡ = 0.45; then g_6..g_9 = 1.7/3, 1.3/3, 1.2/3, 1.2/3;
    # δ(si 5) = (2.2 + 1.7)/6 = 0.65, δ(si 6) = (1.7 + 1.3)/6 = 0.5, δ(si 7) = (1.3 + 1.2)/6 = 0.41667 < 0.45 → si 8
    ("pooled", 0.5, [8, 8, 8]),
])
def test_batch_level_activation_on_three_samples(scope, share, expected):
    fake = Fake(B=3, K=9, hw=(2, 2))
    activation = ACTIVATIONS.get("entropy_inflection")(component_config(
        "activation", "entropy_inflection", scope=scope, batch_share=share))
    run_activation(activation, fake, THREE)
    assert fake.signals.activation_scale_B.tolist() == expected
    state = fake.signals.extras["entropy_inflection"]
    if scope == "batch":  # the offline form agrees; each sample's own test is recorded until the batch switches on
        own = first_accelerated_scale(THREE, t_est=5, alpha=0.5)
        assert own.tolist() == [6, 7, 9]
        assert batch_first_scale(own, share, 9) == expected[0]
        assert state["t_star_B"][0].item() == 5
        assert state["batch_t_star"] == (expected[0] - 1 if expected[0] < 9 else -1)


def test_quorum_and_batch_of_one():
    assert [quorum_size(3, s) for s in (0.1, 0.34, 0.5, 0.67, 1.0)] == [1, 2, 2, 3, 3]
    assert quorum_size(5, 0.5) == 3 and quorum_size(1, 0.01) == 1
    for scope in ("batch", "pooled"):  # at batch 1 every scope is the per-sample rule
        fake = Fake(B=1, K=9, hw=(2, 2))
        activation = ACTIVATIONS.get("entropy_inflection")(component_config("activation", "entropy_inflection",
                                                                            scope=scope))
        run_activation(activation, fake, THREE[1:2])
        assert fake.signals.activation_scale_B.tolist() == [7]


# ------------------------------------------------------------------------------------------- NOVA: scorer source
def test_predictive_source_is_the_previous_scales_sampled_entropy():
    scorer = SCORERS.get("entropy")()
    assert scorer.config.source == "predictive"
    alias = component_config("scorer", "entropy", source="previous")  # the old name
    assert alias.source == "predictive" and alias == component_config("scorer", "entropy")
    fake = Fake(B=1, K=3, hw=(2, 2))
    scorer = SCORERS.get("entropy")(component_config("scorer", "entropy", upsample="nearest"))
    scorer.start(fake.info, fake.signals)
    fake.finish_scale(0, torch.tensor([[0.0, 1.0, 2.0, 3.0]]))  # the 2x2 map [[0, 1], [2, 3]]
    ctx = ScaleContext(1, 3, (4, 4), 0, 1, GuidanceMode.COND_ONLY, 2, ("attn", "ffn"), "var", tuple(fake.history))
    assert scorer.needs(ctx, fake.signals) is NO_NEEDS  # no lens
    scores = scorer.score(ctx, 1, "attn", torch.zeros(1, 16, 8), fake.signals)
    # nearest 2x2 → 4x4: each value fills its 2x2 quadrant
    assert scores.view(4, 4).tolist() == [[0, 0, 1, 1], [0, 0, 1, 1], [2, 2, 3, 3], [2, 2, 3, 3]]
    assert get_preset("nova").scorer.source == "predictive"


# ------------------------------------------------------------------------------------------- NOVA: lens-free layers
def test_layer_linkage_from_a_fixed_profile_needs_no_lens():
    # profile = entropy entering blocks 0..3; block b: P_b − mean(P_<b): 3 − 2 = 1, 1 − 2.5 = −1.5, 2.5 − 2 = 0.5
    # r = sigmoid(logit(0.5) − 1·tanh(diff)) → 0.5, 0.31830, 0.71201, 0.38455; keep ceil((1 − r)·100)
    profile = (2.0, 3.0, 1.0, 2.5)
    schedule = SCHEDULES.get("layer_linkage")(component_config("schedule", "layer_linkage", r_base=0.5, lam=1.0,
                                                               layer_profile=profile))
    fake = Fake(B=2, K=3, hw=(10, 10), L=4)
    fake.signals.activation_scale_B = torch.tensor([2, 2])
    fake.signals.pruning_now = True
    ctx = fake.ctx(2)
    assert schedule.needs(ctx, fake.signals) is NO_NEEDS
    got = [schedule.keep_counts(ctx, b, "attn", torch.zeros(2, 100), fake.signals) for b in range(4)]
    ratios = [0.5, sigmoid(-math.tanh(1.0)), sigmoid(-math.tanh(-1.5)), sigmoid(-math.tanh(0.5))]
    expected = [math.ceil((1 - r) * 100) for r in ratios]
    assert expected == [50, 69, 29, 62]
    assert [c.tolist() for c in got] == [[n, n] for n in expected]  # the same for both samples
    lens = SCHEDULES.get("dual_linkage")()  # default: the lens
    assert lens.needs(ctx, fake.signals).lens_blocks == frozenset({0, 1, 2})
    with pytest.raises(ValueError, match="4 values but the model has 3 blocks"):
        schedule.check_model(Fake(L=3).info)


def test_measure_layer_profile_from_lens_records():
    fake = Fake(B=2, K=3, hw=(2, 2), L=3)
    fake.finish_scale(0, torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0]]))  # means 1, 3
    fake.finish_scale(1, torch.tensor([[2.0, 2.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0]]))  # means 2, 4
    for si, (after0, after1) in ((1, (5.0, 6.0)), (2, (7.0, 8.0))):
        fake.signals.lens_entropy[(si, 0)] = torch.full((2, 4), after0)
        fake.signals.lens_entropy[(si, 1)] = torch.full((2, 4), after1)
    # block 0: previous scale's mean: si 1 → scale 0 (1, 3), si 2 → scale 1 (2, 4) → mean 2.5
    # block 1: lens after block 0: 5, 5, 7, 7 → 6; block 2: lens after block 1: 6, 6, 8, 8 → 7
    assert measure_layer_profile(fake.signals, 3) == pytest.approx((2.5, 6.0, 7.0))


# ------------------------------------------------------------------------------------------- ToProVAR: layer classes
def diag(a: float, b: float) -> torch.Tensor:
    return torch.tensor([a, 0.0, 0.0, b])  # the 2x2 map [[a, 0], [0, b]]: σ = (a, b)


# R = exp(−0.1·(σ1/σ2 − 1)): diag(3, 1) → 0.81873 Detail; ones → σ2 = 0 → R = 0 Global; diag(7.5, 1) → 0.52205
# (Detail by 0.022, ambiguous at margin 0.05); diag(2, 1) → 0.90484 Detail.
TABLE = {  # (0-indexed scale, block) → hand-made attention-entropy map
    (1, 0): diag(3.0, 1.0), (1, 1): torch.ones(4), (1, 2): diag(7.5, 1.0),
    (2, 0): torch.ones(4), (2, 1): diag(2.0, 1.0), (2, 2): diag(3.0, 1.0),
}


def test_detail_layers_and_ambiguity_fallback():
    R = torch.tensor([[math.exp(-0.2), 0.0, math.exp(-0.65)]])
    assert detail_layers(R, 0.5, 0.0).tolist() == [[True, False, True]]
    assert detail_layers(R, 0.5, 0.05, "layer").tolist() == [[True, False, False]]  # |0.52205 − 0.5| ≤ 0.05
    assert detail_layers(R, 0.5, 0.05, "sample").tolist() == [[False, False, False]]  # the whole split dropped
    assert detail_layers(R, 0.5, 0.01, "sample").tolist() == [[True, False, True]]  # 0.022 > 0.01: clear


def _gate(fake: Fake, **params):
    gate = SCHEDULES.get("toprovar_gate")(component_config("schedule", "toprovar_gate", s_rep=2, beta=0.1,
                                                           min_region_keep=0.0, **params))
    gate.start(fake.info, fake.signals)
    fake.signals.activation_scale_B = torch.zeros(fake.B, dtype=torch.long)  # D = 0: only the layer classes gate
    return gate


def _pruned_blocks(gate, fake: Fake, si: int) -> list[int]:
    ctx = fake.ctx(si)
    return [b for b in range(fake.L) if gate.keep_counts(ctx, b, "attn", torch.zeros(1, 4), fake.signals) is not None]


@pytest.mark.parametrize("layer_classes,margin,at2,at3", [
    ("per_scale", 0.05, [0], [1, 2]),  # si 2 uses si 1's classes (block 2 ambiguous), si 3 uses si 2's
    ("per_scale", 0.0, [0, 2], [1, 2]),
    ("once", 0.05, [0], [0]),  # classified at s_rep (si 1) only
])
def test_per_scale_global_detail_split_on_a_hand_made_table(layer_classes, margin, at2, at3):
    fake = Fake(B=1, K=4, hw=(2, 2), L=3)
    gate = _gate(fake, layer_classes=layer_classes, ambiguity_margin=margin)
    for si in range(3):
        ctx = fake.ctx(si)
        blocks = gate.needs(ctx, fake.signals).attention_blocks
        if si >= 1 and (si == 1 or layer_classes == "per_scale"):
            assert blocks == frozenset({0, 1, 2})  # every block's map is observed where the classes are made
        for block in range(3):
            if (si, block) in TABLE:
                fake.signals.attention_entropy[(si, block)] = TABLE[(si, block)].view(1, 4)
        if si == 2:
            assert _pruned_blocks(gate, fake, 2) == at2
        gate.end_scale(ctx, fake.finish_scale(si), fake.signals)
    assert _pruned_blocks(gate, fake, 3) == at3
    R = fake.signals.extras["toprovar_gate"]["R_by_scale"]
    assert R[1][0].tolist() == pytest.approx([math.exp(-0.2), 0.0, math.exp(-0.65)])
    if layer_classes == "per_scale":
        assert R[2][0].tolist() == pytest.approx([0.0, math.exp(-0.1), math.exp(-0.2)])
    else:
        assert 2 not in R


def test_phi_and_s_max():
    assert phi(3, 4) == 0.75 and phi(13, 13) == 1.0 and phi(11, 11) == 1.0
    # Block 0 at si 2 (s = 3): Detail by si 1's map diag(3, 1), R = 0.81873; gate entropies = that map (previous
    # scale, same grid) → Ĥ = H / max H = (1, 0, 0, 1/3), ΣĤ = 4/3. α_min = 0.3, α_max = 0.9:
    # Σ p = 4·0.3 + 0.6·φ·R·4/3 = 1.2 + 0.65498·φ; S_max = K = 4: φ = 0.75 → 1.69124 → prune 2 → keep 2;
    # S_max = 12: φ = 0.25 → 1.36375 → prune 1 → keep 3.
    for s_max, keep in ((0, 2), (12, 3)):
        fake = Fake(B=1, K=4, hw=(2, 2), L=1)
        gate = _gate(fake, s_max=s_max, alpha_min=0.3)
        fake.finish_scale(0)
        fake.signals.attention_entropy[(1, 0)] = TABLE[(1, 0)].view(1, 4)
        gate.end_scale(fake.ctx(1), fake.finish_scale(1), fake.signals)
        assert gate.keep_counts(fake.ctx(2), 0, "attn", torch.zeros(1, 4), fake.signals).tolist() == [keep]


# ------------------------------------------------------------------------------------------- ToProVAR: region floor
def test_region_grid_floor_and_priority():
    # 2x4 map, 2x2 grid: cells [[0, 0, 1, 1], [2, 2, 3, 3]]; quota ceil(0.5·2) = 1 per cell → floor 4
    assert region_ids((2, 4), 2).view(2, 4).tolist() == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert region_floor((2, 4), 2, 0.5) == 4
    assert region_floor((8, 8), 4, 0.1) == 16  # 16 cells of 4 tokens, ceil(0.4) = 1 each
    assert region_floor((64, 64), 4, 0.1) == 16 * 26  # cells of 256 tokens, ceil(25.6) = 26
    assert region_floor((64, 64), 4, 0.0) == 0
    scores = torch.tensor([[10.0, 9.0, 1.0, 0.0, 8.0, 7.0, 6.0, 5.0]])
    # plain top 4: 10, 9, 8, 7 (cells 0, 0, 2, 2). With the floor each cell's best comes first: 10 (cell 0),
    # 1 (cell 1), 8 (cell 2), 6 (cell 3); then the rest by score: 9, 7, 5, 0
    ranked = region_priority(scores, (2, 4), 2, 0.5)
    order = ranked[0].argsort(descending=True).tolist()
    assert order[:4] == [0, 4, 6, 2] and order[4:] == [1, 5, 7, 3]
    assert torch.equal(region_priority(scores, (2, 4), 2, 0.0), scores)


def test_gate_count_floor_per_region():
    # α_min = α_max = 0.9: every token's pruning probability is 0.9 → Σ = 14.4 → prune 14 of 16 → keep 2; with a
    # 2x2 grid of 2x2 cells and 25 % per cell the floor is 4 · ceil(0.25·4) = 4
    for min_keep, keep in ((0.0, 2), (0.25, 4)):
        fake = Fake(B=1, K=4, hw=(4, 4), L=1)
        gate = SCHEDULES.get("toprovar_gate")(component_config(
            "schedule", "toprovar_gate", s_rep=2, beta=0.1, alpha_min=0.9, alpha_max=0.9, min_region_keep=min_keep,
            regions=2))
        gate.start(fake.info, fake.signals)
        fake.signals.activation_scale_B = torch.zeros(1, dtype=torch.long)
        fake.finish_scale(0)
        # diag(3, 1, 0, 0) on 4x4: σ = (3, 1) → R = 0.81873, Detail
        fake.signals.attention_entropy[(1, 0)] = torch.diag(torch.tensor([3.0, 1.0, 0.0, 0.0])).view(1, 16)
        gate.end_scale(fake.ctx(1), fake.finish_scale(1), fake.signals)
        assert gate.keep_counts(fake.ctx(2), 0, "attn", torch.zeros(1, 16), fake.signals).tolist() == [keep]


# ------------------------------------------------------------------------------------------- ToProVAR: depth exit
def with_zeros(k: int, N: int = 16) -> list[float]:
    """k zero-entropy tokens among N ones: mean (N − k)/N, exactly the k zeros below it → ρ = k/N."""
    return [0.0] * k + [1.0] * (N - k)


# ρ per scale (k/16): sample 0: 8, 7, 6, 5, 4, 3 → 0.5, 0.4375, 0.375 ≤ 0.4 at si 2 → D = 3 (si 3 not generated)
#                     sample 1: 8, 8, 7, 6, 5, 4 → 0.375 first at si 3 → D = 4
ZEROS = [[8, 7, 6, 5, 4, 3], [8, 8, 7, 6, 5, 4]]


def drive_exit(skip, fake: Fake, zeros=ZEROS) -> int | None:
    """Run the skip's slots scale by scale on the ``zeros`` table; the first scale it stops (or skips) at."""
    skip.start(fake.info, fake.signals)
    for si in range(fake.K):
        ctx = fake.ctx(si)
        decision = skip.decide(ctx, fake.signals)
        if decision.stop or decision.skip:
            return si
        entropy = torch.tensor([with_zeros(zeros[b][si]) for b in range(fake.B)])
        skip.end_scale(ctx, fake.finish_scale(si, entropy), fake.signals)
    return None


@pytest.mark.parametrize("samples,rule,comparison,stop,depth", [
    ([0], "all", "le", 3, [3]), ([1], "all", "le", 4, [4]),
    ([0, 1], "all", "le", 4, [3, 4]),  # the batch waits for its last sample
    ([0, 1], "any", "le", 3, [3, 6]),  # the first sample's depth stops the batch (sample 1 never reached its own)
    ([0], "all", "ge", 1, [1]),  # main-text reading ρ ≥ 0.4: 0.5 at si 0 → stop before si 1
])
def test_depth_exit_stopping_scale_on_a_hand_made_rho_sequence(samples, rule, comparison, stop, depth):
    fake = Fake(B=len(samples), K=6, hw=(4, 4))
    skip = SKIPS.get("depth_exit")(component_config("skip", "depth_exit", entropy_source="predictive",
                                                    batch_rule=rule, comparison=comparison))
    assert drive_exit(skip, fake, [ZEROS[b] for b in samples]) == stop
    state = fake.signals.extras["depth_exit"]
    assert state["depth_B"].tolist() == depth and state["stopped_at"] == stop
    assert state["rho_BK"][0, 0].item() == 0.5


def test_depth_exit_never_crossing_generates_everything_and_skip_mode():
    fake = Fake(B=1, K=6, hw=(4, 4))
    skip = SKIPS.get("depth_exit")(component_config("skip", "depth_exit", entropy_source="predictive", tau=0.1))
    assert drive_exit(skip, fake) is None  # ρ ≥ 3/16 > 0.1 at every tested scale (the last one is not tested)
    assert fake.signals.extras["depth_exit"]["depth_B"].tolist() == [6]
    fake = Fake(B=1, K=6, hw=(4, 4))
    skip = SKIPS.get("depth_exit")(component_config("skip", "depth_exit", entropy_source="predictive",
                                                    mode="skip"))
    skip.start(fake.info, fake.signals)
    fake.signals.extras["depth_exit"]["depth_B"] = torch.tensor([3])
    assert [skip.decide(fake.ctx(si), fake.signals).skip for si in range(6)] == [False] * 3 + [True] * 3


# the hand-worked values below were derived from generations with the multinomial random stream
SAMPLING = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9, draw="multinomial")


@pytest.fixture(scope="module")
def tiny():
    from var_core.zoo import load_model

    return load_model("official-tiny")


def test_depth_exit_generation_stops_where_rho_says(tiny):
    # official-tiny: 7 scales of 1, 4, 9, 16, 25, 36, 64 tokens; tested scales have ≥ 16 tokens and are not last
    policy = build_policy(PolicyConfig(skip=component_config("skip", "depth_exit", entropy_source="predictive")))
    result = generate(tiny, torch.tensor([1]), seeds=[13], sampling=SAMPLING, policy=policy)
    signals = policy.signals
    stop = None
    for si in range(3, 6):  # ρ by hand from the sampled distributions' entropies
        if si >= len(result.records):
            break
        ent = signals.token_entropy(si)[0].double()
        rho = float((ent < ent.mean()).double().mean())
        if rho <= 0.4:
            stop = si + 1
            break
    assert stop is not None, "this seed is expected to exit early on official-tiny"
    assert result.stopped_at == stop and len(result.records) == stop
    assert result.images.shape == (1, 3, 128, 128) and torch.isfinite(result.images).all()
