"""CLIP score (Hessel et al., "CLIPScore: A Reference-free Evaluation Metric for Image Captioning", 2021) of each
image against the prompt it was generated from, through torchmetrics' ``CLIPScore`` and a CLIP model of
`transformers` loaded from a LOCAL folder (never downloaded).

Per sample: ``max(100 · cos(E_image, E_text), 0)`` — torchmetrics' scale (100; the paper writes ``w = 2.5``), and
the paper's clamp at 0 per image-caption pair. Each sample is one ``CLIPScore`` update/compute (torchmetrics keeps
only a running sum, so a batch would give the mean alone); the arm's number is the mean over samples with a
bootstrap interval over prompts (the runner's per-sample summaries). With every cosine positive — always so for a
trained CLIP — that mean is exactly torchmetrics' batch ``CLIPScore``.

The folder is a Hugging Face CLIP layout (``config.json`` + ``model.safetensors`` / ``pytorch_model.bin``, the
tokenizer files and ``preprocessor_config.json``), e.g. a local copy of ``openai/clip-vit-large-patch14``. The knob
that matters is the model itself: scores of different CLIP models are not comparable; every record keeps the
folder's path and a sha256 over its files (:func:`var_core.eval.metric_registry.weights_identity`).

Two pieces of glue, both exact:

* torchmetrics 1.9 accepts only its listed hub names or a callable returning ``(model, processor)``; we pass a
  callable over the locally loaded pair (so nothing can reach the hub).
* transformers 5 returns a ``BaseModelOutputWithPooling`` from ``get_image_features`` / ``get_text_features``
  where torchmetrics expects the projected tensor; :class:`CLIPFeatures` hands torchmetrics the ``pooler_output``
  (the projected embedding, what transformers 4 returned directly).

Prompts: the sample's own prompt where the condition set has prompts (``MetricContext.prompts``), else the text the
model was conditioned on (Infinity: its fixed per-label prompt) or a caption from the class name (testbed).
:func:`clip_preprocess` is CLIP's image preprocessing (bicubic resize of the shorter side, centre crop, OpenAI
mean/std), shared by ImageReward and HPSv2 which use the same.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .metric_base import LOCAL_METRIC, MetricUnavailable, quantize01

__all__ = ["OPENAI_MEAN", "OPENAI_STD", "CLIPFeatures", "LoadedCLIP", "load_clip", "clip_scores", "clip_preprocess",
           "to_uint8"]

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """``[B, 3, H, W]`` in ``[0, 1]`` (or uint8) → uint8 on the 8-bit grid (what a saved PNG holds)."""
    if images.dtype == torch.uint8:
        return images.cpu()
    return (quantize01(images.cpu()) * 255).round().to(torch.uint8)


def clip_preprocess(images: torch.Tensor, size: int, *, resize: str = "shorter_crop",
                    mean: Sequence[float] = OPENAI_MEAN, std: Sequence[float] = OPENAI_STD) -> torch.Tensor:
    """CLIP's evaluation transform on a batch, with PIL as torchvision does it on PIL images.

    ``resize="shorter_crop"``: the shorter side to ``size`` (bicubic; the longer ``int(size · long / short)``),
    then a centre crop of ``size × size`` (offsets ``round((h − size) / 2)``). ``"longest_pad"``: the longer side
    to ``size`` (each side ``round(side · size / long)``), then zero padding to a centred square (open_clip's
    ``ResizeMaxSize``). For square images the two are identical. Then ``/255`` and the per-channel normalisation.
    Returns float32 ``[B, 3, size, size]``.
    """
    from PIL import Image

    if resize not in ("shorter_crop", "longest_pad"):
        raise ValueError(f"resize must be 'shorter_crop' or 'longest_pad', got {resize!r}")
    u8 = to_uint8(images)
    out = []
    for img in u8:
        pil = Image.fromarray(img.permute(1, 2, 0).contiguous().numpy(), mode="RGB")
        w, h = pil.size
        if resize == "shorter_crop":
            if w <= h:
                nw, nh = size, int(size * h / w)
            else:
                nw, nh = int(size * w / h), size
            if (nw, nh) != (w, h):
                pil = pil.resize((nw, nh), Image.BICUBIC)
            top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
            pil = pil.crop((left, top, left + size, top + size))
            arr = np.asarray(pil, dtype=np.float32)
        else:
            scale = size / max(w, h)
            nw, nh = round(w * scale), round(h * scale)
            if (nw, nh) != (w, h):
                pil = pil.resize((nw, nh), Image.BICUBIC)
            arr = np.zeros((size, size, 3), dtype=np.float32)
            top, left = (size - nh) // 2, (size - nw) // 2
            arr[top:top + nh, left:left + nw] = np.asarray(pil, dtype=np.float32)
        out.append(torch.from_numpy(arr.copy()).permute(2, 0, 1) / 255.0)
    x = torch.stack(out)
    m = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (x - m) / s


class CLIPFeatures(torch.nn.Module):
    """A transformers ``CLIPModel`` whose ``get_image_features`` / ``get_text_features`` return the projected
    embedding tensor under transformers 4 and 5 alike (what torchmetrics' ``CLIPScore`` reads)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config

    @staticmethod
    def _tensor(out) -> torch.Tensor:
        if isinstance(out, torch.Tensor):
            return out
        pooled = getattr(out, "pooler_output", None)
        if pooled is None:
            pooled = out[1] if isinstance(out, (tuple, list)) else None
        if not isinstance(pooled, torch.Tensor):
            raise TypeError(f"unexpected CLIP feature output {type(out).__name__}")
        return pooled

    def get_image_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_image_features(*args, **kwargs))

    def get_text_features(self, *args, **kwargs) -> torch.Tensor:
        return self._tensor(self.model.get_text_features(*args, **kwargs))


