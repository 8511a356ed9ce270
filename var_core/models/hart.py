"""HART's transformer ``HARTForT2I`` (Tang et al., 2024), re-implemented in the official parameter layout.

Module names and shapes follow the official ``hart/modules/models/transformer/hart_transformer_t2i.py`` and
``hart/modules/networks/basic_hart.py`` on the Llama path (specs/hart.md §3, §8.2), so the ``llm/`` folders of
HART checkpoints (``pytorch_model.bin`` / ``ema_model.bin``) and the fixture ``official_hart_tiny`` load unchanged.
As in ``var_core.models.var`` and ``infinity``, every block exposes its two residual branches (``attn``, ``ffn``)
separately so the engine can run each on a token subset; self-attention takes the tokens' **true** positions
(the 2-D RoPE tables are gathered at kept positions). The model knows nothing about the loop or about methods.

Official behaviours reproduced (checked against the fixture, ``python -m var_core.verify``):

* text conditioning through the attention context: ``sos = context_embed(context_norm(context))`` (``[R, ctx, C]``)
  is the first "scale"; its last position predicts the 1×1 scale; context padding is never masked;
* Llama-style blocks: one RMSNorm (``ln_wo_grad``, *with* a learnable weight although the official code asks for
  none) before both sub-layers; SwiGLU MLP without biases; attention ``qkv = x·W + [q_bias, 0, v_bias]``, with
  ``attn_l2_norm`` cosine attention (per-head temperature ``exp(min(scale_mul, ln 100))``, softmax scale 1), else
  the softmax scale **0.25/√head_dim**; then RoPE: 1-D Llama RoPE for the context (its position ids, −1 on left
  pads), 2-D for image tokens at fractional positions ``(r, c)·pn_N/pn + the row's last context position``, laid
  out ``[row, row, col, col]`` over quarters of the head (channel ``d`` is mixed with ``d + hd/2`` using the
  row angle for the first and the column angle for the second: not a rotation; reproduced exactly);
* the per-block AdaLN variant (``disable_aln=False``: ``ada_lin`` on the max- or masked-mean-pooled ``sos``, split
  gamma1, gamma2, scale1, scale2, shift1, shift2) — believed unused by the release but covered by the fixture;
* the head ``head(RMS(x)·(1+scale)+shift)`` with ``(scale, shift)`` from the **max** over all context tokens;
* ``decoder_norm`` (RMSNorm) of ``x_last + word_embed(embedding(idx))``: the diffusion head's condition.

Not reproduced: the GPT-2 attention/MLP path, ``shared_aln``, ``use_timestep_embed``, cross-attention and absolute
position embeddings (``attn_type="gpt2"``): none is on the Llama path of the release; a config asking for one is
refused when it is loaded. The saved ``attn_bias_for_masking`` buffer (380 MB for 0.7B) is rebuilt, not loaded;
``lvl_1L`` is checked against the schedule and dropped.

FastVAR's HART setting (``FASTVAR_HART_SETTING``, specs/hart.md §9.1) is what preset ``fastvar`` resolves to on
this family (``var_core.accel.presets``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .hart_diffusion import DiffusionHead
from .hart_tokenizer import HART_PATCH_NUMS_1024

__all__ = ["FASTVAR_HART_SETTING", "HART_0P7B", "HARTConfig", "HARTTransformer", "image_positions",
           "prepare_hart_state_dict", "randomize_hart_"]

MAX_LOG_SCALE = math.log(100.0)
HART_DROPPED_BUFFERS = ("lvl_1L", "attn_bias_for_masking")

#: FastVAR's released HART port (csguoh/FastVAR ``HART/``, specs/hart.md §9.1): before BOTH sub-layers of EVERY block,
#: per network row, tokens ranked by ``‖x_i − mean_j x_j‖²`` keep ``L − int(L·r)``, with r keyed on the token map's
#: width; the pruned tokens receive the same sub-layer's output cached at the 36×36 scale, area-interpolated; no
#: scale is skipped. Preset ``fastvar`` resolves to exactly this on HART (``presets.FASTVAR_TABLES["hart"]``).
FASTVAR_HART_SETTING = {"widths": (48, 64), "removal_ratios": (0.5, 0.75), "cache_grid": (36, 36),
                        "blocks": "all", "sub_layers": ("attn", "ffn"), "score": "mean_distance",
                        "rows": "per_row", "skip_scales": ()}


@dataclass(frozen=True)
class HARTConfig:
    """Architecture of a ``HARTForT2I`` (Llama path) plus the tokenizer sizes it reads (``vocab_size``,
    ``z_channels``). Build from the two ``config.json`` files with :meth:`from_json`."""

    context_token: int = 300
    context_dim: int = 1536
    depth: int = 24
    embed_dim: int = 1536
    num_heads: int = 24
    mlp_ratio: float = 4.0
    patch_nums: tuple[int, ...] = HART_PATCH_NUMS_1024
    vocab_size: int = 4096
    z_channels: int = 32
    disable_aln: bool = True
    sep_aln_pooling_mode: str = "max"
    attn_l2_norm: bool = False
    use_context_norm: bool = False
    norm_eps: float = 1e-6
    diff_width: int = 1024
    diff_depth: int = 6
    num_sampling_steps: int = 8
    rope_base: float = 10000.0
    mlp_hidden_override: int | None = None  # read from the checkpoint when it differs from the Llama rule
    extra: dict = field(default_factory=dict, compare=False)  # the rest of config.json, kept for the record

    def __post_init__(self) -> None:
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"2-D RoPE needs head_dim divisible by 4, got {self.head_dim}")
        if self.context_token < 1:
            raise ValueError("HART needs context tokens (context_token >= 1); context_token=0 is the GPT-2 class "
                             "path, not supported")
        if self.sep_aln_pooling_mode not in ("max", "avg"):
            raise ValueError(f"sep_aln_pooling_mode must be 'max' or 'avg', got {self.sep_aln_pooling_mode!r}")

    # supported values of config.json fields that select code paths we do not implement
    REQUIRED = {"attn_type": "llama", "mlp_type": "llama", "shared_aln": False, "use_timestep_embed": False,
                "use_cross_attn": False, "sampler": "iddpm"}

    @classmethod
    def from_json(cls, data: Mapping, tokenizer_cfg=None, source: str = "llm/config.json") -> "HARTConfig":
        from .loading import CheckpointMismatchError

        for name, value in cls.REQUIRED.items():
            if name in data and data[name] != value:
                raise CheckpointMismatchError(
                    f"{source}: {name}={data[name]!r} is not supported: this HART implementation has the Llama path "
                    f"of the release ({name}={value!r}, specs/hart.md §2.2/§3)")
        steps = str(data.get("num_sampling_steps", "8"))
        if not steps.isdigit():
            raise CheckpointMismatchError(f"{source}: num_sampling_steps={steps!r}: only a plain step count "
                                          f"(respacing of one section, official '8') is supported")
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", "mlp_hidden_override", "num_sampling_steps",
                                                                   "vocab_size", "z_channels", "rope_base")}
        kwargs = {k: data[k] for k in known if k in data}
        if "patch_nums" in kwargs:
            kwargs["patch_nums"] = tuple(int(p) for p in kwargs["patch_nums"])
        for key in ("disable_aln", "attn_l2_norm", "use_context_norm"):
            if key in kwargs:
                kwargs[key] = bool(kwargs[key])
        if tokenizer_cfg is not None:
            kwargs.update(vocab_size=int(tokenizer_cfg.vocab_size), z_channels=int(tokenizer_cfg.z_channels))
        return cls(**kwargs, num_sampling_steps=int(steps),
                   extra={k: v for k, v in data.items() if k not in known and k != "num_sampling_steps"})

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def num_scales(self) -> int:
        return len(self.patch_nums)

    @property
    def total_tokens(self) -> int:
        return sum(p * p for p in self.patch_nums)

    @property
    def mlp_hidden(self) -> int:
        """SwiGLU hidden size: the Llama rule ``int(2·(C·mlp_ratio)/3)`` rounded up to a multiple of 256."""
        if self.mlp_hidden_override is not None:
            return int(self.mlp_hidden_override)
        hidden = int(2 * int(self.embed_dim * self.mlp_ratio) / 3)
        return (hidden + 255) // 256 * 256

    @property
    def attn_scale(self) -> float:
        return 1.0 if self.attn_l2_norm else 0.25 / math.sqrt(self.head_dim)

    @property
    def num_classes(self) -> int:
        """Not architectural: how many integer class labels the adapter maps to fixed prompts (so that
        class-conditional commands can drive this text-to-image model)."""
        return 1000

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("extra")
        return out


#: HART-0.7B at 1024 px as specs/hart.md §2.2 infers it (the release config.json was not available): each field is
#: checked against a real checkpoint's config.json when ``hart-0.7b`` is loaded (``zoo.HART_0P7B_ASSUMPTIONS``).
HART_0P7B = HARTConfig()


# ================================================================================================================
# norms, RoPE
# ================================================================================================================
class RMSNorm(nn.Module):
    """``LlamaRMSNormFused``: ``x·rsqrt(mean(x²) + eps)·w`` in fp32, with a learnable weight (always)."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x_RHnd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x·cos + rotate_half(x)·sin``; ``cos``/``sin`` ``[R, 1, n, hd]`` (or broadcastable)."""
    cos, sin = cos.to(x_RHnd.dtype), sin.to(x_RHnd.dtype)
    return x_RHnd * cos + _rotate_half(x_RHnd) * sin


