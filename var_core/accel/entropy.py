"""Predictive entropy of a scale's sampling distribution, in the codebook (VAR) and bitwise (Infinity) forms.

NOVA §2.1 (specs/methods.md): for a codebook VAR ``e_i = −Σ_v p_iv ln p_iv``; for Infinity's bitwise head
``e_i = Σ_b h(p_ib)`` with the binary entropy ``h``. Infinity logits arrive as ``[B, N, 2d]`` with bit ``b``'s two
classes at positions ``2b, 2b+1`` (the official ``reshape(B, N·d, 2)`` layout).
"""

from __future__ import annotations

import math

import torch

SCALE_ENTROPY_DEFINITIONS = ("mean", "sum", "normalized")


def categorical_entropy(logits_BNV: torch.Tensor) -> torch.Tensor:
    """``H = logsumexp(z) − Σ_v softmax(z)_v · z_v`` (nats), in three passes over ``[…, V]``.

    Written this way rather than ``−Σ p·log p`` because it runs per block on every token (NOVA's lens): the
    log-softmax form made four temporaries of the logits' size and cost ~5× more on a 4096-way head.
    """
    z = logits_BNV.float()
    lse = torch.logsumexp(z, dim=-1)
    # masked (top-k'd) entries are -inf with p = 0; clamping them to the lowest finite value keeps p·z = 0, not nan
    finite = z.clamp(min=torch.finfo(z.dtype).min)
    return lse - torch.linalg.vecdot(torch.softmax(z, dim=-1), finite)


def bitwise_entropy(logits_BN2d: torch.Tensor) -> torch.Tensor:
    B, N, two_d = logits_BN2d.shape
    return categorical_entropy(logits_BN2d.view(B, N, two_d // 2, 2)).sum(-1)


def predictive_entropy(logits: torch.Tensor, family: str) -> torch.Tensor:
    """``[B, N]`` token entropy (nats) for the model family's head layout."""
    return bitwise_entropy(logits) if family == "infinity" else categorical_entropy(logits)


def max_token_entropy(logits: torch.Tensor, family: str) -> float:
    """Entropy of the uniform distribution over one token's outcomes (for the ``normalized`` definition)."""
    if family == "infinity":
        return (logits.shape[-1] // 2) * math.log(2.0)
    return math.log(logits.shape[-1])


def scale_entropy(token_entropy_BN: torch.Tensor, definition: str, max_entropy: float) -> torch.Tensor:
    """Per-sample scale entropy ``H_t`` ``[B]`` (NOVA §2.1; the definition is a RECONSTRUCTED option).

    ``mean``: per-token mean; ``sum``: per-scale total (grows with the token count); ``normalized``: mean divided
    by the maximum per-token entropy (ln V, or d·ln 2 for bitwise heads).
    """
    if definition == "mean":
        return token_entropy_BN.mean(-1)
    if definition == "sum":
        return token_entropy_BN.sum(-1)
    if definition == "normalized":
        return token_entropy_BN.mean(-1) / max_entropy
    raise ValueError(f"unknown scale-entropy definition {definition!r}; choose one of {SCALE_ENTROPY_DEFINITIONS}")