class LoadedCLIP:
    """A local CLIP model and processor, loaded once per run."""

    def __init__(self, model, processor, path: Path):
        self.model = CLIPFeatures(model.eval().requires_grad_(False))
        self.processor = processor
        self.path = path

    def to(self, device) -> "LoadedCLIP":
        self.model.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def metric(self):
        from torchmetrics.multimodal.clip_score import CLIPScore


        return CLIPScore(model_name_or_path=lambda: (self.model, self.processor), **LOCAL_METRIC).to(self.device)


def load_clip(model_dir: str | Path | None) -> LoadedCLIP:
    """The CLIP model and processor of a local Hugging Face folder; :class:`MetricUnavailable` with the fix
    otherwise (no folder given, missing, unreadable, or `transformers` not installed)."""
    if model_dir is None:
        raise MetricUnavailable("CLIP score needs a local CLIP model directory: pass --clip-weights DIR "
                                "(a Hugging Face layout; nothing is downloaded)")
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise MetricUnavailable(f"CLIP model directory not found at {path} (pass --clip-weights DIR: a Hugging Face "
                                f"CLIP folder with config.json, the weights, tokenizer and preprocessor files)")
    try:
        import transformers  # noqa: F401
        from torchmetrics.multimodal.clip_score import CLIPScore  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not available here
        raise MetricUnavailable(f"CLIP score needs the 'transformers' package ({type(exc).__name__}: {exc}); "
                                f"install it with pip install -e '.[test]' or pip install transformers") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import logging
    import warnings

    from transformers import CLIPModel, CLIPProcessor
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)  # "torchvision missing: using the PIL image processor" notices
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = CLIPModel.from_pretrained(str(path), local_files_only=True)
            processor = CLIPProcessor.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged / incomplete folder: say which and why
        raise MetricUnavailable(f"cannot load the CLIP model in {path} ({type(exc).__name__}: {exc}); it must be a "
                                f"Hugging Face CLIP folder (config.json, weights, tokenizer, preprocessor)") from None
    finally:
        hf_logging.set_verbosity(previous)
    return LoadedCLIP(model, processor, path)


@torch.no_grad()
def clip_scores(images: torch.Tensor, texts: Sequence[str], clip: LoadedCLIP | str | Path | None) -> np.ndarray:
    """Per-sample CLIP score ``max(100 cos, 0)`` of ``images`` (``[B, 3, H, W]`` in ``[0, 1]`` or uint8) against
    ``texts`` (one per image), each through torchmetrics' ``CLIPScore``."""
    if len(texts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(texts)} prompts")
    loaded = clip if isinstance(clip, LoadedCLIP) else load_clip(clip)
    metric = loaded.metric()
    u8 = to_uint8(images).to(loaded.device)  # torchmetrics runs the model on the images' device
    out = np.empty(len(texts))
    for i, text in enumerate(texts):
        metric.reset()
        metric.update(u8[i:i + 1], [str(text)])
        out[i] = float(metric.compute())
    return out

