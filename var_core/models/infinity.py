"""Infinity (bitwise text-to-image next-scale transformer), re-implemented in the official parameter layout.

Module names and shapes follow the official ``infinity/models/infinity.py`` / ``basic.py``
(``block_chunks.{k}.module.{j}.…``, see ``specs/reference_models.md`` §2.3 and §2.6), so the released
``infinity_2b_reg.pth`` / ``infinity_8b_weights`` state_dicts and the fixture ``official_infinity_tiny`` load
unchanged. As in ``var_core.models.var``, every block exposes its residual branches separately — self-attention
(``attn``), cross-attention to the text (``cross``) and the MLP (``ffn``) — so the engine can run each branch on a
token subset. Self-attention takes the tokens' **true** positions, so 2-D RoPE is gathered at kept positions when
tokens are pruned. The model knows nothing about the loop, caching policy or acceleration methods.

Official behaviours reproduced (checked against the fixture):
* cosine self-attention (``scale_mul`` clamped at ln 100) with 2-D RoPE applied *after* the normalisation, on
  interleaved (even, odd) pairs: the first half of the pairs rotate with the row, the second half with the column;
  positions are ``round(i·H_ref/h), round(j·W_ref/w)`` with ``(H_ref, W_ref)`` the last scale of the **1M** schedule
  of the aspect-ratio template (``rope2d_normalized_by_hw=2``), also when generating at a smaller pn;
* the fused AdaLN-LayerNorm branch (``fused_norm=True``) of ``CrossAttnBlock`` — the branch that passes the scale
  index to RoPE during KV-cached inference;
* cross-attention with no gate (``ca_gamma = 1``), ``ca_norm`` a LayerNorm *with* affine, ``1/√head_dim`` scale;
* text conditioning ``text_norm`` (RMSNorm) → ``TextAttentivePool`` (the start token / AdaLN condition) and
  ``text_proj_for_ca``; level embedding added only before the first block;
* the head reads ``2·d_vae`` logits as ``d_vae`` two-way bit classifiers.

Not reproduced: the random text dropout in eval mode (``cond_drop_rate`` only matters for training, which this
module does not implement), the bf16 cast of the cross-attention inputs (we stay in the model dtype), padding the
sequence to a multiple of 128 (the padded rows are invisible to real tokens).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .text_encoder import TextTokens

MAX_LOG_SCALE = math.log(100.0)

try:  # optional CUDA kernel for the varlen cross-attention; the SDPA path is the reference
    from flash_attn import flash_attn_varlen_kvpacked_func as _flash_varlen  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means: not available
    _flash_varlen = None


# ================================================================================================================
# scale schedules (infinity/utils/dynamic_resolution.py)
# ================================================================================================================
VAE_STRIDE = 16
# (h, w) per scale of the 1M schedule, for h/w >= 1; the transposed templates are derived below
_RATIO_TO_HWS: dict[float, tuple[tuple[int, int], ...]] = {
    1.000: ((1, 1), (2, 2), (4, 4), (6, 6), (8, 8), (12, 12), (16, 16), (20, 20), (24, 24), (32, 32), (40, 40),
            (48, 48), (64, 64)),
    1.250: ((1, 1), (2, 2), (3, 3), (5, 4), (10, 8), (15, 12), (20, 16), (25, 20), (30, 24), (35, 28), (45, 36),
            (55, 44), (70, 56)),
    1.333: ((1, 1), (2, 2), (4, 3), (8, 6), (12, 9), (16, 12), (20, 15), (24, 18), (28, 21), (36, 27), (48, 36),
            (60, 45), (72, 54)),
    1.500: ((1, 1), (2, 2), (3, 2), (6, 4), (9, 6), (15, 10), (21, 14), (27, 18), (33, 22), (39, 26), (48, 32),
            (63, 42), (78, 52)),
    1.750: ((1, 1), (2, 2), (3, 3), (7, 4), (11, 6), (14, 8), (21, 12), (28, 16), (35, 20), (42, 24), (56, 32),
            (70, 40), (84, 48)),
    2.000: ((1, 1), (2, 2), (4, 2), (6, 3), (10, 5), (16, 8), (22, 11), (30, 15), (38, 19), (46, 23), (60, 30),
            (74, 37), (90, 45)),
    2.500: ((1, 1), (2, 2), (5, 2), (10, 4), (15, 6), (20, 8), (25, 10), (30, 12), (40, 16), (50, 20), (65, 26),
            (80, 32), (100, 40)),
    3.000: ((1, 1), (2, 2), (6, 2), (9, 3), (15, 5), (21, 7), (27, 9), (36, 12), (45, 15), (54, 18), (72, 24),
            (90, 30), (111, 37)),
}
PN_NUM_SCALES = {"0.06M": 7, "0.25M": 10, "0.60M": 12, "1M": 13}


def _full_templates() -> dict[float, tuple[tuple[int, int], ...]]:
    out = {}
    for ratio, hws in _RATIO_TO_HWS.items():
        out[ratio] = hws
        if ratio != 1.0:
            out[int(1 / ratio * 1000) / 1000] = tuple((w, h) for h, w in hws)
    return out


TEMPLATES: dict[float, tuple[tuple[int, int], ...]] = _full_templates()
H_DIV_W_TEMPLATES: tuple[float, ...] = tuple(TEMPLATES)


def nearest_template(h_div_w: float) -> float:
    """The official template choice: the nearest ``h/w`` ratio in absolute difference."""
    return min(H_DIV_W_TEMPLATES, key=lambda t: abs(float(h_div_w) - t))


def scale_schedule(pn: str = "1M", h_div_w: float = 1.0, num_scales: int | None = None) -> tuple[tuple[int, int], ...]:
    """``(h, w)`` per scale of ``dynamic_resolution_h_w[template][pn]`` (``t`` is always 1 at inference).

    ``num_scales`` takes the first scales of the template's list instead of a pn key (an extension used by the
    tiny random models; RoPE positions are still normalised by the 1M schedule).
    """
    template = nearest_template(h_div_w)
    if num_scales is None:
        if pn not in PN_NUM_SCALES:
            raise ValueError(f"unknown pn {pn!r}; choose one of {list(PN_NUM_SCALES)}")
        num_scales = PN_NUM_SCALES[pn]
    if not 1 <= num_scales <= len(TEMPLATES[template]):
        raise ValueError(f"num_scales must be in [1, {len(TEMPLATES[template])}], got {num_scales}")
    return TEMPLATES[template][:num_scales]


def rope_reference_hw(schedule_hw: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(H_ref, W_ref)`` that normalises RoPE positions: the last scale of the 1M schedule of the template
    whose list starts with ``schedule_hw`` (officially the RoPE table is keyed by the exact schedule)."""
    sched = tuple(tuple(int(v) for v in hw[-2:]) for hw in schedule_hw)
    h_last, w_last = sched[-1]
    candidates = [t for t, hws in TEMPLATES.items() if hws[: len(sched)] == sched]
    if not candidates:  # not an official schedule: use the nearest ratio (an extension; the official code fails)
        candidates = [nearest_template(h_last / w_last)]
    template = min(candidates, key=lambda t: abs(h_last / w_last - t))
    return TEMPLATES[template][-1]


