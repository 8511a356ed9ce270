"""LPIPS, version 0.1 (Zhang et al., "The Unreasonable Effectiveness of Deep Features as a Perceptual Metric",
CVPR 2018), with AlexNet or VGG16 backbones built from plain ``torch.nn`` (torchvision cannot be imported on CPU
torch 2.13), loading the official weight files from local paths only.

Distance of two images ``x0, x1`` in ``[-1, 1]``: both are standardised ``x' = (x − shift) / scale`` (shift
``[-.030, -.088, -.188]``, scale ``[.458, .448, .450]``), run through the backbone, and at each of five tapped
ReLU outputs the features are unit-normalised along channels (``f / (‖f‖₂ + 1e-10)``), their squared difference
is weighted per channel by the layer's learned non-negative 1×1 convolution (``lin{k}``, no bias), and the
resulting map is averaged over space (or, with ``spatial=True``, upsampled bilinearly to the input size); the five
layer values are summed. Taps: AlexNet relu1–relu5 (``features[0:2], [2:5], [5:8], [8:10], [10:12]``), VGG16
relu1_2, relu2_2, relu3_3, relu4_3, relu5_3 (``features[0:4], [4:9], [9:16], [16:23], [23:30]``).

Weights (the knob that matters is ``net``: ``"alex"``, the authors' default, or ``"vgg"``):

* backbone: torchvision's ``features.N.{weight,bias}`` layout (``alexnet-owt-7be5be79.pth``,
  ``vgg16-397923af.pth``; a ``classifier.*`` part is ignored), or the lpips package's own ``net.slice{K}.N.*``;
* linear layers: the lpips package's ``weights/v0.1/{alex,vgg}.pth`` (``lin{k}.model.1.weight [1, C_k, 1, 1]``).

Without the *pretrained* backbone weights LPIPS means nothing (random features do not measure perception):
:func:`load_lpips` then refuses, and the metric is reported unavailable. Nothing is downloaded.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError, did_you_mean

__all__ = ["NETS", "LPIPS", "load_lpips", "lpips_backbone_layout"]

# per backbone: features index of every conv, (in, out, kernel, padding, stride), the max-pools, the taps
_ALEX_CONVS = {0: (3, 64, 11, 2, 4), 3: (64, 192, 5, 2, 1), 6: (192, 384, 3, 1, 1), 8: (384, 256, 3, 1, 1),
               10: (256, 256, 3, 1, 1)}
_ALEX_POOLS = {2: (3, 2), 5: (3, 2), 12: (3, 2)}
_VGG_CHANNELS = [(0, 3, 64), (2, 64, 64), (5, 64, 128), (7, 128, 128), (10, 128, 256), (12, 256, 256),
                 (14, 256, 256), (17, 256, 512), (19, 512, 512), (21, 512, 512), (24, 512, 512), (26, 512, 512),
                 (28, 512, 512)]
_VGG_CONVS = {i: (cin, cout, 3, 1, 1) for i, cin, cout in _VGG_CHANNELS}
_VGG_POOLS = {4: (2, 2), 9: (2, 2), 16: (2, 2), 23: (2, 2), 30: (2, 2)}
_LAYOUT = {
    "alex": dict(convs=_ALEX_CONVS, pools=_ALEX_POOLS, length=13, taps=(1, 4, 7, 9, 11),
                 channels=(64, 192, 384, 256, 256)),
    "vgg": dict(convs=_VGG_CONVS, pools=_VGG_POOLS, length=31, taps=(3, 8, 15, 22, 29),
                channels=(64, 128, 256, 512, 512)),
}
NETS = tuple(_LAYOUT)
_SHIFT = (-0.030, -0.088, -0.188)
_SCALE = (0.458, 0.448, 0.450)
_EPS = 1e-10


def _check_net(net: str) -> str:
    if net not in _LAYOUT:
        raise UserError(f"unknown LPIPS backbone {net!r}; choose from {', '.join(NETS)}." + did_you_mean(net, NETS))
    return net


def lpips_backbone_layout(net: str) -> dict:
    """``{features index: (in, out, kernel, padding, stride)}`` of the backbone's convolutions (torchvision
    indices), plus ``taps`` and ``channels``: the structure the weight files follow."""
    spec = _LAYOUT[_check_net(net)]
    return dict(convs=dict(spec["convs"]), taps=spec["taps"], channels=spec["channels"])


class _Linear(nn.Module):
    """``model = Sequential(Dropout, 1×1 conv without bias)``: the lpips package's ``NetLinLayer`` layout (dropout is
    the identity in evaluation)."""

    def __init__(self, channels: int):
        super().__init__()
        self.model = nn.Sequential(nn.Dropout(), nn.Conv2d(channels, 1, 1, bias=False))

    def forward(self, x):
        return self.model(x)


class LPIPS(nn.Module):
    """LPIPS v0.1 network (module docstring); inputs ``[N, 3, H, W]`` in ``[-1, 1]`` (``normalize=True``: in
    ``[0, 1]``). State-dict keys: ``features.N.*`` (torchvision) and ``lin{k}.model.1.weight`` (lpips)."""

    def __init__(self, net: str = "alex"):
        super().__init__()
        spec = _LAYOUT[_check_net(net)]
        self.net_name = net
        self.taps = spec["taps"]
        layers: list[nn.Module] = []
        for i in range(spec["length"]):
            if i in spec["convs"]:
                cin, cout, k, p, s = spec["convs"][i]
                layers.append(nn.Conv2d(cin, cout, k, stride=s, padding=p))
            elif i in spec["pools"]:
                k, s = spec["pools"][i]
                layers.append(nn.MaxPool2d(k, s))
            else:
                layers.append(nn.ReLU())
        self.features = nn.Sequential(*layers)
        for k, c in enumerate(spec["channels"]):
            self.add_module(f"lin{k}", _Linear(c))
        self.register_buffer("shift", torch.tensor(_SHIFT).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("scale", torch.tensor(_SCALE).view(1, 3, 1, 1), persistent=False)
        self.requires_grad_(False)
        self.eval()

    def tapped(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The five tapped ReLU outputs of the standardised input ``(x − shift) / scale``."""
        x = (x - self.shift) / self.scale
        out = []
        last = self.taps[-1]
        for i, layer in enumerate(self.features):
            if i > last:
                break
            x = layer(x)
            if i in self.taps:
                out.append(x)
        return out

    @staticmethod
    def _unit(f: torch.Tensor) -> torch.Tensor:
        return f / (f.pow(2).sum(1, keepdim=True).sqrt() + _EPS)

    def normalized_sq_diffs(self, in0: torch.Tensor, in1: torch.Tensor) -> list[torch.Tensor]:
        """Per tapped layer ``(unit(f0) − unit(f1))²`` ``[N, C_k, h_k, w_k]`` (the input of ``lin{k}``)."""
        f0, f1 = self.tapped(in0), self.tapped(in1)
        return [(self._unit(a) - self._unit(b)).pow(2) for a, b in zip(f0, f1)]

    def layer_maps(self, in0: torch.Tensor, in1: torch.Tensor) -> list[torch.Tensor]:
        """Per layer the weighted map ``lin_k(diff_k)`` ``[N, 1, h_k, w_k]``."""
        return [getattr(self, f"lin{k}")(d) for k, d in enumerate(self.normalized_sq_diffs(in0, in1))]

    @torch.no_grad()
    def forward(self, in0: torch.Tensor, in1: torch.Tensor, *, normalize: bool = False, spatial: bool = False,
                per_layer: bool = False):
        """Distances ``[N]`` (``spatial``: maps ``[N, 1, H, W]``; ``per_layer``: also ``[N, 5]`` layer values)."""
        if in0.shape != in1.shape:
            raise ValueError(f"LPIPS inputs differ in shape: {tuple(in0.shape)} vs {tuple(in1.shape)}")
        if normalize:
            in0, in1 = 2 * in0 - 1, 2 * in1 - 1
        maps = self.layer_maps(in0, in1)
        if spatial:
            size = tuple(in0.shape[-2:])
            parts = [F.interpolate(m, size=size, mode="bilinear", align_corners=False) for m in maps]
        else:
            parts = [m.mean((2, 3), keepdim=True) for m in maps]
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        value = total if spatial else total.flatten()
        if per_layer:
            return value, torch.cat([p.mean((2, 3)) if spatial else p.flatten(1) for p in parts], 1)
        return value


