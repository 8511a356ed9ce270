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

Sample subsets: every accessor takes an optional ``samples`` (bool ``[B]`` or sorted int64 indices) and then
projects only those samples' rows (their cond row, their mixed row, or both CFG rows for :meth:`logits`), returning
them in sample order. NOVA reads the lens only for samples that are accelerated at the scale (the others run
dense), so in a batch where some samples have not activated yet the head runs on the active ones alone.
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
        head_parts: optional; ``head_parts(rows=None)`` returns ``(features_RNC, linear)`` — the head's normalised
            input (of the network rows ``rows`` only, when given) and its affine layer — enabling
            :meth:`mixed_logits` and :meth:`cond_logits` without the full head. Without it those fall back to
            combining :meth:`logits`.
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
        self._cache: dict[tuple, torch.Tensor] = {}
        self.projected_rows = 0  # rows projected through the head so far (for FLOPs accounting)

    @classmethod
    def of_logits(cls, logits_RNV: torch.Tensor, batch_size: int) -> "LensProbe":
        """A probe over logits already computed (tests, offline analysis)."""
        return cls(lambda: logits_RNV, batch_size, logits_RNV.shape[0])

    @property
    def both_halves(self) -> bool:
        return self.rows == 2 * self.batch_size

    def _sample_index(self, samples) -> torch.Tensor | None:
        """Sorted int64 sample indices of ``samples`` (None: every sample)."""
        if samples is None:
            return None
        samples = torch.as_tensor(samples)
        if samples.dtype == torch.bool:
            if samples.shape != (self.batch_size,):
                raise ValueError(f"samples mask has shape {tuple(samples.shape)}, expected ({self.batch_size},)")
            if bool(samples.all()):
                return None
            return samples.nonzero().flatten()
        index = samples.long().flatten()
        return None if index.numel() == self.batch_size and bool(
            (index == torch.arange(self.batch_size, device=index.device)).all()) else index

    def _rows_of(self, index: torch.Tensor, halves: int) -> torch.Tensor:
        """Network rows of the samples ``index``: their cond rows (``halves=1``), or cond then uncond rows."""
        if halves == 1:
            return index
        return torch.cat((index, index + self.batch_size))

    def logits(self, samples=None) -> torch.Tensor:
        """``[R, N, V]``: the head on every row (``samples``: the cond rows of those samples, then their uncond rows
        when both halves run)."""
        index = self._sample_index(samples)
        if index is None or self._logits is not None:
            if self._logits is None:
                self._logits = self._full_logits()
                self.projected_rows += self.rows
            if index is None:
                return self._logits
            return self._logits[self._rows_of(index.to(self._logits.device), 2 if self.both_halves else 1)]
        key = ("logits", tuple(index.tolist()))
        if key not in self._cache:
            rows = self._rows_of(index, 2 if self.both_halves else 1)
            parts = self._features(rows)
            if parts is None:  # no head parts: the full head, then the rows asked for
                return self.logits()[rows.to(self.logits().device)]
            features, linear = parts
            self._cache[key] = F.linear(features, linear.weight, linear.bias).float()
            self.projected_rows += int(rows.numel())
        return self._cache[key]

    def _features(self, rows: torch.Tensor | None = None) -> HeadParts | None:
        """Head features of every row (``rows`` None) or of the network rows ``rows`` (in that order)."""
        if self._head_parts is None:
            return None
        if rows is None or self._parts is not None:
            if self._parts is None:
                self._parts = self._head_parts()
            features, linear = self._parts
            return self._parts if rows is None else (features[rows.to(features.device)], linear)
        key = ("features", tuple(rows.tolist()))
        if key not in self._cache:
            self._cache[key] = self._head_parts(rows)
        return self._cache[key]

    def cond_logits(self, samples=None) -> torch.Tensor:
        """``[B, N, V]``: the first ``B`` rows (the conditional half, or the only half); ``samples``: those samples'
        rows only, in sample order."""
        index = self._sample_index(samples)
        if self._logits is not None or not self.both_halves or self._head_parts is None:
            if not self.both_halves:
                return self.logits(samples)
            logits = self.logits()[: self.batch_size]
            return logits if index is None else logits[index.to(logits.device)]
        key = ("cond", None if index is None else tuple(index.tolist()))
        if key not in self._cache:
            rows = torch.arange(self.batch_size) if index is None else index
            features, linear = self._features(rows)
            self._cache[key] = F.linear(features, linear.weight, linear.bias).float()
            self.projected_rows += features.shape[0]
        return self._cache[key]

    def mixed_logits(self, cond_weight_B: torch.Tensor, uncond_weight_B: torch.Tensor, samples=None,
                     host_weights: tuple[torch.Tensor, torch.Tensor] | None = None, weights_key=None
                     ) -> torch.Tensor:
        """``[B, N, V]`` = ``w_c·ℓ_cond + w_u·ℓ_uncond`` per sample (both CFG halves must be present);
        ``samples``: those samples only (``[b, N, V]`` in sample order; the weights stay per sample, ``[B]``).
        ``host_weights``: the same two weights already on the host (a caller that copies them once per scale), read
        for the cache key and the shared-bias test instead of the device ones (no host synchronisation).
        ``weights_key``: a hashable the caller names these weights by (e.g. its per-scale memo key), the cache key
        instead of their values; with one sample projected the shared-bias test needs no values either, so then
        neither weights nor ``host_weights`` are read."""
        if not self.both_halves:
            raise ValueError(f"mixed_logits needs both CFG halves ({2 * self.batch_size} rows), got {self.rows}")
        B = self.batch_size
        index = self._sample_index(samples)
        b = B if index is None else int(index.numel())
        single = weights_key is not None and b == 1  # one weight pair: shared by construction, never read
        host_c, host_u = host_weights if host_weights is not None else (cond_weight_B, uncond_weight_B)
        key = ("mixed", ("key", weights_key) if single else (tuple(host_c.tolist()), tuple(host_u.tolist())),
               None if index is None else tuple(index.tolist()))
        if key in self._cache:
            return self._cache[key]
        if index is not None:
            cond_weight_B, uncond_weight_B = cond_weight_B[index.cpu()], uncond_weight_B[index.cpu()]
            if not single:
                host_c, host_u = host_c[index.cpu()], host_u[index.cpu()]
        parts = None
        if self._logits is None and self._head_parts is not None:
            parts = self._features(None if index is None else self._rows_of(index, 2))
        if parts is None:
            logits = self.logits().float()
            cond, uncond = logits[:B], logits[B:]
            if index is not None:
                cond, uncond = cond[index.to(logits.device)], uncond[index.to(logits.device)]
            wc, wu = (w.to(logits.device, logits.dtype).view(b, 1, 1) for w in (cond_weight_B, uncond_weight_B))
            mixed = wc * cond + wu * uncond
        else:
            features, linear = parts  # [2b, N, C]: the samples' cond rows, then their uncond rows
            cond, uncond = features[:b], features[b:]
            wc, wu = (w.to(features.device, features.dtype).view(b, 1, 1) for w in (cond_weight_B, uncond_weight_B))
            bias_scale = wc + wu
            self.projected_rows += b
            shared = single
            if not single:
                host_scale = host_c.to(features.dtype) + host_u.to(features.dtype)  # = bias_scale, on the host
                shared = bool((host_scale == host_scale.flatten()[0]).all())
            if linear.bias is not None and shared:
                # one weight for every sample (VAR: α = 1): the scaled bias rides in the GEMM (no pass over [b, N, V])
                bias = linear.bias * bias_scale.flatten()[0]
                mixed = F.linear(wc * cond + wu * uncond, linear.weight, bias).float()
            else:
                mixed = F.linear(wc * cond + wu * uncond, linear.weight).float()
                if linear.bias is not None:
                    mixed = mixed + bias_scale.float() * linear.bias.float()
        self._cache[key] = mixed
        return mixed