# ================================================================================================================
# configuration
# ================================================================================================================
@dataclass(frozen=True)
class InfinityConfig:
    """Architecture hyper-parameters (``infinity_2b`` / ``infinity_8b`` and tiny variants)."""

    depth: int = 32
    embed_dim: int = 2048
    num_heads: int = 16
    mlp_ratio: float = 4.0
    text_channels: int = 2048  # flan-t5-xl d_model
    text_maxlen: int = 512  # rows of cfg_uncond
    d_vae: int = 32  # bits per transformer token (4·codebook_dim with the 2×2 patchify)
    block_chunks: int = 8
    norm_eps: float = 1e-6
    num_levels: int = 15  # rows of lvl_embed
    apply_spatial_patchify: bool = False
    pool_heads: int | None = None  # TextAttentivePool heads; official: text_channels // (64 if C > 4096 else 128)
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}")
        if self.block_chunks < 1 or self.depth % self.block_chunks:
            raise ValueError(f"depth={self.depth} must be a multiple of block_chunks={self.block_chunks}")
        if (self.embed_dim // self.num_heads) % 4:
            raise ValueError("2-D RoPE needs head_dim divisible by 4")
        if self.text_pool_heads < 1 or self.embed_dim % self.text_pool_heads:
            raise ValueError(f"text pool heads {self.text_pool_heads} must divide embed_dim={self.embed_dim}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def ffn_hidden(self) -> int:
        return round(self.embed_dim * self.mlp_ratio / 256) * 256

    @property
    def blocks_per_chunk(self) -> int:
        return self.depth // self.block_chunks

    @property
    def text_pool_heads(self) -> int:
        if self.pool_heads is not None:
            return self.pool_heads
        return self.text_channels // (64 if self.embed_dim > 4096 else 128)

    @property
    def vocab_size(self) -> int:
        return 2 * self.d_vae

    @property
    def num_classes(self) -> int:
        """Not architectural: how many integer class labels the engine adapter maps to fixed prompts (so that
        class-conditional commands can drive a text-to-image model)."""
        return 1000

    def to_dict(self) -> dict:
        return asdict(self)


INFINITY_2B = InfinityConfig(depth=32, embed_dim=2048, num_heads=16, text_channels=2048, d_vae=32, block_chunks=8)
INFINITY_8B = InfinityConfig(depth=40, embed_dim=3584, num_heads=28, text_channels=2048, d_vae=56, block_chunks=8,
                             apply_spatial_patchify=True)


# ================================================================================================================
# RoPE
# ================================================================================================================
def rope_tables(schedule_hw: Sequence[Sequence[int]], ref_hw: tuple[int, int], head_dim: int,
                base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` each ``[L, head_dim/2]`` for every token of the schedule (scales concatenated, row-major).

    Computed with the same float32 operations as the official ``precompute_rope2d_freqs_grid`` (so the tables
    are bit-identical): ``inv_freq = 1/base^(2i/half)``, angle = position × inv_freq, rows then columns.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, half, 2, dtype=torch.int64) / half))
    uph, upw = ref_hw
    angles = []
    for hw in schedule_hw:
        ph, pw = int(hw[-2]), int(hw[-1])
        rows = (torch.arange(ph) * (uph / ph)).round().int()
        cols = (torch.arange(pw) * (upw / pw)).round().int()
        r = rows.view(ph, 1).expand(ph, pw).reshape(-1).to(torch.float32)
        c = cols.view(1, pw).expand(ph, pw).reshape(-1).to(torch.float32)
        angles.append(torch.cat((r[:, None] * inv_freq[None], c[:, None] * inv_freq[None]), dim=-1))
    theta = torch.cat(angles)
    return torch.cos(theta), torch.sin(theta)


def apply_rope(x_BHnd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved (even, odd) pairs. ``cos``/``sin``: ``[n, d/2]`` or ``[B, 1, n, d/2]``."""
    cos, sin = cos.to(x_BHnd.dtype), sin.to(x_BHnd.dtype)
    pairs = x_BHnd.unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return torch.stack((cos * x0 - sin * x1, sin * x0 + cos * x1), dim=-1).flatten(-2)


class RopeTables(nn.Module):
    """The ``(cos, sin)`` tables of :func:`rope_tables` as (non-persistent) buffers, so that they move with the
    model: the adapter holds one of these, and ``Module.to`` / Lightning carry the tables to the model's device.
    (As plain tensors on the adapter they stayed on the CPU when the model moved to a GPU.)"""

    def __init__(self, schedule_hw: Sequence[Sequence[int]], ref_hw: tuple[int, int], head_dim: int,
                 base: float = 10000.0, device: torch.device | str | None = None):
        super().__init__()
        cos, sin = rope_tables(schedule_hw, ref_hw, head_dim, base)
        self.register_buffer("cos", cos.to(device) if device is not None else cos, persistent=False)
        self.register_buffer("sin", sin.to(device) if device is not None else sin, persistent=False)


# ================================================================================================================
# modules
# ================================================================================================================
def ada_layer_norm(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """The official ``fused_ada_layer_norm``: ``LN(x)·(1+scale)+shift`` (no affine), in x's dtype."""
    out = F.layer_norm(x, (x.shape[-1],), None, None, eps)
    return out.mul(scale.add(1)).add_(shift).to(x.dtype)


class RMSNorm(nn.Module):
    """``FastRMSNorm`` with weight: ``x·rsqrt(mean(x²)+eps)·w``."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps))) * self.weight).to(x.dtype)


class SelfAttention(nn.Module):
    """Cosine self-attention with 2-D RoPE. ``project_qkv`` and ``attend`` are split for the engine's KV cache."""

    def __init__(self, embed_dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scale_mul_1H11 = nn.Parameter(torch.full((1, num_heads, 1, 1), 4.0).log())
        self.mat_qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(embed_dim))
        self.v_bias = nn.Parameter(torch.zeros(embed_dim))
        self.register_buffer("zero_k_bias", torch.zeros(embed_dim))
        self.proj = nn.Linear(embed_dim, embed_dim)

    def project_qkv(self, x_BnC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packing=None):
        """q, k, v ``[B, H, n, head_dim]``: q and k l2-normalised (q times the clamped temperature), then RoPE.
        ``packing`` (``var_core.engine.packing.RowPacking``): the projection on the valid tokens only."""
        B, n, C = x_BnC.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        if packing is not None:
            qkv = packing.apply(lambda x: F.linear(x, self.mat_qkv.weight, bias), x_BnC)
        else:
            qkv = F.linear(x_BnC, self.mat_qkv.weight, bias)
        qkv = qkv.view(B, n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        scale_mul = self.scale_mul_1H11.clamp_max(MAX_LOG_SCALE).exp().to(qkv.dtype)
        q = F.normalize(q, dim=-1, eps=1e-12).mul(scale_mul)
        k = F.normalize(k, dim=-1, eps=1e-12)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None = None,
               return_probs: bool = False, packing=None, core=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``core(q, k, v, attn_bias, scale)``: the caller's attention (the engine's, over its KV cache)."""
        B, H, n, hd = q.shape
        probs = None
        if return_probs:
            scores = torch.matmul(q, k.transpose(-1, -2))
            if attn_bias is not None:
                scores = scores + attn_bias
            probs = scores.softmax(dim=-1)
            out = torch.matmul(probs, v)
        elif core is not None:
            out = core(q, k, v, attn_bias, 1.0)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, scale=1.0)
        out = out.transpose(1, 2).reshape(B, n, H * hd)
        return (packing.apply(self.proj, out) if packing is not None else self.proj(out)), probs


class CrossAttention(nn.Module):
    """Cross-attention to per-row text tokens (also the learned-query attentive pool with ``for_attn_pool``).

    The official code packs the text of all rows and calls ``flash_attn_varlen_kvpacked_func``. We keep the
    text padded per row and mask the padding (SDPA; exact same math, per-row softmax over the valid tokens only).
    """

    def __init__(self, embed_dim: int, kv_dim: int, num_heads: int, for_attn_pool: bool = False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scale = 1 / math.sqrt(self.head_dim)
        self.for_attn_pool = for_attn_pool
        if for_attn_pool:
            q = torch.empty(1, num_heads, self.head_dim)
            nn.init.trunc_normal_(q, mean=0, std=math.sqrt(1 / embed_dim / 3))
            self.mat_q = nn.Parameter(q)
        else:
            self.mat_q = nn.Linear(embed_dim, embed_dim, bias=True)
        self.mat_kv = nn.Linear(kv_dim, 2 * embed_dim, bias=False)
        self.v_bias = nn.Parameter(torch.zeros(embed_dim))
        self.register_buffer("zero_k_bias", torch.zeros(embed_dim))
        self.proj = nn.Linear(embed_dim, embed_dim)

    def project_kv(self, kv_RLc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[R, H, L, head_dim]`` of the (padded) text tokens; computed once per generation."""
        R, L, _ = kv_RLc.shape
        kv = F.linear(kv_RLc, self.mat_kv.weight, torch.cat((self.zero_k_bias, self.v_bias)))
        k, v = kv.view(R, L, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return k.contiguous(), v.contiguous()

    def attend(self, x_RnC: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, mask_RL: torch.Tensor,
               packing=None) -> torch.Tensor:
        """``packing``: the q and output projections on the valid tokens of a ragged selection only."""
        R = k.shape[0]
        if self.for_attn_pool:
            q = self.mat_q.to(k.dtype).unsqueeze(2).expand(R, -1, -1, -1)  # [R, H, 1, hd]
            n = 1
        else:
            n = x_RnC.shape[1]
            q = packing.apply(self.mat_q, x_RnC) if packing is not None else self.mat_q(x_RnC)
            q = q.view(R, n, self.num_heads, self.head_dim).transpose(1, 2)
        if _flash_varlen is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            out = _flash_cross(q, k, v, mask_RL, self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_RL[:, None, None, :], scale=self.scale)
        out = out.transpose(1, 2).reshape(R, n, -1)
        return packing.apply(self.proj, out) if packing is not None else self.proj(out)


def _flash_cross(q, k, v, mask_RL, scale):
    """Varlen flash-attention path (CUDA, half precision): pack the valid text tokens of every row."""
    R, H, n, hd = q.shape
    lens = mask_RL.sum(-1).to(torch.int32)
    cu_k = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    kv = torch.stack((k, v), dim=2).permute(0, 3, 2, 1, 4)[mask_RL]  # [Σ lens, 2, H, hd]
    q_packed = q.transpose(1, 2).reshape(R * n, H, hd)
    cu_q = torch.arange(0, (R + 1) * n, n, dtype=torch.int32, device=q.device)
    out = _flash_varlen(q_packed, kv.contiguous(), cu_q, cu_k, n, int(lens.max()), dropout_p=0.0, softmax_scale=scale)
    return out.view(R, n, H, hd).transpose(1, 2)


class FFN(nn.Module):
    def __init__(self, embed_dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CrossAttnBlock(nn.Module):
    """``x += γ1·SA(adaLN1(x))``; ``x += CA(ca_norm(x), text)``; ``x += γ2·FFN(adaLN2(x))`` (shared AdaLN)."""

    def __init__(self, cfg: InfinityConfig):
        super().__init__()
        C = cfg.embed_dim
        self.eps = cfg.norm_eps
        self.ada_gss = nn.Parameter(torch.randn(1, 1, 6, C) / C**0.5)
        self.sa = SelfAttention(C, cfg.num_heads)
        self.ca = CrossAttention(C, C, cfg.num_heads)
        self.ffn = FFN(C, cfg.ffn_hidden)
        self.ca_norm = nn.LayerNorm(C, eps=cfg.norm_eps, elementwise_affine=True)

    def modulation(self, gss_R16C: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``gamma1, gamma2, scale1, scale2, shift1, shift2``, each ``[R, 1, C]``."""
        return tuple((self.ada_gss + gss_R16C).unbind(2))

    def attn_input(self, x: torch.Tensor, mods) -> torch.Tensor:
        return ada_layer_norm(x, mods[2], mods[4], self.eps)

    def attn_output(self, out: torch.Tensor, mods) -> torch.Tensor:
        return out.mul(mods[0])

    def cross_branch(self, x: torch.Tensor, text_k: torch.Tensor, text_v: torch.Tensor, mask_RL: torch.Tensor,
                     packing=None):
        return self.ca.attend(self.ca_norm(x), text_k, text_v, mask_RL, packing)

    def ffn_branch(self, x: torch.Tensor, mods, packing=None) -> torch.Tensor:
        if packing is not None:
            return packing.apply(lambda t, s, b, g: self.ffn(ada_layer_norm(t, s, b, self.eps)).mul(g),
                                 x, mods[3], mods[5], mods[1])
        return self.ffn(ada_layer_norm(x, mods[3], mods[5], self.eps)).mul(mods[1])

    def forward(self, x, mods, text_k, text_v, mask_RL, cos, sin, attn_bias=None) -> torch.Tensor:
        q, k, v = self.sa.project_qkv(self.attn_input(x, mods), cos, sin)
        x = x + self.attn_output(self.sa.attend(q, k, v, attn_bias)[0], mods)
        x = x + self.cross_branch(x, text_k, text_v, mask_RL)
        return x + self.ffn_branch(x, mods)


class TextAttentivePool(nn.Module):
    def __init__(self, cfg: InfinityConfig):
        super().__init__()
        self.ca = CrossAttention(cfg.embed_dim, cfg.text_channels, cfg.text_pool_heads, for_attn_pool=True)

    def forward(self, text_RLc: torch.Tensor, mask_RL: torch.Tensor) -> torch.Tensor:
        k, v = self.ca.project_kv(text_RLc)
        return self.ca.attend(None, k, v, mask_RL).squeeze(1)


class SharedAdaLin(nn.Linear):
    def forward(self, cond_BD: torch.Tensor) -> torch.Tensor:
        C = self.weight.shape[0] // 6
        return super().forward(cond_BD).reshape(-1, 1, 6, C)


class AdaLNBeforeHead(nn.Module):
    def __init__(self, C: int, eps: float):
        super().__init__()
        self.eps = eps
        self.ada_lin = nn.Sequential(nn.SiLU(inplace=False), nn.Linear(C, 2 * C))

    def forward(self, x_BLC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        scale, shift = self.ada_lin(cond_BD).view(-1, 1, 2, x_BLC.shape[-1]).unbind(2)
        return ada_layer_norm(x_BLC, scale, shift, self.eps)


class MultipleLayers(nn.Module):
    """One block chunk (``block_chunks.{k}.module.{j}``)."""

    def __init__(self, blocks: Sequence[nn.Module]):
        super().__init__()
        self.module = nn.ModuleList(blocks)


@dataclass
class TextContext:
    """What the text gives every scale: AdaLN/start condition and the cross-attention token source."""

    cond_RD: torch.Tensor  # [R, C] attentive-pool output (start token, head AdaLN)
    gss_R16C: torch.Tensor  # [R, 1, 6, C] shared AdaLN input
    ca_kv_RLC: torch.Tensor  # [R, L, C] text_proj_for_ca output (padded)
    mask_RL: torch.Tensor  # [R, L] bool
    text_norm_RLc: torch.Tensor  # [R, L, Ct5] text_norm output (padded)


class Infinity(nn.Module):
    """The Infinity transformer (official layout; the BSQ-VAE and the text encoder live outside)."""

    def __init__(self, cfg: InfinityConfig):
        super().__init__()
        self.cfg = cfg
        C, Ct5 = cfg.embed_dim, cfg.text_channels
        cfg_uncond = torch.empty(cfg.text_maxlen, Ct5)
        nn.init.trunc_normal_(cfg_uncond, std=1.2, generator=torch.Generator().manual_seed(0))
        self.cfg_uncond = nn.Parameter(cfg_uncond / Ct5**0.5)
        self.text_norm = RMSNorm(Ct5, eps=cfg.norm_eps)
        self.text_proj_for_sos = TextAttentivePool(cfg)
        self.text_proj_for_ca = nn.Sequential(nn.Linear(Ct5, C), nn.GELU(approximate="tanh"), nn.Linear(C, C))
        init_std = math.sqrt(1 / C / 3)
        self.pos_start = nn.Parameter(torch.empty(1, 1, C))
        nn.init.trunc_normal_(self.pos_start, mean=0, std=init_std)
        self.lvl_embed = nn.Embedding(cfg.num_levels, C)
        self.word_embed = nn.Linear(cfg.d_vae, C)
        self.shared_ada_lin = nn.Sequential(nn.SiLU(inplace=False), SharedAdaLin(C, 6 * C))
        self.head_nm = AdaLNBeforeHead(C, cfg.norm_eps)
        self.head = nn.Linear(C, cfg.vocab_size)
        blocks = [CrossAttnBlock(cfg) for _ in range(cfg.depth)]
        n = cfg.blocks_per_chunk
        self.block_chunks = nn.ModuleList(MultipleLayers(blocks[i * n:(i + 1) * n]) for i in range(cfg.block_chunks))

    @property
    def blocks(self) -> list[CrossAttnBlock]:
        """Blocks in global order (index = chunk·blocks_per_chunk + j); not a second registration."""
        return [b for chunk in self.block_chunks for b in chunk.module]

    # ----- text ---------------------------------------------------------------------------------------------
    def null_text(self, lens: torch.Tensor) -> TextTokens:
        """The unconditional text of each row: ``cfg_uncond[:len_i]`` (the same length as the prompt)."""
        lens = torch.as_tensor(lens, dtype=torch.long).view(-1)
        if int(lens.max()) > self.cfg.text_maxlen:
            raise ValueError(f"prompt of {int(lens.max())} tokens exceeds text_maxlen={self.cfg.text_maxlen}")
        L = int(lens.max())
        feats = self.cfg_uncond[:L].unsqueeze(0).repeat(lens.numel(), 1, 1)
        mask = torch.arange(L).view(1, L) < lens.view(-1, 1)
        return TextTokens(feats.masked_fill(~mask.to(feats.device).unsqueeze(-1), 0.0), lens)

    def encode_text(self, text: TextTokens) -> TextContext:
        param = self.text_norm.weight
        feats = text.features.to(device=param.device, dtype=param.dtype)
        mask = text.mask.to(param.device)
        normed = self.text_norm(feats)
        cond = self.text_proj_for_sos(normed, mask)
        ca_kv = self.text_proj_for_ca(normed)
        return TextContext(cond, self.shared_ada_lin(cond), ca_kv, mask, normed)

    def text_kv(self, ctx: TextContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per block, the cross-attention keys and values of the text (they do not change between scales)."""
        return [b.ca.project_kv(ctx.ca_kv_RLC) for b in self.blocks]

    # ----- pieces the engine calls --------------------------------------------------------------------------
    def embed_first_scale(self, cond_RD: torch.Tensor) -> torch.Tensor:
        R = cond_RD.shape[0]
        x = cond_RD.unsqueeze(1).expand(R, 1, -1) + self.pos_start.expand(R, 1, -1)
        return x + self.lvl_embed.weight[0]

    def embed_tokens(self, x_BNd: torch.Tensor, si: int) -> torch.Tensor:
        return self.word_embed(x_BNd.to(self.word_embed.weight.dtype)) + self.lvl_embed.weight[si]

    def logits(self, x_BNC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_nm(x_BNC, cond_BD)).float()

    # ----- teacher forcing (fixture checks) -----------------------------------------------------------------
    def forward(self, text: TextTokens, x_BLd_wo_first: torch.Tensor, schedule_hw: Sequence[Sequence[int]],
                ref_hw: tuple[int, int] | None = None, return_intermediates: bool = False):
        """Teacher-forced logits ``[B, L, 2·d_vae]`` under the block-causal mask (the official training forward
        with ``cond_drop_rate = 0``). With ``return_intermediates`` also a dict of the internal tensors."""
        sched = [tuple(int(v) for v in hw[-2:]) for hw in schedule_hw]
        ref_hw = ref_hw or rope_reference_hw(sched)
        ctx = self.encode_text(text)
        B = x_BLd_wo_first.shape[0]
        sos = ctx.cond_RD.unsqueeze(1).expand(B, 1, -1) + self.pos_start.expand(B, 1, -1)
        x = torch.cat((sos, self.word_embed(x_BLd_wo_first.to(sos.dtype))), dim=1)
        level = torch.cat([torch.full((h * w,), si, dtype=torch.long) for si, (h, w) in enumerate(sched)])
        x = x + self.lvl_embed(level.to(x.device)).unsqueeze(0)
        visible = level.view(-1, 1) >= level.view(1, -1)
        bias = torch.where(visible, 0.0, float("-inf")).to(device=x.device, dtype=x.dtype).view(1, 1, *visible.shape)
        cos, sin = rope_tables(sched, ref_hw, self.cfg.head_dim, self.cfg.rope_base)
        cos, sin = cos.to(x.device), sin.to(x.device)
        inter = {"text_norm_out": ctx.text_norm_RLc, "cond_BD": ctx.cond_RD, "ca_kv": ctx.ca_kv_RLC,
                 "mask": ctx.mask_RL, "cond_BD_or_gss": ctx.gss_R16C, "block0_input": x, "block_outputs": []}
        for block, (k_t, v_t) in zip(self.blocks, self.text_kv(ctx)):
            x = block(x, block.modulation(ctx.gss_R16C), k_t, v_t, ctx.mask_RL, cos, sin, bias)
            inter["block_outputs"].append(x)
        logits = self.logits(x, ctx.cond_RD)
        return (logits, inter) if return_intermediates else logits


# ================================================================================================================
# checkpoints
# ================================================================================================================
DROPPED_BUFFERS = ("lvl_1L", "attn_bias_for_masking", "Infinity_visible_kvlen", "Infinity_invisible_qlen")


def infer_infinity_config(sd: Mapping[str, torch.Tensor], **overrides) -> InfinityConfig:
    """Architecture of an official Infinity state_dict (any depth, width, bit count, chunking)."""
    required = ("pos_start", "word_embed.weight", "head.weight", "text_norm.weight", "cfg_uncond")
    absent = [k for k in required if k not in sd]
    if absent:
        raise KeyError(f"not an Infinity transformer state_dict: missing {absent} (got keys like {sorted(sd)[:5]})")
    pairs = {(int(m.group(1)), int(m.group(2))) for k in sd
             if (m := re.match(r"block_chunks\.(\d+)\.module\.(\d+)\.", k))}
    if not pairs:
        raise KeyError("no block_chunks.{k}.module.{j}.* keys: block_chunks=1 checkpoints are not supported")
    chunks = 1 + max(k for k, _ in pairs)
    per_chunk = 1 + max(j for _, j in pairs)
    C = sd["pos_start"].shape[-1]
    fields = dict(
        depth=chunks * per_chunk,
        embed_dim=C,
        num_heads=sd["block_chunks.0.module.0.sa.scale_mul_1H11"].shape[1],
        mlp_ratio=sd["block_chunks.0.module.0.ffn.fc1.weight"].shape[0] / C,
        text_channels=sd["text_norm.weight"].shape[0],
        text_maxlen=sd["cfg_uncond"].shape[0],
        d_vae=sd["word_embed.weight"].shape[1],
        block_chunks=chunks,
        num_levels=sd["lvl_embed.weight"].shape[0],
        pool_heads=sd["text_proj_for_sos.ca.mat_q"].shape[1],
    )
    fields.update(overrides)
    if fields["text_channels"] // (64 if fields["embed_dim"] > 4096 else 128) == fields["pool_heads"]:
        fields["pool_heads"] = None  # the official rule gives it
    return InfinityConfig(**fields)


def prepare_infinity_state_dict(sd: Mapping[str, torch.Tensor], model: Infinity) -> dict[str, torch.Tensor]:
    """What the official ``Infinity.load_state_dict`` tolerates, made explicit before a strict load:
    drop the training buffers, fill missing ``zero_k_bias`` buffers (zeros), trim/pad ``cfg_uncond`` to
    ``text_maxlen`` (padding with the model's own initial rows, as the official loader does)."""
    out = {k: v for k, v in sd.items() if k not in DROPPED_BUFFERS}
    own = model.state_dict()
    for key, value in own.items():
        if key.endswith("zero_k_bias") and key not in out:
            out[key] = torch.zeros_like(value)
    if "cfg_uncond" in out:
        old, new = out["cfg_uncond"], own["cfg_uncond"]
        if old.shape[0] >= new.shape[0]:
            out["cfg_uncond"] = old[: new.shape[0]]
        else:
            out["cfg_uncond"] = torch.cat((old.to(new.dtype), new[old.shape[0]:]))
    return out


def randomize_infinity_(model: Infinity, seed: int = 0) -> Infinity:
    """Redraw every parameter from a private generator so that every sub-layer matters (like the fixture's
    re-randomisation): weights ``N/√fan_in`` (head ×3), biases ``0.1·N``, norm weights ``1+0.1·N``,
    ``scale_mul`` ``ln 4 + 0.3·N``, ``ada_gss`` ``0.3·N``, ``pos_start``/``lvl_embed`` ``0.5·N``, ``cfg_uncond``
    ``0.3·N``, pool query ``N``. No global RNG state is touched."""
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name == "text_proj_for_sos.ca.mat_q":
                value = noise
            elif name.endswith("scale_mul_1H11"):
                value = math.log(4.0) + 0.3 * noise
            elif name.endswith("ada_gss") or name == "cfg_uncond":
                value = 0.3 * noise
            elif name in ("pos_start", "lvl_embed.weight"):
                value = 0.5 * noise
            elif name in ("text_norm.weight",) or name.endswith("ca_norm.weight"):
                value = 1 + 0.1 * noise
            elif p.ndim >= 2:
                value = noise / math.sqrt(p.shape[-1]) * (3.0 if name == "head.weight" else 1.0)
            else:
                value = 0.1 * noise
            p.copy_(value.to(p.dtype))
    return model
