"""Predictive entropy of a scale's sampling distribution, in the codebook (VAR) and bitwise (Infinity) forms.

NOVA §2.1 (specs/methods.md): for a codebook VAR ``e_i = −Σ_v p_iv ln p_iv``; for Infinity's bitwise head
``e_i = Σ_b h(p_ib)`` with the binary entropy ``h``. Infinity logits arrive as ``[B, N, 2d]`` with bit ``b``'s two
classes at positions ``2b, 2b+1`` (the official ``reshape(B, N·d, 2)`` layout).
"""

from __future__ import annotations

import math

import torch

SCALE_ENTROPY_DEFINITIONS = ("mean", "sum", "normalized")
ENTROPY_CHUNK = 1 << 18  # logits per chunk of categorical_entropy (1 MiB of float32)


def categorical_entropy(logits_BNV: torch.Tensor) -> torch.Tensor:
    """``H = log Z − Σ_v e_v·s_v / Z`` with ``s = z − max z``, ``e = exp(s)``, ``Z = Σ e`` (nats).

    Written this way rather than ``−Σ p·log p`` because it runs per block on every token (NOVA's lens): the
    log-softmax form made four temporaries of the logits' size and cost ~5× more on a 4096-way head. One
    exponential pass, computed over chunks of ``ENTROPY_CHUNK`` elements so that the temporaries stay in cache
    (a batch-8 lens map of 8·256·4096 logits: ~6× faster than whole-tensor temporaries on a CPU). Each token's
    value depends on its own logits only.
    """
    z = logits_BNV.float()
    V = z.shape[-1]
    flat = z.reshape(-1, V)
    out = flat.new_empty(flat.shape[0])
    step = max(1, ENTROPY_CHUNK // max(V, 1))
    for start in range(0, flat.shape[0], step):
        chunk = flat[start:start + step]
        s = chunk - chunk.amax(dim=-1, keepdim=True)
        e = s.exp()
        Z = e.sum(-1)
        # masked (top-k'd) entries are -inf with e = 0; zeroing their s keeps e·s = 0, not nan
        out[start:start + step] = Z.log() - e.mul_(s.nan_to_num_(neginf=0.0)).sum(-1) / Z
    return out.view(z.shape[:-1])


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
