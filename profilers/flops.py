"""Analytic FLOPs of a next-scale generation, following the tokens the loop actually computed.

What is counted
---------------
Matrix-multiply FLOPs, ``2·m·n·k`` per product (one multiply-add = 2 FLOPs), the same convention as
``torch.utils.flop_counter.FlopCounterMode`` (linear/matmul/bmm/conv/attention): element-wise work (norms,
activations, softmax, sampling, top-k/top-p) and bias additions are **not** counted. The counts follow
``GenerationResult.records``:

* per scale, rows ``R`` = ``2B`` while both guidance halves run, ``B`` after guidance stops (``record.guidance``);
  skipped scales cost nothing and append no keys;
* per block and per branch, the number of tokens actually computed (``record.kept_tokens``, in
  ``adapter.branches`` order);
* the attention of block ``l`` at scale ``k`` runs its ``n`` queries over the KV length that block has
  accumulated so far **including** this scale's keys (with pruning a block appends only its attention-branch
  kept tokens, so each block has its own length); for a block whose rows were ragged, the query-key pairs the
  engine's attention actually computed (``record.attention_pairs``: each row's valid queries over its own keys
  with ``ragged_attention="varlen"``, the padded rectangle otherwise), ``2·pairs·C`` each for scores and PV;
* attention statistics an observer read (ToProVAR's entropy, ``record.attention_stats_flops``): component
  ``attn_stats``, the matrix FLOPs of the fused or chunked pass (``var_core.engine.attention.AttentionProbe``).

VAR (family ``"var"``), per network row, ``C`` = width, ``H_m`` = MLP hidden, ``V`` = vocabulary:

=================  ======================================================  ===================================
component / op     FLOPs                                                   where
=================  ======================================================  ===================================
condition          ``2·R0·C·6C`` per block (``2·R0·C·6C`` once if shared)  AdaLN modulation, once per generation
embed              ``2·B·N·C_vae·C`` (scales ≥ 1; computed on B samples)   ``word_embed``
attn/qkv           ``2·n·C·3C``                                            ``mat_qkv``
attn/scores        ``2·n·L·C`` (all heads: ``H·2·n·L·d_head``)             QKᵀ over the L cached keys
attn/pv            ``2·n·L·C``                                             probabilities × V
attn/proj          ``2·n·C·C``                                             output projection
ffn/fc1, ffn/fc2   ``2·n·C·H_m`` each                                      MLP
head/adaln         ``2·R·C·2C``                                            ``head_nm.ada_lin`` (every scale)
head/logits        ``2·R·N·C·V``                                           ``head``
latent_update/phi  ``2·B·h·w·C_vae²·9`` (only where Phi is a conv)         quantizer Phi at full latent size
vq_decode          measured with FlopCounterMode on fake tensors           optional (``include_decode``)
=================  ======================================================  ===================================

Infinity (family ``"infinity"``, :class:`~var_core.engine.adapters.infinity_adapter.InfinityAdapter`), per
network row, ``T`` = padded text length of the run (every row is padded to the longest prompt of the batch, cond
and uncond rows together, and attention runs over the padded length with a mask — what our SDPA path computes;
the official varlen kernel would compute only each row's own tokens), ``C_t`` = text-encoder width, ``d`` = bits
per token (head ``2·d``), ``H_m`` = FFN hidden (``round(4C/256)·256``, GELU, two matrices):

=====================  ====================================================  ======================================
component / op         FLOPs                                                 where
=====================  ====================================================  ======================================
condition              ``2·R0·C·6C`` (shared AdaLN, once)                    ``shared_ada_lin``
 text_pool_kv          ``2·R0·T·C_t·2C``                                     ``text_proj_for_sos.ca.mat_kv``
 text_pool_attn        ``4·R0·T·C`` (one learned query)                      attentive pool
 text_pool_proj        ``2·R0·C·C``                                          ``text_proj_for_sos.ca.proj``
 text_proj_ca          ``2·R0·T·C_t·C + 2·R0·T·C·C``                         ``text_proj_for_ca`` (two linears)
 cross_kv              ``2·R0·T·C·2C`` per block, **once per generation**    ``ca.mat_kv`` (``Infinity.text_kv``)
embed                  ``2·B·N·d·C`` (scales ≥ 1; computed on B samples)     ``word_embed``
attn/*                 as VAR (``qkv``, ``scores``, ``pv``, ``proj``)        cosine self-attention, KV-cached
cross/q, cross/proj    ``2·n·C·C`` each                                      ``ca.mat_q``, ``ca.proj`` (kept tokens)
cross/scores, pv       ``2·n·T·C`` each                                      attention of the kept tokens to text
ffn/fc1, ffn/fc2       ``2·n·C·H_m`` each                                    MLP
head/adaln, logits     ``2·R·C·2C``, ``2·R·N·C·2d``                          ``head_nm.ada_lin``, bitwise ``head``
latent_update          0 (bit→code mapping and trilinear resampling only)
vq_decode              measured with FlopCounterMode on fake tensors         optional (``include_decode``)
=====================  ====================================================  ======================================

The text K/V: our :class:`~var_core.models.infinity.Infinity` projects the text keys/values of every block once
per generation (``text_kv`` in ``begin``) and reuses them at every scale, so the ``cross_kv`` cost sits in
``condition``. The official ``CrossAttention.forward`` recomputes ``mat_kv(ca_kv)`` in every block at every
scale: ``ArchSpec.cross_kv_per_scale=True`` counts it that way (an extra ``cross/kv`` op per block and scale,
independent of the kept tokens). The text encoder (flan-T5) is not counted (it is timed separately as
``text_encode``). ``T`` is not in the records: pass ``text_len`` to :func:`count_flops` (or
:func:`infinity_text_len` computes it from the conditions).

HART (family ``"hart"``, :class:`~var_core.engine.adapters.hart_adapter.HARTAdapter`; specs/hart.md), ``T`` =
``context_token`` (300 for HART-0.7B), ``C_c`` = context width, SwiGLU MLP (three matrices), ``W`` / ``D`` / ``K`` =
diffusion width / depth / steps:

=====================  ====================================================  ======================================
component / op         FLOPs                                                 where
=====================  ====================================================  ======================================
condition              ``2·R0·T·C_c·C`` (+ ``2·R0·C·6C`` per block, AdaLN)   ``context_embed`` (+ ``ada_lin``)
embed                  as VAR (scales ≥ 1)                                   ``word_embed``
attn/*                 as VAR; scale 0 runs all ``T`` context tokens, and    Llama attention, KV-cached
                       every later scale attends to ``T − 1`` more keys
                       (``ArchSpec.prefix_len``)
ffn/fc1_gate, fc2      ``2·n·C·2H_m``, ``2·n·H_m·C``                         gate + up, down
head                   as VAR (scale 0: the one sampled context row)         ``head_nm.ada_lin``, ``head``
latent_update/phi      as VAR for scales < N−1; 0 at the last (no Phi)
diffusion              ``K × [2·n·(256W + W²) + 2·n·C·W + 2·n·C_vae·W        the residual diffusion head on
                       + D·(2·n·3W² + 4·n·W²) + 2·n·2W² + 2·n·W·2C_vae]``   ``n = R·l_N`` rows when guided (the
                       + ``2·R·l_N·C_vae·C`` (condition)                     net runs on ``[x_c ; x_c]``), ``B·l_N``
                                                                             unguided
=====================  ====================================================  ======================================

Arch-only: :func:`hart_arch` (e.g. ``hart_arch(HART_0P7B)``) and :func:`dense_records`.

Other families plug in through :func:`register_family_formulas` (per-branch formulas keyed by
``adapter.family``) and ``ARCH_BUILDERS``. Arch-only reports (no model, no run): :func:`infinity_arch` /
:func:`var_arch` and :func:`dense_records` (a synthetic dense record list for :func:`count_record_flops`).

Also here: :func:`gflops_vs_resolution`, the theoretical next-scale vs next-token (raster AR with a KV cache)
comparison of the papers' Figure 2b (plot: :func:`profilers.breakdown.plot_gflops_vs_resolution`), and the CPU
attention FLOP formula for ``FlopCounterMode`` (:func:`register_cpu_sdpa_flop_formula`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch

from var_core.engine.context import GuidanceMode, ScaleRecord

__all__ = [
    "ArchSpec", "FamilyFormulas", "FlopReport", "FlopRow", "FAMILY_FORMULAS", "arch_from_adapter",
    "count_flops", "count_record_flops", "decode_flops", "flop_counter_mode", "gflops_vs_resolution",
    "measure_flops", "next_scale_schedule", "next_scale_transformer_flops", "next_token_transformer_flops",
    "register_cpu_sdpa_flop_formula", "register_family_formulas", "VAR_PATCH_NUMS_256", "VAR_PATCH_NUMS_512",
    "INFINITY_SCHEDULE_1024", "dense_records", "hart_arch", "hart_diffusion_ops", "infinity_arch", "infinity_text_len",
    "var_arch",
]

VAR_PATCH_NUMS_256 = (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
VAR_PATCH_NUMS_512 = (1, 2, 3, 4, 6, 9, 13, 18, 24, 32)
INFINITY_SCHEDULE_1024 = (1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)


# ----- architecture description -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ArchSpec:
    """The sizes FLOPs and memory depend on (family-generic; VAR fills it from its config)."""

    family: str
    depth: int
    embed_dim: int  # C
    num_heads: int
    mlp_hidden: int  # H_m
    head_out: int  # V (VAR vocabulary) or 2·d (Infinity bitwise head)
    latent_channels: int  # the embedding input width (VAR C_vae, Infinity d)
    scale_hw: tuple[tuple[int, int], ...]
    latent_hw: tuple[int, int]  # full latent resolution (where the latent update runs)
    branches: tuple[str, ...] = ("attn", "ffn")
    shared_aln: bool = False
    phi_conv: tuple[bool, ...] = ()  # VAR: per scale, whether the quantizer's Phi is a 3x3 conv
    text_len: int = 0  # Infinity: text tokens seen by cross-attention (padded length of the run)
    cross_kv_per_scale: bool = True  # Infinity: text K/V recomputed at every scale (official code) or once
    text_channels: int = 0  # Infinity: text-encoder width C_t (0: text pooling / projection not counted)
    mlp_gated: bool = False  # SwiGLU-style MLP (three matrices)
    param_bytes: int = 4  # element size of weights / activations (fp32 = 4, bf16 = 2)
    # HART: the first scale runs the prefix_len + 1 context tokens (the loop's records count the 1 it samples from)
    # and their keys stay in the cache; context_dim feeds context_embed; the residual diffusion head after the last
    # scale (diff_steps = 0: not run)
    prefix_len: int = 0
    context_dim: int = 0
    per_block_aln: bool = False  # HART's AdaLN variant (disable_aln=False): a 6C modulation per block
    diff_width: int = 0
    diff_depth: int = 0
    diff_steps: int = 0
    soft_codes: bool = False  # HART more_smooth: the latent gets softmax(·) @ codebook (2·B·N·V·C_vae per scale)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def total_tokens(self) -> int:
        return sum(h * w for h, w in self.scale_hw)


def _var_arch(adapter) -> ArchSpec:
    cfg = adapter.cfg
    quantize = adapter.vae.quantize
    phi_conv = tuple(isinstance(quantize.quant_resi[quantize.phi_index(si)], torch.nn.Conv2d)
                     for si in range(len(cfg.patch_nums)))
    param = next(adapter.var.parameters())
    p = cfg.patch_nums[-1]
    return ArchSpec(
        family="var", depth=cfg.depth, embed_dim=cfg.embed_dim, num_heads=cfg.num_heads,
        mlp_hidden=cfg.mlp_hidden, head_out=cfg.vocab_size, latent_channels=cfg.z_channels,
        scale_hw=tuple(adapter.scale_hw), latent_hw=(p, p), branches=tuple(adapter.branches),
        shared_aln=cfg.shared_aln, phi_conv=phi_conv, param_bytes=param.element_size(),
    )


def _infinity_arch(adapter) -> ArchSpec:
    """What our Infinity code computes: text K/V once per generation (``cross_kv_per_scale=False``);
    ``text_len`` is left 0 (a property of the run, not of the model: pass it to :func:`count_flops`)."""
    cfg = adapter.cfg
    _, H, W = adapter.vae_schedule[-1]
    return infinity_arch(cfg, adapter.scale_hw, text_len=0, latent_hw=(H, W), branches=tuple(adapter.branches),
                         param_bytes=adapter.model.head.weight.element_size())


def infinity_arch(cfg, scale_hw, text_len: int = 0, latent_hw: tuple[int, int] | None = None,
                  branches: tuple[str, ...] = ("attn", "cross", "ffn"), cross_kv_per_scale: bool = False,
                  param_bytes: int = 4) -> ArchSpec:
    """:class:`ArchSpec` of an Infinity architecture without building it (``cfg``: an
    :class:`~var_core.models.infinity.InfinityConfig`, e.g. ``INFINITY_2B``; ``scale_hw``: the ``(h, w)`` per scale).
    ``latent_hw`` defaults to the last scale (×2 with the 8B's spatial patchify)."""
    scale_hw = tuple(tuple(int(v) for v in hw[-2:]) for hw in scale_hw)
    if latent_hw is None:
        f = 2 if getattr(cfg, "apply_spatial_patchify", False) else 1
        latent_hw = (f * scale_hw[-1][0], f * scale_hw[-1][1])
    return ArchSpec(
        family="infinity", depth=cfg.depth, embed_dim=cfg.embed_dim, num_heads=cfg.num_heads,
        mlp_hidden=cfg.ffn_hidden, head_out=cfg.vocab_size, latent_channels=cfg.d_vae, scale_hw=scale_hw,
        latent_hw=tuple(latent_hw), branches=tuple(branches), shared_aln=True, text_len=int(text_len),
        cross_kv_per_scale=cross_kv_per_scale, text_channels=cfg.text_channels, param_bytes=param_bytes,
    )


def var_arch(cfg, param_bytes: int = 4, phi_conv: tuple[bool, ...] = ()) -> ArchSpec:
    """:class:`ArchSpec` of a VAR architecture without building it (``cfg``: a
    :class:`~var_core.models.var.VARConfig`, e.g. ``official_var_config(30)``). ``phi_conv`` empty: every scale's
    Phi is a 3×3 conv (the official VQVAE with ``quant_resi = 0.5``)."""
    p = cfg.patch_nums[-1]
    return ArchSpec(
        family="var", depth=cfg.depth, embed_dim=cfg.embed_dim, num_heads=cfg.num_heads,
        mlp_hidden=cfg.mlp_hidden, head_out=cfg.vocab_size, latent_channels=cfg.z_channels,
        scale_hw=tuple((q, q) for q in cfg.patch_nums), latent_hw=(p, p), shared_aln=cfg.shared_aln,
        phi_conv=tuple(phi_conv), param_bytes=param_bytes,
    )


def dense_records(scale_hw, guidance: GuidanceMode = GuidanceMode.BOTH) -> list[ScaleRecord]:
    """Synthetic records of a dense generation (every token of every scale, ``guidance`` rows throughout): feed
    them to :func:`count_record_flops` for an arch-only FLOP report (no model run)."""
    return [ScaleRecord(si, (int(hw[-2]), int(hw[-1])), skipped=False, guidance=guidance)
            for si, hw in enumerate(scale_hw)]


def hart_arch(cfg, tokenizer_phi_conv: tuple[bool, ...] = (), diff_steps: int | None = None,
              param_bytes: int = 4, soft_codes: bool = False) -> ArchSpec:
    """:class:`ArchSpec` of a HART architecture without building it (``cfg``: a
    :class:`~var_core.models.hart.HARTConfig`, e.g. ``HART_0P7B``). ``diff_steps``: diffusion steps (default the
    config's ``num_sampling_steps``; 0 = the discrete-only image). ``tokenizer_phi_conv`` empty: every scale but the
    last applies a 3×3 Phi conv (``quant_resi = 0.5``; HART adds the last scale without Phi)."""
    N = len(cfg.patch_nums)
    phi = tuple(tokenizer_phi_conv) or tuple(si < N - 1 for si in range(N))
    p = cfg.patch_nums[-1]
    return ArchSpec(
        family="hart", depth=cfg.depth, embed_dim=cfg.embed_dim, num_heads=cfg.num_heads,
        mlp_hidden=cfg.mlp_hidden, head_out=cfg.vocab_size, latent_channels=cfg.z_channels,
        scale_hw=tuple((q, q) for q in cfg.patch_nums), latent_hw=(p, p), phi_conv=phi, mlp_gated=True,
        param_bytes=param_bytes, prefix_len=cfg.context_token - 1, context_dim=cfg.context_dim,
        per_block_aln=not cfg.disable_aln, diff_width=cfg.diff_width, diff_depth=cfg.diff_depth,
        diff_steps=int(cfg.num_sampling_steps if diff_steps is None else diff_steps), soft_codes=soft_codes,
    )


def _hart_arch(adapter) -> ArchSpec:
    """What our HART code computes. The diffusion steps are those of the adapter's latest generation
    (``adapter.last_settings``; before any, the checkpoint's)."""
    quantize = adapter.tokenizer.quantize
    N = adapter.num_scales
    phi = tuple(si < N - 1 and isinstance(quantize.quant_resi[quantize.phi_index(si)], torch.nn.Conv2d)
                for si in range(N))
    settings = getattr(adapter, "last_settings", None) or {}
    steps = (settings.get("diffusion_steps") if settings.get("diffusion", True) else 0) if settings else None
    return hart_arch(adapter.cfg, phi, steps, adapter.model.head.weight.element_size(),
                     soft_codes=bool(settings.get("soft_codes", False)))


ARCH_BUILDERS: dict[str, Callable] = {"var": _var_arch, "infinity": _infinity_arch, "hart": _hart_arch}


def arch_from_adapter(adapter, **overrides) -> ArchSpec:
    """:class:`ArchSpec` of an engine adapter (families registered in ``ARCH_BUILDERS``); ``overrides`` replace
    fields (e.g. ``text_len=…`` for Infinity, ``cross_kv_per_scale=True`` for the official text K/V cost)."""
    try:
        builder = ARCH_BUILDERS[adapter.family]
    except KeyError:
        raise ValueError(
            f"no ArchSpec builder for model family {adapter.family!r} (known: {sorted(ARCH_BUILDERS)}); "
            f"construct profilers.flops.ArchSpec(...) explicitly and pass it instead of the adapter"
        ) from None
    arch = builder(adapter)
    return dataclasses.replace(arch, **overrides) if overrides else arch


def infinity_text_len(adapter, conditions, cfg: float | None = None) -> int:
    """Padded text length ``T`` that an Infinity run over ``conditions`` attends to: the longest prompt of the
    conditional rows and, with guidance (``cfg != 1``), of the unconditional / negative rows too.

    Prompts (strings or class labels) are encoded here (the text encoder runs once); pass pre-encoded
    :class:`~var_core.models.text_encoder.TextTokens` to avoid it."""
    cond, negative = adapter._split_conditions(conditions)
    T = int(cond.features.shape[1])
    guided = (cfg if cfg is not None else adapter.default_sampling.cfg) != 1
    if guided and negative is not None:
        T = max(T, int(negative.features.shape[1]))
    return T


# ----- per-family formulas ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FamilyFormulas:
    """FLOP formulas of one family; each returns ``{op: flops}``.

    * ``branch(arch, branch, rows, n, kv_len)`` — one residual branch of one block on ``n`` tokens per row;
      ``kv_len`` is the block's self-attention KV length after appending this scale's keys.
    * ``head(arch, rows, n)`` — the logits head on ``n`` tokens per row (also used for the logit lens).
    * ``embed(arch, scale, samples, n)`` — building scale ``scale``'s input (VAR: computed on ``B`` samples).
    * ``condition(arch, rows)`` — once per generation (AdaLN modulations, text projections, ...).
    * ``latent_update(arch, scale, samples)`` — accumulating the sampled scale into the latent.
    * ``finish(arch, record, samples)`` — after the last scale, when it ran (HART's diffusion head); optional.
    """

    branch: Callable[[ArchSpec, str, int, int, int], dict[str, int]]
    head: Callable[[ArchSpec, int, int], dict[str, int]]
    embed: Callable[[ArchSpec, int, int, int], dict[str, int]]
    condition: Callable[[ArchSpec, int], dict[str, int]]
    latent_update: Callable[[ArchSpec, int, int], dict[str, int]]
    finish: Callable[[ArchSpec, ScaleRecord, int], dict[str, int]] | None = None


# ops that stay on the padded row layout when a ragged selection's per-token work is packed (attention scores and
# values; the per-scale text K/V projection of ``cross_kv_per_scale``, which is per row, not per token)
PADDED_OPS = frozenset({"scores", "pv", "kv"})


def _self_attention(arch: ArchSpec, rows: int, n: int, kv_len: int) -> dict[str, int]:
    C = arch.embed_dim
    return {
        "qkv": 2 * rows * n * C * 3 * C,
        "scores": 2 * rows * n * kv_len * C,
        "pv": 2 * rows * n * kv_len * C,
        "proj": 2 * rows * n * C * C,
    }


def _mlp(arch: ArchSpec, rows: int, n: int) -> dict[str, int]:
    C, Hm = arch.embed_dim, arch.mlp_hidden
    if arch.mlp_gated:
        return {"fc1_gate": 2 * rows * n * C * 2 * Hm, "fc2": 2 * rows * n * Hm * C}
    return {"fc1": 2 * rows * n * C * Hm, "fc2": 2 * rows * n * Hm * C}


def _var_branch(arch: ArchSpec, branch: str, rows: int, n: int, kv_len: int) -> dict[str, int]:
    if branch == "attn":
        return _self_attention(arch, rows, n, kv_len)
    if branch == "ffn":
        return _mlp(arch, rows, n)
    raise ValueError(f"VAR blocks have branches 'attn' and 'ffn', not {branch!r}")


def _var_head(arch: ArchSpec, rows: int, n: int) -> dict[str, int]:
    C = arch.embed_dim
    return {"adaln": 2 * rows * C * 2 * C, "logits": 2 * rows * n * C * arch.head_out}


def _var_embed(arch: ArchSpec, scale: int, samples: int, n: int) -> dict[str, int]:
    if scale == 0:
        return {}  # class embedding + position embedding: additions only
    return {"word_embed": 2 * samples * n * arch.latent_channels * arch.embed_dim}


def _var_condition(arch: ArchSpec, rows: int) -> dict[str, int]:
    C = arch.embed_dim
    per = 2 * rows * C * 6 * C
    return {"adaln_modulation": per if arch.shared_aln else per * arch.depth}


def _var_latent_update(arch: ArchSpec, scale: int, samples: int) -> dict[str, int]:
    if arch.phi_conv and not arch.phi_conv[scale]:
        return {}
    h, w = arch.latent_hw
    c = arch.latent_channels
    return {"phi_conv": 2 * samples * h * w * c * c * 9}


def _infinity_branch(arch: ArchSpec, branch: str, rows: int, n: int, kv_len: int) -> dict[str, int]:
    """Infinity: self-attn as VAR; cross-attn of the ``n`` kept tokens to ``text_len`` text tokens (q and output
    projections on the ``n`` tokens; the text K/V projection here only with ``cross_kv_per_scale``)."""
    C, T = arch.embed_dim, arch.text_len
    if branch == "attn":
        return _self_attention(arch, rows, n, kv_len)
    if branch == "cross":
        ops = {"q": 2 * rows * n * C * C, "scores": 2 * rows * n * T * C, "pv": 2 * rows * n * T * C,
               "proj": 2 * rows * n * C * C}
        if arch.cross_kv_per_scale:
            ops["kv"] = 2 * rows * T * C * 2 * C
        return ops
    if branch == "ffn":
        return _mlp(arch, rows, n)
    raise ValueError(f"Infinity blocks have branches 'attn', 'cross' and 'ffn', not {branch!r}")


def _infinity_condition(arch: ArchSpec, rows: int) -> dict[str, int]:
    C, T, Ct = arch.embed_dim, arch.text_len, arch.text_channels
    ops = {"adaln_modulation": 2 * rows * C * 6 * C * (1 if arch.shared_aln else arch.depth)}
    if Ct:  # text conditioning: attentive pool (start token / AdaLN condition) and the cross-attention source
        ops["text_pool_kv"] = 2 * rows * T * Ct * 2 * C
        ops["text_pool_attn"] = 4 * rows * T * C  # one learned query per row over T keys, all heads
        ops["text_pool_proj"] = 2 * rows * C * C
        ops["text_proj_ca"] = 2 * rows * T * Ct * C + 2 * rows * T * C * C
    if not arch.cross_kv_per_scale:
        ops["cross_kv"] = 2 * rows * T * C * 2 * C * arch.depth
    return ops


def _hart_branch(arch: ArchSpec, branch: str, rows: int, n: int, kv_len: int) -> dict[str, int]:
    if branch == "attn":
        return _self_attention(arch, rows, n, kv_len)
    if branch == "ffn":
        return _mlp(arch, rows, n)  # SwiGLU: gate and up (2·C·2H_m), down
    raise ValueError(f"HART blocks have branches 'attn' and 'ffn', not {branch!r}")


def _hart_condition(arch: ArchSpec, rows: int) -> dict[str, int]:
    C, T = arch.embed_dim, arch.prefix_len + 1
    ops = {"context_embed": 2 * rows * T * arch.context_dim * C}
    if arch.per_block_aln:
        ops["adaln_modulation"] = 2 * rows * C * 6 * C * arch.depth
    return ops


def _hart_latent_update(arch: ArchSpec, scale: int, samples: int) -> dict[str, int]:
    ops = {}
    if arch.soft_codes:  # more_smooth: the Gumbel-softmax mixture of code vectors
        h, w = arch.scale_hw[scale]
        ops["soft_codes"] = 2 * samples * h * w * arch.head_out * arch.latent_channels
    if scale < len(arch.scale_hw) - 1:  # the hybrid rule: the last scale's codes are added without Phi
        ops.update(_var_latent_update(arch, scale, samples))
    return ops


def hart_diffusion_ops(arch: ArchSpec, rows: int, tokens: int, condition_rows: int | None = None
                       ) -> dict[str, int]:
    """The residual diffusion head: ``rows`` network rows (2B when guided: the net runs on ``[x_c ; x_c]`` with
    both conditions) of ``tokens`` each, ``diff_steps`` steps; the condition ``word_embed`` on
    ``condition_rows`` rows (default ``rows``)."""
    W, D, C, c = arch.diff_width, arch.diff_depth, arch.embed_dim, arch.latent_channels
    n = rows * tokens
    per_step = {
        "time_embed": 2 * n * (256 * W + W * W),
        "cond_embed": 2 * n * C * W,
        "input_proj": 2 * n * c * W,
        "res_adaln": 2 * n * W * 3 * W * D,
        "res_mlp": 2 * n * 2 * W * W * D,
        "final": 2 * n * W * 2 * W + 2 * n * W * 2 * c,
    }
    ops = {op: v * arch.diff_steps for op, v in per_step.items()}
    ops["condition_word_embed"] = 2 * (condition_rows if condition_rows is not None else rows) * tokens * c * C
    return ops


def _hart_finish(arch: ArchSpec, record: ScaleRecord, samples: int) -> dict[str, int]:
    if arch.diff_steps <= 0:
        return {}
    h, w = record.hw
    R = _rows_for(record.guidance, samples)
    net_rows = R if record.guidance is GuidanceMode.BOTH else samples  # unguided: the computed half only
    return hart_diffusion_ops(arch, net_rows, h * w, condition_rows=R)


FAMILY_FORMULAS: dict[str, FamilyFormulas] = {
    "var": FamilyFormulas(_var_branch, _var_head, _var_embed, _var_condition, _var_latent_update),
    "infinity": FamilyFormulas(_infinity_branch, _var_head, _var_embed, _infinity_condition,
                               lambda arch, scale, samples: {}),
    "hart": FamilyFormulas(_hart_branch, _var_head, _var_embed, _hart_condition, _hart_latent_update, _hart_finish),
}


def register_family_formulas(family: str, formulas: FamilyFormulas, replace_existing: bool = False) -> None:
    """Add the FLOP formulas of a model family (refuses to overwrite unless ``replace_existing``)."""
    if family in FAMILY_FORMULAS and not replace_existing:
        raise ValueError(f"FLOP formulas for family {family!r} already registered")
    FAMILY_FORMULAS[family] = formulas


# ----- the report -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FlopRow:
    scale: int  # -1: once per generation (condition, vq_decode)
    block: int  # -1: not inside a block
    component: str  # condition, embed, attn, cross, ffn, lens, head, latent_update, vq_decode
    op: str
    rows: int  # network rows (2B with both guidance halves) or samples (B) where computed per sample
    tokens: int  # tokens computed per row (queries)
    kv_len: int  # attention keys per query (0 where no attention)
    flops: int


@dataclass
class FlopReport:
    """Analytic FLOPs of one generation, one :class:`FlopRow` per (scale, block, component, op)."""

    arch: ArchSpec
    rows: list[FlopRow] = field(default_factory=list)

    def add(self, scale: int, block: int, component: str, ops: Mapping[str, int], rows: int, tokens: int,
            kv_len: int = 0) -> None:
        for op, flops in ops.items():
            self.rows.append(FlopRow(scale, block, component, op, rows, tokens, kv_len, int(flops)))

    @property
    def total(self) -> int:
        return sum(r.flops for r in self.rows)

    @property
    def gflops(self) -> float:
        return self.total / 1e9

    def total_for(self, components: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> int:
        keep = None if components is None else set(components)
        skip = set(exclude)
        return sum(r.flops for r in self.rows
                   if (keep is None or r.component in keep) and r.component not in skip)

    def frame(self):
        import pandas as pd

        return pd.DataFrame([r.__dict__ for r in self.rows], columns=list(FlopRow.__dataclass_fields__))

    def per_scale(self, unit: float = 1e9):
        """Scale × component pivot (GFLOPs by default)."""
        frame = self.frame()
        table = frame.pivot_table(index="scale", columns="component", values="flops", aggfunc="sum",
                                  fill_value=0) / unit
        table["total"] = table.sum(axis=1)
        return table

    def per_block(self, unit: float = 1e9):
        """Block × component pivot summed over scales (block rows only)."""
        frame = self.frame()
        frame = frame[frame["block"] >= 0]
        return frame.pivot_table(index="block", columns="component", values="flops", aggfunc="sum",
                                 fill_value=0) / unit

    def per_scale_block(self, unit: float = 1e9):
        """Block × scale matrix (heat-map data)."""
        frame = self.frame()
        frame = frame[frame["block"] >= 0]
        return frame.pivot_table(index="block", columns="scale", values="flops", aggfunc="sum",
                                 fill_value=0) / unit

    def per_op(self, unit: float = 1e9):
        frame = self.frame()
        return frame.groupby(["component", "op"])["flops"].sum() / unit


def _rows_for(guidance: GuidanceMode, batch_size: int) -> int:
    return batch_size * (2 if guidance is GuidanceMode.BOTH else 1)


def count_record_flops(
    arch: ArchSpec,
    records: Sequence[ScaleRecord],
    batch_size: int,
    initial_guidance: GuidanceMode | None = None,
    lens_blocks: Mapping[int, Iterable[int]] | None = None,
    formulas: FamilyFormulas | None = None,
) -> FlopReport:
    """FLOPs of a generation from its per-scale records.

    Args:
        batch_size: samples ``B``.
        initial_guidance: the row layout the conditions were encoded with (default: the first record's);
            sets the rows of the once-per-generation ``condition`` cost.
        lens_blocks: scale → blocks whose output went through the head on all ``R`` rows (logit lens); default:
            each record's ``lens_rows`` (block, rows the lens actually projected), as the loop ran it.
        formulas: override the family formulas (default ``FAMILY_FORMULAS[arch.family]``).
    """
    formulas = formulas or FAMILY_FORMULAS[arch.family]
    report = FlopReport(arch)
    if not records:
        return report
    guidance0 = initial_guidance or records[0].guidance
    rows0 = _rows_for(guidance0, batch_size)
    report.add(-1, -1, "condition", formulas.condition(arch, rows0), rows0, 1)
    try:
        attn_index = arch.branches.index("attn")
    except ValueError:
        attn_index = None
    kv_len = [arch.prefix_len] * arch.depth  # HART: the context tokens other than the sampled one
    for record in records:
        if record.skipped:
            continue
        si = record.scale_index
        h, w = record.hw
        N = h * w
        R = _rows_for(record.guidance, batch_size)
        report.add(si, -1, "embed", formulas.embed(arch, si, batch_size, N), batch_size, N)
        kept = record.kept_tokens or tuple((N,) * len(arch.branches) for _ in range(arch.depth))
        if len(kept) != arch.depth:
            raise ValueError(f"scale {si}: {len(kept)} kept-token entries for {arch.depth} blocks")
        for block, counts in enumerate(kept):
            if attn_index is not None:
                kv_len[block] += counts[attn_index]
                if record.attention_lengths and record.attention_lengths[block] is not None:
                    kv_len[block] = record.attention_lengths[block]  # a KV policy evicted: the kept keys
            packed = record.packed_tokens[block] if record.packed_tokens else (None,) * len(counts)
            if si == 0 and arch.prefix_len:  # the first scale runs every context token
                counts = tuple(n + arch.prefix_len for n in counts)
            pairs = record.attention_pairs[block] if record.attention_pairs else None
            for branch, n, total in zip(arch.branches, counts, packed):
                L = kv_len[block] if branch == "attn" else (arch.text_len if branch == "cross" else 0)
                ops = formulas.branch(arch, branch, R, n, kv_len[block])
                if total is not None:  # per-token ops ran on the valid tokens only; attention on the padded rows
                    per_token = formulas.branch(arch, branch, 1, total, kv_len[block])
                    ops = {op: v if op in PADDED_OPS else per_token[op] for op, v in ops.items()}
                if branch == "attn" and pairs is not None:  # ragged rows: the query-key pairs attention computed
                    ops.update(scores=2 * pairs * arch.embed_dim, pv=2 * pairs * arch.embed_dim)
                report.add(si, block, "prefill" if record.teacher_forced else branch, ops, R, n, L)
        for block, stats in enumerate(record.attention_stats_flops):
            if stats:  # what an observer's attention statistics cost (AttentionProbe.flops)
                report.add(si, block, "attn_stats", {"qk": stats}, R, kept[block][attn_index or 0], kv_len[block])
        if record.teacher_forced:  # a refiner's prefill pass (engine.switch): blocks only, no head, no sampling
            continue
        lens = ([(block, R) for block in sorted(lens_blocks.get(si, ()))] if lens_blocks is not None
                else record.lens_rows)
        for block, rows in lens:
            if rows:
                report.add(si, block, "lens", formulas.head(arch, rows, N), rows, N)
        report.add(si, -1, "head", formulas.head(arch, R, N), R, N)
        report.add(si, -1, "latent_update", formulas.latent_update(arch, si, batch_size), batch_size, N)
        if formulas.finish is not None and si == len(arch.scale_hw) - 1:
            ops = formulas.finish(arch, record, batch_size)
            if ops:
                report.add(si, -1, "diffusion", ops, _rows_for(record.guidance, batch_size), N)
    return report


def count_flops(adapter_or_arch, result, batch_size: int | None = None, include_decode: bool = False,
                initial_guidance: GuidanceMode | None = None,
                lens_blocks: Mapping[int, Iterable[int]] | None = None, text_len: int | None = None) -> FlopReport:
    """FLOPs of a finished ``generate()`` call (``result``: its ``GenerationResult``).

    ``adapter_or_arch``: the engine adapter (its :class:`ArchSpec` is derived) or an :class:`ArchSpec`.
    ``include_decode`` adds the VQ decoder's FLOPs, measured with ``FlopCounterMode`` on fake tensors (needs
    the adapter). ``text_len`` (Infinity): the run's padded text length; default: the ``context_length`` the
    result recorded (see also :func:`infinity_text_len`).
    """
    arch = adapter_or_arch if isinstance(adapter_or_arch, ArchSpec) else arch_from_adapter(adapter_or_arch)
    if text_len is None:
        text_len = getattr(result, "context_length", None)
    if text_len is not None:
        arch = dataclasses.replace(arch, text_len=int(text_len))
    if "cross" in arch.branches and arch.text_len <= 0:
        raise ValueError(
            "Infinity FLOPs depend on the run's text length: pass text_len=... (the padded prompt length, e.g. "
            "profilers.flops.infinity_text_len(adapter, conditions) or TextTokens.features.shape[1])"
        )
    if batch_size is None:
        batch_size = int(result.latent.shape[0])
    refiner = getattr(result, "refiner", None)
    if refiner is None:
        report = count_record_flops(arch, result.records, batch_size, initial_guidance, lens_blocks)
    else:  # two models (engine.switch): the drafter's scales on its arch, the refiner's prefill + scales on its own
        at = int(result.switch_scale)
        arch_r = arch_from_adapter(refiner)
        if arch.text_len:
            arch_r = dataclasses.replace(arch_r, text_len=arch.text_len)
        report = count_record_flops(arch, [r for r in result.records if r.scale_index < at], batch_size,
                                    initial_guidance, lens_blocks)
        report.rows.extend(count_record_flops(arch_r, [*result.prefill, *(r for r in result.records
                                                                          if r.scale_index >= at)],
                                              batch_size, initial_guidance, lens_blocks).rows)
    if include_decode:
        if isinstance(adapter_or_arch, ArchSpec):
            raise ValueError("include_decode needs the adapter (the decoder is measured, not derived)")
        report.add(-1, -1, "vq_decode", {"decoder": decode_flops(adapter_or_arch, batch_size)}, batch_size,
                   arch.latent_hw[0] * arch.latent_hw[1])
    return report


# ----- FlopCounterMode support ------------------------------------------------------------------------------
def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def register_cpu_sdpa_flop_formula() -> bool:
    """Teach ``FlopCounterMode`` the CPU fused attention op (it counts 0 for it otherwise).

    On CPU, ``F.scaled_dot_product_attention`` dispatches to ``aten._scaled_dot_product_flash_attention_for_cpu``,
    which has no formula in torch's registry. This registers PyTorch's own ``sdpa_flop_count`` for it
    (QKᵀ + PV, ``4·b·h·s_q·s_k·d``) through ``torch.utils.flop_counter.register_flop_formula``. Idempotent;
    returns True when it registered now. The registry is process-wide, but the entry only adds a count that
    was missing (no existing formula changes).
    """
    from torch.utils import flop_counter

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or op in flop_counter.flop_registry:
        return False
    flop_counter.register_flop_formula([op])(_cpu_sdpa_flop)
    return True


def flop_counter_mode(display: bool = False):
    """A ``FlopCounterMode`` that also counts CPU attention (see :func:`register_cpu_sdpa_flop_formula`)."""
    from torch.utils.flop_counter import FlopCounterMode

    register_cpu_sdpa_flop_formula()
    return FlopCounterMode(display=display)


def measure_flops(fn: Callable[[], object]) -> tuple[int, dict[str, int]]:
    """Run ``fn()`` under :func:`flop_counter_mode`; returns (total, {op name: flops})."""
    with flop_counter_mode() as counter:
        fn()
    per_op = {str(op): int(v) for op, v in counter.get_flop_counts().get("Global", {}).items()}
    return int(counter.get_total_flops()), per_op


DECODE_FLOPS: dict[str, Callable] = {}


def _var_decode_flops(adapter, batch_size: int) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = adapter.cfg
    p = cfg.patch_nums[-1]
    with flop_counter_mode() as counter, FakeTensorMode(allow_non_fake_inputs=True):
        f_hat = torch.empty(batch_size, cfg.z_channels, p, p, device=adapter.device)
        adapter.vae.fhat_to_img(f_hat)
    return int(counter.get_total_flops())


DECODE_FLOPS["var"] = _var_decode_flops


def _infinity_decode_flops(adapter, batch_size: int) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, H, W = adapter.vae_schedule[-1]
    with flop_counter_mode() as counter, FakeTensorMode(allow_non_fake_inputs=True):
        codes = torch.empty(batch_size, adapter.vae.codebook_dim, H, W, device=adapter.device)
        adapter.vae.decode(codes)
    return int(counter.get_total_flops())


DECODE_FLOPS["infinity"] = _infinity_decode_flops


def _hart_decode_flops(adapter, batch_size: int) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = adapter.cfg.patch_nums[-1]
    with flop_counter_mode() as counter, FakeTensorMode(allow_non_fake_inputs=True):
        f_hat = torch.empty(batch_size, adapter.cfg.z_channels, p, p, device=adapter.device)
        adapter.tokenizer.fhat_to_img(f_hat)
    return int(counter.get_total_flops())


DECODE_FLOPS["hart"] = _hart_decode_flops


def decode_flops(adapter, batch_size: int) -> int:
    """The VQ decoder's FLOPs for ``batch_size`` images, counted by ``FlopCounterMode`` on fake tensors
    (shapes only: nothing is computed, so it is cheap even for the official VQVAE)."""
    try:
        fn = DECODE_FLOPS[adapter.family]
    except KeyError:
        raise ValueError(f"no decoder FLOP counter for family {adapter.family!r}") from None
    return fn(adapter, batch_size)


# ----- next-scale vs next-token (Figure 2b) -------------------------------------------------------------------
def next_scale_schedule(side: int) -> tuple[int, ...]:
    """Scale sides ending at ``side`` latent tokens per edge.

    The published schedules for 16 (VAR 256 px), 32 (VAR 512 px) and 64 (Infinity 1024 px); for other sides
    a *reconstruction*: ``K = round(2.5·log2(side))`` sides spaced geometrically from 1 to ``side`` (rounded,
    made strictly increasing). Pass an explicit schedule to the FLOP functions to use another rule.
    """
    known = {16: VAR_PATCH_NUMS_256, 32: VAR_PATCH_NUMS_512, 64: INFINITY_SCHEDULE_1024}
    if side in known:
        return known[side]
    if side < 1:
        raise ValueError(f"side must be >= 1, got {side}")
    if side == 1:
        return (1,)
    K = max(2, round(2.5 * math.log2(side)))
    sides: list[int] = []
    for k in range(K):
        p = max(1, round(side ** (k / (K - 1))))
        if sides and p <= sides[-1]:
            p = sides[-1] + 1
        sides.append(min(p, side))
        if sides[-1] == side:
            break
    sides[-1] = side
    return tuple(sides)


def _per_token_linear(embed_dim: int, mlp_hidden: int) -> int:
    """Linear FLOPs of one token through one block: qkv (3C²) + proj (C²) + MLP (2·C·H_m), times 2."""
    return 2 * (4 * embed_dim * embed_dim + 2 * embed_dim * mlp_hidden)


def next_scale_transformer_flops(schedule: Sequence[int], depth: int, embed_dim: int, mlp_hidden: int,
                                 vocab: int, rows: int = 1) -> int:
    """Dense next-scale generation: scale ``k`` computes ``N_k = p_k²`` queries over ``L_k = Σ_{j≤k} N_j`` keys
    in every block, then the head on its ``N_k`` tokens."""
    total, L = 0, 0
    linear = _per_token_linear(embed_dim, mlp_hidden)
    for p in schedule:
        N = p * p
        L += N
        total += depth * (N * linear + 4 * N * L * embed_dim) + 2 * N * embed_dim * vocab
    return total * rows


def next_token_transformer_flops(num_tokens: int, depth: int, embed_dim: int, mlp_hidden: int, vocab: int,
                                 rows: int = 1) -> int:
    """Raster-order next-token generation with a KV cache: step ``t`` (1-based) computes one query over ``t``
    keys in every block, then the head on that token: ``Σ_t depth·(linear + 4·t·C) + 2·C·V``."""
    n = num_tokens
    linear = _per_token_linear(embed_dim, mlp_hidden)
    attention = 4 * embed_dim * n * (n + 1) // 2
    return rows * (depth * (n * linear + attention) + n * 2 * embed_dim * vocab)


def gflops_vs_resolution(resolutions: Sequence[int] = (256, 512, 1024, 2048), depth: int = 16,
                         embed_dim: int = 1024, mlp_ratio: float = 4.0, vocab: int = 4096, downsample: int = 16,
                         schedules: Mapping[int, Sequence[int]] | None = None):
    """Theoretical GFLOPs of next-scale vs next-token generation per image (the papers' Figure 2b).

    Uniform settings: the same transformer (default: VAR-d16 sizes) for both, one row (no CFG), dense, the
    tokenizer's ``downsample`` factor giving a ``(resolution/downsample)²`` token grid. Next-scale uses
    :func:`next_scale_schedule` unless ``schedules`` gives one per resolution. Returns a DataFrame with
    ``resolution, method, tokens_final, tokens_computed, gflops``.
    """
    import pandas as pd

    mlp_hidden = round(embed_dim * mlp_ratio)
    rows = []
    for res in resolutions:
        side = res // downsample
        schedule = tuple(schedules[res]) if schedules and res in schedules else next_scale_schedule(side)
        if schedule[-1] != side:
            raise ValueError(f"schedule for {res}px ends at {schedule[-1]}, expected {side}")
        ns = next_scale_transformer_flops(schedule, depth, embed_dim, mlp_hidden, vocab)
        nt = next_token_transformer_flops(side * side, depth, embed_dim, mlp_hidden, vocab)
        computed = sum(p * p for p in schedule)
        rows.append((res, "next-scale (VAR)", side * side, computed, len(schedule), ns / 1e9))
        rows.append((res, "next-token (raster AR, KV cache)", side * side, side * side, side * side, nt / 1e9))
    return pd.DataFrame(rows, columns=["resolution", "method", "tokens_final", "tokens_computed", "steps",
                                       "gflops"])