def context_rope(position_ids_RL: torch.Tensor, head_dim: int, base: float = 10000.0):
    """1-D Llama RoPE of the context tokens: ``(cos, sin)`` ``[R, 1, L, hd]``, angles ``pos·base^(−2i/hd)``
    duplicated over the two halves."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids_RL.device)
                                .float() / head_dim))
    freqs = position_ids_RL.float()[..., None] * inv_freq  # [R, L, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def image_positions(patch_nums: Sequence[int], rule: str = "inference") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per scale, the fractional ``(row, col)`` positions of its tokens (row-major), each ``[pn²]`` float32,
    ``(r, c)·pn_N/pn`` rounded as the official code rounds it on each path: ``rule="inference"`` (the KV-cached
    sampler) computes ``(r/pn)·pn_N`` in float32, ``rule="training"`` (the teacher-forced forward) ``r·(pn_N/pn)``.
    The two differ by one float32 ulp on some positions of scales whose side does not divide ``pn_N`` (so the
    official code's own teacher-forced and sampled logits differ by ~4e-5); each path here matches its official
    counterpart bit for bit. Scale 0 has no image token in the sequence (its input is the context) but is listed."""
    if rule not in ("inference", "training"):
        raise ValueError(f"rule must be 'inference' or 'training', got {rule!r}")
    last = patch_nums[-1]
    out = []
    for pn in patch_nums:
        r = torch.arange(pn, dtype=torch.float32)
        coords = r / pn * last if rule == "inference" else r * (last / pn)
        rows = coords.view(pn, 1).expand(pn, pn).reshape(-1)
        cols = coords.view(1, pn).expand(pn, pn).reshape(-1)
        out.append((rows, cols))
    return out


