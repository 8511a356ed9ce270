"""SkipVAR's per-sample decision: after scale 9, a logistic model on two image features picks how many of the last
scales to leave out (c) or, when none, from which scale on the unconditional rows are dropped (u)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..base import NO_NEEDS, Needs, ScaleSkip, Signals, SkipDecision
from ..knobs import ComponentConfig, knob
from ..registry import SKIPS
from ..skipvar_models import DEFAULT_MODEL, load_models

EXTRAS_KEY = "skipvar"


def sobel_magnitude(gray_B1HW: torch.Tensor) -> torch.Tensor:
    """``sqrt(Gx² + Gy²)`` with the 3×3 Sobel kernels (x: rows ``[1, 0, −1], [2, 0, −2], [1, 0, −1]``; y: its
    transpose), zero padding 1, as SkipVAR's ``extract_high_freq_sobel``."""
    kx = torch.tensor([[1.0, 0.0, -1.0], [2.0, 0.0, -2.0], [1.0, 0.0, -1.0]], dtype=gray_B1HW.dtype,
                      device=gray_B1HW.device).view(1, 1, 3, 3)
    gx = F.conv2d(gray_B1HW, kx, padding=1)
    gy = F.conv2d(gray_B1HW, kx.transpose(2, 3), padding=1)
    return torch.sqrt(gx ** 2 + gy ** 2)


def high_frequency_share(gray_B1HW: torch.Tensor, radius_ratio: float = 0.4) -> torch.Tensor:
    """``[B]``: the share of the centred FFT amplitude outside the circle of radius
    ``int(radius_ratio · min(H, W) / 2)`` around ``(H // 2, W // 2)`` (strictly outside), over the total + 1e-6."""
    # shift the two image dims only: the released call shifts every dim, the batch one too (a no-op at its batch 1)
    amplitude = torch.fft.fftshift(torch.fft.fft2(gray_B1HW.float()), dim=(-2, -1)).abs()
    H, W = amplitude.shape[-2:]
    radius = int(radius_ratio * min(H, W) / 2)
    y = torch.arange(H, device=amplitude.device).view(H, 1) - H // 2
    x = torch.arange(W, device=amplitude.device).view(1, W) - W // 2
    outside = ((y ** 2 + x ** 2).float().sqrt() > radius).to(amplitude.dtype)
    return (amplitude * outside).sum(dim=(-2, -1)).flatten() / (amplitude.sum(dim=(-2, -1)).flatten() + 1e-6)


def skipvar_features(new_B3HW: torch.Tensor, old_B3HW: torch.Tensor, radius_ratio: float = 0.4) -> torch.Tensor:
    """``[B, 2]`` (HF_Diff, HF_Ratio) from two decoded previews in the VAE's output range ([−1, 1]): the mean
    absolute difference of the Sobel magnitudes of the channel-mean images, and the new image's high-frequency
    share. Per sample (the released code averages over its batch of one)."""
    new_gray, old_gray = new_B3HW.float().mean(1, keepdim=True), old_B3HW.float().mean(1, keepdim=True)
    diff = (sobel_magnitude(new_gray) - sobel_magnitude(old_gray)).abs().flatten(1).mean(1)
    return torch.stack([diff, high_frequency_share(new_gray, radius_ratio)], dim=1)


