"""HPSv2.1 (Wu et al., "Human Preference Score v2: A Solid Benchmark for Evaluating Human Preferences of
Text-to-Image Synthesis", 2023): OpenCLIP ViT-H-14 fine-tuned on human preference pairs; the score of an image for
its prompt is ``100 · cos(E_image, E_text)`` (higher is better).

Scale: the released ``hpsv2.score`` returns the bare cosine (≈ 0.30); the papers' tables (ToProVAR Table 2:
Infinity-2B 30.47, LD-Pruning Table 3, NOVA Table 2) print it ×100, which is what we report (``scale=100``).

Network (plain ``torch.nn``, written from OpenCLIP's published architecture — the ``hpsv2`` and ``open_clip_torch``
packages need torchvision, which does not import beside CPU torch 2.13):

* image: ViT with a bias-free patch convolution, a class embedding, learned positions, ``ln_pre``, pre-norm
  residual blocks (``nn.MultiheadAttention`` with a fused ``in_proj``, exact-GELU MLP ``c_fc``/``c_proj``,
  ``LayerNorm(eps=1e-5)``), ``ln_post`` on the class token and the ``proj`` matrix;
* text: token embedding + positions, the same blocks under a causal mask, ``ln_final``, the feature at the
  end-of-text token (the largest token id, so ``argmax`` of the ids) times ``text_projection``.

Weights: the released ``HPS_v2.1_compressed.pt`` — OpenCLIP's state-dict layout (``visual.conv1.weight``,
``visual.class_embedding``, ``visual.positional_embedding``, ``visual.ln_pre.*``,
``visual.transformer.resblocks.N.{ln_1,attn.in_proj_weight,attn.in_proj_bias,attn.out_proj,ln_2,mlp.c_fc,
mlp.c_proj}.*``, ``visual.ln_post.*``, ``visual.proj``, ``token_embedding.weight``, ``positional_embedding``,
``transformer.resblocks.N.*``, ``ln_final.*``, ``text_projection``, ``logit_scale``), bare or under a
``state_dict`` key (the training checkpoint's form), ``module.`` prefixes stripped. Widths, depths, patch and
context length are read from the tensors; the head counts (not stored) come from OpenCLIP's model config —
ViT-H-14's by default (vision ``head_width`` 80 → 16 heads, text 16 heads) or a ``model_config.json`` beside the
file in OpenCLIP's format (``{"embed_dim", "vision_cfg": {"width", "head_width", ...}, "text_cfg": {"heads", ...}}``).
Tokenizer: CLIP's BPE through transformers' ``CLIPTokenizer`` from a local folder (``vocab.json`` + ``merges.txt``
or ``tokenizer.json``, e.g. the tokenizer files of ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``), ``<|startoftext|>``
… ``<|endoftext|>``, truncated to the context length with the last token kept as end-of-text and zero-padded, as
OpenCLIP's tokenizer does (it also runs ``ftfy``/HTML-unescaping first, which changes nothing for plain prompts).

Knob that matters: the checkpoint (HPSv2.0 and v2.1 scores differ; every record keeps the file's sha256).
RECONSTRUCTED: ``resize="longest_pad"`` resizes the longer side to 224 and zero-pads (the HPSv2 fork's
``ResizeMaxSize`` evaluation transform, as we read it); ``resize="shorter_crop"`` is OpenCLIP's standard
resize + centre crop. Both are identical for square images (all of this project's models make square images).

Layout on disk (``--hps-weights PATH``): ``PATH`` is the checkpoint or a folder holding it, with the tokenizer in
``tokenizer/`` (or ``open_clip_tokenizer/``) beside it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .image_reward import open_released_checkpoint
from .metric_base import MetricUnavailable

__all__ = ["HPSConfig", "OpenCLIPModel", "LoadedHPS", "load_hps", "hps_scores", "WEIGHT_FILE", "VIT_H_14"]

WEIGHT_FILE = "HPS_v2.1_compressed.pt"
TOKENIZER_DIRS = ("tokenizer", "open_clip_tokenizer")
VIT_H_14 = {"embed_dim": 1024,
            "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
            "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24}}


@dataclass(frozen=True)
class HPSConfig:
    embed_dim: int = 1024
    image_size: int = 224
    patch_size: int = 14
    vision_width: int = 1280
    vision_layers: int = 32
    vision_heads: int = 16
    vision_mlp: int = 5120
    context_length: int = 77
    vocab_size: int = 49408
    text_width: int = 1024
    text_layers: int = 24
    text_heads: int = 16
    text_mlp: int = 4096
    scale: float = 100.0  # the papers' tables; hpsv2.score returns the bare cosine (scale 1)
    resize: str = "longest_pad"  # RECONSTRUCTED: "shorter_crop" = OpenCLIP's resize + centre crop

    @staticmethod
    def from_state_dict(sd: dict[str, torch.Tensor], model_config: dict | None = None, **overrides) -> "HPSConfig":
        cfg = model_config or VIT_H_14
        vc, tc = cfg.get("vision_cfg", {}), cfg.get("text_cfg", {})
        try:
            vw = sd["visual.class_embedding"].shape[-1]
            patch = sd["visual.conv1.weight"].shape[-1]
            grid = math.isqrt(sd["visual.positional_embedding"].shape[0] - 1)
            tw = sd["token_embedding.weight"].shape[1]
            out = HPSConfig(
                embed_dim=sd["visual.proj"].shape[1], image_size=grid * patch, patch_size=patch, vision_width=vw,
                vision_layers=_count(sd, "visual.transformer.resblocks."),
                vision_heads=int(vw // vc.get("head_width", 64)),
                vision_mlp=sd["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0],
                context_length=sd["positional_embedding"].shape[0], vocab_size=sd["token_embedding.weight"].shape[0],
                text_width=tw, text_layers=_count(sd, "transformer.resblocks."),
                text_heads=int(tc.get("heads", max(1, tw // 64))),
                text_mlp=sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0])
        except KeyError as exc:
            raise MetricUnavailable(f"not an OpenCLIP / HPSv2 checkpoint: {exc.args[0]!r} is missing (expected the "
                                    f"open_clip layout: visual.*, transformer.*, token_embedding.weight, "
                                    f"positional_embedding, text_projection)") from None
        return replace(out, **overrides)


def _count(sd: dict, prefix: str) -> int:
    return len({k[len(prefix):].split(".", 1)[0] for k in sd if k.startswith(prefix)})


class _Mlp(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.c_fc = nn.Linear(width, hidden)
        self.c_proj = nn.Linear(hidden, width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class _ResBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = _Mlp(width, hidden)

    def forward(self, x, mask=None):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class _Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, hidden: int):
        super().__init__()
        self.resblocks = nn.ModuleList(_ResBlock(width, heads, hidden) for _ in range(layers))

    def forward(self, x, mask=None):
        for block in self.resblocks:
            x = block(x, mask)
        return x


class _Visual(nn.Module):
    def __init__(self, cfg: HPSConfig):
        super().__init__()
        grid = cfg.image_size // cfg.patch_size
        w = cfg.vision_width
        self.conv1 = nn.Conv2d(3, w, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.zeros(w))
        self.positional_embedding = nn.Parameter(torch.zeros(grid * grid + 1, w))
        self.ln_pre = nn.LayerNorm(w)
        self.transformer = _Transformer(w, cfg.vision_layers, cfg.vision_heads, cfg.vision_mlp)
        self.ln_post = nn.LayerNorm(w)
        self.proj = nn.Parameter(torch.zeros(w, cfg.embed_dim))

    def forward(self, x):
        x = self.conv1(x).flatten(2).transpose(1, 2)
        cls = self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.positional_embedding.to(x.dtype)
        x = self.transformer(self.ln_pre(x))
        return self.ln_post(x[:, 0]) @ self.proj


class OpenCLIPModel(nn.Module):
    """OpenCLIP's ``CLIP`` in its state-dict layout (``visual.*`` and the text tower at the top level)."""

    def __init__(self, cfg: HPSConfig):
        super().__init__()
        self.cfg = cfg
        self.visual = _Visual(cfg)
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.text_width)
        self.positional_embedding = nn.Parameter(torch.zeros(cfg.context_length, cfg.text_width))
        self.transformer = _Transformer(cfg.text_width, cfg.text_layers, cfg.text_heads, cfg.text_mlp)
        self.ln_final = nn.LayerNorm(cfg.text_width)
        self.text_projection = nn.Parameter(torch.zeros(cfg.text_width, cfg.embed_dim))
        self.logit_scale = nn.Parameter(torch.zeros(()))

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.visual(pixels), dim=-1)

    def encode_text(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.token_embedding(ids) + self.positional_embedding[:n]
        causal = torch.full((n, n), float("-inf"), device=ids.device, dtype=x.dtype).triu(1)
        x = self.ln_final(self.transformer(x, causal))
        x = x[torch.arange(ids.shape[0], device=ids.device), ids.argmax(-1)] @ self.text_projection
        return F.normalize(x, dim=-1)

    def forward(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``scale · cos`` per (image, text) pair, ``[B]``."""
        return self.cfg.scale * (self.encode_image(pixels) * self.encode_text(ids)).sum(-1)


class LoadedHPS:
    def __init__(self, model: OpenCLIPModel, tokenizer, path: Path):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.path = path

    def to(self, device) -> "LoadedHPS":
        self.model.to(device)
        return self

    def tokenize(self, texts: Sequence[str]) -> torch.Tensor:
        """OpenCLIP's token layout: ``[sot, ..., eot]`` truncated to the context (last kept as eot), zero-padded."""
        n = self.model.cfg.context_length
        sot = self.tokenizer.convert_tokens_to_ids("<|startoftext|>")
        eot = self.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        out = torch.zeros(len(texts), n, dtype=torch.long)
        for i, text in enumerate(texts):
            body = self.tokenizer(str(text), add_special_tokens=False)["input_ids"]
            tokens = [sot, *body, eot]
            if len(tokens) > n:
                tokens = tokens[:n]
                tokens[-1] = eot
            out[i, :len(tokens)] = torch.tensor(tokens)
        return out


def _clip_tokenizer(folder: Path):
    import logging
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import CLIPTokenizer
    from transformers.utils import logging as hf_logging

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        return CLIPTokenizer.from_pretrained(str(folder), local_files_only=True)
    finally:
        hf_logging.set_verbosity(previous)


def load_hps(path: str | Path | None, *, tokenizer: str | Path | None = None, config: HPSConfig | None = None,
             **overrides) -> LoadedHPS:
    """HPSv2.1 from the released checkpoint (file or folder) and a local CLIP tokenizer folder;
    :class:`MetricUnavailable` with what is missing otherwise. ``overrides``: fields of :class:`HPSConfig`."""
    checkpoint, tok_dir, sd, model_config = open_released_checkpoint(
        path, tokenizer, weight_file=WEIGHT_FILE, tokenizer_dirs=TOKENIZER_DIRS,
        tokenizer_files="vocab.json|tokenizer.json", side_config="model_config.json", what="HPSv2.1",
        flag="--hps-weights", beside="a CLIP tokenizer/ folder")
    cfg = config or HPSConfig.from_state_dict(sd, model_config, **overrides)
    if config is not None and overrides:
        cfg = replace(cfg, **overrides)
    if cfg.resize not in ("longest_pad", "shorter_crop"):
        raise ValueError(f"resize must be 'longest_pad' or 'shorter_crop', got {cfg.resize!r}")
    sd = {k: v for k, v in sd.items() if not k.endswith("attn_mask")}
    model = OpenCLIPModel(cfg)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as exc:
        raise MetricUnavailable(f"{checkpoint} does not match the OpenCLIP ViT architecture ({exc})") from None
    return LoadedHPS(model, _clip_tokenizer(tok_dir), checkpoint)


@torch.no_grad()
def hps_scores(images: torch.Tensor, texts: Sequence[str], scorer: LoadedHPS, batch_size: int = 16) -> np.ndarray:
    """Per-sample HPSv2.1 (``100 · cos``) of ``images`` (``[B, 3, H, W]`` in ``[0, 1]`` or uint8) for ``texts``."""
    from .clip_score import clip_preprocess

    if len(texts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(texts)} prompts")
    model = scorer.model
    device = next(model.parameters()).device
    out = []
    for i in range(0, len(texts), batch_size):
        pixels = clip_preprocess(images[i:i + batch_size], model.cfg.image_size, resize=model.cfg.resize).to(device)
        ids = scorer.tokenize(texts[i:i + batch_size]).to(device)
        out.append(model(pixels, ids).double().cpu())
    return torch.cat(out).numpy() if out else np.zeros(0)
