"""The logit lens at one block, computed only as far as a component asks (the ``observe_lens`` slot).

NOVA's layer entropy (specs/methods.md §2.1, RECONSTRUCTED) applies the model's head to the hidden state after
every block. On a codebook VAR the head is ``C → V`` (1024 → 4096 for VAR-d16), about a third of a block per
token, so how much of it runs matters: a component that wants the entropy of the *guided* distribution does not
need the head on both CFG halves. The head is affine in the normalised features ``f`` (``ℓ = W·f + b``), so

    w_c·ℓ_c + w_u·ℓ_u = W·(w_c·f_c + w_u·f_u) + (w_c + w_u)·b

gives the guided logits with ONE head matmul on ``B`` rows instead of two on ``2B`` (exact up to float rounding).
:class:`LensProbe` offers the full per-row logits, the conditional rows, and such mixtures, each computed on
first use and memoised, so two components reading the same lens never pay twice. ``projected_rows`` counts the
rows that went through the head's projection; the loop stores it in the scale record so that FLOPs counts
follow what was actually computed. A probe is valid during the ``observe_lens`` call only (it reads the live
generation state).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

HeadParts = tuple[torch.Tensor, torch.nn.Linear]


class LensProbe:
    """Lazy logit lens on one block's output ``x_RNC`` (rows: ``B`` cond then ``B`` uncond when both CFG halves
    run, else ``B`` rows of one half).

    Args:
        full_logits: computes the head on every row, ``[R, N, V]`` (the adapter's ``logits``).
        head_parts: optional; returns ``(features_RNC, linear)`` — the head's normalised input and its affine
            layer — enabling :meth:`mixed_logits` and :meth:`cond_logits` without the full head. Without it those
            fall back to combining :meth:`logits`.
        batch_size: samples ``B``.
    """

    def __init__(self, full_logits: Callable[[], torch.Tensor], batch_size: int, rows: int,
                 head_parts: Callable[[], HeadParts] | None = None):
        self._full_logits = full_logits
        self._head_parts = head_parts
        self.batch_size = batch_size
        self.rows = rows
        self._logits: torch.Tensor | None = None
        self._parts: HeadParts | None = None
        self._mixed: dict[tuple, torch.Tensor] = {}
        self.projected_rows = 0  # rows projected through the head so far (for FLOPs accounting)

    @classmethod
    def of_logits(cls, logits_RNV: torch.Tensor, batch_size: int) -> "LensProbe":
        """A probe over logits already computed (tests, offline analysis)."""
        return cls(lambda: logits_RNV, batch_size, logits_RNV.shape[0])

    @property
    def both_halves(self) -> bool:
        return self.rows == 2 * self.batch_size

    def logits(self) -> torch.Tensor:
        """``[R, N, V]``: the head on every row."""
        if self._logits is None:
            self._logits = self._full_logits()
            self.projected_rows += self.rows
        return self._logits

    def _features(self) -> HeadParts | None:
        if self._head_parts is None:
            return None
        if self._parts is None:
            self._parts = self._head_parts()
        return self._parts

    def cond_logits(self) -> torch.Tensor:
        """``[B, N, V]``: the first ``B`` rows (the conditional half, or the only half)."""
        parts = None if self._logits is not None or not self.both_halves else self._features()
        if parts is None:
            return self.logits()[: self.batch_size]
        features, linear = parts
        self.projected_rows += self.batch_size
        return F.linear(features[: self.batch_size], linear.weight, linear.bias).float()

    def mixed_logits(self, cond_weight_B: torch.Tensor, uncond_weight_B: torch.Tensor) -> torch.Tensor:
        """``[B, N, V]`` = ``w_c·ℓ_cond + w_u·ℓ_uncond`` per sample (both CFG halves must be present)."""
        if not self.both_halves:
            raise ValueError(f"mixed_logits needs both CFG halves ({2 * self.batch_size} rows), got {self.rows}")
        B = self.batch_size
        key = (tuple(cond_weight_B.tolist()), tuple(uncond_weight_B.tolist()))
        if key in self._mixed:
            return self._mixed[key]
        parts = None if self._logits is not None else self._features()
        if parts is None:
            logits = self.logits().float()
            wc, wu = (w.to(logits.device, logits.dtype).view(B, 1, 1) for w in (cond_weight_B, uncond_weight_B))
            mixed = wc * logits[:B] + wu * logits[B:]
        else:
            features, linear = parts
            wc, wu = (w.to(features.device, features.dtype).view(B, 1, 1) for w in (cond_weight_B, uncond_weight_B))
            mixed = F.linear(wc * features[:B] + wu * features[B:], linear.weight).float()
            self.projected_rows += B
            if linear.bias is not None:
                mixed = mixed + (wc + wu).float() * linear.bias.float()
        self._mixed[key] = mixed
        return mixed
