"""Class-conditional VAR transformer (Tian et al., 2024), re-implemented in the official parameter layout.

The module names and shapes match the official ``models/var.py`` / ``models/basic_var.py`` so that the
released ``var_d{16,20,24,30,36}.pth`` state_dicts load with ``strict=True`` (see
``specs/reference_models.md`` §1.4–1.5). What differs from the official code is the *shape* of the API:
every block exposes its two residual branches (self-attention, MLP) separately, so the generation loop in
``var_core.engine`` can run each branch on a token subset, restore pruned slots, and observe attention —
none of which the official monolithic ``forward`` allows. The model itself knows nothing about the loop,
caching policy or acceleration methods.

Official behaviours deliberately *not* reproduced:
* process-global ``reset_parameters`` patching in the factory (we never touch global state);
* random label dropout in eval mode (``cond_drop_rate`` only applies when ``self.training``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_LOG_SCALE = math.log(100.0)  # the official clamp on the learned attention temperature


@dataclass(frozen=True)
class VARConfig:
    """Architecture hyper-parameters; ``from_checkpoint`` in ``loading.py`` infers them from state_dict keys."""

    vocab_size: int = 4096
    z_channels: int = 32  # Cvae, the VQVAE latent width
    num_classes: int = 1000
    depth: int = 16
    embed_dim: int = 1024  # official: 64 * depth
    num_heads: int = 16  # official: depth
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-6
    shared_aln: bool = False
    attn_l2_norm: bool = True
    patch_nums: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
    cond_drop_rate: float = 0.1  # training only (the official code also drops in eval mode; we do not)

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_nums", tuple(int(p) for p in self.patch_nums))
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}")

    @property
    def num_scales(self) -> int:
        return len(self.patch_nums)

    @property
    def total_tokens(self) -> int:
        return sum(p * p for p in self.patch_nums)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def mlp_hidden(self) -> int:
        return round(self.embed_dim * self.mlp_ratio)

    def to_dict(self) -> dict:
        return asdict(self)


def official_var_config(depth: int, **overrides) -> VARConfig:
    """The official ``build_vae_var`` sizing rule: width = 64·depth, heads = depth."""
    return VARConfig(depth=depth, embed_dim=64 * depth, num_heads=depth, **overrides)


class SelfAttention(nn.Module):
    """VAR self-attention: qkv without bias on k, l2-normalised q/k with a learned per-head temperature.

    ``project_qkv`` and ``attend`` are split so that the caller (the engine) owns the KV cache.
    """

    def __init__(self, embed_dim: int, num_heads: int, attn_l2_norm: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.attn_l2_norm = attn_l2_norm
        if attn_l2_norm:
            self.scale = 1.0
            self.scale_mul_1H11 = nn.Parameter(torch.full((1, num_heads, 1, 1), math.log(4.0)))
        else:
            self.scale = 0.25 / math.sqrt(self.head_dim)
        self.mat_qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(embed_dim))
        self.v_bias = nn.Parameter(torch.zeros(embed_dim))
        self.register_buffer("zero_k_bias", torch.zeros(embed_dim))
        self.proj = nn.Linear(embed_dim, embed_dim)

    def project_qkv(self, x_BNC: torch.Tensor, packing=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns q, k, v as ``[B, H, N, head_dim]``; q already carries the temperature, k is normalised.

        ``packing`` (a ``var_core.engine.packing.RowPacking``): run the projection on the valid tokens only."""
        B, N, C = x_BNC.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        if packing is not None:
            qkv = packing.apply(lambda x: F.linear(x, self.mat_qkv.weight, bias), x_BNC)
        else:
            qkv = F.linear(x_BNC, self.mat_qkv.weight, bias)
        qkv = qkv.view(B, N, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, N, hd]
        if self.attn_l2_norm:
            temperature = self.scale_mul_1H11.clamp(max=MAX_LOG_SCALE).exp()
            q = F.normalize(q, dim=-1).mul(temperature)
            k = F.normalize(k, dim=-1)
        return q, k, v

    def attend(
        self,
        q_BHnd: torch.Tensor,
        k_BHLd: torch.Tensor,
        v_BHLd: torch.Tensor,
        attn_bias: torch.Tensor | None = None,
        return_probs: bool = False,
        packing=None,
        core=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of the queries over the given keys, then the output projection.

        With ``return_probs`` the probabilities are materialised (eager path); otherwise PyTorch's fused SDPA runs,
        or ``core(q, k, v, attn_bias, scale)`` when the caller supplies one (the engine's attention over its KV
        cache, ``var_core.engine.attention.CachedAttention``).
        """
        B, H, n, hd = q_BHnd.shape
        if return_probs:
            scores = torch.matmul(q_BHnd, k_BHLd.transpose(-1, -2)) * self.scale
            if attn_bias is not None:
                scores = scores + attn_bias
            probs = scores.softmax(dim=-1)
            out = torch.matmul(probs, v_BHLd)
        elif core is not None:
            probs = None
            out = core(q_BHnd, k_BHLd, v_BHLd, attn_bias, self.scale)
        else:
            probs = None
            out = F.scaled_dot_product_attention(q_BHnd, k_BHLd, v_BHLd, attn_mask=attn_bias, scale=self.scale)
        out = out.transpose(1, 2).reshape(B, n, H * hd)
        if packing is not None:
            return packing.apply(self.proj, out), probs
        return self.proj(out), probs

    def forward(self, x_BNC: torch.Tensor, attn_bias: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project_qkv(x_BNC)
        return self.attend(q, k, v, attn_bias)[0]


class FeedForward(nn.Module):
    """fc1 → GELU(tanh) → fc2, as in the official FFN."""

    def __init__(self, embed_dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, hidden)
        self.fc2 = nn.Linear(hidden, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class AdaLNSelfAttnBlock(nn.Module):
    """One VAR block: ``x += γ1·attn(LN(x)(1+s1)+b1)``; ``x += γ2·ffn(LN(x)(1+s2)+b2)``.

    The six AdaLN chunks come in the official order ``gamma1, gamma2, scale1, scale2, shift1, shift2``.
    With ``shared_aln`` (VAR-d36) the block adds its own ``ada_gss`` to a modulation computed once for all
    blocks; otherwise it owns an ``ada_lin``.
    """

    def __init__(self, cfg: VARConfig):
        super().__init__()
        C = cfg.embed_dim
        self.shared_aln = cfg.shared_aln
        if cfg.shared_aln:
            self.ada_gss = nn.Parameter(torch.randn(1, 1, 6, C) / C**0.5)
        self.attn = SelfAttention(C, cfg.num_heads, cfg.attn_l2_norm)
        self.ffn = FeedForward(C, cfg.mlp_hidden)
        self.ln_wo_grad = nn.LayerNorm(C, eps=cfg.norm_eps, elementwise_affine=False)
        if not cfg.shared_aln:
            self.ada_lin = nn.Sequential(nn.SiLU(inplace=False), nn.Linear(C, 6 * C))

    def modulation(self, cond_BD_or_gss: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The six ``[B, 1, C]`` AdaLN tensors. Depends only on the condition, so the engine computes it once."""
        if self.shared_aln:
            mods = (self.ada_gss + cond_BD_or_gss).unbind(2)  # cond is [B, 1, 6, C]
        else:
            B, C = cond_BD_or_gss.shape[0], self.ln_wo_grad.normalized_shape[0]
            mods = self.ada_lin(cond_BD_or_gss).view(B, 1, 6, C).unbind(2)
        return tuple(mods)  # gamma1, gamma2, scale1, scale2, shift1, shift2

    def attn_input(self, x_BNC: torch.Tensor, mods) -> torch.Tensor:
        _, _, scale1, _, shift1, _ = mods
        return self.ln_wo_grad(x_BNC).mul(scale1.add(1)).add_(shift1)

    def attn_output(self, attn_out_BNC: torch.Tensor, mods) -> torch.Tensor:
        return attn_out_BNC.mul(mods[0])

    def ffn_branch(self, x_BNC: torch.Tensor, mods, packing=None) -> torch.Tensor:
        """The residual-branch output of the MLP (γ2 included), for the tokens given (``packing``: the valid ones
        of a ragged selection only, see ``var_core.engine.packing``)."""
        _, gamma2, _, scale2, _, shift2 = mods
        if packing is not None:
            return packing.apply(
                lambda x, s, b, g: self.ffn(self.ln_wo_grad(x).mul(s.add(1)).add_(b)).mul(g),
                x_BNC, scale2, shift2, gamma2)
        return self.ffn(self.ln_wo_grad(x_BNC).mul(scale2.add(1)).add_(shift2)).mul(gamma2)

    def forward(self, x_BNC: torch.Tensor, cond_BD_or_gss: torch.Tensor, attn_bias: torch.Tensor | None) -> torch.Tensor:
        mods = self.modulation(cond_BD_or_gss)
        x_BNC = x_BNC + self.attn_output(self.attn(self.attn_input(x_BNC, mods), attn_bias), mods)
        return x_BNC + self.ffn_branch(x_BNC, mods)


class AdaLNBeforeHead(nn.Module):
    """``LN(x)·(1+scale)+shift`` with (scale, shift) from the raw class embedding."""

    def __init__(self, embed_dim: int, norm_eps: float):
        super().__init__()
        self.ln_wo_grad = nn.LayerNorm(embed_dim, eps=norm_eps, elementwise_affine=False)
        self.ada_lin = nn.Sequential(nn.SiLU(inplace=False), nn.Linear(embed_dim, 2 * embed_dim))

    def forward(self, x_BNC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        scale, shift = self.ada_lin(cond_BD).view(-1, 1, 2, x_BNC.shape[-1]).unbind(2)
        return self.ln_wo_grad(x_BNC).mul(scale.add(1)).add_(shift)


class SharedAdaLin(nn.Linear):
    """The d36 shared modulation: one Linear(D, 6C), output viewed as ``[B, 1, 6, C]``."""

    def forward(self, cond_BD: torch.Tensor) -> torch.Tensor:
        C = self.weight.shape[0] // 6
        return super().forward(cond_BD).view(-1, 1, 6, C)


def scale_index_per_token(patch_nums: Sequence[int]) -> torch.Tensor:
    """``[1, L]`` int64: the scale index of every token, scales concatenated in order."""
    return torch.cat([torch.full((p * p,), si, dtype=torch.long) for si, p in enumerate(patch_nums)]).view(1, -1)


def block_causal_bias(patch_nums: Sequence[int]) -> torch.Tensor:
    """``[1, 1, L, L]``: 0 where the key's scale ≤ the query's scale, −inf elsewhere (the training mask)."""
    level = scale_index_per_token(patch_nums)
    visible = level.view(-1, 1) >= level.view(1, -1)  # [query, key]
    return torch.where(visible, 0.0, float("-inf")).view(1, 1, *visible.shape)


class VAR(nn.Module):
    """The VAR next-scale transformer (official layout, no VQVAE inside: the engine pairs them)."""

    def __init__(self, cfg: VARConfig):
        super().__init__()
        self.cfg = cfg
        C, L = cfg.embed_dim, cfg.total_tokens
        first_l = cfg.patch_nums[0] ** 2
        self.first_l = first_l
        self.pos_start = nn.Parameter(torch.randn(1, first_l, C) * 0.02)
        self.pos_1LC = nn.Parameter(torch.randn(1, L, C) * 0.02)
        self.register_buffer("lvl_1L", scale_index_per_token(cfg.patch_nums))
        self.register_buffer("attn_bias_for_masking", block_causal_bias(cfg.patch_nums).contiguous())
        self.word_embed = nn.Linear(cfg.z_channels, C)
        self.class_emb = nn.Embedding(cfg.num_classes + 1, C)
        self.lvl_embed = nn.Embedding(cfg.num_scales, C)
        self.shared_ada_lin = (
            nn.Sequential(nn.SiLU(inplace=False), SharedAdaLin(C, 6 * C)) if cfg.shared_aln else nn.Identity()
        )
        self.blocks = nn.ModuleList(AdaLNSelfAttnBlock(cfg) for _ in range(cfg.depth))
        self.head_nm = AdaLNBeforeHead(C, cfg.norm_eps)
        self.head = nn.Linear(C, cfg.vocab_size)
        self.scale_slices = []
        start = 0
        for p in cfg.patch_nums:
            self.scale_slices.append(slice(start, start + p * p))
            start += p * p

    @property
    def null_class(self) -> int:
        return self.cfg.num_classes

    def init_weights(self, init_adaln: float = 0.5, init_adaln_gamma: float = 1e-5, init_head: float = 0.02) -> None:
        """Training initialisation in the spirit of the official ``init_weights`` (near-identity blocks)."""
        C = self.cfg.embed_dim
        std = math.sqrt(1 / C / 3)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.trunc_normal_(m.weight, std=std)
        nn.init.trunc_normal_(self.pos_start, std=std)
        nn.init.trunc_normal_(self.pos_1LC, std=std)
        with torch.no_grad():
            self.head.weight.mul_(init_head)
            self.head_nm.ada_lin[-1].weight.mul_(init_adaln)
            for block in self.blocks:
                block.attn.proj.weight.div_(math.sqrt(2 * self.cfg.depth))
                block.ffn.fc2.weight.div_(math.sqrt(2 * self.cfg.depth))
                if not self.cfg.shared_aln:
                    w = block.ada_lin[-1].weight
                    w[: 2 * C].mul_(init_adaln_gamma)
                    w[2 * C :].mul_(init_adaln)
            if self.cfg.shared_aln:
                w = self.shared_ada_lin[-1].weight
                w[: 2 * C].mul_(init_adaln_gamma)
                w[2 * C :].mul_(init_adaln)

    # ----- pieces the engine calls -------------------------------------------------------------------------
    def condition(self, label_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Class embedding ``cond_BD`` and the block modulation input (``[B,1,6,C]`` with shared AdaLN)."""
        cond_BD = self.class_emb(label_B)
        return cond_BD, self.shared_ada_lin(cond_BD)

    def level_position_embedding(self) -> torch.Tensor:
        """``[1, L, C]``: level + absolute position embedding of every token."""
        return self.lvl_embed(self.lvl_1L) + self.pos_1LC

    def embed_first_scale(self, cond_BD: torch.Tensor, lvl_pos_1LC: torch.Tensor) -> torch.Tensor:
        return cond_BD.unsqueeze(1).expand(-1, self.first_l, -1) + self.pos_start + lvl_pos_1LC[:, : self.first_l]

    def embed_tokens(self, feat_BNCv: torch.Tensor, si: int, lvl_pos_1LC: torch.Tensor) -> torch.Tensor:
        """Input of scale ``si`` from the VQVAE feature map resized to that scale, flattened row-major."""
        return self.word_embed(feat_BNCv.to(self.word_embed.weight.dtype)) + lvl_pos_1LC[:, self.scale_slices[si]]

    def head_input(self, x_BNC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        """The head's normalised input. The official code normalises in fp32 and lets autocast run the head in
        half precision; with the weights stored in bf16/fp16 the features are cast to the head's dtype instead
        (a no-op in fp32, so fp32 stays bit-identical to the official goldens)."""
        return self.head_nm(x_BNC.float(), cond_BD).to(self.head.weight.dtype)

    def logits(self, x_BNC: torch.Tensor, cond_BD: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_input(x_BNC, cond_BD)).float()

    # ----- teacher forcing (training and fixture checks) ---------------------------------------------------
    def forward(
        self, label_B: torch.Tensor, x_BLCv_wo_first_l: torch.Tensor, return_block_outputs: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Teacher-forced logits ``[B, L, V]`` under the block-causal mask."""
        if self.training and self.cfg.cond_drop_rate > 0:
            drop = torch.rand(label_B.shape[0], device=label_B.device) < self.cfg.cond_drop_rate
            label_B = torch.where(drop, torch.full_like(label_B, self.null_class), label_B)
        cond_BD, cond_mod = self.condition(label_B)
        lvl_pos = self.level_position_embedding()
        x = torch.cat(
            (
                cond_BD.unsqueeze(1).expand(-1, self.first_l, -1) + self.pos_start,
                self.word_embed(x_BLCv_wo_first_l.to(self.word_embed.weight.dtype)),
            ),
            dim=1,
        )
        x = x + lvl_pos
        L = x.shape[1]
        bias = self.attn_bias_for_masking[:, :, :L, :L].to(x.dtype)
        outputs = []
        for block in self.blocks:
            x = block(x, cond_mod, bias)
            if return_block_outputs:
                outputs.append(x)
        logits = self.logits(x, cond_BD)
        return (logits, outputs) if return_block_outputs else logits
