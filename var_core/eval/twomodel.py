"""The evaluator's side of the second-model seam: the refiner a policy config names (``PolicyConfig.refiner``, a zoo
entry) loaded beside the study's model, as the :class:`~var_core.engine.switch.ModelSwitch` ``generate()`` takes.

Loaded refiners are kept per (entry, device, dtype) for the process, so the arms of a study load each once.
"""

from __future__ import annotations

from typing import Any

import torch

from ..engine.switch import ModelSwitch, TokenizerMismatchError, check_shared_tokenizer

_LOADED: dict[tuple[str, str, str], Any] = {}
# restorers that fill pruned slots with hidden states kept from earlier scales: across a switch between models of
# different widths those states no longer fit (the loop would fail mid-generation)
HIDDEN_STATE_RESTORERS = ("static_cache", "residual_reuse", "previous_output")


class TwoModelConfigError(ValueError):
    """A policy config that cannot run across a model switch (an arm that is not for this pair of models)."""


def load_refiner(name: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """The adapter of zoo entry ``name`` on ``device`` (loaded once per process)."""
    from ..zoo import check_model_name, load_model

    check_model_name(name)  # an unknown entry: UserError with a did-you-mean
    key = (name, str(torch.device(device)), str(dtype))
    if key not in _LOADED:
        _LOADED[key] = load_model(name, device=device, dtype=dtype)
    return _LOADED[key]


def model_switch_for(config, drafter) -> ModelSwitch | None:
    """The :class:`ModelSwitch` of a policy config on the model ``drafter`` (None: the config names no refiner).

    Raises :class:`TokenizerMismatchError` (a user error: ``error:`` line, exit 2) when the two models do not share a
    tokenizer, naming both and what to pick instead."""
    name = getattr(config, "refiner", "") or ""
    if not name:
        return None
    try:
        dtype = next(p.dtype for m in drafter.modules().values() for p in m.parameters())
    except StopIteration:
        dtype = torch.float32
    refiner = load_refiner(name, drafter.device, dtype)
    if getattr(drafter, "precision", None) is not None and getattr(refiner, "precision", None) is None:
        refiner.precision = drafter.precision
    try:
        check_shared_tokenizer(drafter, refiner)
    except TokenizerMismatchError as exc:
        raise TokenizerMismatchError(f"refiner={name}: {exc} (--set refiner=ENTRY)") from None
    restorer = getattr(getattr(config, "restorer", None), "component_name", "")
    widths = [getattr(getattr(m, "cfg", None), "embed_dim", None) for m in (drafter, refiner)]
    if restorer in HIDDEN_STATE_RESTORERS and widths[0] != widths[1]:
        raise TwoModelConfigError(
            f"restorer {restorer!r} reuses hidden states of earlier scales, which do not fit across the switch from "
            f"width {widths[0]} to the refiner {name}'s {widths[1]}: with a refiner use a restorer that fills from "
            f"the current scale (identity, nearest, anchors, sparse_residual)")
    attention = getattr(getattr(config, "attention", None), "component_name", "dense")
    heads = [getattr(getattr(m, "cfg", None), "num_heads", None) for m in (drafter, refiner)]
    if attention != "dense" and (heads[0] != heads[1] or widths[0] != widths[1]):
        raise TwoModelConfigError(
            f"attention pattern {attention!r} carries per-head patterns across scales, which do not fit across the "
            f"switch from {heads[0]} heads to the refiner {name}'s {heads[1]}: with a refiner use dense attention")
    return ModelSwitch(refiner, int(config.switch_scale))


def attach_model_switch(policy, drafter):
    """Give ``policy`` (built from a config) the model switch its config names, as its ``model_switch`` attribute,
    which ``generate()`` uses when no ``switch`` is passed; returns the policy."""
    config = getattr(policy, "config", None)
    if config is not None:
        policy.model_switch = model_switch_for(config, drafter)
    return policy


def check_refiner_override(arms, overrides, drafter) -> None:
    """``--set refiner=ENTRY``: a refiner the user named that does not share the model's tokenizer is their mistake,
    an error before anything runs (a preset's own refiner that does not fit this model only makes its arm
    unavailable, as any preset not meant for the model)."""
    if not any((getattr(o, "key", None) or str(o).split("=", 1)[0]).strip() == "refiner" for o in overrides or ()):
        return
    for arm in arms:
        config = getattr(arm, "config", None)
        if config is not None and getattr(config, "refiner", ""):
            try:
                model_switch_for(config, drafter)
            except TwoModelConfigError:  # this arm's method, not the refiner: the arm is unavailable (pre-flight)
                pass
