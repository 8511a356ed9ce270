"""Sampling settings and token draws: top-k / top-p filtering and one generator per sample.

Unlike the official samplers these functions never modify the logits they are given, so observers can keep
references to the guided logits without a defensive copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """User-facing sampling knobs.

    ``cfg`` is the guidance strength in the model family's own convention (VAR: a linear ramp from 0 at the
    first scale to ``cfg`` at the last, applied as ``(1+t)·cond − t·uncond``; Infinity: constant
    ``cfg·cond + (1−cfg)·uncond``). ``top_k=0`` / ``top_p=0`` disable the filters; ``top_k=1`` is greedy.
    """

    cfg: float = 1.5
    top_k: int = 900
    top_p: float = 0.96
    temperature: float = 1.0  # Infinity's tau; VAR's official loop has none (1.0)

    def __post_init__(self) -> None:
        if self.cfg < 0:
            raise ValueError(f"cfg must be >= 0, got {self.cfg}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1] (0 disables it), got {self.top_p}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def filter_top_k_top_p(logits_BNV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Official VAR semantics, out of place: keep the ``top_k`` largest; then drop the tokens whose ascending
    cumulative probability is ≤ ``1 − top_p`` (the largest token always survives)."""
    V = logits_BNV.shape[-1]
    out = logits_BNV
    if 0 < top_k < V:
        kth = logits_BNV.topk(top_k, dim=-1, largest=True, sorted=False)[0].amin(dim=-1, keepdim=True)
        out = out.masked_fill(out < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, sorted_idx = out.sort(dim=-1, descending=False)
        drop_sorted = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def draw_categorical(
    logits_BNV: torch.Tensor,
    sampling: SamplingConfig,
    generators: list[torch.Generator] | None = None,
    shared_generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Token ids ``[B, N]``.

    ``generators``: one per sample (results independent of batch composition; the default in the engine).
    ``shared_generator``: one draw over the whole batch with a single generator, which is what the official
    code does (used to compare against RNG-dependent official goldens).
    """
    if sampling.greedy:
        return logits_BNV.argmax(dim=-1)
    filtered = filter_top_k_top_p(logits_BNV, sampling.top_k, sampling.top_p)
    B, N, V = filtered.shape
    probs = filtered.softmax(dim=-1)
    if shared_generator is not None or generators is None:
        flat = torch.multinomial(probs.view(-1, V), 1, replacement=True, generator=shared_generator)
        return flat.view(B, N)
    if len(generators) != B:
        raise ValueError(f"got {len(generators)} generators for a batch of {B} samples")
    return torch.cat(
        [torch.multinomial(probs[b], 1, replacement=True, generator=generators[b]).view(1, N) for b in range(B)]
    )
