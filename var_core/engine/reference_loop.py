"""A straightforward statement of the official VAR sampling algorithm, with no hook slots.

It follows ``autoregressive_infer_cfg`` of the official code step by step (doubled CFG batch, a KV cache that
re-concatenates the history at every scale, per-scale AdaLN modulation, the linear CFG ramp, top-k/top-p) on
our modules. It exists for two reasons: the performance target of the engine ("no slower than a plain
implementation of the official algorithm", ``python -m studies.bench engine``) and an independent cross-check of
the hookable loop in the tests. Do not build features on it: ``var_core.engine.loop.generate`` is the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.var import VAR
from .sampling import SamplingConfig, draw_categorical


@torch.inference_mode()
def reference_generate(var: VAR, vae, labels_B: torch.Tensor, sampling: SamplingConfig,
                       generators: list[torch.Generator]) -> torch.Tensor:
    cfg = var.cfg
    B = labels_B.shape[0]
    labels = torch.cat((labels_B, torch.full_like(labels_B, var.null_class)))
    cond_BD = var.class_emb(labels)
    lvl_pos = var.level_position_embedding()
    x = cond_BD.unsqueeze(1) + var.pos_start + lvl_pos[:, :1]
    cond_mod = var.shared_ada_lin(cond_BD)
    p_last = cfg.patch_nums[-1]
    f_hat = torch.zeros(B, cfg.z_channels, p_last, p_last, device=labels_B.device)
    cached_k: list[torch.Tensor | None] = [None] * cfg.depth
    cached_v: list[torch.Tensor | None] = [None] * cfg.depth
    K = cfg.num_scales
    for si, pn in enumerate(cfg.patch_nums):
        for li, block in enumerate(var.blocks):
            mods = block.modulation(cond_mod)
            q, k, v = block.attn.project_qkv(block.attn_input(x, mods))
            cached_k[li] = k if cached_k[li] is None else torch.cat((cached_k[li], k), dim=2)
            cached_v[li] = v if cached_v[li] is None else torch.cat((cached_v[li], v), dim=2)
            out = F.scaled_dot_product_attention(q, cached_k[li], cached_v[li], scale=block.attn.scale)
            out = block.attn.proj(out.transpose(1, 2).reshape(x.shape[0], -1, x.shape[-1]))
            x = x + block.attn_output(out, mods)
            x = x + block.ffn_branch(x, mods)
        logits = var.logits(x, cond_BD)
        t = sampling.cfg * si / (K - 1)
        guided = (1 + t) * logits[:B] - t * logits[B:]
        tokens = draw_categorical(guided, sampling, generators)
        h = vae.quantize.embed_idx(tokens, pn)
        f_hat = vae.quantize.next_autoregressive_input(si, f_hat, h)[0]
        if si < K - 1:
            nxt = cfg.patch_nums[si + 1]
            feat = F.interpolate(f_hat, size=(nxt, nxt), mode="area").flatten(2).transpose(1, 2)
            x = var.embed_tokens(feat, si + 1, lvl_pos).repeat(2, 1, 1)
    return vae.fhat_to_img(f_hat).add(1).mul(0.5)
