"""The FID Inception-v3 network (the 2015-12-05 TensorFlow graph, as pytorch-fid and torch-fidelity port it) and
the input protocols of the FID implementations, built from plain ``torch.nn`` (torchvision cannot be imported on
CPU torch 2.13).

Network (Szegedy et al., "Rethinking the Inception Architecture for Computer Vision", 2016; the FID variant of
Heusel et al., "GANs Trained by a Two Time-Scale Update Rule Converge to a Local Nash Equilibrium", 2017):
Inception-v3 with every convolution bias-free, followed by BatchNorm (``eps = 1e-3``) and ReLU, 1008 output
classes, and the FID-specific blocks of the TensorFlow graph: the pooling branch of ``Mixed_5b``–``5d``,
``6b``–``6e`` and ``7b`` averages *without* counting the zero padding, the one of ``Mixed_7c`` takes a max (a quirk
of the original graph that every FID implementation keeps).

Weights: the module names are torchvision's ``Inception3`` names (``Conv2d_1a_3x3.conv.weight``,
``….bn.{weight,bias,running_mean,running_var}``, ``Mixed_7c.branch_pool.bn.*``, ``fc.weight [1008, 2048]``,
``fc.bias``), which is the layout of both pytorch-fid's ``pt_inception-2015-12-05-6726825d.pth`` and
torch-fidelity's ``weights-inception-2015-12-05-6726825d.pth``, so :func:`load_fid_inception` loads either file
unchanged (``num_batches_tracked`` entries, if present, are ignored). Nothing is ever downloaded.

Input protocols (:data:`PROTOCOLS`; the one that matters is ``protocol``): the FID implementations feed the same
network differently, and on small images their FIDs disagree by far more than sampling noise (on the
``official_metrics_tiny`` fixture: 9124.6 pytorch-fid, 8466.4 torch-fidelity, 8116.6 torchmetrics' default).

* ``"torch-fidelity"`` (the default, :data:`DEFAULT_PROTOCOL`): 8-bit values cast to float (0–255), resized to
  299 × 299 with TensorFlow 1.x ``resize_bilinear`` semantics (``align_corners=False``: source coordinate
  ``dst · in/out``, no half-pixel offset, the last row/column repeated), then ``(x − 128) / 128``. This is the
  pipeline of the TensorFlow graph that OpenAI's ADM evaluator runs, which VAR's FID (ImageNet 50k against the
  ADM reference batch) uses; torchmetrics with ``antialias=False`` computes the same.
* ``"pytorch-fid"``: ``u8 / 255`` (true division, what ``ToTensor`` gives), ``F.interpolate(bilinear,
  align_corners=False)`` to 299 × 299 without antialiasing, then ``2x − 1``.
* ``"torchmetrics"``: torchmetrics' default (``antialias=True``): 0–255 floats, ``F.interpolate(bilinear,
  align_corners=False, antialias=True)``, then ``(x − 128) / 128``.

RECONSTRUCTED: which protocol the text-to-image papers (MJHQ-30K / COCO FIDs of FastVAR, NOVA, ToProVAR, ...)
used is not stated in their text; we default to the torch-fidelity protocol for every model because it is the
only one stated for the family (VAR's ADM-evaluator FID). ``protocol="pytorch-fid"`` selects the alternative.
Every record names the protocol it was computed with; compare FIDs only within one protocol.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError, did_you_mean

__all__ = [
    "PROTOCOLS", "DEFAULT_PROTOCOL", "FEATURES", "FIDInceptionV3", "InceptionFeatures", "load_fid_inception",
    "preprocess", "resize_bilinear_tf1", "to_uint8", "check_protocol",
]

PROTOCOLS = ("torch-fidelity", "pytorch-fid", "torchmetrics")
DEFAULT_PROTOCOL = "torch-fidelity"
FEATURES = ("64", "192", "768", "2048", "logits_unbiased", "logits")
INPUT_SIZE = 299
NUM_CLASSES = 1008


# ----- building blocks -------------------------------------------------------------------------------------
class _FrozenBatchNorm2d(nn.Module):
    """Inference-only BatchNorm with the four tensors of ``nn.BatchNorm2d`` and no ``num_batches_tracked`` (the
    FID weight files carry none)."""

    def __init__(self, channels: int, eps: float = 1e-3):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels), requires_grad=False)
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class _ConvBN(nn.Module):
    """Bias-free convolution, BatchNorm (eps 1e-3), ReLU; submodules ``conv`` and ``bn`` as in the weight files."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = _FrozenBatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _avg_pool_3x3(x: torch.Tensor) -> torch.Tensor:
    # the graph's 'SAME' average pool: padded positions do not count towards the mean
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class _MixedA(nn.Module):
    """35 × 35 block (Mixed_5b–5d): 1×1 | 1×1→5×5 | 1×1→3×3→3×3 | avg-pool→1×1."""

    def __init__(self, cin: int, pool_channels: int):
        super().__init__()
        self.branch1x1 = _ConvBN(cin, 64, 1)
        self.branch5x5_1 = _ConvBN(cin, 48, 1)
        self.branch5x5_2 = _ConvBN(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = _ConvBN(cin, 64, 1)
        self.branch3x3dbl_2 = _ConvBN(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = _ConvBN(96, 96, 3, padding=1)
        self.branch_pool = _ConvBN(cin, pool_channels, 1)

    def forward(self, x):
        a = self.branch1x1(x)
        b = self.branch5x5_2(self.branch5x5_1(x))
        c = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        d = self.branch_pool(_avg_pool_3x3(x))
        return torch.cat([a, b, c, d], 1)


class _ReductionB(nn.Module):
    """35 → 17 reduction (Mixed_6a): 3×3 stride 2 | 1×1→3×3→3×3 stride 2 | max-pool stride 2."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = _ConvBN(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = _ConvBN(cin, 64, 1)
        self.branch3x3dbl_2 = _ConvBN(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = _ConvBN(96, 96, 3, stride=2)

    def forward(self, x):
        a = self.branch3x3(x)
        b = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([a, b, F.max_pool2d(x, 3, stride=2)], 1)


class _MixedC(nn.Module):
    """17 × 17 block with factorised 7×7 convolutions (Mixed_6b–6e)."""

    def __init__(self, cin: int, mid: int):
        super().__init__()
        self.branch1x1 = _ConvBN(cin, 192, 1)
        self.branch7x7_1 = _ConvBN(cin, mid, 1)
        self.branch7x7_2 = _ConvBN(mid, mid, (1, 7), padding=(0, 3))
        self.branch7x7_3 = _ConvBN(mid, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = _ConvBN(cin, mid, 1)
        self.branch7x7dbl_2 = _ConvBN(mid, mid, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = _ConvBN(mid, mid, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = _ConvBN(mid, mid, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = _ConvBN(mid, 192, (1, 7), padding=(0, 3))
        self.branch_pool = _ConvBN(cin, 192, 1)

    def forward(self, x):
        a = self.branch1x1(x)
        b = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        c = x
        for layer in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                      self.branch7x7dbl_5):
            c = layer(c)
        d = self.branch_pool(_avg_pool_3x3(x))
        return torch.cat([a, b, c, d], 1)


class _ReductionD(nn.Module):
    """17 → 8 reduction (Mixed_7a)."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = _ConvBN(cin, 192, 1)
        self.branch3x3_2 = _ConvBN(192, 320, 3, stride=2)
        self.branch7x7x3_1 = _ConvBN(cin, 192, 1)
        self.branch7x7x3_2 = _ConvBN(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = _ConvBN(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = _ConvBN(192, 192, 3, stride=2)

    def forward(self, x):
        a = self.branch3x3_2(self.branch3x3_1(x))
        b = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([a, b, F.max_pool2d(x, 3, stride=2)], 1)


class _MixedE(nn.Module):
    """8 × 8 block with split 1×3 / 3×1 outputs (Mixed_7b: average pool, Mixed_7c: max pool)."""

    def __init__(self, cin: int, pool: str):
        super().__init__()
        self.pool = pool
        self.branch1x1 = _ConvBN(cin, 320, 1)
        self.branch3x3_1 = _ConvBN(cin, 384, 1)
        self.branch3x3_2a = _ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = _ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = _ConvBN(cin, 448, 1)
        self.branch3x3dbl_2 = _ConvBN(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = _ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = _ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = _ConvBN(cin, 192, 1)

    def forward(self, x):
        a = self.branch1x1(x)
        s = self.branch3x3_1(x)
        b = torch.cat([self.branch3x3_2a(s), self.branch3x3_2b(s)], 1)
        t = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        c = torch.cat([self.branch3x3dbl_3a(t), self.branch3x3dbl_3b(t)], 1)
        pooled = _avg_pool_3x3(x) if self.pool == "avg" else F.max_pool2d(x, 3, stride=1, padding=1)
        return torch.cat([a, b, c, self.branch_pool(pooled)], 1)


# ----- the network ------------------------------------------------------------------------------------------
class FIDInceptionV3(nn.Module):
    """The FID Inception-v3 on already prepared ``[N, 3, 299, 299]`` input (see :func:`preprocess`).

    :meth:`blocks` returns the four stage outputs pytorch-fid calls blocks 0–3 (64 × 73², 192 × 35², 768 × 17²,
    2048 pooled); :meth:`forward` the named features of :data:`FEATURES` (``"64"``/``"192"``/``"768"``: blocks 0–2
    average-pooled; ``"2048"``: the pool features FID uses; ``"logits_unbiased"``: ``pool @ fc.weightᵀ``, what
    torch-fidelity's Inception Score reads; ``"logits"``: with ``fc.bias``).
    """

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = _ConvBN(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = _ConvBN(32, 32, 3)
        self.Conv2d_2b_3x3 = _ConvBN(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = _ConvBN(64, 80, 1)
        self.Conv2d_4a_3x3 = _ConvBN(80, 192, 3)
        self.Mixed_5b = _MixedA(192, 32)
        self.Mixed_5c = _MixedA(256, 64)
        self.Mixed_5d = _MixedA(288, 64)
        self.Mixed_6a = _ReductionB(288)
        self.Mixed_6b = _MixedC(768, 128)
        self.Mixed_6c = _MixedC(768, 160)
        self.Mixed_6d = _MixedC(768, 160)
        self.Mixed_6e = _MixedC(768, 192)
        self.Mixed_7a = _ReductionD(768)
        self.Mixed_7b = _MixedE(1280, "avg")
        self.Mixed_7c = _MixedE(2048, "max")
        self.fc = nn.Linear(2048, NUM_CLASSES)
        self.requires_grad_(False)
        self.eval()

    def blocks(self, x: torch.Tensor, upto: int = 3) -> list[torch.Tensor]:
        """Outputs of blocks ``0..upto`` (block 3 already pooled to ``[N, 2048]``)."""
        out = []
        x = F.max_pool2d(self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x))), 3, stride=2)
        out.append(x)
        if upto >= 1:
            x = F.max_pool2d(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)), 3, stride=2)
            out.append(x)
        if upto >= 2:
            for name in ("Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d",
                         "Mixed_6e"):
                x = getattr(self, name)(x)
            out.append(x)
        if upto >= 3:
            x = self.Mixed_7c(self.Mixed_7b(self.Mixed_7a(x)))
            out.append(F.adaptive_avg_pool2d(x, 1).flatten(1))
        return out

    def forward(self, x: torch.Tensor, features: tuple[str, ...] = ("2048",)) -> dict[str, torch.Tensor]:
        unknown = [f for f in features if f not in FEATURES]
        if unknown:
            raise UserError(f"unknown Inception feature {unknown[0]!r}; choose from {', '.join(FEATURES)}."
                            + did_you_mean(unknown[0], FEATURES))
        depth = max({"64": 0, "192": 1, "768": 2}.get(f, 3) for f in features)
        stages = self.blocks(x, upto=depth)
        out = {}
        for i, name in enumerate(("64", "192", "768")):
            if name in features:
                out[name] = F.adaptive_avg_pool2d(stages[i], 1).flatten(1)
        if depth == 3:
            pool = stages[3]
            out["2048"] = pool
            if "logits_unbiased" in features or "logits" in features:
                unbiased = pool @ self.fc.weight.T
                out["logits_unbiased"] = unbiased
                out["logits"] = unbiased + self.fc.bias
        return {f: out[f] for f in features}


# ----- input protocols -------------------------------------------------------------------------------------
def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """``uint8 [N, 3, H, W]``: uint8 input unchanged, float input in ``[0, 1]`` rounded to the 8-bit grid (what a
    saved PNG holds, which every FID protocol starts from)."""
    if images.dtype == torch.uint8:
        return images
    if not images.is_floating_point():
        raise UserError(f"images must be uint8 (0-255) or float in [0, 1], got {images.dtype}")
    return images.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8)


def _tf1_axis_weights(n_in: int, n_out: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lower / upper source indices and the fraction towards the upper one, per output index (TF1 semantics)."""
    position = torch.arange(n_out, dtype=torch.float32, device=device) * torch.tensor(n_in / n_out,
                                                                                      dtype=torch.float32)
    low = position.long()  # positions are >= 0: truncation is floor
    high = (low + 1).clamp(max=n_in - 1)
    return low, high, position - low.float()


def resize_bilinear_tf1(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """TensorFlow 1.x ``resize_bilinear(align_corners=False)``: output pixel ``i`` reads source coordinate
    ``i · in/out`` (no half-pixel centres), interpolating between ``floor`` and ``floor + 1`` (clamped to the last
    row/column); first along the width, then along the height. ``x``: float ``[N, C, H, W]``."""
    height, width = size
    y0, y1, fy = _tf1_axis_weights(x.shape[-2], height, x.device)
    x0, x1, fx = _tf1_axis_weights(x.shape[-1], width, x.device)
    top, bottom = x[..., y0, :], x[..., y1, :]
    top = top[..., x0] + (top[..., x1] - top[..., x0]) * fx
    bottom = bottom[..., x0] + (bottom[..., x1] - bottom[..., x0]) * fx
    return top + (bottom - top) * fy.view(-1, 1)


def check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise UserError(f"unknown FID protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}."
                        + did_you_mean(protocol, PROTOCOLS))
    return protocol


def preprocess(images: torch.Tensor, protocol: str = DEFAULT_PROTOCOL) -> torch.Tensor:
    """Images (uint8 ``[N, 3, H, W]`` or float in ``[0, 1]``) → the network input ``[N, 3, 299, 299]`` of a
    protocol (see the module docstring)."""
    check_protocol(protocol)
    u8 = to_uint8(images)
    if u8.dim() != 4 or u8.shape[1] != 3:
        raise UserError(f"images must be [N, 3, H, W], got {tuple(u8.shape)}")
    size = (INPUT_SIZE, INPUT_SIZE)
    if protocol == "pytorch-fid":
        x = u8.to(torch.float32).div(255)
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
        return 2 * x - 1
    x = u8.to(torch.float32)
    if protocol == "torch-fidelity":
        x = resize_bilinear_tf1(x, size)
    else:
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return (x - 128) / 128


# ----- weights ---------------------------------------------------------------------------------------------
def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unreadable / not a torch file
        raise UserError(f"cannot read the Inception weights {path} ({type(exc).__name__}: {exc}); pass "
                        f"pytorch-fid's pt_inception-2015-12-05-6726825d.pth or torch-fidelity's "
                        f"weights-inception-2015-12-05-6726825d.pth") from None
    if isinstance(data, dict) and "state_dict" in data and isinstance(data["state_dict"], dict):
        data = data["state_dict"]
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a {type(data).__name__}, not a state dict of the FID Inception network")
    return {k: v for k, v in data.items() if torch.is_tensor(v) and not k.endswith("num_batches_tracked")}


@functools.lru_cache(maxsize=2)
def _load_cached(path: str, mtime_ns: int) -> FIDInceptionV3:
    state = _read_state_dict(Path(path))
    net = FIDInceptionV3()
    expected = net.state_dict()
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    if missing or extra:
        raise UserError(f"{path} is not an FID Inception-v3 state dict: {len(missing)} missing "
                        f"(e.g. {missing[:2]}), {len(extra)} unexpected (e.g. {extra[:2]}); expected torchvision "
                        f"Inception3 names with 1008 classes, as in pt_inception-2015-12-05-6726825d.pth")
    wrong = [k for k, v in expected.items() if tuple(state[k].shape) != tuple(v.shape)]
    if wrong:
        raise UserError(f"{path}: tensor {wrong[0]} has shape {tuple(state[wrong[0]].shape)}, expected "
                        f"{tuple(expected[wrong[0]].shape)}")
    net.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return net


def load_fid_inception(path: str | Path) -> FIDInceptionV3:
    """The FID Inception from a LOCAL weight file (pytorch-fid or torch-fidelity layout; float16 files are cast to
    float32). Cached per path and modification time; never downloads."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"Inception weights not found at {p}; pass a local pt_inception-2015-12-05-6726825d.pth "
                        f"(pytorch-fid) or weights-inception-2015-12-05-6726825d.pth (torch-fidelity)")
    return _load_cached(str(p.resolve()), p.stat().st_mtime_ns)


class InceptionFeatures(nn.Module):
    """One feature of the FID Inception under one input protocol, as a module ``images → [N, d]`` (uint8 or float
    ``[0, 1]`` images of any size): what torchmetrics' ``FrechetInceptionDistance`` / ``KernelInceptionDistance``
    / ``InceptionScore`` accept as ``feature=`` (a tensor, not torch-fidelity's tuple). ``num_features`` says
    ``d``; batches of ``batch_size`` bound the memory."""

    def __init__(self, net: FIDInceptionV3, feature: str = "2048", protocol: str = DEFAULT_PROTOCOL,
                 batch_size: int = 50):
        super().__init__()
        if feature not in FEATURES:
            raise UserError(f"unknown Inception feature {feature!r}; choose from {', '.join(FEATURES)}."
                            + did_you_mean(feature, FEATURES))
        self.net = net
        self.feature = feature
        self.protocol = check_protocol(protocol)
        self.batch_size = int(batch_size)
        self.num_features = NUM_CLASSES if feature.startswith("logits") else int(feature)

    @torch.no_grad()
    def features(self, images: torch.Tensor, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Several features of one pass, ``{name: float32 [N, d]}`` (default: this module's feature)."""
        names = tuple(names) if names else (self.feature,)
        device = next(self.net.parameters()).device
        chunks: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for i in range(0, images.shape[0], self.batch_size):
            x = preprocess(images[i:i + self.batch_size], self.protocol).to(device)
            for name, value in self.net(x, names).items():
                chunks[name].append(value.float().cpu())
        return {n: torch.cat(v) if v else torch.zeros(0, NUM_CLASSES if n.startswith("logits") else int(n))
                for n, v in chunks.items()}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.features(images)[self.feature]
