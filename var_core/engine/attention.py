"""Self-attention over the engine's KV cache: ragged rows on their valid tokens only, and attention statistics
(per-query entropy, attention mass received) without materialising the probabilities.

Ragged rows (``attention="varlen"``, the default of :class:`~var_core.engine.loop.GenerationOptions`). A ragged
:class:`~var_core.engine.policy.TokenSelection` pads short rows to the batch's largest keep count. The cache
(``KVCache`` with ``layout="packed"``) stores each row's valid keys contiguously, so row ``r`` holds ``len_r`` keys
at positions ``[0, len_r)``; :class:`CachedAttention` then runs SDPA per group of rows with the same
``(queries, keys)`` counts, each group a strided view of the batch (no copies of the cache), and every row attends
with its own valid queries to its own valid keys: ``Σ_r n_r·len_r`` query-key pairs instead of
``R·n_max·len_max``. With ``attention="padded"`` the cache keeps padding entries in place and SDPA runs on the
padded rectangle with an additive mask (the engine's behaviour before issue 16; tests compare the two). A dense
generation (no ragged selection) takes neither path: one SDPA call, bit-identical to the official sampler.

Attention statistics (:class:`AttentionProbe`, handed to ``Policy.observe_attention`` instead of a probability
tensor). ToProVAR's entropy ``H_i = −Σ_j α_ij log α_ij`` equals ``log Z_i − E_α[s_i]`` with ``s_ij`` the scaled
logits and ``Z_i = Σ_j exp(s_ij)``; both terms come from a blockwise pass that never holds more than one
``[queries-chunk × keys-chunk]`` tile per head:

* ``method="fused"`` (default on CPU and CUDA): PyTorch's CPU flash-attention kernel, or on CUDA the
  memory-efficient kernel (float32, additive mask), returns ``log Z`` with its output; run with
  the KEYS as values it returns ``E_α[k]``, and ``E_α[s] = scale · q·E_α[k]`` (specs/methods.md §4.1, "exact,
  simpler PyTorch route"). One extra fused attention call per observed block.
* ``method="chunked"`` (every device): an online log-sum-exp over key chunks (running max ``m``, ``Z`` and
  ``Σ exp(s − m)·s``, rescaled when the max grows), query chunk by query chunk — the FlashAttention-Entropy
  recurrence written in PyTorch ops, in float32.
* ``method="materialised"``: the probabilities ``[R, H, n, L]`` and ``−Σ p log p`` (the reference; tests only).

All three agree to float error (``tests/unit/test_attention_entropy_chunked.py``). The attention OUTPUT of an
observed block is the ordinary SDPA output, so observing a block no longer changes what it computes.

Sparse attention patterns (:class:`AttentionPattern`, returned by ``Policy.plan_attention`` per block and scale):
key subsets per group of queries, cross-scale local windows (:class:`ScaleWindows`) and dense prefixes, over the
dense cache. :func:`masked_attention_reference` is the reference (materialised logits, masked softmax);
:func:`sparse_attention` runs a pattern with the kernel it names (SDPA with a boolean mask, a gathered key union per
query group, or FlexAttention's block masks) and counts the attended pairs, which the FLOPs counters charge
(``tests/unit/test_attention_pattern.py``; CPU timings: ``profilers/sparse_attention_bench.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from .packing import count_bounds, host_counts

RAGGED_ATTENTION = ("varlen", "padded")
ENTROPY_METHODS = ("auto", "fused", "chunked", "materialised")


@dataclass
class CachedKV:
    """What :meth:`KVCache.append` returns: views over a block's cached keys and values after this append.

    ``keys``/``values`` are ``[R, H, L, d]`` with ``L`` the longest row; ``bias`` an additive ``[R, 1, 1, L]`` mask
    (0 = valid key, −inf = padding or beyond the row's length) or None when every row's ``L`` keys are valid;
    ``lengths`` the valid keys per row (packed layout, only when rows differ; None otherwise); ``current_Rn``
    the cache position of the key appended for each query slot of this scale and ``current_valid_Rn`` which of
    them are real keys (None: all). Unpacks as ``keys, values, bias`` (the tuple ``append`` returned before).
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor | None
    lengths: tuple[int, ...] | None
    current_Rn: torch.Tensor
    current_valid_Rn: torch.Tensor | None
    packed: bool
    on_pairs: Callable[[int], None] | None = None  # the cache's record of the query-key pairs computed
    # False: ``lengths`` are host upper bounds (counts kept on the device) and ``bias`` masks each row's tail; the
    # varlen row groups then take the mask too
    exact_lengths: bool = True

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter((self.keys, self.values, self.bias))


# ------------------------------------------------------------------------------------------------ row groups
def row_groups(query_counts: Sequence[int], key_lengths: Sequence[int]) -> list[tuple[slice, int, int]]:
    """Rows with equal ``(queries, keys)`` counts, as strided slices: ``[(rows, n, L), …]`` covering every row once.

    Rows of one group are split into arithmetic runs (e.g. the cond row ``b`` and uncond row ``b + B`` of a sample,
    or a block of consecutive rows), so each slice is a view of the batch. Rows with no query are left out."""
    groups: dict[tuple[int, int], list[int]] = {}
    for r, (n, L) in enumerate(zip(query_counts, key_lengths)):
        if n > 0:
            groups.setdefault((int(n), int(L)), []).append(r)
    out = []
    for (n, L), rows in groups.items():
        i = 0
        while i < len(rows):
            if i + 1 == len(rows):
                out.append((slice(rows[i], rows[i] + 1), n, L))
                break
            step = rows[i + 1] - rows[i]
            j = i + 1
            while j + 1 < len(rows) and rows[j + 1] - rows[j] == step:
                j += 1
            out.append((slice(rows[i], rows[j] + 1, step), n, L))
            i = j + 1
    return out


# ------------------------------------------------------------------------------------------------ SDPA kernels
# torch.nn.attention.SDPBackend values -> the names records use
SDPA_KERNEL_NAMES = {-1: "none", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_choose_kernel = getattr(torch, "_fused_sdp_choice", None)  # the dispatcher's own choice (tests stand in for it)
_KERNELS_RUN: dict[str, int] = {}


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                scale: float | None = None) -> str:
    """``"<device>:<kernel>"`` that ``F.scaled_dot_product_attention`` dispatches to for exactly these inputs under
    the current backend flags (``torch._fused_sdp_choice``, the function SDPA itself asks): ``flash``,
    ``efficient``, ``cudnn`` or ``math``. Not the enabled flags: on CUDA an additive mask or float32 inputs rule
    flash out and the dispatcher says so; on the CPU "flash" is PyTorch's CPU flash kernel."""
    if _choose_kernel is None:
        return f"{q.device.type}:unknown"
    try:
        choice = int(_choose_kernel(q, k, v, attn_mask, 0.0, False, scale=scale))
    except Exception:  # noqa: BLE001 - no kernel accepts the inputs: SDPA itself raises on the call
        return f"{q.device.type}:unknown"
    return f"{q.device.type}:{SDPA_KERNEL_NAMES.get(choice, str(choice))}"


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` that counts the kernel each call ran (:func:`sdpa_kernels_run`)."""
    name = sdpa_kernel(q, k, v, attn_mask, scale)
    _KERNELS_RUN[name] = _KERNELS_RUN.get(name, 0) + 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def sdpa_kernels_run(reset: bool = False) -> dict[str, int]:
    """Calls per kernel (``"cuda:efficient": 1200`` …) of the engine's SDPA calls in this process since the last
    reset; ``reset`` clears the count after reading it (the runner reads it per arm)."""
    out = dict(sorted(_KERNELS_RUN.items()))
    if reset:
        _KERNELS_RUN.clear()
    return out


def describe_kernels_run(counts: dict[str, int]) -> str:
    """``"cuda:efficient ×1200, cuda:math ×48"`` (most calls first), or ``"none recorded"``."""
    if not counts:
        return "none recorded"
    return ", ".join(f"{k} ×{v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _prefix_counts(valid_Rn: torch.Tensor) -> list[int] | None:
    """Valid query count per row when every row's valid slots form a prefix (padding at the end), else None.
    A selection's host-known counts (``engine.policy.host_counts``: prefixes by construction) are taken as they
    are: no read of the mask."""
    known = count_bounds(valid_Rn) or host_counts(valid_Rn)  # counts on the device: the queries their bounds run
    if known is not None:
        return list(known)
    counts = valid_Rn.sum(1)
    prefix = torch.arange(valid_Rn.shape[1], device=valid_Rn.device).view(1, -1) < counts.view(-1, 1)
    return counts.tolist() if bool((prefix == valid_Rn).all()) else None


class CachedAttention:
    """The attention core a model's ``attend(..., core=...)`` calls: ``core(q, k, v, attn_bias, scale) -> out``.

    Runs varlen (row groups, valid queries and keys only) when the cache is packed and the rows are ragged and
    ``query_valid_Rn`` is given (padding query slots then get zeros: the caller drops them, e.g. a
    :class:`~var_core.engine.packing.RowPacking`); otherwise one SDPA call with the cache's mask. ``pairs`` is the
    number of query-key pairs computed (summed over rows; FLOPs = ``4·pairs·head_dim·heads``), reported to the
    cache. After the call, :meth:`probe` gives the block's :class:`AttentionProbe`.
    """

    def __init__(self, kv: CachedKV, query_valid_Rn: torch.Tensor | None = None,
                 pattern: "AttentionPattern | None" = None):
        self.kv = kv
        self.query_valid_Rn = query_valid_Rn
        self.pattern = pattern  # a sparse pattern over the cache (Policy.plan_attention); None = dense
        self.pairs = 0
        self._q: torch.Tensor | None = None
        self._scale = 1.0

    def __call__(self, q_RHnd: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
        kv = self.kv
        self._q, self._scale = q_RHnd, float(scale)
        R, H, n, _ = q_RHnd.shape
        L = kv.keys.shape[2]
        if self.pattern is not None:
            if kv.lengths is not None or self.query_valid_Rn is not None:
                raise ValueError("a sparse attention pattern runs on a dense scale over a dense cache; this block's "
                                 "rows are ragged (token pruning): prune tokens or sparsify attention, not both")
            out, self.pairs = sparse_attention(q_RHnd, kv.keys, kv.values, self.pattern, scale, kv.bias)
            if kv.on_pairs is not None:
                kv.on_pairs(self.pairs)
            return out
        counts = None
        if kv.packed and (kv.lengths is not None or self.query_valid_Rn is not None):
            counts = [n] * R if self.query_valid_Rn is None else _prefix_counts(self.query_valid_Rn)
        lengths = kv.lengths if kv.lengths is not None else (L,) * R
        if counts is None or (len(set(counts)) == 1 and len(set(lengths)) == 1 and counts[0] == n):
            out = sdpa(q_RHnd, kv.keys, kv.values, attn_mask=kv.bias, scale=scale)
            self.pairs = R * n * L
        else:
            out = q_RHnd.new_zeros(R, H, n, kv.values.shape[-1])
            self.pairs = 0
            for rows, n_g, L_g in row_groups(counts, lengths):
                mask = None if kv.exact_lengths or kv.bias is None else kv.bias[rows, :, :, :L_g]
                out[rows, :, :n_g] = sdpa(q_RHnd[rows, :, :n_g], kv.keys[rows, :, :L_g], kv.values[rows, :, :L_g],
                                          attn_mask=mask, scale=scale)
                self.pairs += len(range(R)[rows]) * n_g * L_g
        if kv.on_pairs is not None:
            kv.on_pairs(self.pairs)
        return out

    def probe(self, last_queries: int | None = None) -> "AttentionProbe":
        """The statistics of this call's attention (``last_queries``: only the last that many queries, e.g. HART's
        sampled context token)."""
        if self._q is None:
            raise RuntimeError("CachedAttention.probe() before the attention ran")
        q = self._q if last_queries is None else self._q[:, :, -last_queries:]
        return AttentionProbe(q, self.kv, self._scale, current_keys=last_queries is None)


# ------------------------------------------------------------------------------------------------ entropy
def _masked_logits(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None) -> torch.Tensor:
    # in the dtype of q and k (fp32 for the entropies): under --precision *-autocast the matmul would otherwise
    # run in bf16 / fp16 (and the chunked pass's clamp to the fp32 minimum overflow)
    with torch.autocast(q.device.type, enabled=False):
        s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if bias is not None:
        s = s.add_(bias)
    return s


def entropy_materialised(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """``[R, H, n]`` ``−Σ_j α_ij log α_ij`` from the full probabilities (reference)."""
    p = _masked_logits(q.float(), k.float(), scale, None if bias is None else bias.float()).softmax(-1)
    return -torch.special.xlogy(p, p).sum(-1)


def entropy_chunked(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None = None,
                    query_chunk: int = 256, key_chunk: int = 1024, return_lse: bool = False):
    """``[R, H, n]`` attention entropy by an online log-sum-exp over key chunks (float32), ``query_chunk ×
    key_chunk`` logits per head at a time. ``bias``: additive mask broadcastable to ``[R, H, n, L]`` (−inf =
    masked). With ``return_lse`` also ``log Z`` ``[R, H, n]``."""
    q, k = q.float(), k.float()
    bias = None if bias is None else bias.float()
    R, H, n, _ = q.shape
    L = k.shape[2]
    lowest = torch.finfo(torch.float32).min
    entropy = q.new_empty(R, H, n)
    lse_all = q.new_empty(R, H, n) if return_lse else None
    for q0 in range(0, n, query_chunk):
        qc = q[:, :, q0:q0 + query_chunk]
        m = qc.new_full(qc.shape[:-1], float("-inf"))
        z = qc.new_zeros(qc.shape[:-1])
        e = qc.new_zeros(qc.shape[:-1])
        for k0 in range(0, L, key_chunk):
            b = None
            if bias is not None:
                b = bias[..., k0:k0 + key_chunk]
                if b.shape[-2] != 1:
                    b = b[..., q0:q0 + query_chunk, :]
            s = _masked_logits(qc, k[:, :, k0:k0 + key_chunk], scale, b).clamp_(min=lowest)  # masked: exp -> 0
            m_new = torch.maximum(m, s.amax(-1))
            rescale = torch.exp(m - m_new)
            p = torch.exp(s - m_new.unsqueeze(-1))
            z = z * rescale + p.sum(-1)
            e = e * rescale + (p * s).sum(-1)
            m = m_new
        lse = m + torch.log(z)
        entropy[:, :, q0:q0 + query_chunk] = lse - e / z
        if lse_all is not None:
            lse_all[:, :, q0:q0 + query_chunk] = lse
    return (entropy, lse_all) if return_lse else entropy


_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# CUDA: the memory-efficient kernel takes float32, an additive bias and returns log Z (compute_log_sumexp); the CUDA
# flash kernel returns it too but takes neither a mask nor float32, so it cannot serve the ragged / fp32 statistics
_CUDA_EFFICIENT = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)


def fused_available(q: torch.Tensor) -> bool:
    """Whether :func:`entropy_fused` can run on ``q``'s device: a kernel that returns ``log Z`` with its output (the
    CPU flash kernel; on CUDA the memory-efficient kernel)."""
    if q.device.type == "cpu":
        return _CPU_FLASH is not None
    return q.device.type == "cuda" and _CUDA_EFFICIENT is not None


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(scale·qkᵀ + bias)·v, log Z)`` from one fused kernel call on ``q``'s device (float32 inputs)."""
    if q.device.type != "cuda":
        out, lse = _CPU_FLASH(q, k, v, attn_mask=bias, scale=scale)[:2]
        return out, lse
    R, H, n, _ = q.shape
    if bias is not None:
        L = k.shape[2]
        pad = (-L) % 16  # the kernel wants the bias rows 16-element aligned; pad, then view the first L keys
        bias = F.pad(bias.expand(R, H, n, L), (0, pad))[..., :L] if pad else bias.expand(R, H, n, L).contiguous()
    out, lse = _CUDA_EFFICIENT(q, k, v, bias, True, 0.0, False, scale=scale)[:2]
    return out, lse[..., :n]  # log Z comes padded to a multiple of 32 queries


def entropy_fused(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None = None,
                  return_lse: bool = False):
    """``[R, H, n]`` attention entropy ``log Z − scale·q·E_α[k]`` from one fused attention call with the keys as
    values (float32: the CPU flash kernel, or the CUDA memory-efficient kernel). With ``return_lse`` also
    ``log Z``."""
    q32, k32 = q.float(), k.float()
    b = None if bias is None else bias.float()
    with torch.autocast(q.device.type, enabled=False):  # fp32 under --precision *-autocast too
        mean_key, lse = _attention_with_lse(q32, k32, k32, b, scale)
        entropy = lse - scale * torch.linalg.vecdot(q32, mean_key)
    return (entropy, lse) if return_lse else entropy


def attention_entropy(q: torch.Tensor, k: torch.Tensor, scale: float, bias: torch.Tensor | None = None,
                      method: str = "auto", return_lse: bool = False):
    """Per-head attention entropy ``[R, H, n]`` (nats) of queries ``q [R, H, n, d]`` over keys ``k [R, H, L, d]``
    with logits ``scale·q·k`` plus the additive ``bias``; ``method`` per the module docstring (``auto``: fused
    where available, else chunked)."""
    if method not in ENTROPY_METHODS:
        raise ValueError(f"unknown attention-entropy method {method!r}; choose one of {ENTROPY_METHODS}")
    if method == "auto":
        method = "fused" if fused_available(q) else "chunked"
    if method == "fused":
        return entropy_fused(q, k, scale, bias, return_lse)
    if method == "chunked":
        return entropy_chunked(q, k, scale, bias, return_lse=return_lse)
    ent = entropy_materialised(q, k, scale, bias)
    if return_lse:
        return ent, torch.logsumexp(_masked_logits(q.float(), k.float(), scale, bias), -1)
    return ent


class AttentionProbe:
    """Lazy statistics of one block's self-attention at one scale (the ``observe_attention`` slot): queries
    ``q [R, H, n, d]`` (scaled as the model attends) over the block's cached keys.

    :meth:`query_entropy` ``[R, n]`` (head-averaged per-query entropy, ToProVAR Eq. 2) and
    :meth:`received_mass` ``[R, n]`` never materialise the probabilities; :meth:`probs` does (``[R, H, n, L]`` in
    the cache's layout: each row's keys at its cache positions, masked keys 0). Results are memoised; a probe is
    valid during the ``observe_attention`` call only. ``method``: see :func:`attention_entropy`.
    """

    def __init__(self, q_RHnd: torch.Tensor, kv: CachedKV, scale: float, method: str = "auto",
                 current_keys: bool = True):
        self.q = q_RHnd
        self.kv = kv
        self.scale = float(scale)
        self.method = method
        self.current_keys = current_keys
        self.rows, self.heads, self.queries = q_RHnd.shape[:3]
        self._entropy: torch.Tensor | None = None
        self._lse: torch.Tensor | None = None
        self._probs: torch.Tensor | None = None
        self.flops = 0  # matrix FLOPs spent on statistics so far (the loop records them: ScaleRecord)

    @property
    def num_keys(self) -> int:
        return self.kv.keys.shape[2]

    def _qk_flops(self, keys: int) -> int:
        return 2 * self.rows * self.heads * self.queries * keys * self.q.shape[-1]

    def probs(self) -> torch.Tensor:
        """``[R, H, n, L]`` softmax probabilities (materialised; the costly path)."""
        if self._probs is None:
            logits = _masked_logits(self.q.float(), self.kv.keys.float(), self.scale,
                                    None if self.kv.bias is None else self.kv.bias.float())
            self.flops += self._qk_flops(self.num_keys)
            self._probs = logits.softmax(-1)
            if self._lse is None:
                self._lse = torch.logsumexp(logits, -1)
        return self._probs

    def _entropy_and_lse(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._entropy is None:
            if self._probs is not None:
                p = self._probs
                self._entropy = -torch.special.xlogy(p, p).sum(-1)
            else:
                method = self.method
                if method == "auto":
                    method = "fused" if fused_available(self.q) else "chunked"
                self._entropy, self._lse = attention_entropy(self.q, self.kv.keys, self.scale, self.kv.bias,
                                                             method, return_lse=True)
                # fused: QK^T and (probabilities x keys); chunked: QK^T only; materialised: QK^T (then softmax)
                self.flops += self._qk_flops(self.num_keys) * (2 if method == "fused" else 1)
                if method == "materialised":  # attention_entropy recomputed the logits for log Z
                    self.flops += self._qk_flops(self.num_keys)
        return self._entropy, self._lse

    def head_entropy(self) -> torch.Tensor:
        """``[R, H, n]`` per-head entropy (nats)."""
        return self._entropy_and_lse()[0]

    def query_entropy(self) -> torch.Tensor:
        """``[R, n]`` per-query entropy averaged over heads (the mean of per-head entropies)."""
        return self.head_entropy().mean(1)

    def key_mass(self, query_block: int) -> torch.Tensor:
        """``[R, H, G, L]`` float32: for each group of ``query_block`` consecutive queries (``G = ⌈n/query_block⌉``),
        the attention probability each cached key receives, summed over the group's queries (per head; masked keys
        get 0). One group's ``[R, H, query_block, L]`` probabilities at a time (SparVAR's block column sums)."""
        R, H, n = self.rows, self.heads, self.queries
        L = self.num_keys
        groups = -(-n // query_block)
        out = torch.zeros(R, H, groups, L, device=self.q.device)
        bias = None if self.kv.bias is None else self.kv.bias.float()
        keys = self.kv.keys.float()
        for g in range(groups):
            q = self.q[:, :, g * query_block:(g + 1) * query_block].float()
            out[:, :, g] = _masked_logits(q, keys, self.scale, bias).softmax(-1).sum(2)
        self.flops += self._qk_flops(L)
        return out

    def received_mass(self, query_weight_Rn: torch.Tensor | None = None, query_chunk: int = 256) -> torch.Tensor:
        """``[R, n]``: for each query slot ``j`` of this scale, the head-averaged probability mass its key receives
        from the scale's queries, ``Σ_i w_i · mean_h α_h,i,key(j)`` (``w``: ``query_weight_Rn``, default 1; slots
        whose key is padding get 0). Computed from ``log Z`` and the logits of the current keys only."""
        if not self.current_keys:
            raise ValueError("received_mass needs this scale's own keys (a probe over the last queries only)")
        _, lse = self._entropy_and_lse()
        kv = self.kv
        R, H, n = self.rows, self.heads, self.queries
        index = kv.current_Rn.to(kv.keys.device)
        current_k = kv.keys.gather(2, index.view(R, 1, n, 1).expand(R, H, n, kv.keys.shape[-1])).float()
        key_bias = None
        if kv.bias is not None:
            key_bias = kv.bias.float().gather(-1, index.view(R, 1, 1, n))
        weights = torch.ones(R, n, device=self.q.device) if query_weight_Rn is None else query_weight_Rn.float()
        weights = weights.to(self.q.device)
        mass = torch.zeros(R, n, device=self.q.device)
        q = self.q.float()
        for q0 in range(0, n, query_chunk):
            s = _masked_logits(q[:, :, q0:q0 + query_chunk], current_k, self.scale, key_bias)
            p = torch.exp(s - lse[:, :, q0:q0 + query_chunk].unsqueeze(-1))  # [R, H, chunk, n]
            mass += (p * weights[:, None, q0:q0 + query_chunk, None]).sum((1, 2)) / H
        self.flops += self._qk_flops(n)
        if kv.current_valid_Rn is not None:
            mass = mass * kv.current_valid_Rn.to(mass.device)
        return mass


# ------------------------------------------------------------------------------------------------ sparse patterns
SPARSE_KERNELS = ("reference", "sdpa", "gather", "flex")


@dataclass(frozen=True)
class ScaleWindows:
    """Cross-scale local windows (a CSLA-style pattern) over a next-scale cache laid out scale after scale.

    Keys: the ``L`` cache positions of the scales ``0 .. k`` in raster order (``scale_hw[:k+1]``). A query at
    ``(y, x)`` of the current scale ``(h, w)`` attends to a key at ``(y', x')`` of scale ``s`` (grid ``(h_s, w_s)``)
    when ``radius[s] >= 0`` and ``|y' − ⌊y·h_s/h⌋| ≤ radius[s]`` and ``|x' − ⌊x·w_s/w⌋| ≤ radius[s]`` (the key grid's
    cell under the query, and its neighbours; at a border the window is cut, not shifted). ``radius[s] = −1``: no
    window on scale ``s``. The current scale's own window (``radius[k] >= 0``) always holds the query's own key."""

    scale_hw: tuple[tuple[int, int], ...]  # the grids of the scales in the cache, the current (query) scale last
    radius: tuple[int, ...]  # per scale in ``scale_hw``: half-width of the window (window size 2r+1), −1 = none
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.radius) != len(self.scale_hw):
            raise ValueError(f"ScaleWindows: {len(self.radius)} radii for {len(self.scale_hw)} scales")

    @property
    def num_keys(self) -> int:
        return sum(h * w for h, w in self.scale_hw)

    def mask(self, q0: int, q1: int, device) -> torch.Tensor:
        """bool ``[q1 − q0, L]``: the window part of the pattern for the queries ``q0 .. q1−1`` of the scale (built
        scale by scale from separable row and column windows: ``(q1 − q0) × L`` booleans, no integer work per
        pair)."""
        h, w = self.scale_hw[-1]
        m = q1 - q0
        q = torch.arange(q0, q1, device=device)
        qy, qx = (q // w).view(m, 1), (q % w).view(m, 1)
        parts = []
        for (hs, ws), r in zip(self.scale_hw, self.radius):
            if r < 0:
                parts.append(torch.zeros(m, hs * ws, dtype=torch.bool, device=device))
                continue
            rows = (torch.arange(hs, device=device).view(1, hs) - qy * hs // h).abs() <= r  # [m, hs]
            cols = (torch.arange(ws, device=device).view(1, ws) - qx * ws // w).abs() <= r  # [m, ws]
            parts.append((rows.view(m, hs, 1) & cols.view(m, 1, ws)).view(m, hs * ws))
        return torch.cat(parts, 1)

    def local(self, q0: int, q1: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [u], mask [q1 − q0, u])``: for each scale with a window, the rectangle of key rows and columns that
        some query of ``q0 .. q1−1`` reaches (ascending cache positions), and the window mask over those keys. The
        rectangles hold every key the windows reach, so the mask over them equals :meth:`mask` there (and
        :meth:`mask` is False elsewhere). The rectangles' rows and columns are worked out on the host from the grid
        sizes (no device→host read: issue 27); results are memoised per query range and device."""
        memo_key = ("local", q0, q1, str(device))
        if memo_key in self._memo:
            return self._memo[memo_key]
        h, w = self.scale_hw[-1]
        m = q1 - q0
        q = torch.arange(q0, q1, device=device)
        qy, qx = (q // w).view(m, 1), (q % w).view(m, 1)
        host_qy = range(q0 // w, (q1 - 1) // w + 1)
        host_qx = sorted({i % w for i in range(q0, q1)})
        keys, masks, offset = [], [], 0
        for (hs, ws), r in zip(self.scale_hw, self.radius):
            if r >= 0:
                rows = (torch.arange(hs, device=device).view(1, hs) - qy * hs // h).abs() <= r  # [m, hs]
                cols = (torch.arange(ws, device=device).view(1, ws) - qx * ws // w).abs() <= r  # [m, ws]
                y = _index_of(_reached(host_qy, hs, h, r), device)  # = rows.any(0).nonzero(), from host ints
                x = _index_of(_reached(host_qx, ws, w, r), device)
                keys.append((offset + y.view(-1, 1) * ws + x.view(1, -1)).flatten())
                masks.append((rows.index_select(1, y).unsqueeze(2) & cols.index_select(1, x).unsqueeze(1)).flatten(1))
            offset += hs * ws
        if not keys:
            out = torch.zeros(0, dtype=torch.long, device=device), torch.zeros(m, 0, dtype=torch.bool, device=device)
        else:
            out = torch.cat(keys), torch.cat(masks, 1)
        self._memo[memo_key] = out
        return out


def _reached(query_cells: Sequence[int], size: int, query_size: int, radius: int) -> list[int]:
    """Ascending key rows (or columns) of a ``size`` grid that windows of ``radius`` reach from the query rows (or
    columns) ``query_cells`` of a ``query_size`` grid (each under ``⌊c·size/query_size⌋``, cut at the border)."""
    reached = set()
    for c in query_cells:
        centre = c * size // query_size
        reached.update(range(max(centre - radius, 0), min(centre + radius + 1, size)))
    return sorted(reached)


def _index_of(values: list[int], device) -> torch.Tensor:
    """int64 tensor of the ascending host ints ``values`` on ``device``, built from device ``arange`` runs (no
    host→device copy of data)."""
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append(torch.arange(values[start], values[i - 1] + 1, device=device))
            start = i
    if not runs:
        return torch.zeros(0, dtype=torch.long, device=device)
    return runs[0] if len(runs) == 1 else torch.cat(runs)


class AttentionPattern:
    """Which cached keys each query of one block attends to at one scale: the union of

    * ``key_blocks_RHGL`` (bool ``[R or 1, H or 1, G, L_b]``): for each group of ``query_block`` consecutive queries
      (``G = ⌈n / query_block⌉``), the keys the whole group attends to (per row and head; ``L_b ≤ L`` covers the
      first ``L_b`` cache positions, e.g. the keys a decision scale saw); None: none;
    * ``windows`` (:class:`ScaleWindows`): per-query local windows; None: none;
    * ``dense_keys``: the first that many cache positions, attended by every query (sinks; 0: none).

    The mask is over this scale's ``n`` queries (all of them, in raster order) and the ``L`` cache positions of a
    dense cache. :meth:`mask` materialises it for a range of queries (the reference); the attention core
    (:class:`CachedAttention`) runs it with ``kernel`` (one of :data:`SPARSE_KERNELS`, see :func:`sparse_attention`).
    After the call, :attr:`pairs` holds the attended query-key pairs (summed over rows, averaged over heads): what
    the FLOPs and bytes counters charge.
    """

    def __init__(self, num_queries: int, num_keys: int, *, key_blocks_RHGL: torch.Tensor | None = None,
                 query_block: int = 64, windows: ScaleWindows | None = None, dense_keys: int = 0,
                 kernel: str = "sdpa"):
        if kernel not in SPARSE_KERNELS:
            raise ValueError(f"unknown sparse-attention kernel {kernel!r}; choose one of {SPARSE_KERNELS}")
        if key_blocks_RHGL is not None:
            groups = -(-num_queries // query_block)
            if key_blocks_RHGL.dim() != 4 or key_blocks_RHGL.shape[2] != groups or \
                    key_blocks_RHGL.shape[3] > num_keys:
                raise ValueError(f"key_blocks_RHGL {tuple(key_blocks_RHGL.shape)}: expected [R|1, H|1, {groups}, "
                                 f"<= {num_keys}] for {num_queries} queries in groups of {query_block}")
        if windows is not None and windows.num_keys != num_keys:
            raise ValueError(f"windows cover {windows.num_keys} keys, the pattern {num_keys}")
        self.num_queries, self.num_keys = num_queries, num_keys
        self.key_blocks_RHGL, self.query_block = key_blocks_RHGL, query_block
        self.windows, self.dense_keys, self.kernel = windows, dense_keys, kernel
        self.pairs: int | None = None
        # host numbers read once for several patterns (read_pattern_counts): per group the most group keys, and the
        # attended pairs over [R|1, H|1] (without a padding bias); None: each call reads its own from the device
        self.group_counts: list[int] | None = None
        self.known_pairs: int | None = None

    def mask(self, q0: int = 0, q1: int | None = None, device=None) -> torch.Tensor:
        """bool ``[R|1, H|1, q1 − q0, L]``, True = the query attends to the key."""
        q1 = self.num_queries if q1 is None else q1
        if device is None:
            device = self.key_blocks_RHGL.device if self.key_blocks_RHGL is not None else torch.device("cpu")
        out = torch.zeros(1, 1, q1 - q0, self.num_keys, dtype=torch.bool, device=device)
        if self.dense_keys:
            out[..., :self.dense_keys] = True
        if self.windows is not None:
            out = out | self.windows.mask(q0, q1, device)
        if self.key_blocks_RHGL is not None:
            kb = self.key_blocks_RHGL.to(device)
            group = torch.arange(q0, q1, device=device) // self.query_block
            rows = kb.index_select(2, group)  # [R|1, H|1, q1-q0, L_b]
            out = out.expand(rows.shape[0], rows.shape[1], -1, -1).clone()
            out[..., :rows.shape[3]] |= rows
        return out

    def _shared(self, q0: int, q1: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(shared_keys [u_s], shared_mask [m, u_s], shared_L)`` of the queries ``q0 .. q1−1``: the keys every row
        and head may use (the dense prefix, then the windows' rectangles; prefix keys are masked in the rectangles),
        the window / prefix pattern over them, and bool ``[L]`` marking those keys (no device→host read)."""
        m = q1 - q0
        prefix = torch.arange(self.dense_keys, device=device)
        shared_keys, shared_mask = prefix, torch.ones(m, self.dense_keys, dtype=torch.bool, device=device)
        if self.windows is not None:
            window_keys, window_mask = self.windows.local(q0, q1, device)
            window_mask = window_mask & (window_keys >= self.dense_keys)  # never two columns of one attended key
            shared_keys = torch.cat((prefix, window_keys))
            shared_mask = torch.cat((shared_mask, window_mask), 1)
        shared_L = torch.zeros(self.num_keys, dtype=torch.bool, device=device).index_fill_(0, shared_keys, True)
        return shared_keys, shared_mask, shared_L

    def group_keys(self, q0: int, q1: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """For the queries ``q0 .. q1−1`` (inside one query group): ``(keys_RHu, mask)`` with ``keys_RHu`` int64
        ``[R|1, H|1, u]`` the cache positions each row and head of the group may attend to (its group keys, then
        the union of the queries' windows and the dense prefix; padding entries repeat a position and are masked)
        and ``mask`` bool ``[R|1, H|1, q1 − q0, u]`` the pattern over them (the ``gather`` kernel's work). The
        number of group keys (the most over rows and heads) comes from :attr:`group_counts` when
        :func:`read_pattern_counts` filled it, else it is read from the device here (one sync per group)."""
        m = q1 - q0
        shared_keys, shared_mask, shared_L = self._shared(q0, q1, device)
        shared_mask = shared_mask.view(1, 1, m, -1)
        if self.key_blocks_RHGL is None:
            return shared_keys.view(1, 1, -1), shared_mask
        group = q0 // self.query_block
        block = self.key_blocks_RHGL[:, :, group].to(device)  # [R|1, H|1, L_b]
        L_b = block.shape[-1]
        inside = shared_keys < L_b
        # a group key that is also a shared key goes with the shared keys (its column: group key OR window)
        first = torch.ones_like(shared_keys, dtype=torch.bool)  # the first column of each key (window duplicates)
        if self.dense_keys:
            first[self.dense_keys:] = shared_keys[self.dense_keys:] >= self.dense_keys
        shared_mask = shared_mask | (block.index_select(-1, shared_keys.clamp(max=L_b - 1)) & inside & first
                                     ).unsqueeze(2)
        block = block & ~shared_L[:L_b]
        count = int(block.sum(-1).max()) if self.group_counts is None else self.group_counts[group]
        order = (~block).to(torch.uint8).sort(dim=-1, stable=True).indices[..., :count]  # selected positions first
        valid = block.gather(-1, order)  # [R|1, H|1, c]
        keys = torch.cat((order, shared_keys.view(1, 1, -1).expand(*order.shape[:2], -1)), -1)
        mask = torch.cat((valid.unsqueeze(2).expand(-1, -1, m, -1),
                          shared_mask.expand(order.shape[0], order.shape[1], -1, -1)), -1)
        return keys, mask

    def device_counts(self, device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """On the device, without reading anything back: ``(counts [G] | None, pairs [])`` — per query group the
        most group keys outside the group's shared keys over rows and heads (what :meth:`group_keys` sizes its key
        list by; None without group keys), and the attended pairs summed over the pattern's own ``[R|1, H|1]``
        (the pairs of a group and row-head are its window / prefix pairs plus, per group key, the group's queries
        whose window or prefix misses that key)."""
        n, qb = self.num_queries, self.query_block
        kb = None if self.key_blocks_RHGL is None else self.key_blocks_RHGL.to(device)
        counts, pairs = [], torch.zeros((), dtype=torch.long, device=device)
        for q0 in range(0, n, qb):
            q1 = min(q0 + qb, n)
            near = torch.zeros(q1 - q0, self.num_keys, dtype=torch.bool, device=device)  # prefix or window
            near[:, :self.dense_keys] = True
            if self.windows is not None:
                near = near | self.windows.mask(q0, q1, device)
            near_pairs = near.sum()
            if kb is None:
                pairs = pairs + near_pairs
                continue
            block = kb[:, :, q0 // qb]  # [R|1, H|1, L_b]
            L_b = block.shape[-1]
            _, _, shared_L = self._shared(q0, q1, device)
            counts.append((block & ~shared_L[:L_b]).sum(-1).amax())
            missed = (q1 - q0) - near[:, :L_b].sum(0)  # per key: the group's queries that reach it only as a group key
            pairs = pairs + near_pairs * (kb.shape[0] * kb.shape[1]) + (block * missed).sum()
        return (None if kb is None else torch.stack(counts)), pairs

    def host_pairs(self) -> int:
        """The attended pairs of a pattern WITHOUT group keys (prefix and windows: geometry only), worked out on the
        host from the grid sizes: ``Σ_q |prefix ∪ window(q)|`` over the scale's queries (what a pattern provider
        stores in :attr:`known_pairs`, reading nothing from the device)."""
        if self.key_blocks_RHGL is not None:
            raise ValueError("host_pairs: a pattern with group keys needs read_pattern_counts")
        n, dense, win = self.num_queries, self.dense_keys, self.windows
        total = n * dense
        if win is None:
            return total
        h, w = win.scale_hw[-1]
        if h * w != n:
            raise ValueError(f"windows over a {h}x{w} query grid, the pattern has {n} queries")

        def span(c: int, size: int, query_size: int, r: int) -> tuple[int, int]:
            centre = c * size // query_size
            return max(centre - r, 0), min(centre + r, size - 1)

        offset = 0
        for (hs, ws), r in zip(win.scale_hw, win.radius):
            if r >= 0 and offset + hs * ws > dense:
                ys = [span(qy, hs, h, r) for qy in range(h)]
                xs = [span(qx, ws, w, r) for qx in range(w)]
                if offset >= dense:  # no key of the scale in the prefix: rows x columns, separably
                    total += sum(y1 - y0 + 1 for y0, y1 in ys) * sum(x1 - x0 + 1 for x0, x1 in xs)
                else:  # the prefix ends inside this scale: count the window's keys past it, row by row
                    for y0, y1 in ys:
                        for x0, x1 in xs:
                            for y in range(y0, y1 + 1):
                                first = max(x0, dense - offset - y * ws)
                                total += max(x1 - first + 1, 0)
            offset += hs * ws
        return total

    def pairs_for(self, rows: int, heads: int, count: int) -> int:
        """Attended pairs summed over ``rows`` and averaged over ``heads`` from ``count``, the pairs summed over the
        pattern's own ``[R|1, H|1]`` (broadcast over the rest)."""
        shape = (1, 1) if self.key_blocks_RHGL is None else self.key_blocks_RHGL.shape[:2]
        return count * (rows * heads // (shape[0] * shape[1])) // heads

    def mask_mod(self, rows: int, heads: int, device, valid_RL: torch.Tensor | None = None):
        """FlexAttention's ``mask_mod(b, h, q, k) -> bool`` for this pattern, from small tables (group keys padded
        to ``L``: ``[R|1, H|1, G, L]``; per-key scale, row and column; per-scale grid and radius), never the
        ``[R, H, n, L]`` mask: what ``create_block_mask`` needs to build a block-sparse mask on a GPU."""
        L, dense = self.num_keys, self.dense_keys
        kb = None
        if self.key_blocks_RHGL is not None:
            kb = self.key_blocks_RHGL.to(device)
            if kb.shape[3] < L:
                kb = torch.nn.functional.pad(kb, (0, L - kb.shape[3]))
        win = self.windows
        if win is not None:
            h, w = win.scale_hw[-1]
            key_scale = torch.cat([torch.full((hs * ws,), s, dtype=torch.long, device=device)
                                   for s, (hs, ws) in enumerate(win.scale_hw)])
            key_y = torch.cat([torch.arange(hs, device=device).repeat_interleave(ws) for hs, ws in win.scale_hw])
            key_x = torch.cat([torch.arange(ws, device=device).repeat(hs) for hs, ws in win.scale_hw])
            grid = torch.tensor(win.scale_hw, device=device)
            radius = torch.tensor(win.radius, device=device)
        group = self.query_block

        def mask_mod(b, hd, q, k):
            keep = k < dense
            if kb is not None:
                keep = keep | kb[b % kb.shape[0], hd % kb.shape[1], q // group, k]
            if win is not None:
                s = key_scale[k]
                r = radius[s]
                near_y = (key_y[k] - (q // w) * grid[s, 0] // h).abs() <= r
                near_x = (key_x[k] - (q % w) * grid[s, 1] // w).abs() <= r
                keep = keep | (near_y & near_x & (r >= 0))
            if valid_RL is not None:
                keep = keep & valid_RL[b, k]
            return keep

        return mask_mod

    def take_pairs(self) -> int | None:
        """The pairs of the latest attention call (then cleared)."""
        pairs, self.pairs = self.pairs, None
        return pairs


def read_pattern_counts(patterns: Sequence[AttentionPattern], device) -> None:
    """Fill :attr:`AttentionPattern.group_counts` and :attr:`~AttentionPattern.known_pairs` of ``patterns`` with ONE
    device→host read (a pattern provider calls it once per scale for all its blocks; issue 27): the ``gather``
    kernel then sizes each group's key list and every kernel charges its pairs without reading the device."""
    parts, sizes = [], []
    for pattern in patterns:
        counts, pairs = pattern.device_counts(device)
        part = [pairs.view(1)] if counts is None else [pairs.view(1), counts]
        parts += part
        sizes.append(sum(t.numel() for t in part))
    if not parts:
        return
    values = torch.cat(parts).tolist()
    for pattern, size in zip(patterns, sizes):
        head, values = values[:size], values[size:]
        pattern.known_pairs = head[0]
        pattern.group_counts = head[1:] if pattern.key_blocks_RHGL is not None else None


def masked_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                               scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scale·qkᵀ + bias, masked to keep)·v`` from materialised logits (float32; the tests' reference)."""
    s = _masked_logits(q.float(), k.float(), scale, None if bias is None else bias.float())
    s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(s.softmax(-1), v.float()).to(q.dtype)


def _bias_keep(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else torch.isfinite(bias)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern, scale: float,
                     bias: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Attention of ``q [R, H, n, d]`` over ``k, v [R, H, L, d]`` restricted to ``pattern``; returns ``(out, pairs)``.

    ``pattern.kernel``:

    * ``reference``: :func:`masked_attention_reference` (materialised logits, float32);
    * ``sdpa``: one ``F.scaled_dot_product_attention`` call with the boolean mask ``[R|1, H|1, n, L]`` (every pair
      is still computed on the CPU: the mask saves no time there; on CUDA the efficient kernel takes the mask);
    * ``gather``: query group by query group (``pattern.query_block`` queries), each row's and head's keys of the
      group (its group keys, the union of the queries' windows) are gathered and SDPA runs on them with the
      group's mask: work ∝ Σ_groups group size × keys per head;
    * ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built from the pattern (compiled on CUDA:
      a block-sparse kernel that skips empty 128×128 tiles; eager on the CPU, which materialises the scores).

    ``pairs`` (also left in ``pattern.pairs``): the attended query-key pairs summed over rows and averaged over heads
    (the mask's count), whatever the kernel computes internally."""
    R, H, n, _ = q.shape
    L = k.shape[2]
    if pattern.num_queries != n or pattern.num_keys != L:
        raise ValueError(f"attention pattern for {pattern.num_queries} queries over {pattern.num_keys} keys, but the "
                         f"block attends {n} queries over {L} cached keys (sparse attention patterns run on dense "
                         "scales over a dense cache: no token pruning or KV eviction in the same block)")
    valid = _bias_keep(bias)  # [R, 1, 1, L] or None
    kernel = pattern.kernel
    known = pattern.known_pairs if valid is None else None  # read once per scale for every block
    if kernel == "flex":
        valid_RL = None if valid is None else valid.reshape(R, L)
        out = _flex(q, k, v, pattern.mask_mod(R, H, q.device, valid_RL), scale)
        if known is not None:
            pattern.pairs = pattern.pairs_for(R, H, known)
        else:
            keep = pattern.mask(device=q.device) if valid is None else pattern.mask(device=q.device) & valid
            pattern.pairs = int(torch.count_nonzero(keep)) * (R * H // (keep.shape[0] * keep.shape[1])) // H
        return out, pattern.pairs
    if kernel in ("reference", "sdpa"):
        keep = pattern.mask(device=q.device)
        if valid is not None:
            keep = keep & valid
        if known is not None:
            pattern.pairs = pattern.pairs_for(R, H, known)
        else:
            pattern.pairs = int(torch.count_nonzero(keep)) * (R * H // (keep.shape[0] * keep.shape[1])) // H
        if kernel == "reference":
            return masked_attention_reference(q, k, v, keep, scale), pattern.pairs
        return sdpa(q, k, v, attn_mask=keep, scale=scale), pattern.pairs
    out = q.new_empty(R, H, n, v.shape[-1])
    pairs = torch.zeros((), dtype=torch.long, device=q.device)  # counted on the device when not known: one read
    for q0 in range(0, n, pattern.query_block):
        q1 = min(q0 + pattern.query_block, n)
        keys, keep = pattern.group_keys(q0, q1, q.device)  # each row's and head's keys, the mask over them
        keys = keys.expand(R, H, -1)
        if valid is not None:
            keep = keep & valid.reshape(R, 1, L).expand(R, H, L).gather(2, keys).unsqueeze(2)
        if known is None:
            pairs += torch.count_nonzero(keep) * (R * H // (keep.shape[0] * keep.shape[1]))
        index = keys.unsqueeze(-1)
        out[:, :, q0:q1] = sdpa(q[:, :, q0:q1], k.gather(2, index.expand(-1, -1, -1, k.shape[-1])),
                                v.gather(2, index.expand(-1, -1, -1, v.shape[-1])), attn_mask=keep, scale=scale)
    pattern.pairs = pattern.pairs_for(R, H, known) if known is not None else int(pairs) // H
    return out, pattern.pairs


_FLEX_COMPILED = None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod, scale: float) -> torch.Tensor:
    """FlexAttention with a BlockMask built from the pattern's ``mask_mod`` (compiled where a GPU runs it)."""
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    R, H, n, _ = q.shape
    L = k.shape[2]
    block_mask = create_block_mask(mask_mod, R, H, n, L, device=q.device.type)
    if q.device.type == "cuda":
        if _FLEX_COMPILED is None:
            _FLEX_COMPILED = torch.compile(flex_attention, dynamic=True)
        return _FLEX_COMPILED(q, k, v, block_mask=block_mask, scale=scale)
    import warnings

    with warnings.catch_warnings():  # eager flex on the CPU: the unfused reference path (it warns once)
        warnings.simplefilter("ignore", UserWarning)
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)


__all__ = ["AttentionPattern", "AttentionProbe", "CachedAttention", "CachedKV", "ENTROPY_METHODS",
           "RAGGED_ATTENTION", "SPARSE_KERNELS", "ScaleWindows", "attention_entropy", "entropy_chunked",
           "entropy_fused", "entropy_materialised", "fused_available", "masked_attention_reference",
           "read_pattern_counts", "row_groups", "sparse_attention"]