def image_rope(rows_n: torch.Tensor, cols_n: torch.Tensor, offset_R: torch.Tensor, head_dim: int,
               base: float = 10000.0):
    """2-D RoPE of image tokens at positions ``(rows + off, cols + off)`` per network row (``offset_R``: the row's
    last context position id; 0 for unconditional rows): ``(cos, sin)`` ``[R, 1, n, hd]`` laid out
    ``[row·g, row·g, col·g, col·g]`` with ``g_j = base^(−4j/hd)``, ``j < hd/4``."""
    quarter_dim = head_dim // 2
    inv_freq = 1.0 / (base ** (torch.arange(0, quarter_dim, 2, dtype=torch.int64, device=rows_n.device).float()
                               / quarter_dim))
    off = offset_R.float().view(-1, 1)
    r = (rows_n.view(1, -1) + off)[..., None] * inv_freq  # [R, n, hd/4]
    c = (cols_n.view(1, -1) + off)[..., None] * inv_freq
    emb = torch.cat((r, r, c, c), dim=-1)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


# ================================================================================================================
# modules
# ================================================================================================================
class HARTAttention(nn.Module):
    """Llama attention of HART: ``project_qkv`` (with RoPE) and ``attend`` split for the engine's KV cache."""

    def __init__(self, cfg: HARTConfig):
        super().__init__()
        C = cfg.embed_dim
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.l2_norm = cfg.attn_l2_norm
        self.scale = cfg.attn_scale
        if self.l2_norm:
            self.scale_mul_1H11 = nn.Parameter(torch.full((1, cfg.num_heads, 1, 1), 4.0).log())
        self.q_bias = nn.Parameter(torch.zeros(C))
        self.v_bias = nn.Parameter(torch.zeros(C))
        self.register_buffer("zero_k_bias", torch.zeros(C))
        self.qkv_proj = nn.Linear(C, 3 * C, bias=False)
        self.proj = nn.Linear(C, C, bias=True)

    def project_qkv(self, x_RnC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packing=None):
        """q, k, v ``[R, H, n, hd]`` (q, k after the optional l2 norm and RoPE)."""
        R, n, C = x_RnC.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        if packing is not None:
            qkv = packing.apply(lambda t: F.linear(t, self.qkv_proj.weight, bias), x_RnC)
        else:
            qkv = F.linear(x_RnC, self.qkv_proj.weight, bias)
        q, k, v = qkv.view(R, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.l2_norm:
            scale_mul = self.scale_mul_1H11.clamp_max(MAX_LOG_SCALE).exp().to(q.dtype)
            q = F.normalize(q, dim=-1).mul(scale_mul)
            k = F.normalize(k, dim=-1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.contiguous()

    def attend(self, q, k, v, attn_bias: torch.Tensor | None = None, return_probs: bool = False, packing=None,
               core=None):
        """Softmax attention of ``q`` over ``k``/``v`` (``attn_bias`` additive), then ``proj``; ``core(q, k, v,
        attn_bias, scale)``: the caller's attention instead of SDPA (the engine's, over its KV cache)."""
        R, H, n, hd = q.shape
        probs = None
        if return_probs:
            scores = torch.matmul(q, k.transpose(-1, -2)).mul(self.scale)
            if attn_bias is not None:
                scores = scores + attn_bias
            probs = scores.softmax(dim=-1)
            out = torch.matmul(probs, v)
        elif core is not None:
            out = core(q, k, v, attn_bias, self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, scale=self.scale)
        out = out.transpose(1, 2).reshape(R, n, H * hd)
        return (packing.apply(self.proj, out) if packing is not None else self.proj(out)), probs


class SwiGLU(nn.Module):
    """``down(silu(gate(h)) · up(h))``, no biases (``LlamaMLP``)."""

    def __init__(self, C: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(C, hidden, bias=False)
        self.up_proj = nn.Linear(C, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, C, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class HARTBlock(nn.Module):
    """``AdaLNSelfAttn`` (Llama path): ``x += [γ1·]Attn(norm1(x))``; ``x += [γ2·]MLP(norm2(x))``, where ``norm`` is
    ``ln_wo_grad`` alone (``disable_aln``) or ``ln_wo_grad(x)·(1+scale)+shift`` (per-block AdaLN)."""

    def __init__(self, cfg: HARTConfig):
        super().__init__()
        C = cfg.embed_dim
        self.attn = HARTAttention(cfg)
        self.ffn = SwiGLU(C, cfg.mlp_hidden)
        self.ln_wo_grad = RMSNorm(C, cfg.norm_eps)
        self.adaln = not cfg.disable_aln
        if self.adaln:
            self.ada_lin = nn.Sequential(nn.SiLU(inplace=False), nn.Linear(C, 6 * C))

    def modulation(self, cond_R1C: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
        """``gamma1, gamma2, scale1, scale2, shift1, shift2`` each ``[R, 1, C]`` (None without AdaLN)."""
        if not self.adaln:
            return None
        C = cond_R1C.shape[-1]
        return tuple(self.ada_lin(cond_R1C).view(-1, 1, 6, C).unbind(2))

    def attn_input(self, x: torch.Tensor, mods) -> torch.Tensor:
        h = self.ln_wo_grad(x)
        return h if mods is None else h.mul(mods[2].add(1)).add(mods[4])

    def attn_output(self, out: torch.Tensor, mods) -> torch.Tensor:
        return out if mods is None else out.mul(mods[0])

    def ffn_branch(self, x: torch.Tensor, mods, packing=None) -> torch.Tensor:
        def run(t, *m):
            h = self.ln_wo_grad(t)
            if m:
                h = h.mul(m[1].add(1)).add(m[2])
            out = self.ffn(h)
            return out.mul(m[0]) if m else out

        extra = () if mods is None else (mods[1], mods[3], mods[5])
        if packing is not None:
            return packing.apply(run, x, *extra)
        return run(x, *extra)

    def forward(self, x, mods, cos, sin, attn_bias=None) -> torch.Tensor:
        q, k, v = self.attn.project_qkv(self.attn_input(x, mods), cos, sin)
        x = x + self.attn_output(self.attn.attend(q, k, v, attn_bias)[0], mods)
        return x + self.ffn_branch(x, mods)


class AdaLNBeforeHead(nn.Module):
    """``ln_wo_grad(x)·(1+scale)+shift`` with ``(scale, shift) = Linear(SiLU(c))``."""

    def __init__(self, C: int, eps: float):
        super().__init__()
        self.ln_wo_grad = RMSNorm(C, eps)
        self.ada_lin = nn.Sequential(nn.SiLU(inplace=False), nn.Linear(C, 2 * C))

    def forward(self, x_RNC: torch.Tensor, cond_R1C: torch.Tensor) -> torch.Tensor:
        scale, shift = self.ada_lin(cond_R1C).view(-1, 1, 2, x_RNC.shape[-1]).unbind(2)
        return self.ln_wo_grad(x_RNC).mul(scale.add(1)).add(shift)


class HARTTransformer(nn.Module):
    """``HARTForT2I`` without its VAE (the tokenizer lives outside, as in the official ``vae_proxy``)."""

    def __init__(self, cfg: HARTConfig):
        super().__init__()
        self.cfg = cfg
        C = cfg.embed_dim
        self.word_embed = nn.Linear(cfg.z_channels, C)
        self.context_embed = nn.Linear(cfg.context_dim, C)
        if cfg.use_context_norm:
            self.context_norm = RMSNorm(cfg.context_dim, cfg.norm_eps)
        self.lvl_embed = nn.Embedding(cfg.num_scales, C)
        self.blocks = nn.ModuleList(HARTBlock(cfg) for _ in range(cfg.depth))
        self.head_nm = AdaLNBeforeHead(C, cfg.norm_eps)
        self.head = nn.Linear(C, cfg.vocab_size)
        self.decoder_norm = RMSNorm(C, cfg.norm_eps)
        self.diffloss = DiffusionHead(cfg.z_channels, C, cfg.diff_width, cfg.diff_depth, cfg.num_sampling_steps)
        self._positions = {rule: image_positions(cfg.patch_nums, rule) for rule in ("inference", "training")}

    # ----- conditioning ------------------------------------------------------------------------------------
    def embed_context(self, context_RLc: torch.Tensor) -> torch.Tensor:
        """``sos = context_embed(context_norm(context))`` ``[R, ctx, C]``."""
        w = self.context_embed.weight
        x = context_RLc.to(device=w.device, dtype=w.dtype)
        if self.cfg.use_context_norm:
            x = self.context_norm(x)
        return self.context_embed(x)

    @staticmethod
    def pool(sos_RLC: torch.Tensor, mask_RL: torch.Tensor, mode: str) -> torch.Tensor:
        """``[R, 1, C]``: ``max`` over all context tokens (padding included) or ``avg`` = masked mean."""
        if mode == "max":
            return sos_RLC.max(dim=1, keepdim=True).values
        m = mask_RL.to(sos_RLC.dtype).unsqueeze(-1)  # [R, L, 1]
        count = m.sum(dim=1, keepdim=True).clamp(min=1)
        return (sos_RLC * m / count).sum(dim=1, keepdim=True)

    def block_condition(self, sos_RLC: torch.Tensor, mask_RL: torch.Tensor) -> torch.Tensor | None:
        """The per-block AdaLN condition (None on the release path ``disable_aln``)."""
        if self.cfg.disable_aln:
            return None
        return self.pool(sos_RLC, mask_RL, self.cfg.sep_aln_pooling_mode)

    def head_condition(self, sos_RLC: torch.Tensor) -> torch.Tensor:
        """The head's AdaLN condition: always the max over all context tokens."""
        return self.pool(sos_RLC, None, "max")

    # ----- pieces the engine calls -------------------------------------------------------------------------
    def embed_tokens(self, x_RNCv: torch.Tensor, si: int) -> torch.Tensor:
        return self.word_embed(x_RNCv.to(self.word_embed.weight.dtype)) + self.lvl_embed.weight[si]

    def head_input(self, x_RNC: torch.Tensor, head_cond_R1C: torch.Tensor) -> torch.Tensor:
        return self.head_nm(x_RNC, head_cond_R1C)

    def logits(self, x_RNC: torch.Tensor, head_cond_R1C: torch.Tensor) -> torch.Tensor:
        return self.head(self.head_input(x_RNC, head_cond_R1C)).float()

    def diffusion_condition(self, x_last_RNC: torch.Tensor, h_RNCv: torch.Tensor) -> torch.Tensor:
        """``decoder_norm(x_last + word_embed(h))``: the diffusion head's per-token condition."""
        return self.decoder_norm(x_last_RNC + self.word_embed(h_RNCv.to(self.word_embed.weight.dtype)))

    def scale_rope(self, si: int, offset_R: torch.Tensor, rule: str = "inference"):
        """``(cos, sin)`` ``[R, 1, pn², hd]`` of scale ``si ≥ 1``'s image tokens (``rule``: see
        :func:`image_positions`)."""
        rows, cols = self._positions[rule][si]
        return image_rope(rows.to(offset_R.device), cols.to(offset_R.device), offset_R, self.cfg.head_dim,
                          self.cfg.rope_base)

    # ----- teacher forcing (fixture checks) ----------------------------------------------------------------
    def forward(self, context_BLc: torch.Tensor, mask_BL: torch.Tensor, position_ids_BL: torch.Tensor,
                x_BLCv_wo_first_l: torch.Tensor, return_intermediates: bool = False):
        """Teacher-forced logits ``[B, L, V]`` (rows ``ctx−1 …``: the last context row predicts scale 0), as the
        official training forward with no prompt dropped and no last-scale token masked."""
        cfg = self.cfg
        sos = self.embed_context(context_BLc)
        B, ctx, C = sos.shape
        device = sos.device
        x = torch.cat((sos, self.word_embed(x_BLCv_wo_first_l.to(sos.dtype))), dim=1)
        level = torch.cat([torch.zeros(ctx, dtype=torch.long)]
                          + [torch.full((p * p,), si, dtype=torch.long) for si, p in enumerate(cfg.patch_nums)
                             if si > 0]).to(device)
        x = x + self.lvl_embed(level).unsqueeze(0)
        visible = level.view(-1, 1) >= level.view(1, -1)
        bias = torch.zeros(visible.shape, dtype=x.dtype, device=device).masked_fill_(~visible, float("-inf"))
        bias = bias.view(1, 1, *visible.shape)
        cos_c, sin_c = context_rope(position_ids_BL.to(device), cfg.head_dim, cfg.rope_base)
        offset = position_ids_BL[:, -1].to(device)
        img = [self.scale_rope(si, offset, "training") for si in range(1, cfg.num_scales)]
        cos = torch.cat([cos_c] + [c for c, _ in img], dim=2)
        sin = torch.cat([sin_c] + [s for _, s in img], dim=2)
        block_cond = self.block_condition(sos, mask_BL.to(device))
        inter = {"block0_input": x, "block_outputs": []}
        for block in self.blocks:
            x = block(x, block.modulation(block_cond), cos, sin, bias)
            inter["block_outputs"].append(x)
        logits = self.logits(x[:, ctx - 1:], self.head_condition(sos))
        inter["last_layer_cond"] = x[:, -cfg.patch_nums[-1] ** 2:]
        return (logits, inter) if return_intermediates else logits


# ================================================================================================================
# checkpoints
# ================================================================================================================
def check_levels(lvl_1L: torch.Tensor, cfg: HARTConfig, source: str) -> None:
    """The saved ``lvl_1L`` (level per training position) must be the config's context + schedule."""
    from .loading import CheckpointMismatchError

    expected = [0] * cfg.context_token + [si for si, p in enumerate(cfg.patch_nums) if si > 0 for _ in range(p * p)]
    got = lvl_1L.flatten().tolist()
    if got != expected:
        raise CheckpointMismatchError(
            f"{source}: lvl_1L (the level of every training position, {len(got)} entries) does not match "
            f"config.json's context_token={cfg.context_token} and patch_nums={list(cfg.patch_nums)} "
            f"({len(expected)} positions): the config and the weights are not from the same model")


def prepare_hart_state_dict(sd: Mapping[str, torch.Tensor], model: HARTTransformer, source: str = "llm"
                            ) -> dict[str, torch.Tensor]:
    """What the official loader tolerates, made explicit before a strict load: ``lvl_1L`` checked and dropped,
    ``attn_bias_for_masking`` dropped (rebuilt), missing ``zero_k_bias`` buffers filled with zeros."""
    if "lvl_1L" in sd:
        check_levels(sd["lvl_1L"], model.cfg, source)
    out = {k: v for k, v in sd.items() if k not in HART_DROPPED_BUFFERS}
    for key, value in model.state_dict().items():
        if key.endswith("zero_k_bias") and key not in out:
            out[key] = torch.zeros_like(value)
    return out


def randomize_hart_(model: HARTTransformer, seed: int = 0) -> HARTTransformer:
    """Redraw every parameter from a private generator (the fixture's rules: 2-D weights ``N/√fan_in``, head ×3,
    ``word_embed`` ×4, head AdaLN ×0.2; biases ``0.1·N`` (head AdaLN 0.02); norm weights ``1+0.1·N``;
    ``lvl_embed`` ``0.2·N``; ``scale_mul`` ``ln 4 + 0.3·N``), so every sub-layer and the diffusion head matter.
    No global RNG state is touched."""
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("scale_mul_1H11"):
                value = math.log(4.0) + 0.3 * noise
            elif name == "lvl_embed.weight":
                value = 0.2 * noise
            elif name.endswith(("ln_wo_grad.weight", "decoder_norm.weight", "context_norm.weight", "in_ln.weight")):
                value = 1 + 0.1 * noise
            elif p.ndim >= 2:
                gain = {"head.weight": 3.0, "word_embed.weight": 4.0, "head_nm.ada_lin.1.weight": 0.2}.get(name, 1.0)
                value = gain * noise / math.sqrt(p.shape[-1])
            else:
                value = (0.02 if name == "head_nm.ada_lin.1.bias" else 0.1) * noise
            p.copy_(value.to(p.dtype))
    return model
