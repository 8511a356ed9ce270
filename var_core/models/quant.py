"""Multi-scale residual vector quantizer of VAR (Tian et al., 2024), re-implemented.

Behaviour and parameter layout follow the official ``VectorQuantizer2`` (``models/quant.py`` of
FoundationVision/VAR, see ``specs/reference_models.md`` §1.3), so that the quantizer part of the official
VQVAE state_dicts (``quantize.*``) loads with ``strict=True`` and gives the same tokens:

* ``embedding``: ``nn.Embedding(V, Cvae)``, the codebook.
* ``quant_resi``: the Phi convolutions (3x3, with bias), ``Phi(h) = (1-r)·h + r·conv(h)`` with ``r = |quant_resi|``.
  Key layout depends on ``share_quant_resi`` exactly as in the official code:
  ``K >= 2`` → ``quant_resi.qresi_ls.{k}`` (partially shared, always ``K = 4`` in released checkpoints);
  ``1`` → ``quant_resi.qresi`` (one shared Phi); ``0`` → ``quant_resi.{si}`` (one Phi per scale).
* buffer ``ema_vocab_hit_SV [num_scales, V]``: codebook hit statistics, only used in training.

Scale ``si`` of ``SN`` uses Phi number ``argmin_k |ticks[k] - si/(SN-1)|`` (float64, numpy first-min rule); see
:func:`phi_index_table`.

Deliberate differences from the official API (values are unchanged):

* methods return new tensors instead of updating ``f_hat`` in place;
* :meth:`MultiScaleResidualQuantizer.next_autoregressive_input` returns ``None`` as the next input at the
  last scale (the official ``get_next_autoregressive_input`` returns ``f_hat`` twice);
* the EMA hit statistics are updated in training mode also without ``torch.distributed`` (the official code only
  updates them when a process group exists).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "MEASURED_PHI_TABLES_K4",
    "MultiScaleResidualQuantizer",
    "Phi",
    "phi_index_table",
]

# Scale -> Phi index for share_quant_resi=4, measured with the official code (spec §1.3). Some entries are exact
# ties in real arithmetic (e.g. 10 scales, si=2 and si=7; 7 scales, si=3) that float64 rounding decides.
MEASURED_PHI_TABLES_K4: dict[int, tuple[int, ...]] = {
    4: (0, 1, 2, 3),
    5: (0, 1, 2, 2, 3),
    6: (0, 0, 1, 2, 3, 3),
    7: (0, 0, 1, 2, 2, 3, 3),
    8: (0, 0, 1, 1, 2, 2, 3, 3),
    10: (0, 0, 1, 1, 1, 2, 2, 3, 3, 3),
    14: (0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3),
}


def _official_ticks(num_phis: int) -> np.ndarray:
    """Tick positions of the official Phi containers: spacing 1/(3K) for K=4, 1/(2K) otherwise (float64)."""
    k = num_phis
    if k == 4:
        return np.linspace(1 / 3 / k, 1 - 1 / 3 / k, k)
    return np.linspace(1 / 2 / k, 1 - 1 / 2 / k, k)


def phi_index_table(num_scales: int, share_quant_resi: int = 4) -> tuple[int, ...]:
    """Which Phi each scale uses, as the official partially/non/fully shared Phi containers pick it.

    ``share_quant_resi``: ``0`` → one Phi per scale (``K = num_scales``, which maps scale ``si`` to Phi ``si``);
    ``1`` → a single shared Phi (always 0); ``K >= 2`` → ``argmin_k |ticks[k] - si/(SN-1)|`` in float64 with numpy's
    first-minimum rule. For ``K = 4`` the tables measured with the official code are used where known.
    """
    if num_scales < 1:
        raise ValueError(f"num_scales must be >= 1, got {num_scales}")
    if share_quant_resi < 0:
        raise ValueError(f"share_quant_resi must be >= 0, got {share_quant_resi}")
    if share_quant_resi == 1:
        return (0,) * num_scales
    if share_quant_resi == 4 and num_scales in MEASURED_PHI_TABLES_K4:
        return MEASURED_PHI_TABLES_K4[num_scales]
    num_phis = num_scales if share_quant_resi == 0 else share_quant_resi
    return _tick_argmin_table(num_scales, num_phis)


def _tick_argmin_table(num_scales: int, num_phis: int) -> tuple[int, ...]:
    """The official float64 rule ``argmin_k |ticks[k] - si/(SN-1)|`` (numpy first minimum on ties)."""
    if num_scales == 1:  # the official code divides by SN-1 = 0 here; the single scale takes the first Phi
        return (0,)
    ticks = _official_ticks(num_phis)
    return tuple(int(np.argmin(np.abs(ticks - si / (num_scales - 1)))) for si in range(num_scales))


class Phi(nn.Conv2d):
    """Residual 3x3 conv of VAR's quantizer: ``Phi(h) = (1-r)·h + r·conv(h)`` (official ``Phi``, a Conv2d subclass,
    so its parameters are named ``weight`` / ``bias`` directly)."""

    def __init__(self, channels: int, quant_resi: float):
        super().__init__(channels, channels, kernel_size=3, stride=1, padding=1)
        self.resi_ratio = abs(float(quant_resi))

    def forward(self, h_BChw: torch.Tensor) -> torch.Tensor:
        return h_BChw.mul(1 - self.resi_ratio) + super().forward(h_BChw).mul(self.resi_ratio)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, resi_ratio={self.resi_ratio}"


def _make_phi(channels: int, quant_resi: float) -> nn.Module:
    # The official code uses an identity instead of Phi when |quant_resi| <= 1e-6.
    return Phi(channels, quant_resi) if abs(quant_resi) > 1e-6 else nn.Identity()


class _PhiPartiallyShared(nn.Module):
    """K Phi's under ``qresi_ls.{k}`` (official ``PhiPartiallyShared``)."""

    def __init__(self, phis: Sequence[nn.Module]):
        super().__init__()
        self.qresi_ls = nn.ModuleList(phis)

    def __getitem__(self, k: int) -> nn.Module:
        return self.qresi_ls[k]

    def __len__(self) -> int:
        return len(self.qresi_ls)


