"""Adapter for the HART family (hybrid autoregressive transformer: HART-0.7B and the tiny fixtures/randoms).

Runs ``var_core.models.hart.HARTTransformer`` with a ``var_core.models.hart_tokenizer.HARTTokenizer`` and a text
encoder through THE engine loop; the residual diffusion head runs in :meth:`HARTAdapter.finish`, the loop's
post-last-scale step. Conventions (official ``autoregressive_infer_cfg``, specs/hart.md §5):

* **rows**: conditional rows ``[0, B)`` then unconditional rows ``[B, 2B)`` (``GuidanceMode.BOTH``): the
  unconditional context is all zeros with zero position ids (:meth:`HARTContext.unconditional`).
* **the first scale** (1×1) has no image input: its input is the ``ctx`` context tokens (``sos + lvl_embed[0]``),
  and its token is predicted from the last context position. The loop sees ONE token at scale 0 (the last context
  position, so scale shapes, plans and records stay those of the 1×1 grid); the other ``ctx − 1`` context tokens
  are carried through the blocks by the adapter (their keys fill the KV cache, which therefore holds
  ``ctx + L − 1`` positions).
* **guidance**: VAR's ``(1+t)·cond − t·uncond`` with ``t = cfg·si/(N−1)`` and, at the last scale, the ratio of
  scale ``N−2`` reused (``t = cfg·(N−2)/(N−1)``); the same ``t`` guides the diffusion head. ``cfg = 0`` needs no
  unconditional rows (``COND_ONLY``): their logits are multiplied by 0 and, in the diffusion head, guidance 0
  gives ``ε = ε_c`` — yet the official sampler computes them and takes the *guided* diffusion branch with
  guidance 0 (only ``t == 1.0`` exactly is unguided), so its noise draws are the guided ones (``B·N`` rows
  initially, ``2·B·N`` at every step); ours draws the same and drops the unconditional share, so the image,
  latent and residual tokens equal the official cfg-0 run's.
* **sampling**: top-k / top-p with one multinomial draw per scale; the official loop ignores its ``top_k``
  argument and uses 600 while ``si < 7``, else 300 (``HARTSamplingConfig.official_top_k``, default on; off: the
  configured ``top_k``). ``top_k = 1`` is greedy (argmax) either way. ``more_smooth`` (the official scripts'
  effective default): the latent gets the Gumbel-softmax mixture of code vectors
  ``softmax((ℓ_masked·(1+r) + G)/τ) @ codebook``, ``r = si/(N−1)`` (reused at the last scale),
  ``τ = max(0.27·(1 − 0.95·r), 0.005)``, drawn after the token from the same generator.
* **latent**: ``f_hat`` ``[B, Cvae, pn_N, pn_N]``: ``+= Phi(bicubic(h))`` for scales ``< N−1``, ``+= h`` at the last
  (the hybrid rule), then ``+=`` the diffusion head's residual tokens. The next scale's input is the area
  downsampling of ``f_hat`` embedded by ``word_embed``.
* **diffusion** (:meth:`finish`): condition ``decoder_norm(x_last + word_embed(emb(idx)))`` per token (hard tokens
  even with ``more_smooth``), ``steps`` respaced iDDPM steps, guided with the last scale's ``t`` (exactly 1.0 takes
  the unguided branch, an official quirk; 0 the guided one, see above). With one half of the rows only (cfg 0,
  or a policy dropped the unconditional rows) the head denoises those rows with guidance 0 and the guided
  branch's noise draws. Per-sample guidance stops at the last scale give those samples guidance 0 (the
  conditional prediction) inside the guided batch. Positions a policy's ``latent_mask`` excludes at the last
  scale receive no residual either (sparse residual tokens).

RNG: with per-sample generators (``seeds``) every draw — tokens, Gumbel noise, diffusion noise — comes from the
sample's own generator (a sample's result does not depend on its batch). With ``shared_generator`` (or none) the
official order: tokens (and Gumbel noise) from that generator, the diffusion noise from the **global** torch
generator (``torch.manual_seed`` before the call reproduces an official run).

Conditions: prompts (``list[str]``), a :class:`HARTContext` (precomputed LLM states), the official triple
``(context_tensor, context_mask, context_position_ids)``, or integer class labels (mapped to the prompts
``LABEL_PROMPT.format(label=k)``, so class-conditional benchmark commands can run a HART model).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ...models.hart import HARTTransformer, context_rope
from ...models.hart_diffusion import torch_noise
from ...models.hart_text import HARTContext
from ...models.hart_tokenizer import HARTTokenizer, tokens_to_map
from ..context import GuidanceMode
from ..attention import CachedAttention
from ..kvcache import KVCache
from ..packing import RowPacking
from ..sampling import SamplingConfig, draw_categorical, filter_top_k_top_p
from ..tracing import NULL_TRACER, Tracer
from .base import ModelAdapter

LABEL_PROMPT = "a photo of object class {label}"
OFFICIAL_TOP_K = (600, 300)  # the official loop's top-k: 600 while si < 7, else 300
OFFICIAL_TOP_K_SWITCH = 7


@dataclass(frozen=True)
class HARTSamplingConfig(SamplingConfig):
    """:class:`SamplingConfig` plus HART's own sampling settings (recorded with the others).

    ``diffusion``: run the residual diffusion head (official ``final_stage=0``; False = the discrete-only image).
    ``diffusion_steps``: respaced iDDPM steps (0 = the checkpoint's ``num_sampling_steps``, official 8).
    ``diffusion_temperature``: scales the diffusion noise (official 1). ``more_smooth``: the Gumbel-softmax latent
    (see the module docstring). ``official_top_k``: 600/300 per scale instead of ``top_k``.
    """

    diffusion: bool = True
    diffusion_steps: int = 0
    diffusion_temperature: float = 1.0
    more_smooth: bool = True
    official_top_k: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.diffusion_steps < 0:
            raise ValueError(f"diffusion_steps must be >= 0 (0: the checkpoint's), got {self.diffusion_steps}")
        if self.diffusion_temperature < 0:
            raise ValueError(f"diffusion_temperature must be >= 0, got {self.diffusion_temperature}")


HART_FIELDS = ("diffusion", "diffusion_steps", "diffusion_temperature", "more_smooth", "official_top_k")


@dataclass
class HARTState:
    """Per-generation tensors; ``*_R*`` tensors follow the current row layout (cond rows, then uncond)."""

    batch_size: int
    guidance: GuidanceMode
    cfg: float
    settings: dict
    sos_RLC: torch.Tensor  # context embeddings
    head_cond_R1C: torch.Tensor  # max-pooled sos (the head's AdaLN condition)
    modulations: list  # per block: six [R, 1, C] AdaLN tensors, or None (release path)
    offset_R: torch.Tensor  # last context position id per row (2-D RoPE offset)
    ctx_cos: torch.Tensor  # [R, 1, ctx, hd] 1-D RoPE of the context
    ctx_sin: torch.Tensor
    f_hat_BChw: torch.Tensor
    context: HARTContext | None = None  # the encoded text of the initial row layout (for observers)
    ctx_x_RLC: torch.Tensor | None = None  # scale 0: hidden states of every context token
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # current scale's 2-D RoPE [R, 1, N, hd]
    rope_scale: int = -1
    t_last: float = 0.0  # guidance ratio of the latest scale
    cond_only_B: torch.Tensor | None = None  # per-sample guidance stop at the latest scale
    keep_last_BN: torch.Tensor | None = None  # latent mask of the last scale (sparse residual)
    last_scale: tuple[torch.Tensor, torch.Tensor] | None = None  # (f_hat before the last scale, its code map)


def _as_class_labels(conditions) -> list[int] | None:
    if isinstance(conditions, torch.Tensor) and not conditions.is_floating_point() and conditions.ndim <= 1:
        return [int(k) for k in conditions.view(-1).tolist()]
    if isinstance(conditions, (list, tuple)) and conditions and all(isinstance(k, int) for k in conditions):
        return [int(k) for k in conditions]
    return None


class HARTAdapter(ModelAdapter):
    """Runs HART through the engine loop (branches ``attn``, ``ffn``; the diffusion head in :meth:`finish`)."""

    family = "hart"
    branches = ("attn", "ffn")
    # sample.py's settings: cfg 4.5, top-p off, the 600/300 top-k, more_smooth (argparse type=bool: always on)
    default_sampling = HARTSamplingConfig(cfg=4.5, top_k=600, top_p=0.0)

    def __init__(self, model: HARTTransformer, tokenizer: HARTTokenizer, text_encoder=None, *,
                 tracer: Tracer = NULL_TRACER, keep_diffusion_trace: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer.eval()
        self.text_encoder = text_encoder
        self.cfg = model.cfg
        if tuple(tokenizer.patch_nums) != tuple(self.cfg.patch_nums):
            raise ValueError(f"the transformer's patch_nums {self.cfg.patch_nums} differ from the tokenizer's "
                             f"{tuple(tokenizer.patch_nums)}; pair a HART llm/ with its own tokenizer/")
        if tokenizer.vocab_size != self.cfg.vocab_size or tokenizer.z_channels != self.cfg.z_channels:
            raise ValueError(f"the transformer predicts {self.cfg.vocab_size} codes of {self.cfg.z_channels} channels "
                             f"but the tokenizer has {tokenizer.vocab_size} × {tokenizer.z_channels}")
        self._scale_hw = tuple((p, p) for p in self.cfg.patch_nums)
        self._scale_of_count = {p * p: si for si, p in enumerate(self.cfg.patch_nums)}
        self.tracer = tracer
        self.keep_diffusion_trace = keep_diffusion_trace
        self.last_diffusion: dict | None = None  # set by finish() when keep_diffusion_trace (observers, verify)
        self.last_settings: dict | None = None  # the HART sampling settings of the latest generation
        self._smooth_handoff: tuple[torch.Tensor, torch.Tensor] | None = None  # (tokens, soft code map) sample→latent

    # ----- description --------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.cfg.depth

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
    def context_tokens(self) -> int:
        return self.cfg.context_token

    @property
    def image_size(self) -> int:
        return self.cfg.patch_nums[-1] * self.tokenizer.downsample_factor

    def kv_cache(self) -> KVCache:
        return KVCache(self.num_blocks, self.cfg.context_token + self.total_tokens - 1)

    def context_length(self, state: HARTState) -> int | None:
        return None  # no cross-attention: the context is a prefix of the self-attention sequence

    def settings(self, sampling: SamplingConfig) -> dict:
        """HART's sampling settings of a run: the fields of a :class:`HARTSamplingConfig`, else the defaults."""
        out = {f: getattr(sampling, f, getattr(self.default_sampling, f)) for f in HART_FIELDS}
        if not out["diffusion_steps"]:
            out["diffusion_steps"] = int(self.cfg.num_sampling_steps)
        return out

    # ----- conditions ---------------------------------------------------------------------------------------
    def encode_prompts(self, prompts: str | Sequence[str]) -> HARTContext:
        if self.text_encoder is None:
            raise RuntimeError("this HART adapter has no text encoder: pass a HARTContext (precomputed LLM states) "
                               "or load the model with a text encoder (a local Qwen2 folder)")
        if isinstance(prompts, str):
            prompts = [prompts]
        return self.text_encoder.encode(list(prompts))

    def _as_context(self, conditions) -> HARTContext:
        if isinstance(conditions, dict):
            conditions = conditions.get("context", conditions.get("prompts", conditions.get("text")))
        if isinstance(conditions, HARTContext):
            ctx = conditions
        elif (isinstance(conditions, (tuple, list)) and len(conditions) == 3
              and all(isinstance(t, torch.Tensor) for t in conditions)):
            ctx = HARTContext.from_official(conditions)
        elif isinstance(conditions, str) or (isinstance(conditions, (list, tuple)) and conditions
                                             and all(isinstance(t, str) for t in conditions)):
            with self.tracer.span("text_encode"):
                ctx = self.encode_prompts(conditions)
        else:
            labels = _as_class_labels(conditions)
            if labels is None:
                raise TypeError("HART conditions must be prompts (list[str]), a HARTContext, the official triple "
                                "(context_tensor, context_mask, context_position_ids) or integer class labels; got "
                                f"{type(conditions)}")
            with self.tracer.span("text_encode"):
                ctx = self.encode_prompts([LABEL_PROMPT.format(label=k) for k in labels])
        if ctx.length != self.cfg.context_token or ctx.channels != self.cfg.context_dim:
            raise ValueError(f"the HART context is [R, {ctx.length}, {ctx.channels}] but the transformer reads "
                             f"[R, {self.cfg.context_token}, {self.cfg.context_dim}] (context_token, context_dim): "
                             f"encode the prompts to exactly {self.cfg.context_token} tokens")
        return ctx

    def initial_guidance(self, sampling: SamplingConfig) -> GuidanceMode:
        # t = cfg·si/(N−1): with cfg == 0 the unconditional rows never reach the result (the diffusion head's
        # guidance is 0; finish() draws its noise as the official guided branch does)
        return GuidanceMode.BOTH if sampling.cfg > 0 else GuidanceMode.COND_ONLY

    def begin(self, conditions, guidance: GuidanceMode, sampling: SamplingConfig) -> HARTState:
        cond = self._as_context(conditions).to(self.device)
        B = cond.rows
        uncond = HARTContext.unconditional(B, cond.length, cond.channels, device=self.device)
        if guidance is GuidanceMode.BOTH:
            rows = HARTContext.cat([cond, uncond])
        elif guidance is GuidanceMode.UNCOND_ONLY:
            rows = uncond
        else:
            rows = cond
        sos = self.model.embed_context(rows.features)
        block_cond = self.model.block_condition(sos, rows.mask)
        cos, sin = context_rope(rows.position_ids, self.cfg.head_dim, self.cfg.rope_base)
        p = self.cfg.patch_nums[-1]
        f_hat = torch.zeros(B, self.cfg.z_channels, p, p, device=self.device, dtype=self.tokenizer.codebook.dtype)
        self._smooth_handoff = None
        self.last_diffusion = None
        settings = self.settings(sampling)
        settings["soft_codes"] = bool(settings["more_smooth"]) and not sampling.greedy
        self.last_settings = settings  # what the latest generation ran (FLOP counters read the diffusion steps)
        return HARTState(
            batch_size=B, guidance=guidance, cfg=float(sampling.cfg), settings=settings, sos_RLC=sos,
            head_cond_R1C=self.model.head_condition(sos),
            modulations=[blk.modulation(block_cond) for blk in self.model.blocks],
            offset_R=rows.position_ids[:, -1], ctx_cos=cos, ctx_sin=sin, f_hat_BChw=f_hat, context=cond,
        )

    # ----- the scale loop's steps ---------------------------------------------------------------------------
    def next_input(self, f_hat_BChw: torch.Tensor, si: int) -> torch.Tensor:
        """``[B, pn², Cvae]``: the area downsampling of ``f_hat`` to scale ``si`` (row-major)."""
        p = self.cfg.patch_nums[si]
        return F.interpolate(f_hat_BChw, size=(p, p), mode="area").flatten(2).transpose(1, 2)

    def scale_input(self, state: HARTState, si: int) -> torch.Tensor:
        if si == 0:
            state.ctx_x_RLC = state.sos_RLC + self.model.lvl_embed.weight[0]
            return state.ctx_x_RLC[:, -1:]
        x_BNC = self.model.embed_tokens(self.next_input(state.f_hat_BChw, si), si)
        state.rope = self.model.scale_rope(si, state.offset_R)
        state.rope_scale = si
        return x_BNC.repeat(2, 1, 1) if state.guidance is GuidanceMode.BOTH else x_BNC

    def _rope(self, state: HARTState, si: int, keep_Rn: torch.Tensor | None):
        if state.rope_scale != si:
            state.rope, state.rope_scale = self.model.scale_rope(si, state.offset_R), si
        cos, sin = state.rope
        if keep_Rn is None:
            return cos, sin
        index = keep_Rn[:, None, :, None].expand(-1, 1, -1, cos.shape[-1])
        return cos.gather(2, index), sin.gather(2, index)

    def run_branch(self, state: HARTState, si: int, block: int, branch: str, x_RnC: torch.Tensor,
                   keep_Rn: torch.Tensor | None, valid_Rn: torch.Tensor | None, cache: KVCache, want_probs: bool,
                   packing: RowPacking | None = None, pattern=None):
        if branch not in self.branches:
            raise ValueError(f"HART blocks have branches 'attn' and 'ffn', not {branch!r}")
        blk = self.model.blocks[block]
        mods = state.modulations[block]
        if si == 0:
            return self._context_branch(state, blk, block, branch, x_RnC, cache, want_probs)
        if branch == "ffn":
            return blk.ffn_branch(x_RnC, mods, packing), None
        cos, sin = self._rope(state, si, keep_Rn)
        q, k, v = blk.attn.project_qkv(blk.attn_input(x_RnC, mods), cos, sin, packing)
        kv = cache.append(block, k, v, valid_Rn)
        core = CachedAttention(kv, valid_Rn if packing is not None else None, pattern)  # ragged: valid tokens only
        out, _ = blk.attn.attend(q, kv.keys, kv.values, kv.bias, packing=packing, core=core)
        return blk.attn_output(out, mods), (core.probe() if want_probs else None)

    def _context_branch(self, state: HARTState, blk, block: int, branch: str, x_R1C: torch.Tensor, cache: KVCache,
                        want_probs: bool):
        """Scale 0: the branch on every context token (the loop's one token is the last of them); the keys of all
        ``ctx`` tokens enter the cache, the loop gets the last token's output."""
        full = torch.cat((state.ctx_x_RLC[:, :-1], x_R1C), dim=1)
        mods = state.modulations[block]
        probs = None
        if branch == "attn":
            q, k, v = blk.attn.project_qkv(blk.attn_input(full, mods), state.ctx_cos, state.ctx_sin)
            kv = cache.append(block, k, v)
            core = CachedAttention(kv)
            out, _ = blk.attn.attend(q, kv.keys, kv.values, kv.bias, core=core)
            out = blk.attn_output(out, mods)
            probs = core.probe(last_queries=1) if want_probs else None  # the loop's token: the last context one
        else:
            out = blk.ffn_branch(full, mods)
        state.ctx_x_RLC = full + out
        return out[:, -1:], probs

    def logits(self, state: HARTState, x_RNC: torch.Tensor) -> torch.Tensor:
        return self.model.logits(x_RNC, state.head_cond_R1C)

    def head_parts(self, state: HARTState, x_RNC: torch.Tensor, rows: torch.Tensor | None = None):
        cond = state.head_cond_R1C if rows is None else state.head_cond_R1C[rows]
        return self.model.head_input(x_RNC, cond), self.model.head

    def row_packing(self, keep_Rn: torch.Tensor, valid_Rn: torch.Tensor | None) -> RowPacking | None:
        return RowPacking(keep_Rn, valid_Rn) if RowPacking.worthwhile(valid_Rn) else None

    def guidance_ratio(self, si: int) -> float:
        """``t / cfg`` at scale ``si``: ``si/(N−1)``, the last scale reusing ``(N−2)/(N−1)``."""
        N = self.num_scales
        return min(si, max(N - 2, 0)) / max(1, N - 1)

    def guide(self, state: HARTState, si: int, logits_RNV: torch.Tensor, sampling: SamplingConfig,
              cond_only_B: torch.Tensor | None = None) -> torch.Tensor:
        state.t_last = sampling.cfg * self.guidance_ratio(si)
        state.cond_only_B = cond_only_B
        if state.guidance is not GuidanceMode.BOTH:
            guided = logits_RNV
        else:
            B, t = state.batch_size, state.t_last
            guided = (1 + t) * logits_RNV[:B] - t * logits_RNV[B:]
            if cond_only_B is not None:
                guided = torch.where(cond_only_B.view(B, 1, 1), logits_RNV[:B], guided)
        if sampling.temperature != 1.0:  # ours: the official HART sampler has no temperature
            guided = guided / sampling.temperature
        return guided

    def _scale_of(self, guided_BNV: torch.Tensor) -> int:
        return self._scale_of_count[guided_BNV.shape[1]]

    def top_k_at(self, si: int, sampling: SamplingConfig) -> int:
        """The top-k the sampler uses at scale ``si`` (1 stays greedy)."""
        if sampling.top_k == 1 or not getattr(sampling, "official_top_k", self.default_sampling.official_top_k):
            return sampling.top_k
        k = OFFICIAL_TOP_K[0] if si < OFFICIAL_TOP_K_SWITCH else OFFICIAL_TOP_K[1]
        return k if k < self.cfg.vocab_size else 0

    def sample(self, guided_BNV: torch.Tensor, sampling: SamplingConfig, generators: Sequence[torch.Generator] | None,
               shared_generator: torch.Generator | None) -> torch.Tensor:
        si = self._scale_of(guided_BNV)
        eff = dataclasses.replace(sampling, top_k=self.top_k_at(si, sampling))
        tokens = draw_categorical(guided_BNV, eff, generators, shared_generator)
        self._smooth_handoff = None
        if getattr(sampling, "more_smooth", self.default_sampling.more_smooth) and not eff.greedy:
            masked = filter_top_k_top_p(guided_BNV, eff.top_k, eff.top_p)
            self._smooth_handoff = (tokens, self._smooth_codes(masked, si, generators, shared_generator))
        return tokens

    def _smooth_codes(self, masked_BNV: torch.Tensor, si: int, generators, shared_generator) -> torch.Tensor:
        """The Gumbel-softmax code map ``[B, Cvae, pn, pn]`` (official ``more_smooth``)."""
        r = self.guidance_ratio(si)
        tau = max(0.27 * (1 - 0.95 * r), 0.005)
        if generators is not None and shared_generator is None:
            expo = torch.cat([torch.empty_like(masked_BNV[b:b + 1]).exponential_(generator=g)
                              for b, g in enumerate(generators)])
        else:
            expo = torch.empty_like(masked_BNV).exponential_(generator=shared_generator)
        soft = ((masked_BNV * (1 + r) + (-expo.log())) / tau).softmax(dim=-1)
        h_BNC = soft @ self.tokenizer.codebook.to(soft.dtype)
        return tokens_to_map(h_BNC, self.cfg.patch_nums[si])

    def update_latent(self, state: HARTState, si: int, tokens_BN: torch.Tensor, keep_BN: torch.Tensor | None = None
                      ) -> torch.Tensor:
        p = self.cfg.patch_nums[si]
        handoff, self._smooth_handoff = self._smooth_handoff, None
        if handoff is not None and handoff[0] is tokens_BN:
            h_BChw = handoff[1].to(state.f_hat_BChw.dtype)
        else:
            h_BChw = self.tokenizer.embed_idx(tokens_BN, p).to(state.f_hat_BChw.dtype)
        if keep_BN is not None:  # sparse residual: masked tokens add a zero code map
            h_BChw = h_BChw * keep_BN.view(-1, 1, p, p).to(h_BChw.dtype)
        if si == self.num_scales - 1:  # the diffusion head adds h + residual to this f_hat (official order)
            state.keep_last_BN, state.last_scale = keep_BN, (state.f_hat_BChw, h_BChw)
        state.f_hat_BChw = self.tokenizer.next_autoregressive_input(si, state.f_hat_BChw, h_BChw)[0]
        return h_BChw

    # ----- the residual diffusion head ----------------------------------------------------------------------
    def finish(self, state: HARTState, x_RNC: torch.Tensor, tokens_BN: torch.Tensor, sampling: SamplingConfig,
               generators: Sequence[torch.Generator] | None = None, shared_generator: torch.Generator | None = None
               ) -> None:
        """After the last scale: the continuous residual tokens from the diffusion head, added to ``f_hat``."""
        settings = state.settings
        if not settings["diffusion"]:
            return
        B, N = tokens_BN.shape
        C = self.cfg.embed_dim
        h_BNc = self.tokenizer.quantize.embedding(tokens_BN)
        R = x_RNC.shape[0]
        h_RNc = h_BNc.repeat(R // B, 1, 1)
        z = self.model.diffusion_condition(x_RNC, h_RNc).reshape(R * N, C)
        t = float(state.t_last)
        if state.guidance is GuidanceMode.BOTH and t != 1.0:  # the official guided branch, [cond ; uncond]
            s = t
            if state.cond_only_B is not None:  # samples whose guidance stopped: the conditional prediction
                s = torch.where(state.cond_only_B.to(z.device), 0.0, t).repeat_interleave(N)
            z_in, cond_only = z, False
        else:
            # Only the computed half is denoised; the result equals the official call's conditional half. t == 1
            # exactly: the official unguided branch. Otherwise the rows of one half only (cfg 0, or a policy
            # dropped the other half): guidance 0, the guided branch (official at cfg 0: ε = ε_c, and noise
            # drawn for both halves at every step).
            z_in, cond_only = z[:B * N], True
            s = 1.0 if state.guidance is GuidanceMode.BOTH else 0.0
        noise = self._diffusion_noise(B, N, generators, shared_generator, z.device, z.dtype)
        trace = [] if self.keep_diffusion_trace else None
        head = self.model.diffloss
        res = head.sample(z_in, cfg=s, temperature=settings["diffusion_temperature"],
                          steps=settings["diffusion_steps"], noise=noise, trace=trace, cond_only=cond_only)[:B * N]
        res_BNc = res.view(B, N, -1).to(state.f_hat_BChw.dtype)
        if state.keep_last_BN is not None:
            res_BNc = res_BNc * state.keep_last_BN.view(B, N, 1).to(res_BNc.dtype)
        f_hat_before, h_BChw = state.last_scale
        state.f_hat_BChw = f_hat_before + (h_BChw + tokens_to_map(res_BNc, self.cfg.patch_nums[-1]))
        if trace is not None:
            self.last_diffusion = {"z": z, "cfg": s, "residual_tokens": res_BNc, "trace": trace}

    def _diffusion_noise(self, B: int, N: int, generators, shared_generator, device, dtype):
        if generators is not None and shared_generator is None:
            def per_sample(rows: int, channels: int) -> torch.Tensor:
                own = torch.cat([torch.randn(N, channels, generator=g, device=g.device) for g in generators])
                own = own.to(device=device, dtype=dtype)
                if rows > B * N:  # the unconditional half's noise is never used by the result
                    own = torch.cat((own, own.new_zeros(rows - B * N, channels)))
                return own[:rows]
            return per_sample
        return torch_noise(None, device, dtype)  # official: the global generator

    def decode(self, state: HARTState) -> torch.Tensor:
        return self.tokenizer.fhat_to_img(state.f_hat_BChw).add(1).mul(0.5)

    def latent(self, state: HARTState) -> torch.Tensor:
        return state.f_hat_BChw

    def select_rows(self, state: HARTState, rows: slice, guidance: GuidanceMode) -> None:
        state.sos_RLC = state.sos_RLC[rows]
        state.head_cond_R1C = state.head_cond_R1C[rows]
        state.modulations = [None if m is None else tuple(t[rows] for t in m) for m in state.modulations]
        state.offset_R = state.offset_R[rows]
        state.ctx_cos, state.ctx_sin = state.ctx_cos[rows], state.ctx_sin[rows]
        if state.ctx_x_RLC is not None:
            state.ctx_x_RLC = state.ctx_x_RLC[rows]
        if state.rope is not None:
            state.rope = (state.rope[0][rows], state.rope[1][rows])
        state.guidance = guidance

    def describe(self) -> dict:
        return {
            "family": self.family, "depth": self.cfg.depth, "embed_dim": self.cfg.embed_dim,
            "vocab_size": self.cfg.vocab_size, "scales": self._scale_hw, "image_size": self.image_size,
            "context_token": self.cfg.context_token, "disable_aln": self.cfg.disable_aln,
            "attn_l2_norm": self.cfg.attn_l2_norm, "diffusion": {"width": self.cfg.diff_width,
                                                                 "depth": self.cfg.diff_depth,
                                                                 "steps": self.cfg.num_sampling_steps},
            "text_encoder": getattr(self.text_encoder, "describe", lambda: None)(),
        }
