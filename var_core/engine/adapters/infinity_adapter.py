"""Adapter for the Infinity family (bitwise text-to-image: Infinity-2B / 8B and the tiny fixtures).

Runs ``var_core.models.infinity.Infinity`` with a ``var_core.models.bsq_vae.BSQVAE`` and a text encoder
through THE engine loop. Conventions (official ``autoregressive_infer_cfg``, see ``specs/reference_models.md``
§2.4 and the fixture README):

* **rows**: conditional rows ``[0, B)`` then unconditional rows ``[B, 2B)`` (``GuidanceMode.BOTH``). The
  unconditional text is ``cfg_uncond[:len_i]`` per prompt (same length as the prompt) or a negative prompt.
  With ``cfg == 1`` there are no unconditional rows at all (``GuidanceMode.NONE``).
* **guidance**: constant ``cfg·cond + (1−cfg)·uncond`` on the logits after the ``1/tau`` temperature
  (``SamplingConfig.temperature`` is tau). With ``cfg_insertion_layer = −k`` the same mix is applied instead to
  the hidden state after layer ``depth−k`` (dense case), and only the conditional rows reach the head.
* **sampling**: per-bit top-k / top-p over the ``[B, N·d, 2]`` bit logits; ``sample`` returns bits ``[B, N, d]``.
* **latent**: the summed codes ``[B, d, 1, H, W]`` on the VAE grid (``Σ trilinear_up(codes)``; the last scale is
  added as it is). The next scale's input is the **trilinear** downsampling of the summed codes (2×2
  pixel-unshuffled for the 8B patchify model), embedded by ``word_embed``.
* ``decode`` returns RGB ``[B, 3, H, W]`` in ``[0, 1]`` (the official returns BGR uint8 HWC: ``flip`` and
  ``·255 → uint8`` with truncation to compare).

Conditions: prompts (``list[str]``), pre-encoded :class:`TextTokens`, the official packed tuple, or
:class:`InfinityConditions` (with a negative prompt). Integer class labels (what class-conditional benchmark
commands pass) become the prompts ``LABEL_PROMPT.format(label=k)``, so every command can run an Infinity model.

Text encoding is reported separately: ``begin`` wraps it in ``self.tracer.span("text_encode")`` (assign a
tracer to ``adapter.tracer``), and :meth:`InfinityAdapter.encode_prompts` lets a caller pre-encode (and time)
prompts and pass the :class:`TextTokens` as the conditions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ...models.bsq_vae import BSQVAE, patchify_latent, unpatchify_bits
from ...models.infinity import Infinity, RopeTables, TextContext, rope_reference_hw, scale_schedule
from ...models.text_encoder import TextTokens
from ..context import GuidanceMode
from ..attention import CachedAttention
from ..kvcache import KVCache
from ..packing import RowPacking
from ..sampling import SamplingConfig, draw_categorical
from ..tracing import NULL_TRACER, Tracer
from .base import ModelAdapter


@dataclass
class InfinityConditions:
    """Prompts (or pre-encoded text) plus an optional negative prompt per sample.

    ``text`` / ``negative``: a list of prompts, one prompt string, :class:`TextTokens`, or the official packed
    tuple ``(kv_compact, lens, cu_seqlens_k, max_seqlen_k)``. A single negative is used for every sample.
    """

    text: Any
    negative: Any = None


@dataclass
class InfinityState:
    """Per-generation tensors; ``*_R*`` tensors follow the current row layout (cond rows, then uncond)."""

    batch_size: int
    guidance: GuidanceMode
    cfg: float
    cond_RD: torch.Tensor  # attentive-pool output per row: start token and head AdaLN condition
    modulations: list[tuple[torch.Tensor, ...]]  # per block: six [R, 1, C] AdaLN tensors
    text_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per block: cross-attention K, V [R, H, L, hd]
    text_mask_RL: torch.Tensor
    summed_codes: torch.Tensor  # [B, d, 1, H, W] on the VAE grid
    text: TextContext | None = None  # the encoded text of the initial row layout (for observers)


LABEL_PROMPT = "a photo of object class {label}"


def _as_class_labels(conditions) -> list[int] | None:
    """Integer class labels (a tensor or a list of ints), or None."""
    if isinstance(conditions, torch.Tensor) and not conditions.is_floating_point() and conditions.ndim <= 1:
        return [int(k) for k in conditions.view(-1).tolist()]
    if isinstance(conditions, (list, tuple)) and conditions and all(isinstance(k, int) for k in conditions):
        return [int(k) for k in conditions]
    return None


class InfinityAdapter(ModelAdapter):
    """Runs Infinity through the engine loop (branches ``attn``, ``cross``, ``ffn``)."""

    family = "infinity"
    branches = ("attn", "cross", "ffn")
    # the notebooks' 2B setting (scripts/infer.sh uses cfg 4); top_k 900 has no effect on two-way bit draws
    default_sampling = SamplingConfig(cfg=3.0, top_k=900, top_p=0.97, temperature=0.5)

    def __init__(self, model: Infinity, vae: BSQVAE, text_encoder=None, *, schedule: Sequence | None = None,
                 pn: str = "1M", h_div_w: float = 1.0, num_scales: int | None = None, cfg_insertion_layer: int = 0,
                 negative_prompt: str | Sequence[str] | None = None, tracer: Tracer = NULL_TRACER):
        self.model = model.eval()
        self.vae = vae.eval()
        self.text_encoder = text_encoder
        self.cfg = model.cfg
        self.patchify = bool(model.cfg.apply_spatial_patchify)
        expected = vae.codebook_dim * (4 if self.patchify else 1)
        if expected != model.cfg.d_vae:
            raise ValueError(
                f"the transformer reads {model.cfg.d_vae} bits per token but the VAE has codebook_dim "
                f"{vae.codebook_dim}" + (" (×4 with the 2×2 patchify)" if self.patchify else "")
                + "; pair an Infinity checkpoint with its own VAE"
            )
        if schedule is None:
            schedule = scale_schedule(pn, h_div_w, num_scales)
        self._scale_hw = tuple(tuple(int(v) for v in hw[-2:]) for hw in schedule)
        if len(self._scale_hw) > model.cfg.num_levels:
            raise ValueError(f"{len(self._scale_hw)} scales but lvl_embed has {model.cfg.num_levels} rows")
        f = 2 if self.patchify else 1
        self.vae_schedule = tuple((1, f * h, f * w) for h, w in self._scale_hw)
        self.rope_ref_hw = rope_reference_hw(self._scale_hw)
        # a module (buffers), not plain tensors: the tables move with the model (adapter.to, Lightning)
        self.rope = RopeTables(self._scale_hw, self.rope_ref_hw, model.cfg.head_dim, model.cfg.rope_base,
                               device=self.device)
        self.cfg_insertion_layer = int(cfg_insertion_layer)
        self.negative_prompt = negative_prompt
        self.tracer = tracer

    # ----- description --------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.cfg.depth

    @property
    def block_chunks(self) -> int:
        """The checkpoint's own grouping of its blocks (``block_chunks``: 8 on Infinity-2B); read by the loop's
        ``generation_info`` for policies that work per chunk."""
        return int(self.cfg.block_chunks)

    @property
    def scale_hw(self) -> tuple[tuple[int, int], ...]:
        return self._scale_hw

    @property
    def device(self) -> torch.device:
        return self.model.head.weight.device

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def bits_per_token(self) -> int:
        return self.cfg.d_vae

    @property
    def image_hw(self) -> tuple[int, int]:
        _, h, w = self.vae_schedule[-1]
        return h * self.vae.downsample_factor, w * self.vae.downsample_factor

    @property
    def image_size(self) -> int:
        return max(self.image_hw)

    def with_schedule(self, schedule: Sequence | None = None, *, pn: str = "1M", h_div_w: float = 1.0,
                      num_scales: int | None = None) -> "InfinityAdapter":
        """A new adapter over the same modules for another resolution / aspect ratio."""
        other = InfinityAdapter(self.model, self.vae, self.text_encoder, schedule=schedule, pn=pn, h_div_w=h_div_w,
                                num_scales=num_scales, cfg_insertion_layer=self.cfg_insertion_layer,
                                negative_prompt=self.negative_prompt, tracer=self.tracer)
        if hasattr(self, "model_name"):
            other.model_name = self.model_name
        return other

    # ----- conditions ---------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: str | Sequence[str]) -> TextTokens:
        """Text features of the prompts (time this yourself, or set ``adapter.tracer``)."""
        if self.text_encoder is None:
            raise RuntimeError("this Infinity adapter has no text encoder: pass TextTokens (pre-encoded text) or "
                               "load the model with a text encoder (a local flan-t5 directory)")
        if isinstance(prompts, str):
            prompts = [prompts]
        return self.text_encoder.encode(list(prompts))

    def _as_text(self, text) -> TextTokens:
        if isinstance(text, TextTokens):
            return text
        if isinstance(text, tuple) and len(text) == 4 and isinstance(text[0], torch.Tensor):
            return TextTokens.from_official(text)
        if isinstance(text, str) or (isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text)):
            with self.tracer.span("text_encode"):
                return self.encode_prompts(text)
        labels = _as_class_labels(text)
        if labels is not None:  # class-conditional callers (generic benchmarks): one fixed prompt per label
            with self.tracer.span("text_encode"):
                return self.encode_prompts([LABEL_PROMPT.format(label=k) for k in labels])
        raise TypeError("Infinity conditions must be prompts (list[str]), TextTokens, the official packed tuple "
                        f"(kv_compact, lens, cu_seqlens_k, max_seqlen_k), InfinityConditions or integer class labels; "
                        f"got {type(text)}")

    def _split_conditions(self, conditions) -> tuple[TextTokens, TextTokens | None]:
        negative = self.negative_prompt
        if isinstance(conditions, InfinityConditions):
            text, negative = conditions.text, (conditions.negative if conditions.negative is not None else negative)
        elif isinstance(conditions, dict):
            text = conditions.get("prompts", conditions.get("text"))
            negative = conditions.get("negative", negative)
        else:
            text = conditions
        cond = self._as_text(text)
        neg = None if negative is None else self._as_text(negative)
        if neg is not None and neg.rows != cond.rows:
            if neg.rows != 1:
                raise ValueError(f"{neg.rows} negative prompts for {cond.rows} samples: give one, or one per sample")
            neg = neg.repeat_rows(cond.rows)
        return cond, neg

    def initial_guidance(self, sampling: SamplingConfig) -> GuidanceMode:
        # Infinity: cfg·c + (1−cfg)·u, so cfg == 1 never needs the unconditional rows (none are computed).
        return GuidanceMode.NONE if sampling.cfg == 1 else GuidanceMode.BOTH

    def begin(self, conditions, guidance: GuidanceMode, sampling: SamplingConfig) -> InfinityState:
        cond, negative = self._split_conditions(conditions)
        B = cond.rows
        uncond = None
        if guidance.computes_uncond:
            uncond = negative if negative is not None else self.model.null_text(cond.lens)
        if guidance is GuidanceMode.BOTH:
            rows = TextTokens.cat([cond, uncond])
        elif guidance is GuidanceMode.UNCOND_ONLY:
            rows = uncond
        else:
            rows = cond
        ctx = self.model.encode_text(rows)
        f = 2 if self.patchify else 1
        h, w = self._scale_hw[-1]
        summed = torch.zeros(B, self.vae.codebook_dim, 1, f * h, f * w, device=self.device)
        return InfinityState(
            batch_size=B, guidance=guidance, cfg=float(sampling.cfg), cond_RD=ctx.cond_RD,
            modulations=[blk.modulation(ctx.gss_R16C) for blk in self.model.blocks],
            text_kv=self.model.text_kv(ctx), text_mask_RL=ctx.mask_RL, summed_codes=summed, text=ctx,
        )

    # ----- the scale loop's steps ---------------------------------------------------------------------------
    def next_input(self, summed_codes: torch.Tensor, si: int) -> torch.Tensor:
        """``[B, h·w, d_vae]``: the trilinear downsampling of the summed codes to scale ``si`` (patchified for 8B),
        flattened row-major — the official next-scale input before ``word_embed``."""
        x = F.interpolate(summed_codes, size=self.vae_schedule[si], mode="trilinear").squeeze(-3)
        if self.patchify:
            x = patchify_latent(x)
        return x.reshape(*x.shape[:2], -1).permute(0, 2, 1)

    def scale_input(self, state: InfinityState, si: int) -> torch.Tensor:
        if si == 0:
            return self.model.embed_first_scale(state.cond_RD)
        x_BNC = self.model.embed_tokens(self.next_input(state.summed_codes, si), si)
        return x_BNC.repeat(2, 1, 1) if state.guidance is GuidanceMode.BOTH else x_BNC

    def _rope(self, si: int, n: int, keep_Rn: torch.Tensor | None):
        start = self.token_offsets()[si]
        if keep_Rn is None:
            return self.rope.cos[start:start + n], self.rope.sin[start:start + n]
        pos = keep_Rn + start
        return self.rope.cos[pos].unsqueeze(1), self.rope.sin[pos].unsqueeze(1)  # [R, 1, n, hd/2]

    def _insertion_block(self) -> int | None:
        k = self.cfg_insertion_layer
        if k == 0:
            return None
        if k > 0 or self.cfg.depth + k < 0:
            raise ValueError(f"cfg_insertion_layer must be 0 (on logits) or −1…−{self.cfg.depth}, got {k}")
        return self.cfg.depth + k

    def run_branch(self, state: InfinityState, si: int, block: int, branch: str, x_RnC: torch.Tensor,
                   keep_Rn: torch.Tensor | None, valid_Rn: torch.Tensor | None, cache: KVCache, want_probs: bool,
                   packing: RowPacking | None = None, pattern=None):
        blk = self.model.blocks[block]
        mods = state.modulations[block]
        if branch == "attn":
            cos, sin = self._rope(si, x_RnC.shape[1], keep_Rn)
            q, k, v = blk.sa.project_qkv(blk.attn_input(x_RnC, mods), cos, sin, packing)
            kv = cache.append(block, k, v, valid_Rn)
            core = CachedAttention(kv, valid_Rn if packing is not None else None, pattern)  # ragged: valid tokens only
            out, _ = blk.sa.attend(q, kv.keys, kv.values, kv.bias, packing=packing, core=core)
            return blk.attn_output(out, mods), (core.probe() if want_probs else None)
        if branch == "cross":
            k_t, v_t = state.text_kv[block]
            return blk.cross_branch(x_RnC, k_t, v_t, state.text_mask_RL, packing), None
        if branch != "ffn":
            raise ValueError(f"Infinity blocks have branches 'attn', 'cross' and 'ffn', not {branch!r}")
        out = blk.ffn_branch(x_RnC, mods, packing)
        if block == self._insertion_block() and state.guidance is GuidanceMode.BOTH and state.cfg != 1:
            if keep_Rn is not None:
                raise ValueError("cfg_insertion_layer mixes the full hidden state; it cannot run on a pruned "
                                 f"branch (block {block}); use cfg_insertion_layer=0 with token pruning")
            B, cfg = state.batch_size, state.cfg
            x_out = x_RnC + out
            mixed = cfg * x_out[:B] + (1 - cfg) * x_out[B:]
            out = torch.cat((mixed, mixed)) - x_RnC  # the loop adds x back: x + out == the mixed state
        return out, None

    def logits(self, state: InfinityState, x_RNC: torch.Tensor) -> torch.Tensor:
        return self.model.logits(x_RNC, state.cond_RD)

    def row_packing(self, keep_Rn: torch.Tensor, valid_Rn: torch.Tensor | None) -> RowPacking | None:
        # ragged selections: QKV, projections, cross-attention q/out and MLP on the valid tokens only
        return RowPacking(keep_Rn, valid_Rn) if RowPacking.worthwhile(valid_Rn) else None

    def context_length(self, state: InfinityState) -> int | None:
        return int(state.text_mask_RL.shape[1])

    def head_parts(self, state: InfinityState, x_RNC: torch.Tensor, rows: torch.Tensor | None = None):
        cond = state.cond_RD if rows is None else state.cond_RD[rows]
        return self.model.head_nm(x_RNC, cond), self.model.head

    def guide(self, state: InfinityState, si: int, logits_RNV: torch.Tensor, sampling: SamplingConfig,
              cond_only_B: torch.Tensor | None = None) -> torch.Tensor:
        scaled = logits_RNV.mul(1 / sampling.temperature)
        B, cfg = state.batch_size, state.cfg
        if state.guidance is GuidanceMode.COND_ONLY and cfg != 1 and self._insertion_block() is None:
            # the conditional rows through the guidance formula, as SkipVAR's released sampler does after it drops
            # the unconditional rows (cfg·c + (1 − cfg)·c: equal to c up to rounding, bit for bit the released)
            return cfg * scaled + (1 - cfg) * scaled
        if state.guidance is not GuidanceMode.BOTH:
            return scaled
        if self._insertion_block() is not None:
            if cond_only_B is not None and bool(cond_only_B.any()):
                raise ValueError("per-sample guidance stop (cond_only_B) is not supported with "
                                 "cfg_insertion_layer != 0: the hidden state was already mixed")
            return scaled[:B]  # guidance already mixed into the hidden state
        guided = cfg * scaled[:B] + (1 - cfg) * scaled[B:]
        if cond_only_B is not None:  # samples whose guidance stopped while others still use it
            cond = scaled[:B]
            guided = torch.where(cond_only_B.to(guided.device).view(B, 1, 1), cfg * cond + (1 - cfg) * cond, guided)
        return guided

    def sample(self, guided_BNV: torch.Tensor, sampling: SamplingConfig,
               generators: Sequence[torch.Generator] | None, shared_generator: torch.Generator | None) -> torch.Tensor:
        """Bits ``[B, N, d]`` (int64): one two-way draw per bit, with per-bit top-k / top-p."""
        B, N, V = guided_BNV.shape
        bit_logits = guided_BNV.reshape(B, N * (V // 2), 2)
        bits = draw_categorical(bit_logits, sampling, list(generators) if generators is not None else None,
                                shared_generator)
        return bits.view(B, N, V // 2)

    def bits_to_vae_grid(self, bits_BNd: torch.Tensor, si: int) -> torch.Tensor:
        """Transformer bits of scale ``si`` → VAE bits ``[B, 1, h, w, d]`` (2×2 pixel-shuffle for the 8B)."""
        h, w = self._scale_hw[si]
        bits = bits_BNd.reshape(bits_BNd.shape[0], h, w, -1)
        if self.patchify:
            bits = unpatchify_bits(bits)
        return bits.unsqueeze(1)

    def update_latent(self, state: InfinityState, si: int, bits_BNd: torch.Tensor,
                      keep_BN: torch.Tensor | None = None) -> torch.Tensor:
        codes = self.vae.bits_to_codes(self.bits_to_vae_grid(bits_BNd, si)).to(state.summed_codes.dtype)
        if keep_BN is not None:  # sparse residual: masked tokens add zero codes (a token covers 2x2 cells if patchify)
            h, w = self._scale_hw[si]
            mask = keep_BN.view(-1, 1, 1, h, w).to(device=codes.device, dtype=codes.dtype)
            if self.patchify:
                mask = mask.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)
            codes = codes * mask
        full = tuple(state.summed_codes.shape[2:])
        if tuple(codes.shape[2:]) == full:
            state.summed_codes = state.summed_codes + codes
        else:
            state.summed_codes = state.summed_codes + F.interpolate(codes, size=full, mode="trilinear")
        residual = codes.squeeze(2)  # ±1/√d codes on the VAE grid; on the token grid (4d channels) with patchify
        return patchify_latent(residual) if self.patchify else residual

    def decode(self, state: InfinityState) -> torch.Tensor:
        return self.vae.decode(state.summed_codes.squeeze(-3)).add(1).mul(0.5)

    def decode_preview(self, state: InfinityState, grid_scale: int) -> torch.Tensor:
        """The summed codes brought to the VAE grid of scale ``grid_scale`` (trilinear, the quantizer's
        ``z_interplote_up`` as the released SkipVAR code uses it for this resize too) and decoded."""
        small = F.interpolate(state.summed_codes, size=self.vae_schedule[grid_scale], mode="trilinear")
        return self.vae.decode(small.squeeze(-3)).add(1).mul(0.5)

    def latent(self, state: InfinityState) -> torch.Tensor:
        return state.summed_codes

    def select_rows(self, state: InfinityState, rows: slice, guidance: GuidanceMode) -> None:
        state.cond_RD = state.cond_RD[rows]
        state.modulations = [tuple(m[rows] for m in mods) for mods in state.modulations]
        state.text_kv = [(k[rows], v[rows]) for k, v in state.text_kv]
        state.text_mask_RL = state.text_mask_RL[rows]
        state.text = None
        state.guidance = guidance

    def describe(self) -> dict:
        return {
            "family": self.family, "depth": self.cfg.depth, "embed_dim": self.cfg.embed_dim,
            "bits_per_token": self.cfg.d_vae, "patchify": self.patchify, "scales": self._scale_hw,
            "image_hw": self.image_hw, "rope_reference_hw": self.rope_ref_hw,
            "cfg_insertion_layer": self.cfg_insertion_layer,
            "text_encoder": getattr(self.text_encoder, "describe", lambda: None)(),
        }
