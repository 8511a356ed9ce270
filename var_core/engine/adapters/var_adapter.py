"""Adapter for the class-conditional VAR family (official VAR-d16…d36 and the project's testbed)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...models.var import VAR
from ..context import GuidanceMode
from ..attention import CachedAttention
from ..kvcache import KVCache
from ..packing import RowPacking
from ..sampling import SamplingConfig, draw_categorical
from .base import ModelAdapter


@dataclass
class VARState:
    """Per-generation tensors. ``*_R*`` tensors follow the current row layout (cond rows, then uncond)."""

    batch_size: int
    guidance: GuidanceMode
    cond_RD: torch.Tensor  # class embedding per row (the head's AdaLN input)
    modulations: list[tuple[torch.Tensor, ...]]  # per block: the six [R, 1, C] AdaLN tensors
    lvl_pos_1LC: torch.Tensor
    f_hat_BChw: torch.Tensor


class VARAdapter(ModelAdapter):
    """Runs ``var_core.models.var.VAR`` with a ``var_core.models.vqvae.VQVAE`` through the engine loop."""

    family = "var"
    branches = ("attn", "ffn")

    def __init__(self, var: VAR, vae):
        self.var = var.eval()
        self.vae = vae.eval()
        self.cfg = var.cfg
        if tuple(vae.quantize.patch_nums) != tuple(self.cfg.patch_nums):
            raise ValueError(
                f"VAR patch_nums {self.cfg.patch_nums} differ from the VQVAE quantizer's "
                f"{tuple(vae.quantize.patch_nums)}; build both with the same schedule"
            )
        self._scale_hw = tuple((p, p) for p in self.cfg.patch_nums)

    @property
    def num_blocks(self) -> int:
        return self.cfg.depth

    @property
    def scale_hw(self) -> tuple[tuple[int, int], ...]:
        return self._scale_hw

    @property
    def device(self) -> torch.device:
        return self.var.head.weight.device

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def image_size(self) -> int:
        return self.cfg.patch_nums[-1] * self.vae.downsample_factor

    def initial_guidance(self, sampling: SamplingConfig) -> GuidanceMode:
        # VAR ramps t = cfg·si/(K−1): with cfg == 0 the unconditional rows never matter.
        return GuidanceMode.BOTH if sampling.cfg > 0 else GuidanceMode.COND_ONLY

    def _labels_to_rows(self, labels_B: torch.Tensor, guidance: GuidanceMode) -> torch.Tensor:
        null = torch.full_like(labels_B, self.var.null_class)
        if guidance is GuidanceMode.BOTH:
            return torch.cat((labels_B, null))
        return labels_B if guidance.computes_cond else null

    def begin(self, conditions, guidance: GuidanceMode, sampling: SamplingConfig) -> VARState:
        labels_B = torch.as_tensor(conditions, dtype=torch.long, device=self.device).view(-1)
        if labels_B.numel() and bool(((labels_B < 0) | (labels_B > self.var.null_class)).any()):  # one read
            raise ValueError(
                f"class labels must lie in [0, {self.cfg.num_classes}] ({self.cfg.num_classes} is the null class); "
                f"got min {int(labels_B.min())}, max {int(labels_B.max())}"
            )
        cond_RD, cond_mod = self.var.condition(self._labels_to_rows(labels_B, guidance))
        B = labels_B.shape[0]
        p_last = self.cfg.patch_nums[-1]
        f_hat = torch.zeros(B, self.cfg.z_channels, p_last, p_last, device=self.device)
        return VARState(
            batch_size=B,
            guidance=guidance,
            cond_RD=cond_RD,
            modulations=[block.modulation(cond_mod) for block in self.var.blocks],
            lvl_pos_1LC=self.var.level_position_embedding(),
            f_hat_BChw=f_hat,
        )

    def scale_input(self, state: VARState, si: int) -> torch.Tensor:
        if si == 0:
            return self.var.embed_first_scale(state.cond_RD, state.lvl_pos_1LC)
        p = self.cfg.patch_nums[si]
        feat_BCpp = F.interpolate(state.f_hat_BChw, size=(p, p), mode="area")
        x_BNC = self.var.embed_tokens(feat_BCpp.flatten(2).transpose(1, 2), si, state.lvl_pos_1LC)
        return x_BNC.repeat(2, 1, 1) if state.guidance is GuidanceMode.BOTH else x_BNC

    def run_branch(self, state: VARState, si: int, block: int, branch: str, x_RnC: torch.Tensor,
                   keep_Rn: torch.Tensor | None, valid_Rn: torch.Tensor | None, cache: KVCache, want_probs: bool,
                   packing: RowPacking | None = None, pattern=None):
        blk = self.var.blocks[block]
        mods = state.modulations[block]
        if branch == "ffn":
            return blk.ffn_branch(x_RnC, mods, packing), None
        if branch != "attn":
            raise ValueError(f"VAR blocks have branches 'attn' and 'ffn', not {branch!r}")
        q, k, v = blk.attn.project_qkv(blk.attn_input(x_RnC, mods), packing)
        kv = cache.append(block, k, v, valid_Rn)
        # ragged rows: attention on each row's valid queries and keys (padding queries are dropped by the packing)
        core = CachedAttention(kv, valid_Rn if packing is not None else None, pattern)
        out, _ = blk.attn.attend(q, kv.keys, kv.values, kv.bias, packing=packing, core=core)
        return blk.attn_output(out, mods), (core.probe() if want_probs else None)

    def row_packing(self, keep_Rn: torch.Tensor, valid_Rn: torch.Tensor | None) -> RowPacking | None:
        # ragged selections: QKV, out-projection and MLP on the valid tokens only (attention: engine.attention)
        return RowPacking(keep_Rn, valid_Rn) if RowPacking.worthwhile(valid_Rn) else None

    def logits(self, state: VARState, x_RNC: torch.Tensor) -> torch.Tensor:
        return self.var.logits(x_RNC, state.cond_RD)

    def head_parts(self, state: VARState, x_RNC: torch.Tensor, rows: torch.Tensor | None = None):
        cond = state.cond_RD if rows is None else state.cond_RD[rows]
        return self.var.head_input(x_RNC, cond), self.var.head

    def guide(self, state: VARState, si: int, logits_RNV: torch.Tensor, sampling: SamplingConfig,
              cond_only_B: torch.Tensor | None = None) -> torch.Tensor:
        if state.guidance is not GuidanceMode.BOTH:
            return logits_RNV  # one half only: its logits are used as they are
        B = state.batch_size
        t = sampling.cfg * si / max(1, self.num_scales - 1)
        guided = (1 + t) * logits_RNV[:B] - t * logits_RNV[B:]
        if cond_only_B is not None:  # samples whose guidance a policy stopped while others still use it
            guided = torch.where(cond_only_B.view(B, 1, 1), logits_RNV[:B], guided)
        return guided

    def sample(self, guided_BNV, sampling, generators, shared_generator):
        return draw_categorical(guided_BNV, sampling, generators, shared_generator)

    def update_latent(self, state: VARState, si: int, tokens_BN: torch.Tensor, keep_BN: torch.Tensor | None = None
                      ) -> torch.Tensor:
        p = self.cfg.patch_nums[si]
        h_BChw = self.vae.quantize.embed_idx(tokens_BN, p)
        if keep_BN is not None:  # sparse residual: masked tokens add a zero code map (then bicubic + Phi as usual)
            h_BChw = h_BChw * keep_BN.view(-1, 1, p, p).to(device=h_BChw.device, dtype=h_BChw.dtype)
        state.f_hat_BChw = self.vae.quantize.next_autoregressive_input(si, state.f_hat_BChw, h_BChw)[0]
        return h_BChw

    def decode(self, state: VARState) -> torch.Tensor:
        return self.vae.fhat_to_img(state.f_hat_BChw).add(1).mul(0.5)

    def decode_preview(self, state: VARState, grid_scale: int) -> torch.Tensor:
        """``f_hat`` area-resized to scale ``grid_scale``'s token grid (VAR's own downsampling) and decoded."""
        size = tuple(self.scale_hw[grid_scale])
        return self.vae.fhat_to_img(F.interpolate(state.f_hat_BChw, size=size, mode="area")).add(1).mul(0.5)

    def latent(self, state: VARState) -> torch.Tensor:
        return state.f_hat_BChw

    def tokenizer_fingerprint(self) -> str:
        """SHA-256 of the VQVAE's configuration and every tensor of its state dict (computed once per adapter)."""
        cached = getattr(self, "_tokenizer_fingerprint", None)
        if cached is None:
            import hashlib
            import json

            digest = hashlib.sha256(json.dumps(getattr(self.vae, "config", {}), sort_keys=True, default=str).encode())
            for name, tensor in sorted(self.vae.state_dict().items()):
                digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            cached = self._tokenizer_fingerprint = digest.hexdigest()
        return cached

    def replay_latent(self, state: VARState, si: int, record) -> None:
        # the same op update_latent applied to the same (possibly masked) residual map: f_hat matches bitwise
        state.f_hat_BChw = self.vae.quantize.next_autoregressive_input(si, state.f_hat_BChw, record.residual_BChw)[0]

    def adopt_latent(self, state: VARState, latent: torch.Tensor) -> None:
        state.f_hat_BChw = latent

    def select_rows(self, state: VARState, rows: slice, guidance: GuidanceMode) -> None:
        state.cond_RD = state.cond_RD[rows]
        state.modulations = [tuple(m[rows] for m in mods) for mods in state.modulations]
        state.guidance = guidance
