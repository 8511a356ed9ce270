"""Small CNN classifier for the testbed dataset, and torchmetrics feature wrappers.

The classifier plays the role Inception-v3 plays for ImageNet generators: it
scores *class fidelity* of generated testbed images (accuracy of the
conditioning class) and provides a feature space for FID/KID and logits for
Inception Score.  Inception itself is the wrong tool here: it was trained on
natural photos at 299 px, needs downloaded weights (the testbed must work
offline) and its features are dominated by up-sampling artefacts of 64-px
procedural images.

Architecture (``~0.23 M`` parameters, ``~0.9 MB`` as fp32 safetensors)::

    64x64x3 -> conv3x3(24)            GN SiLU   64x64
            -> conv3x3(32, stride 2)  GN SiLU   32x32
            -> conv3x3(48)            GN SiLU   32x32
            -> conv3x3(64, stride 2)  GN SiLU   16x16
            -> conv3x3(96)            GN SiLU   16x16
            -> conv3x3(128, stride 2) GN SiLU    8x8
            -> conv1x1(128)           GN SiLU    8x8
            -> global average pool -> 128-d features -> linear -> 10 logits

GroupNorm (not BatchNorm) keeps outputs independent of batch composition and
of train/eval mode, so features are identical however torchmetrics batches
images, and wrapping the model inside a ``Metric`` (which may be put into
train mode) cannot change results.  Global average pooling makes the network
accept any input size; the feature wrappers nevertheless resize inputs to the
training resolution so that features are comparable.

Feature wrappers and torchmetrics 1.9 (verified against its source and by
tests):

* ``FrechetInceptionDistance(feature=module)`` / ``KernelInceptionDistance``:
  the module is called directly on the images passed to ``update``; with a
  custom module, ``normalize=True`` does **not** convert to uint8, so float
  images in ``[0, 1]`` arrive unchanged.  The output dimension is taken from a
  ``num_features`` int attribute if present (else inferred from a dummy
  299x299 forward); both wrappers define it.
* ``InceptionScore(feature=module)`` always applies ``(imgs * 255).byte()``
  when ``normalize=True`` -- also for custom modules -- so the wrappers accept
  uint8 ``[0, 255]`` as well.  IS applies ``softmax`` to the module output, so
  use :class:`ClassifierLogitsExtractor` there.

Convention used by varscope: feed float images in ``[0, 1]`` with
``normalize=True``.  Inputs: ``uint8`` -> ``x / 255``; floating -> assumed to
be in ``[0, 1]``; both are then mapped to the classifier's ``[-1, 1]`` range.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "TestbedClassifier",
    "ClassifierFeatureExtractor",
    "ClassifierLogitsExtractor",
    "load_classifier",
    "default_weights_path",
    "classifier_accuracy",
]

WEIGHTS_DIR = Path(__file__).parent / "weights"
WEIGHTS_FILE = "classifier.safetensors"


def default_weights_path() -> Path:
    return WEIGHTS_DIR / WEIGHTS_FILE


def _block(cin: int, cout: int, k: int = 3, stride: int = 1) -> nn.Sequential:
    groups = 8 if cout % 8 == 0 else 4
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False),
        nn.GroupNorm(groups, cout),
        nn.SiLU(inplace=True),
    )


class TestbedClassifier(nn.Module):
    """7-layer GroupNorm CNN; input ``[N,3,H,W]`` in ``[-1, 1]`` (64 px nominal)."""

    __test__ = False  # keep pytest from collecting this class

    def __init__(self, num_classes: int = 10, widths: tuple[int, ...] = (24, 32, 48, 64, 96, 128), image_size: int = 64):
        super().__init__()
        w = tuple(int(c) for c in widths)
        strides = (1, 2, 1, 2, 1, 2)
        layers, cin = [], 3
        for cout, s in zip(w, strides):
            layers.append(_block(cin, cout, 3, s))
            cin = cout
        layers.append(_block(cin, cin, 1, 1))
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)
        self.num_classes = int(num_classes)
        self.feature_dim = cin
        self.image_size = int(image_size)
        self.widths = w

    def features(self, img: torch.Tensor) -> torch.Tensor:
        """Penultimate features ``[N, 128]`` (global average pool)."""
        return self.body(img).mean(dim=(2, 3))

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, num_classes]``."""
        return self.head(self.features(img))

    @torch.no_grad()
    def predict(self, img: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
        """Argmax labels for ``[N,3,H,W]`` images in ``[-1, 1]`` (batched, no grad)."""
        out = [self(img[i : i + batch_size].float()).argmax(1) for i in range(0, img.shape[0], batch_size)]
        return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


@torch.no_grad()
def classifier_accuracy(model: TestbedClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    """Top-1 accuracy of ``model`` on ``[-1,1]`` images (eval mode restored after)."""
    was_training = model.training
    model.eval()
    try:
        return float((model.predict(images).cpu() == labels.cpu()).float().mean())
    finally:
        model.train(was_training)


def load_classifier(path: str | Path | None = None, map_location: str | torch.device = "cpu") -> TestbedClassifier:
    """Load a trained :class:`TestbedClassifier` (eval mode, grads off).

    ``path=None`` loads the shipped weights ``var_core/testbed/weights/
    classifier.safetensors``.  Architecture hyper-parameters are read from the
    safetensors metadata, so non-default widths round-trip.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    p = Path(path) if path is not None else default_weights_path()
    if not p.is_file():
        raise FileNotFoundError(
            f"testbed classifier weights not found at {p}. Train them with "
            f"`python -m var_core.testbed.train_classifier --out-dir {p.parent}` "
            "(a few CPU minutes), or pass path= to an existing classifier.safetensors."
        )
    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata() or {}
    cfg = json.loads(meta.get("config", "{}"))
    model = TestbedClassifier(
        num_classes=int(cfg.get("num_classes", 10)),
        widths=tuple(cfg.get("widths", (24, 32, 48, 64, 96, 128))),
        image_size=int(cfg.get("image_size", 64)),
    )
    model.load_state_dict(load_file(str(p), device=str(map_location)))
    model.eval().requires_grad_(False)
    return model


class _WrapperBase(nn.Module):
    """Shared input handling for the torchmetrics wrappers (see module doc)."""

    def __init__(self, classifier: TestbedClassifier | None = None, resize: bool = True):
        super().__init__()
        self.classifier = load_classifier() if classifier is None else classifier
        self.classifier.eval().requires_grad_(False)
        self.resize = resize

    def train(self, mode: bool = True):  # the wrapped classifier always stays in eval mode
        super().train(mode)
        self.classifier.eval()
        return self

    def _prep(self, imgs: torch.Tensor) -> torch.Tensor:
        if imgs.dim() == 3:
            imgs = imgs.unsqueeze(0)
        if imgs.dtype == torch.uint8:
            x = imgs.float() / 255.0
        elif imgs.is_floating_point():
            x = imgs.float()
        else:
            raise TypeError(f"expected uint8 or floating images, got {imgs.dtype}")
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        x = x * 2.0 - 1.0
        s = self.classifier.image_size
        if self.resize and tuple(x.shape[-2:]) != (s, s):
            x = F.interpolate(x, size=(s, s), mode="bilinear", align_corners=False, antialias=True)
        return x


class ClassifierFeatureExtractor(_WrapperBase):
    """``[N, 128]`` penultimate features for torchmetrics FID / KID.

    Usage::

        fid = FrechetInceptionDistance(feature=ClassifierFeatureExtractor(), normalize=True)
        fid.update(real01, real=True); fid.update(fake01, real=False)  # float [0,1]

    Accepts uint8 ``[0,255]`` or float ``[0,1]`` ``[N,3,H,W]``; returns float32.
    """

    def __init__(self, classifier: TestbedClassifier | None = None, resize: bool = True):
        super().__init__(classifier, resize)
        self.num_features = int(self.classifier.feature_dim)

    @torch.no_grad()
    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.classifier.features(self._prep(imgs))


class ClassifierLogitsExtractor(_WrapperBase):
    """``[N, num_classes]`` logits for torchmetrics ``InceptionScore(feature=...)``.

    IS with ``normalize=True`` hands this module uint8 images; it also accepts
    float ``[0,1]``.
    """

    def __init__(self, classifier: TestbedClassifier | None = None, resize: bool = True):
        super().__init__(classifier, resize)
        self.num_features = int(self.classifier.num_classes)

    @torch.no_grad()
    def forward(self, imgs: torch.Tensor) -> torch.Tensor:
        return self.classifier(self._prep(imgs))
