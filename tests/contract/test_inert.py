"""Contract checks for inert scorers (issue 31): every registered scorer's scores carry information on a model, and
a deliberately inert scorer fails :func:`var_core.accel.contract.check_scorer_informative` with a message saying
why. Parametrized over the registry at collection time: a new scorer (plugins included) gets the check for free."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from var_core.accel import REGISTRIES, component_config
from var_core.accel.base import Scorer
from var_core.accel.contract import InertScorerError, check_scorer_informative
from var_core.accel.knobs import ComponentConfig
from var_core.accel.registry import SCORERS


@pytest.mark.parametrize("name", REGISTRIES["scorer"].names())
def test_every_scorer_is_informative(tiny_adapter, name):
    assert check_scorer_informative(tiny_adapter, component_config("scorer", name)) > 0


@contextmanager
def registered(name: str, cls):
    SCORERS.register(name)(cls)
    try:
        yield
    finally:
        SCORERS._items.pop(name, None)


class _FirstBlockOnly(Scorer):
    """Test scorer: the block input's norm at block 0, zeros at every later block (the draft of issue 31 that read a
    map ``observe_block`` writes only after ``score`` ran at the same block)."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass

    def score(self, ctx, block, branch, x_RNC, signals):
        if block == 0:
            return x_RNC.float().square().sum(-1)
        return torch.zeros(x_RNC.shape[0], ctx.num_tokens, device=x_RNC.device)


class _ByPosition(Scorer):
    """Test scorer: later positions first, whatever the sample (ignores its input)."""

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pass

    def score(self, ctx, block, branch, x_RNC, signals):
        return torch.arange(ctx.num_tokens, dtype=torch.float32).expand(ctx.batch_size, -1)


def test_inert_scorer_fails_with_why(tiny_adapter):
    with registered("test_first_block_only", _FirstBlockOnly):
        with pytest.raises(InertScorerError) as info:
            check_scorer_informative(tiny_adapter, component_config("scorer", "test_first_block_only"))
    message = str(info.value)
    # block 1 of the harness's first pruned scale (official-tiny: 7 scales, 2 blocks; pruned: scales 5 and 6)
    assert "'test_first_block_only' is inert at scale 5, block 1" in message
    assert "same score (0)" in message and "keeps tokens by position only" in message


def test_input_ignoring_scorer_fails_with_why(tiny_adapter):
    with registered("test_by_position", _ByPosition):
        with pytest.raises(InertScorerError, match="'test_by_position' ignores its input: over 4 score maps"):
            check_scorer_informative(tiny_adapter, component_config("scorer", "test_by_position"))
