"""LD-Pruning's pixel-domain criterion: where the decoded image changed last, brought to the token grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..base import NO_NEEDS, Needs, Scorer, Signals
from ..knobs import ComponentConfig, knob
from ..registry import SCORERS

POOLS = ("area", "max")


def pixel_change_map(image_B3HW: torch.Tensor, previous_B3HW: torch.Tensor | None, hw: tuple[int, int],
                     pool: str = "area") -> torch.Tensor:
    """``[B, h·w]``: ``mean_RGB |I − I_prev|`` pooled onto the ``h × w`` token grid (``area``: the mean over the
    pixels each token covers, PyTorch's adaptive average pooling; ``max``: their maximum). ``previous`` None
    compares with a black image (nothing decoded before)."""
    image = image_B3HW.float()
    previous = torch.zeros_like(image) if previous_B3HW is None else previous_B3HW.float().to(image.device)
    change_B1HW = (image - previous).abs().mean(1, keepdim=True)
    if pool == "area":
        pooled = F.adaptive_avg_pool2d(change_B1HW, hw)
    elif pool == "max":
        pooled = F.adaptive_max_pool2d(change_B1HW, hw)
    else:
        raise ValueError(f"unknown pool {pool!r}; choose one of {POOLS}")
    return pooled.flatten(1)


def may_prune_soon(si: int, num_scales: int, signals: Signals, ahead: int) -> bool:
    """Whether one of the ``ahead`` scales after ``si`` may be accelerated (activation scale unpublished, within
    reach, or not decided yet)."""
    if si >= num_scales - 1:
        return False
    first = signals.activation_scale_B
    return first is None or bool(((first <= si + ahead) | (first >= num_scales)).any())


@SCORERS.register("pixel_change")
class PixelChange(Scorer):
    """LD-Pruning (arXiv 2606.00310) §4.1 pixel-domain criterion: decoded ``|I_{k−1} − I_{k−2}|``; high = keep.
    Knob: ``pool``.

    ``I_j`` is the image decoded from the latent accumulated up to scale ``j`` (the loop decodes it when a plan
    asks: ``Needs(decoded_image=True)`` → ``ScaleRecord.image_B3HW``; one VAE decode per scale, requested on
    every scale that is followed within two scales by one that may be pruned, and on every scale while an
    adaptive activation is undecided). That decode is why the paper calls direct pixel-domain selection slow
    (Fig. 2(b)); it is timed as the ``accel/decode`` span and NOT in the analytic FLOPs.

    At scale ``k`` the token score is the mean over RGB of ``|I_{k−1} − I_{k−2}|``, pooled over the pixels the
    token covers (``pool``). RECONSTRUCTED: the paper's reference signal is ``|I_k − I_{k−1}|``, the change scale
    ``k`` itself makes, which does not exist before scale ``k`` runs; the newest change available is the one
    scale ``k−1`` made (the pixel analogue of LHEP reading ``R_{k−1}``). ``pool='area'`` (the mean) or ``max``;
    the channel mean is ours. The same ``[B, N]`` score for every block and both CFG rows; 0 before two scales
    were decoded (a single decoded scale is compared with a black image: ``first='black'``, or scored 0:
    ``first='zero'``).
    """

    @dataclass(frozen=True)
    class Config(ComponentConfig):
        pool: str = knob("area", "how the pixel change is brought to the token grid: mean ('area') or max over the "
                         "pixels a token covers", choices=POOLS, reconstructed=True)
        first: str = knob("zero", "with one decoded scale only: score 0 ('zero') or compare with a black image "
                          "('black')", choices=("zero", "black"), reconstructed=True)

    def start(self, info, signals) -> None:
        self._scores: dict[int, torch.Tensor] = {}

    def needs(self, ctx, signals: Signals) -> Needs:
        if may_prune_soon(ctx.scale_index, ctx.num_scales, signals, ahead=2):
            return Needs(decoded_image=True)
        return NO_NEEDS

    def score(self, ctx, block, branch, x_RNC, signals: Signals) -> torch.Tensor:
        si = ctx.scale_index
        if si not in self._scores:
            images = [r.image_B3HW for r in ctx.history if not r.skipped and r.image_B3HW is not None][-2:]
            if not images or (len(images) == 1 and self.config.first == "zero"):
                scores = torch.zeros(ctx.batch_size, ctx.num_tokens, device=x_RNC.device)
            else:
                previous = images[0] if len(images) == 2 else None
                scores = pixel_change_map(images[-1], previous, ctx.hw, self.config.pool).to(x_RNC.device)
            self._scores = {si: scores}
        return self._scores[si]
