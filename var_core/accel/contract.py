"""Contract checks that catch inert components: a scorer whose scores carry no information.

The contract suite (``tests/contract``) checks shapes, finiteness, determinism and batch = single; none of that
fails a scorer that returns zeros, or the same scores whatever the sample. :func:`check_scorer_informative` runs a
scorer on a model (a random one is enough) inside a harness that prunes the last two scales, records every score
map it returns there, and raises :class:`InertScorerError` saying why when

* a call returned the **same score for every token** of a row (the ranking then keeps tokens by position only:
  at that scale and block the scorer does nothing), or
* at **every** call, every sample got the **same scores** (the scorer ignores its input: what it keeps does not
  depend on the image being generated).

A scorer that is input-independent by design (the ``random`` control) declares ``input_independent = True`` and
is checked for constant rows only. Use it on your own scorer::

    from var_core.accel.contract import check_scorer_informative
    check_scorer_informative(adapter, component_config("scorer", "mine"))
"""

from __future__ import annotations

import dataclasses

import torch

from ..engine import SamplingConfig, generate
from .policy import AccelPolicy, PolicyConfig, component_config

__all__ = ["InertScorerError", "check_scorer_informative", "harness_config"]


class InertScorerError(AssertionError):
    """A scorer whose scores carry no information (constant per row, or the same for every sample)."""


def harness_config(scorer_config) -> PolicyConfig:
    """The scorer under test, pruning active on the last two scales with half the tokens kept (identity restore)."""
    return PolicyConfig(
        name=f"inert-check-{scorer_config.component_name}", scorer=scorer_config,
        activation=component_config("activation", "fixed", start_scale=-2),
        schedule=component_config("schedule", "fixed_table", ratios=(0.5, 0.5)))


def _constant_rows(scores_RN: torch.Tensor) -> bool:
    finite = torch.where(torch.isfinite(scores_RN), scores_RN, torch.zeros_like(scores_RN))
    spread = finite.amax(dim=1) - finite.amin(dim=1)
    scale = finite.abs().amax(dim=1).clamp(min=1.0)
    return bool((spread <= 1e-6 * scale).all())


def check_scorer_informative(adapter, scorer_config, conditions=None, seeds=(11, 12, 13),
                             sampling: SamplingConfig = SamplingConfig(cfg=1.5, top_k=20, top_p=0.9)) -> int:
    """Run ``scorer_config`` (a scorer ``Config``) on ``adapter`` and raise :class:`InertScorerError` if its scores
    carry no information (see the module docstring). ``conditions``: class labels / prompts for ``len(seeds)``
    samples (default: labels 3, 7, 1 … for a class-conditional model). Returns the number of score maps checked."""
    seeds = list(seeds)
    if conditions is None:
        conditions = torch.tensor([(3 + 4 * i) % max(int(getattr(getattr(adapter, "cfg", None), "num_classes", 10)
                                                         or 10), 1) for i in range(len(seeds))])
    policy = AccelPolicy(dataclasses.replace(harness_config(scorer_config)))
    scorer = policy.scorer
    name = scorer_config.component_name
    calls: list[tuple[int, int, str, torch.Tensor, int]] = []
    original = scorer.score

    def spy(ctx, block, branch, x_RNC, signals):
        scores = original(ctx, block, branch, x_RNC, signals)
        if signals.pruning_now and ctx.num_tokens >= 2:
            calls.append((ctx.scale_index, block, branch, scores.detach().float().clone(), ctx.batch_size))
        return scores

    scorer.score = spy
    generate(adapter, conditions, seeds=seeds, sampling=sampling, policy=policy)
    if not calls:
        raise InertScorerError(f"scorer {name!r} was never asked for scores on the pruned scales of the harness "
                               f"(activation fixed at the last two scales, half the tokens kept): nothing to check")
    for si, block, branch, scores, B in calls:
        if _constant_rows(scores):
            value = float(scores.reshape(-1)[0])
            raise InertScorerError(
                f"scorer {name!r} is inert at scale {si}, block {block}, branch {branch!r}: every token of every "
                f"row got the same score ({value:g}), so the selection keeps tokens by position only and the scorer "
                f"does nothing there (did a map read before it was written score zeros? see docs/extending.md, "
                f"hook order)")
    if not getattr(type(scorer), "input_independent", False) and len(seeds) > 1:
        same_everywhere = all(torch.allclose(scores[0], scores[b], atol=1e-6, rtol=1e-5)
                              for _, _, _, scores, B in calls for b in range(1, B))
        if same_everywhere:
            raise InertScorerError(
                f"scorer {name!r} ignores its input: over {len(calls)} score maps, samples with different labels and "
                f"seeds always got identical scores, so what it keeps does not depend on the image (declare "
                f"input_independent = True on a control such as 'random')")
    return len(calls)