class _PhiShared(nn.Module):
    """One Phi under ``qresi`` (official ``PhiShared``)."""

    def __init__(self, phi: nn.Module):
        super().__init__()
        self.qresi = phi

    def __getitem__(self, k: int) -> nn.Module:
        return self.qresi

    def __len__(self) -> int:
        return 1


class _PhiNonShared(nn.ModuleList):
    """One Phi per scale under ``{si}`` (official ``PhiNonShared``, itself a ModuleList)."""


class MultiScaleResidualQuantizer(nn.Module):
    """VAR's multi-scale residual quantizer (official ``VectorQuantizer2`` with ``using_znorm=False``).

    Feature maps are ``[B, Cvae, H, W]`` with ``H = W = patch_nums[-1]``. Token maps are returned flattened
    row-major (h, then w) as ``[B, pn*pn]`` int64 tensors.
    """

    def __init__(
        self,
        vocab_size: int,
        z_channels: int,
        patch_nums: Sequence[int],
        share_quant_resi: int = 4,
        quant_resi: float = 0.5,
        beta: float = 0.25,
    ):
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.z_channels = int(z_channels)
        self.patch_nums: tuple[int, ...] = tuple(int(p) for p in patch_nums)
        if not self.patch_nums:
            raise ValueError("patch_nums must not be empty")
        self.share_quant_resi = int(share_quant_resi)
        self.quant_resi_ratio = float(quant_resi)
        self.beta = float(beta)

        num_scales = len(self.patch_nums)
        # Registration order (quant_resi, then embedding) matches the official state_dict order.
        if self.share_quant_resi == 0:
            self.quant_resi = _PhiNonShared([_make_phi(z_channels, quant_resi) for _ in range(num_scales)])
        elif self.share_quant_resi == 1:
            self.quant_resi = _PhiShared(_make_phi(z_channels, quant_resi))
        else:
            self.quant_resi = _PhiPartiallyShared(
                [_make_phi(z_channels, quant_resi) for _ in range(self.share_quant_resi)]
            )
        self._phi_table = phi_index_table(num_scales, self.share_quant_resi)

        self.register_buffer("ema_vocab_hit_SV", torch.zeros(num_scales, self.vocab_size))
        self.record_hit = 0  # number of EMA updates so far (not saved, as in the official code)
        self.embedding = nn.Embedding(self.vocab_size, self.z_channels)

    # ------------------------------------------------------------------ basics
    @property
    def num_scales(self) -> int:
        return len(self.patch_nums)

    @property
    def phi_table(self) -> tuple[int, ...]:
        """Scale -> Phi index for every scale."""
        return self._phi_table

    def extra_repr(self) -> str:
        return (
            f"V={self.vocab_size}, Cvae={self.z_channels}, patch_nums={self.patch_nums}, "
            f"share_quant_resi={self.share_quant_resi}, quant_resi={self.quant_resi_ratio}, beta={self.beta}, "
            f"phi_table={self._phi_table}"
        )

    def phi_index(self, si: int) -> int:
        """Index of the Phi used at scale ``si`` (official ``quant_resi[si/(SN-1)]``)."""
        return self._phi_table[si]

    def phi(self, si: int, h_BChw: torch.Tensor) -> torch.Tensor:
        """Apply the Phi of scale ``si``."""
        return self.quant_resi[self._phi_table[si]](h_BChw)

    def embed_idx(self, idx_Bl: torch.Tensor, pn: int) -> torch.Tensor:
        """Codebook vectors of a row-major token map ``[B, pn*pn]`` (or ``[B, pn, pn]``) as ``[B, Cvae, pn, pn]``."""
        B = idx_Bl.shape[0]
        return self.embedding(idx_Bl.reshape(B, pn, pn)).permute(0, 3, 1, 2).contiguous()

    def _upsample(self, si: int, h_BChw: torch.Tensor) -> torch.Tensor:
        """Bicubic (align_corners=False) to the full latent size, except at the last scale."""
        if si == self.num_scales - 1:
            return h_BChw
        full = self.patch_nums[-1]
        return F.interpolate(h_BChw, size=(full, full), mode="bicubic", align_corners=False).contiguous()

    @staticmethod
    def _area(f_BChw: torch.Tensor, pn: int) -> torch.Tensor:
        return F.interpolate(f_BChw, size=(pn, pn), mode="area")

    def _nearest_code(self, z_NC: torch.Tensor) -> torch.Tensor:
        """Plain L2 nearest codeword, distances as ``|z|² + |e|² - 2 z·e`` (the official addmm form)."""
        e_VC = self.embedding.weight.detach()
        d_NV = z_NC.square().sum(dim=1, keepdim=True) + e_VC.square().sum(dim=1)
        d_NV = torch.addmm(d_NV, z_NC, e_VC.T, beta=1, alpha=-2)
        return d_NV.argmin(dim=1)

    def _scale_input(self, si: int, f_rest_BChw: torch.Tensor) -> torch.Tensor:
        """Residual at scale ``si`` as ``[B*pn*pn, C]``: area-resized except at the last scale."""
        pn = self.patch_nums[si]
        z = self._area(f_rest_BChw, pn) if si != self.num_scales - 1 else f_rest_BChw
        return z.permute(0, 2, 3, 1).reshape(-1, f_rest_BChw.shape[1])

    def _check_f(self, f_BChw: torch.Tensor) -> None:
        full = self.patch_nums[-1]
        if f_BChw.dim() != 4 or f_BChw.shape[1] != self.z_channels or tuple(f_BChw.shape[2:]) != (full, full):
            raise ValueError(
                f"expected f_BChw of shape [B, {self.z_channels}, {full}, {full}], got {tuple(f_BChw.shape)}"
            )

    # ------------------------------------------------------------------ encoding
    def _encode(self, f_BChw: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Official ``f_to_idxBl_or_fhat``: returns (idx per scale, cumulative f_hat per scale)."""
        self._check_f(f_BChw)
        B = f_BChw.shape[0]
        f_rest = f_BChw.detach().clone()
        f_hat = torch.zeros_like(f_rest)
        idx_list: list[torch.Tensor] = []
        fhat_list: list[torch.Tensor] = []
        for si, pn in enumerate(self.patch_nums):
            idx_N = self._nearest_code(self._scale_input(si, f_rest))
            h_BChw = self.phi(si, self._upsample(si, self.embed_idx(idx_N.view(B, pn * pn), pn)))
            f_hat = f_hat + h_BChw
            f_rest = f_rest - h_BChw
            idx_list.append(idx_N.reshape(B, pn * pn))
            fhat_list.append(f_hat)
        return idx_list, fhat_list

    def f_to_idx_list(self, f_BChw: torch.Tensor) -> list[torch.Tensor]:
        """Token maps of every scale, each ``[B, pn*pn]`` int64 (official ``f_to_idxBl_or_fhat(f, to_fhat=False)``)."""
        return self._encode(f_BChw)[0]

    def f_to_fhat_list(self, f_BChw: torch.Tensor) -> list[torch.Tensor]:
        """Cumulative ``f_hat`` after each scale, each ``[B, Cvae, H, W]`` (official ``to_fhat=True``)."""
        return self._encode(f_BChw)[1]

    def idx_list_to_fhat(self, idx_list: Sequence[torch.Tensor], return_all: bool = False):
        """Decode token maps (the first ``len(idx_list)`` scales) into the accumulated ``f_hat [B, Cvae, H, W]``
        (official ``embed_to_fhat(..., all_to_max_scale=True)``). With ``return_all`` a list after every scale."""
        if not 1 <= len(idx_list) <= self.num_scales:
            raise ValueError(f"expected 1..{self.num_scales} token maps, got {len(idx_list)}")
        B = idx_list[0].shape[0]
        full = self.patch_nums[-1]
        f_hat = self.embedding.weight.new_zeros(B, self.z_channels, full, full)
        out: list[torch.Tensor] = []
        for si, idx_Bl in enumerate(idx_list):
            h_BChw = self.embed_idx(idx_Bl, self.patch_nums[si])
            f_hat = f_hat + self.phi(si, self._upsample(si, h_BChw))
            out.append(f_hat)
        return out if return_all else f_hat

    # ------------------------------------------------------------------ VAR interface
    def idx_list_to_var_input(self, idx_list: Sequence[torch.Tensor]) -> torch.Tensor:
        """Teacher-forcing input of VAR, ``[B, L - first_l, Cvae]`` (official ``idxBl_to_var_input``).

        For si = 0..SN-2: ``f_hat += Phi_si(bicubic(embed(idx_si)))``; emit ``area(f_hat, pn_{si+1})`` flattened
        row-major. The first scale has no VAE input (the class token takes its place).
        """
        if len(idx_list) < self.num_scales - 1:
            raise ValueError(f"need at least {self.num_scales - 1} token maps, got {len(idx_list)}")
        B = idx_list[0].shape[0]
        full = self.patch_nums[-1]
        f_hat = self.embedding.weight.new_zeros(B, self.z_channels, full, full)
        chunks: list[torch.Tensor] = []
        for si in range(self.num_scales - 1):
            h_BChw = self.embed_idx(idx_list[si], self.patch_nums[si])
            h_BChw = F.interpolate(h_BChw, size=(full, full), mode="bicubic", align_corners=False)
            f_hat = f_hat + self.phi(si, h_BChw)
            pn_next = self.patch_nums[si + 1]
            chunks.append(self._area(f_hat, pn_next).flatten(2).transpose(1, 2))
        if not chunks:
            return f_hat.new_zeros(B, 0, self.z_channels)
        return torch.cat(chunks, dim=1)

    def next_autoregressive_input(
        self, si: int, f_hat_BChw: torch.Tensor, h_BChw: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step of VAR inference (official ``get_next_autoregressive_input``, but not in place).

        ``h_BChw`` is the embedded token map of scale ``si`` (``[B, Cvae, pn, pn]``). Returns the new
        ``f_hat = f_hat + Phi_si(bicubic(h))`` and the next scale's input ``area(f_hat, pn_{si+1})``; at the last
        scale there is no resize and the next input is ``None``.
        """
        f_hat_new = f_hat_BChw + self.phi(si, self._upsample(si, h_BChw))
        if si == self.num_scales - 1:
            return f_hat_new, None
        return f_hat_new, self._area(f_hat_new, self.patch_nums[si + 1])

    # ------------------------------------------------------------------ training
    def forward(self, f_BChw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Training pass (official ``VectorQuantizer2.forward``).

        Returns ``(f_hat_st, vq_loss, stats)``: ``f_hat_st`` has the value of the quantized ``f_hat`` and the
        gradient of the identity w.r.t. ``f_BChw`` (straight-through). ``vq_loss`` is the mean over scales of
        ``beta·mse(sg[f_hat_si], f) + mse(f_hat_si, sg[f])`` where ``f_hat_si`` is the cumulative reconstruction after
        scale ``si`` (commitment term to the encoder, codebook term to ``embedding`` and the Phi's).
        ``stats``: ``hits_SV`` (float [SN, V] codeword hits of this batch), ``usage_per_scale`` (float [SN],
        fraction of codes hit at each scale), ``usage`` (float scalar tensor, fraction hit at any scale).
        In training mode the EMA hit buffer is updated (copy, then 0.9/0.1 for 100 updates, then 0.99/0.01).
        """
        f_BChw = f_BChw.float()
        self._check_f(f_BChw)
        B = f_BChw.shape[0]
        f_no_grad = f_BChw.detach()
        f_rest = f_no_grad.clone()
        f_hat = torch.zeros_like(f_no_grad)
        vq_loss = f_BChw.new_zeros(())
        hits: list[torch.Tensor] = []
        for si, pn in enumerate(self.patch_nums):
            idx_N = self._nearest_code(self._scale_input(si, f_rest))
            hits.append(torch.bincount(idx_N, minlength=self.vocab_size).float())
            h_BChw = self.phi(si, self._upsample(si, self.embed_idx(idx_N.view(B, pn, pn), pn)))
            f_hat = f_hat + h_BChw
            f_rest = f_rest - h_BChw.detach()
            vq_loss = vq_loss + self.beta * F.mse_loss(f_hat.detach(), f_BChw) + F.mse_loss(f_hat, f_no_grad)
        vq_loss = vq_loss / self.num_scales
        f_hat_st = f_BChw + (f_hat - f_BChw).detach()

        hits_SV = torch.stack(hits)
        if self.training:
            self._update_ema_hits(hits_SV)
        stats = {
            "hits_SV": hits_SV,
            "usage_per_scale": (hits_SV > 0).float().mean(dim=1),
            "usage": (hits_SV.sum(0) > 0).float().mean(),
        }
        return f_hat_st, vq_loss, stats

    @torch.no_grad()
    def _update_ema_hits(self, hits_SV: torch.Tensor) -> None:
        if self.record_hit == 0:
            self.ema_vocab_hit_SV.copy_(hits_SV)
        elif self.record_hit < 100:
            self.ema_vocab_hit_SV.mul_(0.9).add_(hits_SV, alpha=0.1)
        else:
            self.ema_vocab_hit_SV.mul_(0.99).add_(hits_SV, alpha=0.01)
        self.record_hit += 1

    @torch.no_grad()
    def restart_dead_codes(
        self,
        f_samples: torch.Tensor,
        min_usage: float,
        usage_V: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> int:
        """Re-initialise rarely used codewords from encoder outputs (a training aid, not in the official code).

        A code is dead when its usage is below ``min_usage``; usage is ``usage_V`` if given, else the EMA hit
        count summed over scales (``ema_vocab_hit_SV.sum(0)``, hits per batch). Dead codes are replaced by feature
        vectors drawn from ``f_samples`` (``[B, Cvae, h, w]`` or ``[N, Cvae]``) without replacement when enough
        vectors exist, with ``generator`` (CPU) for determinism. Their EMA counts are set to the per-scale mean so
        they get a grace period. Returns the number of restarted codes.
        """
        if usage_V is None:
            usage_V = self.ema_vocab_hit_SV.sum(0)
        dead_idx = torch.nonzero(usage_V.to(self.ema_vocab_hit_SV.device) < min_usage).flatten()
        n_dead = int(dead_idx.numel())
        if n_dead == 0:
            return 0
        if f_samples.dim() == 4:
            feats_NC = f_samples.detach().permute(0, 2, 3, 1).reshape(-1, f_samples.shape[1])
        elif f_samples.dim() == 2:
            feats_NC = f_samples.detach()
        else:
            raise ValueError(f"f_samples must be [B, C, h, w] or [N, C], got {tuple(f_samples.shape)}")
        if feats_NC.shape[1] != self.z_channels or feats_NC.shape[0] == 0:
            raise ValueError(f"f_samples must hold vectors of {self.z_channels} channels, got {tuple(f_samples.shape)}")
        n = feats_NC.shape[0]
        if n >= n_dead:
            pick = torch.randperm(n, generator=generator)[:n_dead]
        else:
            pick = torch.randint(n, (n_dead,), generator=generator)
        weight = self.embedding.weight
        weight[dead_idx.to(weight.device)] = feats_NC[pick.to(feats_NC.device)].to(weight)
        ema = self.ema_vocab_hit_SV
        ema[:, dead_idx] = ema.mean(dim=1, keepdim=True).expand(-1, n_dead)
        return n_dead

    # ------------------------------------------------------------------ loading
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        """Like the official ``VQVAE.load_state_dict``: a checkpoint ``ema_vocab_hit_SV`` with a different number of
        scales is replaced by this model's own buffer (so 10-scale checkpoints load into other schedules).
        ``state_dict`` here is the private copy made by ``nn.Module.load_state_dict``."""
        key = prefix + "ema_vocab_hit_SV"
        ckpt = state_dict.get(key)
        if ckpt is not None and ckpt.dim() >= 1 and ckpt.shape[0] != self.ema_vocab_hit_SV.shape[0]:
            state_dict[key] = self.ema_vocab_hit_SV.detach().clone()
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
