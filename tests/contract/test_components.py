"""The contract every registered acceleration component must honour (DESIGN.md, "Tests are contracts").

Parametrized over the registries at collection time: registering a new component adds it here with no edit.
Each component runs with its default config inside a harness policy whose other components are simple and
always active (random scores, pruning active on the last two scales, half the tokens kept, identity restore).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from var_core.accel import REGISTRIES, PolicyConfig, component_config
from var_core.accel.policy import AccelPolicy
from var_core.engine import SamplingConfig, generate

SAMPLING = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)
LABELS = torch.tensor([3, 7, 1])
SEEDS = [11, 12, 13]


def harness_config(kind: str, name: str) -> PolicyConfig:
    base = PolicyConfig(
        name=f"contract-{kind}-{name}",
        scorer=component_config("scorer", "random"),
        activation=component_config("activation", "fixed", start_scale=-2),
        schedule=component_config("schedule", "fixed_table", ratios=(0.5, 0.5)),
    )
    if kind == "attention":  # a sparse attention pattern runs on dense scales: no token pruning in the harness
        base = dataclasses.replace(base, activation=component_config("activation", "never"))
    return dataclasses.replace(base, **{kind: component_config(kind, name)})


class SpyPolicy(AccelPolicy):
    """Records what the policy declared and what the loop delivered, and checks shapes on the way."""

    def start(self, info):
        super().start(info)
        self.declared = {"attention": set(), "lens": set(), "block": set(), "branch": set()}
        self.delivered = {"attention": set(), "lens": set(), "block": set(), "branch": set()}
        self.score_shapes = []

    def plan_scale(self, ctx):
        plan = super().plan_scale(ctx)
        si = ctx.scale_index
        if not (plan.stop or plan.skip):
            self.declared["attention"] |= {(si, b) for b in plan.attention_blocks}
            self.declared["lens"] |= {(si, b) for b in plan.lens_blocks}
            if plan.observe_blocks:
                self.declared["block"] |= {(si, b) for b in range(ctx.num_blocks)}
            if plan.observe_branches:
                self.declared["branch"] |= {(si, b) for b in range(ctx.num_blocks)}
        return plan

    def plan_block(self, ctx, block, branch, x_RNC):
        selection = super().plan_block(ctx, block, branch, x_RNC)
        if selection is not None:
            index, valid = selection if isinstance(selection, tuple) else (selection, None)
            assert index.shape[0] == x_RNC.shape[0] and index.dtype == torch.long
            assert int(index.min()) >= 0 and int(index.max()) < ctx.num_tokens
            increasing = index[:, 1:] > index[:, :-1]
            if valid is not None:  # padding (at the end of a row) repeats a kept index
                increasing = increasing | ~valid[:, 1:]
            assert bool(increasing.all()), "kept indices must be sorted and distinct per row"
        return selection

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC):
        full = super().restore(ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC)
        assert full.shape == x_RNC.shape and torch.isfinite(full).all()
        kept = torch.gather(full, 1, keep_Rn.unsqueeze(-1).expand_as(out_kept_RnC))
        assert torch.allclose(kept, out_kept_RnC), "restorers must keep the fresh outputs at kept positions"
        return full

    def observe_attention(self, ctx, block, probs, keep):
        self.delivered["attention"].add((ctx.scale_index, block))
        super().observe_attention(ctx, block, probs, keep)

    def observe_lens(self, ctx, block, logits):
        self.delivered["lens"].add((ctx.scale_index, block))
        super().observe_lens(ctx, block, logits)

    def observe_block(self, ctx, block, x_in, x_out):
        self.delivered["block"].add((ctx.scale_index, block))
        super().observe_block(ctx, block, x_in, x_out)

    def observe_branch(self, ctx, block, branch, out):
        self.delivered["branch"].add((ctx.scale_index, block))
        super().observe_branch(ctx, block, branch, out)


def _wrap_scorer(policy: SpyPolicy):
    original = policy.scorer.score

    def score(ctx, block, branch, x_RNC, signals):
        scores = original(ctx, block, branch, x_RNC, signals)
        assert scores.shape in ((ctx.batch_size, ctx.num_tokens), (x_RNC.shape[0], ctx.num_tokens)), scores.shape
        assert torch.isfinite(scores).all(), "scores must be finite"
        policy.score_shapes.append(tuple(scores.shape))
        return scores

    policy.scorer.score = score


CASES = [(kind, name) for kind, registry in REGISTRIES.items() for name in registry.names()]


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}:{n}" for k, n in CASES])
def test_component_contract(tiny_adapter, kind, name):
    policy = SpyPolicy(harness_config(kind, name))
    _wrap_scorer(policy)
    first = generate(tiny_adapter, LABELS, seeds=SEEDS, sampling=SAMPLING, policy=policy)
    declared, delivered = policy.declared, policy.delivered
    assert first.images.shape == (3, 3, 128, 128) and torch.isfinite(first.images).all()
    for what in declared:
        assert declared[what] <= delivered[what], f"declared {what} observations were not delivered"

    # deterministic, and per-generation state is reset: the same policy object gives the same result again
    second = generate(tiny_adapter, LABELS, seeds=SEEDS, sampling=SAMPLING, policy=policy)
    for a, b in zip(first.tokens, second.tokens):
        assert (a is None and b is None) or torch.equal(a, b)
    assert torch.equal(first.images, second.images)

    # kept-token counts are within bounds and dense where the policy said it would not prune
    for record, step in zip(first.records, policy.history):
        if record.skipped:
            continue
        N = record.hw[0] * record.hw[1]
        for branches in record.kept_tokens:
            assert all(1 <= c <= N for c in branches)
        if not step.get("prune", False):
            assert all(c == N for branches in record.kept_tokens for c in branches)
    if kind in ("scorer", "restorer"):  # the harness schedule decides the counts: check them exactly
        for record in first.records[-2:]:
            N = record.hw[0] * record.hw[1]
            expected = N - int(0.5 * N)
            assert all(c == expected for branches in record.kept_tokens for c in branches), record.kept_tokens

    # a sample generated alone equals the same sample inside the batch
    coupled = getattr(REGISTRIES[kind].get(name), "batch_coupled", False)
    for b in (2,):
        alone = generate(tiny_adapter, LABELS[b:b + 1], seeds=[SEEDS[b]], sampling=SAMPLING, policy=policy)
        for a_tok, batch_tok in zip(alone.tokens, first.tokens):
            assert (a_tok is None and batch_tok is None) or torch.equal(a_tok[0], batch_tok[b])
        if not coupled:
            assert torch.allclose(alone.images[0], first.images[b], atol=2e-4)
    if coupled:  # a documented batch-level decision (depth_exit stops the whole batch): where every sample of the
        # batch decides alike (the same sample three times), the batch must still equal the sample alone
        same = generate(tiny_adapter, LABELS[2:3].repeat(3), seeds=[SEEDS[2]] * 3, sampling=SAMPLING, policy=policy)
        assert same.stopped_at == alone.stopped_at and len(same.records) == len(alone.records)
        for b in range(3):
            assert torch.allclose(alone.images[0], same.images[b], atol=2e-4)


@pytest.mark.parametrize("kind", list(REGISTRIES))
def test_registry_rejects_unknown_with_suggestion(kind):
    registry = REGISTRIES[kind]
    some = registry.names()[0]
    with pytest.raises(KeyError, match="Did you mean"):
        registry.get(some[:-1] + "x" if len(some) > 2 else some + "x")


def test_every_component_has_docstring_and_documented_knobs():
    for kind, registry in REGISTRIES.items():
        for name, cls in registry:
            assert (cls.__doc__ or "").strip(), f"{kind} {name!r} lacks a docstring"
            for f in dataclasses.fields(cls.Config):
                assert f.metadata.get("doc"), f"{kind} {name!r}: knob {f.name} lacks documentation (use knob())"


SCORERS_SCHEDULES = [(scorer, schedule) for scorer in REGISTRIES["scorer"].names()
                     for schedule in REGISTRIES["schedule"].names()]


@pytest.mark.parametrize("scorer,schedule", SCORERS_SCHEDULES, ids=[f"{a}x{b}" for a, b in SCORERS_SCHEDULES])
def test_every_scorer_schedule_pair_is_batch_invariant(tiny_adapter, scorer, schedule):
    """Ragged keep counts (adaptive schedules) and tied scores (Haar energies, upsampled maps) are where a
    selection can start depending on its batch neighbours: each pairing must give a sample the same tokens
    alone as inside a batch (issue 11: LD-Pruning's ties and SparseVAR's near-ties were missed by pairing each
    schedule only with ``random`` and each scorer only with ``fixed_table``)."""
    config = dataclasses.replace(harness_config("scorer", scorer), schedule=component_config("schedule", schedule))
    policy = AccelPolicy(config)
    batch = generate(tiny_adapter, LABELS, seeds=SEEDS, sampling=SAMPLING, policy=policy)
    pruned = sum(c < r.hw[0] * r.hw[1] for r in batch.records if not r.skipped for br in r.kept_tokens for c in br)
    for b in (0, 2):
        alone = generate(tiny_adapter, LABELS[b:b + 1], seeds=[SEEDS[b]], sampling=SAMPLING, policy=policy)
        for si, (a_tok, batch_tok) in enumerate(zip(alone.tokens, batch.tokens)):
            assert (a_tok is None and batch_tok is None) or torch.equal(a_tok[0], batch_tok[b]), (b, si)
        assert torch.allclose(alone.images[0], batch.images[b], atol=2e-4)
    if schedule in ("fixed_table",):  # the harness table certainly prunes the last two scales
        assert pruned > 0
