"""Fast configuration check of every arm of every family on a tiny model (``python -m studies.ablate validate``).

For each family: build the arms (an unavailable arm is an error here), check that each config survives
``to_dict`` → ``from_dict`` with the same hash (records depend on it), then generate two samples with each distinct
config on ``official-tiny`` (decode skipped; optionally stopped after ``max_scales`` scales by a wrapper policy), so
a wrong option name, a value out of range or a component that fails at run time surfaces in seconds. An arm whose
components refuse the model in their pre-flight (``check_model``, e.g. a preset tabulated for Infinity only) is
listed as ``n/a`` with the reason, as the study runner reports it unavailable, and does not fail. One arm also goes
through the Lightning evaluator to check that path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from var_core.accel.policy import PolicyConfig, build_policy
from var_core.engine import GenerationOptions, Policy, SamplingConfig, ScalePlan, generate

from .base import FamilyContext, build_arms, family_names
from .overrides import apply_overrides, parse_overrides

__all__ = ["StopAfter", "ValidationReport", "validate_families"]


class StopAfter(Policy):
    """Delegates every slot to ``inner`` and stops generation before scale ``max_scales``."""

    def __init__(self, inner: Policy, max_scales: int):
        self.inner = inner
        self.max_scales = max_scales

    def __getattr__(self, name):  # history, signals, activation_scales … of the wrapped policy
        return getattr(self.inner, name)

    def start(self, info):
        self.inner.start(info)

    def end(self):
        self.inner.end()

    def plan_scale(self, ctx):
        if ctx.scale_index >= self.max_scales:
            return ScalePlan(stop=True)
        return self.inner.plan_scale(ctx)

    def plan_block(self, ctx, block, branch, x_RNC):
        return self.inner.plan_block(ctx, block, branch, x_RNC)

    def observe_attention(self, ctx, block, probs_RHnL, keep_Rn):
        self.inner.observe_attention(ctx, block, probs_RHnL, keep_Rn)

    def restore(self, ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC):
        return self.inner.restore(ctx, block, branch, out_kept_RnC, keep_Rn, x_RNC)

    def observe_branch(self, ctx, block, branch, out_RNC):
        self.inner.observe_branch(ctx, block, branch, out_RNC)

    def observe_block(self, ctx, block, x_in_RNC, x_out_RNC):
        self.inner.observe_block(ctx, block, x_in_RNC, x_out_RNC)

    def observe_lens(self, ctx, block, logits_RNV):
        self.inner.observe_lens(ctx, block, logits_RNV)

    def observe_logits(self, ctx, raw_logits_RNV):
        self.inner.observe_logits(ctx, raw_logits_RNV)

    def latent_mask(self, ctx):
        return self.inner.latent_mask(ctx)

    def plan_kv(self, ctx, cache):
        return self.inner.plan_kv(ctx, cache)

    def end_scale(self, ctx, record):
        self.inner.end_scale(ctx, record)


@dataclass
class ValidationReport:
    checked: list[tuple[str, str, float]] = field(default_factory=list)  # (family, arm, seconds)
    errors: list[tuple[str, str, str]] = field(default_factory=list)  # (family, arm, message)
    # arms whose components refuse this model in their pre-flight (check_model), as the runner reports them
    not_for_model: list[tuple[str, str, str]] = field(default_factory=list)  # (family, arm, reason)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors


def validate_families(families: list[str] | None = None, *, model: str = "official-tiny", weights=None,
                      max_scales: int | None = None, overrides=(), method: str = "nova", samples: int = 2,
                      lightning: bool = True, threads: int | None = None, log: Callable[[str], None] = print
                      ) -> ValidationReport:
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _validate(families, model=model, weights=weights, max_scales=max_scales, overrides=overrides,
                         method=method, samples=samples, lightning=lightning, threads=threads, log=log)
    finally:
        torch.set_num_threads(previous)


def _validate(families, *, model, weights, max_scales, overrides, method, samples, lightning, threads, log
              ) -> ValidationReport:
    from var_core.zoo import load_model

    started = time.perf_counter()
    report = ValidationReport()
    adapter = load_model(model, weights=weights)
    num_classes = int(getattr(getattr(adapter, "cfg", None), "num_classes", 1) or 1)
    labels = torch.arange(samples) % num_classes
    seeds = list(range(samples))
    sampling = SamplingConfig(cfg=1.5, top_k=50, top_p=0.9)
    options = GenerationOptions(check_finite=True, decode=False)
    done: dict[str, str | None] = {}  # config hash -> error (None: fine)
    unfit: dict[str, str] = {}  # config hash -> why check_model refuses the model
    from var_core.engine.loop import generation_info
    from var_core.eval.twomodel import model_switch_for

    info = generation_info(adapter, samples, adapter.initial_guidance(sampling), sampling=sampling)
    parsed = parse_overrides(list(overrides))
    for fam in families or family_names():
        try:
            arms = apply_overrides(build_arms(fam, FamilyContext(method=method)), parsed)
        except Exception as exc:  # noqa: BLE001
            report.errors.append((fam, "*", f"{type(exc).__name__}: {exc}"))
            log(f"FAIL {fam}: {type(exc).__name__}: {exc}")
            continue
        for arm in arms:
            if not arm.ok:
                report.errors.append((fam, arm.name, arm.error or "no config"))
                log(f"FAIL {fam}/{arm.name}: {arm.error}")
                continue
            key = arm.config.config_hash()
            t0 = time.perf_counter()
            if key not in done and key not in unfit:
                try:
                    again = PolicyConfig.from_dict(arm.config.to_dict())
                    if again.config_hash() != key:
                        raise ValueError(f"config hash changes through to_dict/from_dict: {key} -> "
                                         f"{again.config_hash()}")
                    policy = build_policy(arm.config)
                    try:  # the runner's pre-flight: a model this arm is not for is not an error of the arm
                        policy.check_model(info)
                        switch = model_switch_for(policy.config, adapter)  # a second model: same tokenizer
                    except ValueError as exc:
                        unfit[key] = str(exc)
                        raise
                    if max_scales is not None:
                        policy = StopAfter(policy, max_scales)
                    result = generate(adapter, labels, seeds=seeds, sampling=sampling, policy=policy,
                                      options=options, switch=switch)
                    if not result.records:
                        raise RuntimeError("no scale was generated")
                    done[key] = None
                except Exception as exc:  # noqa: BLE001 - reported per arm
                    if key not in unfit:
                        done[key] = f"{type(exc).__name__}: {exc}"
            seconds = time.perf_counter() - t0
            if key in unfit:
                report.not_for_model.append((fam, arm.name, unfit[key]))
                log(f"n/a  {fam}/{arm.name} (not for {model}: {unfit[key]})")
            elif done[key] is None:
                report.checked.append((fam, arm.name, seconds))
                log(f"ok   {fam}/{arm.name} ({seconds * 1000:.0f} ms)")
            else:
                report.errors.append((fam, arm.name, done[key]))
                log(f"FAIL {fam}/{arm.name}: {done[key]}")
    if lightning:
        from var_core.eval.lightning import ConditionSet, run_generation

        t0 = time.perf_counter()
        try:
            arm = next(a for a in build_arms(families[0] if families else "scorer") if a.role != "baseline")
            run = run_generation(adapter, ConditionSet.balanced(samples, num_classes, 0), policy_config=arm.config,
                                 sampling=sampling, batch_size=samples, warmup=0, progress=False, threads=threads)
            if len(run) != samples:
                raise RuntimeError(f"expected {samples} samples, got {len(run)}")
            report.checked.append(("evaluator", arm.name, time.perf_counter() - t0))
            log(f"ok   evaluator: Trainer.predict with {arm.name} ({time.perf_counter() - t0:.1f} s)")
        except Exception as exc:  # noqa: BLE001
            report.errors.append(("evaluator", "-", f"{type(exc).__name__}: {exc}"))
            log(f"FAIL evaluator: {type(exc).__name__}: {exc}")
    report.seconds = time.perf_counter() - started
    return report