# ----- weights ---------------------------------------------------------------------------------------------
def _load_file(path: Path, what: str) -> dict[str, torch.Tensor]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"cannot read the LPIPS {what} weights {path} ({type(exc).__name__}: {exc})") from None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a {type(data).__name__}, not a state dict of LPIPS {what} weights")
    return {k: v for k, v in data.items() if torch.is_tensor(v)}


def _backbone_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``features.N.*`` entries of a torchvision file, or the lpips package's ``[net.]slice{K}.N.*`` renamed."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("module.")
        m = re.fullmatch(r"(?:net\.)?slice\d+\.(\d+)\.(weight|bias)", key)
        if m:
            out[f"features.{m.group(1)}.{m.group(2)}"] = value
        elif re.fullmatch(r"features\.\d+\.(weight|bias)", key):
            out[key] = value
    return out


@functools.lru_cache(maxsize=4)
def _load_cached(net: str, backbone: str, lin: str, stamp: tuple) -> LPIPS:
    model = LPIPS(net)
    expected = model.state_dict()
    state = _backbone_state(_load_file(Path(backbone), "backbone"))
    lin_state = {k.removeprefix("module."): v for k, v in _load_file(Path(lin), "linear-layer").items()}
    state.update({k: v for k, v in lin_state.items() if re.fullmatch(r"lin\d\.model\.1\.weight", k)})
    missing = [k for k in expected if k not in state]
    if missing:
        which = "linear-layer" if missing[0].startswith("lin") else "backbone"
        hint = (f"the lpips package's weights/v0.1/{net}.pth" if which == "linear-layer" else
                f"torchvision's {'alexnet-owt-7be5be79.pth' if net == 'alex' else 'vgg16-397923af.pth'}")
        raise UserError(f"the LPIPS-{net} {which} file lacks {len(missing)} tensors (e.g. {missing[0]}); pass "
                        f"{hint}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise UserError(f"LPIPS-{net}: {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)} "
                            f"(a file of the other backbone?)")
    model.load_state_dict({k: state[k].to(torch.float32) for k in expected}, strict=True)
    return model


def load_lpips(net: str, backbone: str | Path | None, lin: str | Path | None) -> LPIPS:
    """LPIPS-``net`` from LOCAL files: the backbone's pretrained weights and the v0.1 linear layers. Refuses
    (:class:`UserError`) without either — random backbone weights would make the distance meaningless. Cached per
    paths and modification times; never downloads."""
    _check_net(net)
    if backbone is None:
        raise UserError(f"LPIPS-{net} needs the backbone's pretrained weights (torchvision "
                        f"{'alexnet-owt-7be5be79.pth' if net == 'alex' else 'vgg16-397923af.pth'}); with random "
                        f"backbone weights it is meaningless")
    if lin is None:
        raise UserError(f"LPIPS-{net} needs its linear layers (the lpips package's weights/v0.1/{net}.pth)")
    paths = [Path(backbone).expanduser(), Path(lin).expanduser()]
    for p in paths:
        if not p.is_file():
            raise UserError(f"LPIPS weights not found at {p}")
    return _load_cached(net, str(paths[0].resolve()), str(paths[1].resolve()),
                        tuple(p.stat().st_mtime_ns for p in paths))