@SKIPS.register("skipvar_decision")
class SkipVARDecision(ScaleSkip):
    """SkipVAR (arXiv 2506.08908; code fakerone-li/SkipVAR, ``autoregressive_infer_cfg_SkipVAR``) as released, on
    Infinity. Knob: ``model`` (the decision models: ``decision_model_ssim_84`` as the released code loads it;
    ``_86`` / ``_88`` / ``_84_diff_only`` ship too; or a JSON made by ``python -m var_core.accel.skipvar_models``).

    After scale ``decision_scale`` (9 of Infinity-1024's 13) the summed codes after scales 8 and 9 are each resized
    to the latent grid of scale ``preview_scale`` (4: 8×8) and decoded; features: HF_Diff (mean |ΔSobel
    magnitude| of the gray images) and HF_Ratio (FFT amplitude share of the new gray image outside radius
    ``int(0.4·min(H, W)/2)``). The skip model's class ``c`` leaves out the last ``c`` of the three scales after the
    decision (c = 3, 2, 1 stop before scales 10, 11, 12); only for ``c = 0`` the uncond model's class ``u`` drops
    the unconditional rows on the last ``u`` of them (from 12, 11, 10 for u = 1, 2, 3), which the
    ``skipvar_uncond`` guidance applies (``signals.extras["skipvar"]``). As in the released code these scales are
    absolute (``decision_scale`` + 1 … + 3): on a schedule without a scale after ``decision_scale`` (e.g. the
    5-scale tiny Infinity) no decision is taken and the sample runs in full, as the released sampler would. The
    models' numbers ship as JSON (read from the released pickles without executing them).

    On VAR the mechanics run (previews of ``f_hat`` area-resized to the grid) but the shipped models were trained
    on Infinity-2B's previews, so their thresholds mean nothing there: the ``skipvar`` preset uses the static
    reading on VAR and HART; this component on VAR is for users with their own models.

    Batch rule (ours; the released code runs one image at a time): a sample that reached its stop keeps running
    with the batch but its latent is frozen (its later residuals are masked out of the latent), so each sample's
    image is exactly what it gets alone; the batch stops once every sample has reached its stop. At batch 1 this is
    the released rule. Diagnostics in ``signals.extras["skipvar"]``: ``features_B2``, ``c_B``, ``u_B`` (−1 where
    not asked), ``stop_B`` (first scale not generated; K = never), ``cond_from_B`` (first conditional-only scale;
    K = never).
    """

    batch_coupled: ClassVar[bool] = False

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        model: str = knob(DEFAULT_MODEL, "SkipVAR decision models: a shipped name (decision_model_ssim_84 / _86 / "
                          "_88 / _84_diff_only) or a converted JSON file")
        decision_scale: int = knob(9, "scale after which the decision is taken (0-indexed; -k = k-th from the end; "
                                   "the released code: 9 of 13)", unit="scale")
        preview_scale: int = knob(4, "scale whose latent grid the two previews are decoded at (released: 4, 8x8)",
                                  low=0, unit="scale")
        radius_ratio: float = knob(0.4, "HF_Ratio: radius of the low-frequency disc as a share of min(H, W)/2",
                                   low=0.0, high=1.0, low_open=True)

    def __init__(self, config=None):
        super().__init__(config)
        self._models = load_models(self.config.model)

    def _decision_scale(self, num_scales: int) -> int:
        s = self.config.decision_scale
        return s if s >= 0 else num_scales + s

    def check_model(self, info) -> None:
        d = self._decision_scale(info.num_scales)
        if d < 1:
            raise ValueError(f"skip 'skipvar_decision': decision_scale={self.config.decision_scale} must leave a "
                             f"scale before it (the features compare the previews after it and after the one "
                             f"before); use 1..{info.num_scales - 2}")
        if d < info.num_scales - 1 and not 0 <= self.config.preview_scale < info.num_scales:
            raise ValueError(f"skip 'skipvar_decision': preview_scale={self.config.preview_scale} is outside the "
                             f"{info.num_scales} scales")
        if info.family == "hart":
            raise ValueError("skip 'skipvar_decision': the HART adapter does not decode latent previews; SkipVAR's "
                             "decision models were trained on Infinity-2B anyway (use the preset 'skipvar', whose "
                             "HART setting is the static reading, or 'skipvar_static')")

    def start(self, info, signals: Signals) -> None:
        self.check_model(info)
        B, K = info.batch_size, info.num_scales
        self._num_scales = K
        self._decision = self._decision_scale(K)
        self._previous = None
        signals.extras[EXTRAS_KEY] = dict(
            features_B2=torch.full((B, 2), float("nan")), c_B=torch.full((B,), -1, dtype=torch.long),
            u_B=torch.full((B,), -1, dtype=torch.long), stop_B=torch.full((B,), K, dtype=torch.long),
            cond_from_B=torch.full((B,), K, dtype=torch.long), stopped_at=None, model=self._models.name)

    def needs(self, ctx, signals: Signals) -> Needs:
        if self._decision < ctx.num_scales - 1 and ctx.scale_index in (self._decision - 1, self._decision):
            return Needs(preview_scales=frozenset({self.config.preview_scale}))
        return NO_NEEDS

    def end_scale(self, ctx, record, signals: Signals) -> None:
        si = ctx.scale_index
        if si not in (self._decision - 1, self._decision) or record.skipped or self._decision >= ctx.num_scales - 1:
            return
        preview = dict(record.previews_B3HW).get(self.config.preview_scale)
        if preview is None:
            return
        vae_range = preview.float() * 2 - 1  # the features read the VAE's raw output range, [-1, 1]
        if si == self._decision - 1:
            self._previous = vae_range
            return
        if self._previous is None:
            return
        state = signals.extras[EXTRAS_KEY]
        features = skipvar_features(vae_range, self._previous, self.config.radius_ratio).double().cpu()
        self._previous = None
        state["features_B2"] = features.float()
        inputs = features[:, : self._models.num_features]
        c_B = self._models.skip.predict(inputs)
        u_B = torch.where(c_B == 0, self._models.uncond.predict(inputs), torch.full_like(c_B, -1))
        K = self._num_scales
        state["c_B"], state["u_B"] = c_B, u_B
        after_last = self._decision + 4  # the released code's scales 10, 11, 12 follow its decision at 9
        state["stop_B"] = torch.where(c_B > 0, after_last - c_B, torch.full_like(c_B, K)).clamp(max=K)
        state["cond_from_B"] = torch.where(u_B > 0, after_last - u_B, torch.full_like(u_B, K)).clamp(max=K)

    def _stopped_B(self, ctx, signals: Signals) -> torch.Tensor:
        return signals.extras[EXTRAS_KEY]["stop_B"] <= ctx.scale_index

    def decide(self, ctx, signals: Signals) -> SkipDecision:
        stopped = self._stopped_B(ctx, signals)
        if not bool(stopped.all()):
            return SkipDecision()
        state = signals.extras[EXTRAS_KEY]
        if state["stopped_at"] is None:
            state["stopped_at"] = ctx.scale_index
        return SkipDecision(stop=True)

    def latent_mask(self, ctx, signals: Signals) -> torch.Tensor | None:
        stopped = self._stopped_B(ctx, signals)
        if not bool(stopped.any()):
            return None
        return (~stopped).view(-1, 1).expand(-1, ctx.num_tokens)
